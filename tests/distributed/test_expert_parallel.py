"""Expert parallel on the CPU build under torchrun (2 ranks, gloo): a MoE model at EP=2 gives
EP=1's logits and gradients on the same weights, every expert's gradient the sum of both ranks'
tokens (see expert_parallel_worker.py). Megatron's alltoall dispatcher passes its split sizes
as tensors, which gloo refuses; cpu_runtime passes them as lists."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _torchrun import run_torchrun

WORKER = Path(__file__).with_name("expert_parallel_worker.py")


@pytest.mark.torchrun
def test_expert_parallel_equals_ep1(tmp_path):
    run_torchrun(WORKER, str(tmp_path), nproc=2, timeout_s=200)
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["expert_parallel"] == 2 and r["experts"] > 0 and r["others"] > 10, r
        assert r["logits"] <= 1e-5 * r["logit_scale"], r
        assert r["expert_grad"] < 1e-5 and r["other_grad"] < 1e-5, r
