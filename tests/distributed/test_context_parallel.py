"""Context parallel under torchrun with real ranks: CP=2 (2 ranks) and TP=2 x CP=2 (4 ranks,
sequence parallel on) give the outputs and the CP-summed gradients of CP=1 on the same weights,
for packed rows of independent sequences and for prefix trees of shared prompts, under
selective and full recompute, on a dense model, a Gated DeltaNet hybrid, a MoE model and a
hybrid MoE; and the MoE models at CP=2 x EP=2 on 2 ranks (upstream's default layout for a MoE
model: the experts spread over the CP ranks, whose rows the dispatcher exchanges) against
CP=1 x EP=1 (see context_parallel_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _launches import CP_MODELS as MODELS

MOE_MODELS = ("moe", "hybrid-moe")


def _check(out: Path, tp: int, ranks: int, model: str, ep: int) -> None:
    for rank in range(ranks):
        results = json.loads((out / f"rank{rank}-{model}-ep{ep}.json").read_text())
        assert len(results) == 8
        assert {r["case"] for r in results} >= {"independent", "shared-prefix-4"}
        assert any(r["sequence_parallel"] for r in results) == (tp > 1)
        for r in results:
            label = f"rank {rank} {r}"
            assert r["cp"] == 2 and r["tp"] == tp and r["ep"] == ep, label
            assert r["refused"] is None, label
            for key in ("target_logprobs", "logits", "hidden_states", "top_k"):
                assert r[key] < 1e-5, label
            assert r["grad_names_equal"] and r["grads"] > 10, label
            # Every expert's gradient is compared: under EP each rank holds 1/EP of them.
            assert r["expert_grads"] * ep == r["whole_expert_grads"], label
            assert (r["expert_grads"] > 0) == (model in MOE_MODELS), label
            assert r["grad"] < 1e-5, label


# One torchrun launch per number of ranks (shared with other modules, conftest.py) runs the
# three models (a launch of 4 ranks on the CI's 2 cores costs more than the tiny models): the
# hybrid MoE covers the MoE layer beside the Gated DeltaNet one at CP=2 and TP=2 x CP=2 (its
# experts TP-sharded under sequence parallel), and the tiny MoE, in the 2-rank launch, the
# experts spread over the CP ranks (below); context_parallel_worker.py runs them.
@pytest.fixture(scope="module")
def cp2_run(two_rank_launch) -> Path:
    return two_rank_launch / "context_parallel"


@pytest.fixture(scope="module")
def tp2xcp2_run(four_rank_launch) -> Path:
    return four_rank_launch / "context_parallel"


@pytest.mark.parametrize("model", MODELS)
def test_context_parallel_equals_cp1(cp2_run, model):
    _check(cp2_run, 1, 2, model, ep=1)


@pytest.mark.parametrize("model", MODELS)
def test_tensor_and_context_parallel_equal_cp1(tp2xcp2_run, model):
    _check(tp2xcp2_run, 2, 4, model, ep=1)


def test_context_parallel_with_experts_over_the_cp_ranks_equals_cp1(cp2_run):
    """CP=2 x EP=2 on 2 ranks: the EP group is the CP group, so each rank's experts take the
    routed pairs of both halves of the row and their gradients are whole on their rank."""
    _check(cp2_run, 1, 2, "moe", ep=2)
