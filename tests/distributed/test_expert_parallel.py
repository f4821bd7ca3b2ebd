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


# expert_parallel_worker.py runs the layouts of two ranks one after the other in the 2-rank
# launch, TP=2 x EP=2 in the 4-rank one (both shared with other modules, conftest.py).
@pytest.fixture(scope="module")
def launched(two_rank_launch, four_rank_launch) -> dict[int, Path]:
    return {2: two_rank_launch / "expert_parallel", 4: four_rank_launch / "expert_parallel"}


@pytest.mark.torchrun
@pytest.mark.parametrize(("tp", "etp", "ranks"), [(1, 1, 2), (2, 2, 4), (2, 1, 2)],
                         ids=["ep2", "tp2xep2", "tp2-ep2-etp1"])
def test_expert_parallel_equals_ep1(launched, tp, etp, ranks):
    """At TP=2 x EP=2 (4 ranks, sequence parallel, experts TP-sharded) against TP=2 x EP=1,
    which the TP tests hold equal to TP=1; with expert TP 1 the EP group is the TP group."""
    for rank in range(ranks):
        r = json.loads((launched[ranks] / f"rank{rank}-tp{tp}-etp{etp}.json").read_text())
        assert r["expert_parallel"] == 2 and r["tensor_parallel"] == tp, r
        assert r["expert_tensor_parallel"] == etp, r
        assert r["experts"] > 0 and r["others"] > 10, r
        assert r["logits"] <= 1e-5 * r["logit_scale"], r
        assert r["expert_grad"] < 1e-5 and r["other_grad"] < 1e-5, r
