"""Expert parallel on the CPU build under torchrun (gloo): a MoE model at EP=2 (2 ranks; at
TP=2 x EP=2, 4 ranks; and at TP=2 x EP=2 with expert TP 1 on 2 ranks, upstream's default
layout for a MoE family without CP) gives EP=1's logits and gradients on the same weights,
every expert's gradient the sum of the tokens its EP group's ranks hold (see
expert_parallel_worker.py).
Megatron's alltoall dispatcher passes its split sizes as tensors and, under expert TP, gathers
uneven shards, both of which gloo refuses; cpu_runtime passes lists and pads the shards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _torchrun import run_torchrun

WORKER = Path(__file__).with_name("expert_parallel_worker.py")


@pytest.mark.torchrun
@pytest.mark.parametrize(("tp", "etp", "ranks"), [(1, 1, 2), (2, 2, 4), (2, 1, 2)],
                         ids=["ep2", "tp2xep2", "tp2-ep2-etp1"])
def test_expert_parallel_equals_ep1(tmp_path, tp, etp, ranks):
    """At TP=2 x EP=2 (4 ranks, sequence parallel, experts TP-sharded) against TP=2 x EP=1,
    which the TP tests hold equal to TP=1; with expert TP 1 the EP group is the TP group."""
    run_torchrun(WORKER, str(tmp_path), str(tp), str(etp), nproc=ranks, timeout_s=300)
    for rank in range(ranks):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["expert_parallel"] == 2 and r["tensor_parallel"] == tp, r
        assert r["expert_tensor_parallel"] == etp, r
        assert r["experts"] > 0 and r["others"] > 10, r
        assert r["logits"] <= 1e-5 * r["logit_scale"], r
        assert r["expert_grad"] < 1e-5 and r["other_grad"] < 1e-5, r
