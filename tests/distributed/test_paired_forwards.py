"""Expert parallel across the data-parallel ranks (EP=2 at TP=1 on 2 ranks): every MoE layer's
all-to-all pairs the two ranks, which plan their own items. Calls whose ranks have unequal
work (an empty share in the last wave, a no-grad micro-batch on one rank while the other runs
a grad one, dp_rank_forward with three items on one rank and one on the other) run to the end
with EP=1's outputs and gradients, because the rank with nothing of the step runs filler
forwards (ranks/paired_forwards.py); a grad dp_rank_forward whose ranks need different numbers
of forwards raises on both ranks instead of hanging (paired_forwards_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def records(two_rank_launch) -> dict[tuple[int, int], dict]:
    folder = Path(two_rank_launch) / "paired_forwards"
    return {(rank, ep): json.loads((folder / f"rank{rank}-ep{ep}.json").read_text())
            for rank in (0, 1) for ep in (1, 2)}


@pytest.mark.torchrun
def test_unequal_waves_under_expert_parallel_across_ranks_equal_ep1(records):
    for rank in (0, 1):
        ep2, ep1 = records[(rank, 2)], records[(rank, 1)]
        assert ep2["paired_forwards"] and not ep1["paired_forwards"]
        # Escalation and adaptive would let the ranks re-run different all-to-alls in backward.
        assert ep2["recompute_choice"] == "configured" and ep1["recompute_choice"] == "escalate"
        assert ep1["fillers"] == []
        assert ep2["logprobs"].keys() == ep1["logprobs"].keys() == {"0", "1", "2", "3", "4"}
        for index, value in ep1["logprobs"].items():
            assert ep2["logprobs"][index] == pytest.approx(value, rel=1e-5, abs=1e-4)
        # The optimizer step's gradient norm over every adapter (the experts' included): the
        # fillers' zero losses added nothing.
        assert ep2["grad_norm"] == pytest.approx(ep1["grad_norm"], rel=1e-5)
    # The waves left one rank without a micro-batch of a step's mode: it ran fillers, grad
    # ones (whose backward met the partner's) and no-grad ones.
    fillers = [tuple(f) for rank in (0, 1) for f in records[(rank, 2)]["fillers"]]
    assert (True, 1) in fillers and (False, 1) in fillers
    assert any("empty" in records[(rank, 2)]["decisions"] for rank in (0, 1))


@pytest.mark.torchrun
def test_unequal_dp_rank_forward_under_expert_parallel_across_ranks(records):
    for rank in (0, 1):
        ep2, ep1 = records[(rank, 2)], records[(rank, 1)]
        # Without grad: three items on rank 0, one on rank 1, the same scores as at EP=1.
        assert ep2["nograd_dp_rank_forward"].keys() == ep1["nograd_dp_rank_forward"].keys()
        for key, value in ep1["nograd_dp_rank_forward"].items():
            assert ep2["nograd_dp_rank_forward"][key] == pytest.approx(value, rel=1e-5,
                                                                        abs=1e-4)
        # With grad and a different number of forwards per rank: every rank raises, naming
        # the counts and what works instead; at EP=1 the same call runs.
        assert ep1["grad_error"] is None
        error = ep2["grad_error"]
        assert error is not None and error.startswith("TrainerRankRuntimeSupportError")
        assert "range from 1 to 2" in error and "forward_micro_batches" in error


@pytest.mark.torchrun
def test_micro_batches_are_priced_beside_their_partners_rows(records):
    """Each rank's experts take the tokens its partner routes to them: a micro-batch is
    priced beside the longest row the partner runs in the same step. In the waves that is the
    partner's share of the wave in the same autograd mode (a one-token filler where it has
    none); in dp_rank_forward without grad, the partner's items of the call (35 tokens beside
    rank 0's three items, 75 beside rank 1's one)."""
    runs = {rank: records[(rank, 2)]["wave_partners"] for rank in (0, 1)}
    assert runs[0] and runs[1]
    for rank in (0, 1):
        theirs: dict[tuple[int, bool], int] = {}
        for start, grad, packed, _ in runs[1 - rank]:
            theirs[(start, grad)] = theirs.get((start, grad), 0) + packed
        for start, grad, _, partner in runs[rank]:
            assert partner == max(1, theirs.get((start, grad), 0)), (rank, start, grad)
        # EP=1 has no partners.
        assert all(p is None for *_, p in records[(rank, 1)]["wave_partners"])
    calls = {rank: records[(rank, 2)]["call_partners"] for rank in (0, 1)}
    assert {p for *_, p in calls[0]} == {35}
    assert {p for *_, p in calls[1]} == {75}
