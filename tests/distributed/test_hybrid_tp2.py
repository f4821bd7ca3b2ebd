"""The tiny hybrids (Gated DeltaNet + attention, dense and MoE) train in each recompute mode,
and TP=2 under torchrun (sequence parallel) equals TP=1: one torchrun launch for all cases."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from _torchrun import rank_records

WORKER = Path(__file__).with_name("hybrid_tp_worker.py")


def _worker_module():
    spec = importlib.util.spec_from_file_location("hybrid_tp_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.torchrun
def test_hybrids_train_in_every_recompute_mode_and_tp2_equals_tp1(two_rank_launch):
    """tiny-qwen3_5 and tiny-qwen3_5-moe: forward + backward in each recompute mode give one
    loss per model and finite gradients; TP=2 (torchrun, sequence parallel) gives the TP=1
    loss and gradients."""
    tp1 = _worker_module().hybrid_cases(1)
    for model in ("tiny-qwen3_5", "tiny-qwen3_5-moe"):
        rows = [r for r in tp1 if r["model"] == model]
        assert len({r["loss"] for r in rows}) == 1, rows
        assert all(r["sharded_grad_sq"] > 0 and r["replicated_grad_sq"] > 0 for r in rows)
    # hybrid_tp_worker.py at TP=2, in a launch shared with other modules (conftest.py).
    for tp2 in rank_records(two_rank_launch / "hybrid"):
        assert [r["recompute"] for r in tp2] == [r["recompute"] for r in tp1]
        for one, two in zip(tp1, tp2):
            assert two["loss"] == pytest.approx(one["loss"], rel=1e-5), one["recompute"]
            for key in ("sharded_grad_sq", "replicated_grad_sq"):
                assert two[key] == pytest.approx(one[key], rel=1e-4), (key, one["recompute"])
    _dispatcher_state_priced(tp1, 1)
    for tp2 in rank_records(two_rank_launch / "hybrid"):
        _dispatcher_state_priced(tp2, 2)


def _dispatcher_state_priced(rows: list[dict], tp: int) -> None:
    """The routing state a MoE layer's dispatcher keeps until its next call
    (`moe_dispatcher_state`) is what the real one references, to its small per-expert index
    arrays: at TP=2 with sequence parallel the router and the permutation run on this rank's
    half of the row, so the state is half of TP=1's."""
    from art.megatron.geometry import load_geometry
    from art.megatron.implementation import Implementation
    from art.trainer_rank.pricing.layer_terms import Dims
    from art.trainer_rank.pricing.layers_mlp import moe_dispatcher_state

    worker = _worker_module()
    dims = Dims(load_geometry("tiny-qwen3_5-moe"), worker.layout(tp),
                Implementation.cpu_local(), 4, 0, frozenset())
    priced = moe_dispatcher_state(dims, worker.TOKENS)
    measured = [r["dispatcher_state_bytes"] for r in rows if r["model"] == "tiny-qwen3_5-moe"]
    assert measured and all(m is not None for m in measured)
    for got in measured:
        assert abs(got - priced) <= 512, (tp, got, priced)


@pytest.mark.torchrun
def test_a_probe_point_reruns_on_every_tp_rank_when_one_left_allocations_behind(
        two_rank_launch):
    """On CPU a probe point runs once, and again when its run left allocations behind
    (measuring/probe_runs.py). A TP layer's run is collectives on every TP rank, so when
    only one rank's run left something (here the last rank dropped its grads) every rank
    runs the point again: each rank runs each point twice, and the repeated point measures
    what the first did. Decided on one rank alone, the other would wait in the layer's
    collectives and the launch would time out."""
    for rank in range(2):
        record = json.loads((two_rank_launch / "hybrid" / f"probe-reruns-rank{rank}.json")
                            .read_text())
        assert record == {"runs": [2, 2], "same_row": True}, (rank, record)

