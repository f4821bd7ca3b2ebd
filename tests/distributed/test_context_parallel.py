"""Context parallel under torchrun with real ranks: CP=2 (2 ranks) and TP=2 x CP=2 (4 ranks,
sequence parallel on) give the outputs and the CP-summed gradients of CP=1 on the same weights,
for packed rows of independent sequences and for prefix trees of shared prompts, under
selective and full recompute, on a dense model and on a Gated DeltaNet hybrid (see
context_parallel_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _torchrun import run_torchrun

WORKER = Path(__file__).with_name("context_parallel_worker.py")


@pytest.mark.parametrize("model", ["dense", "hybrid"])
@pytest.mark.parametrize("tp,ranks", [(1, 2), (2, 4)], ids=["cp2", "tp2xcp2"])
def test_context_parallel_equals_cp1(tmp_path, tp, ranks, model):
    run_torchrun(WORKER, str(tmp_path), str(tp), model, nproc=ranks, timeout_s=300)
    for rank in range(ranks):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(results) == 8
        assert {r["case"] for r in results} >= {"independent", "shared-prefix-4"}
        assert any(r["sequence_parallel"] for r in results) == (tp > 1)
        for r in results:
            label = f"rank {rank} {r}"
            assert r["cp"] == 2 and r["tp"] == tp, label
            for key in ("target_logprobs", "logits", "hidden_states", "top_k"):
                assert r[key] < 1e-5, label
            assert r["grad_names_equal"] and r["grads"] > 10, label
            assert r["grad"] < 1e-5, label
