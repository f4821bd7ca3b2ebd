"""Per-rank faults under torchrun, TP=2 with sequence parallel (gloo): a fault injected on rank 1
only, in each phase of a micro-batch and in the optimizer step (phase_faults_worker.py, one
torchrun launch for every scenario). An OOM in a layer's forward, the heads, the caller's
backward or the optimizer step: both ranks leave the call with the same TrainerRankMemoryError
naming rank 1 and the phase. Another exception (a bug in a layer's forward or in the step,
the caller's loop body raising on rank 1 only): rank 1 raises its own exception, rank 0 a
TrainerRankPeerError naming rank 1, the phase and the exception. The same for an OOM or
another exception in a probe on first use (the layers measured while the call plans, both
ranks in the probe's collectives), and for an OOM in the probe a MoE model's TrainerRank runs
when it is built at EP=2. Every rank ends within the fault timeout of the fault: no hang, no
rank carrying on alone. An OOM in packing, before any
collective of the micro-batch, is agreed and recovered on both ranks. Then a bounded TP=2
workload fuzz (the rank soak's trial, scripts/soak_ranks_worker.py) with faults on rank 1.
The same launch then runs at CP=2 (every row split over the ranks, keys and values gathered in
each attention layer): an OOM on rank 1 in a layer's forward ends both ranks' calls with the
same error, and one in packing is agreed and recovered; and the two faults published by hand
(_published_fault.py), each of which must wake a peer blocked in a collective at once.
In the 4-rank launch (TP=2 x DP=2, one scenario, shared with other modules: conftest.py): an
OOM on rank 1 ends both replicas' calls with the same error (the other replica's lockstep
all-reduce reads the fault)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _launches import FAULT_TIMEOUT_S

from _torchrun import rank_records, run_torchrun

WORKER = Path(__file__).with_name("phase_faults_worker.py")
FATAL = {"forward layer": "in the forward of micro-batch 0",
         "heads": "in the heads of micro-batch 0",
         "caller backward": "in the caller backward of micro-batch 0"}
# scenario: (what rank 0 reads in its TrainerRankPeerError, the type rank 1 raised itself)
ERRORS = {
    "error in forward layer": ("rank 1 raised ValueError: injected at allocation", "ValueError"),
    "error in optimizer step": ("rank 1 raised ValueError: injected in the gradient norm in the "
                                "optimizer step (step 1)", "ValueError"),
    "error in caller loop": ("rank 1 raised RuntimeError: the caller left the micro-batch loop",
                             "ValueError"),
    "error in probe": ("rank 1 raised ValueError: injected in a probe point in the plan "
                       "(probing the model on first use)", "ValueError"),
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("phase_faults")
    # Its own hard timeout: a hang fails the test instead of stalling the suite.
    run_torchrun(WORKER, str(out), str(FAULT_TIMEOUT_S), nproc=2, timeout_s=420,
                 env={"ART_TEST_PHASE_FAULTS_THEN": "cp2,boundary,waves,ep-probe"})
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _ended_in_time(rows: list[dict], scenario: str) -> None:
    fired_at = rows[1]["fired_at"]
    assert rows[1]["fired"] is not None and rows[0]["fired"] is None, scenario
    for row in rows:
        assert row["error"] is not None, scenario
        assert row["ended_at"] - fired_at < FAULT_TIMEOUT_S, scenario


def _same_oom_ended_every_rank(rows: list[dict], scenario: str) -> None:
    """Rank 1's OOM inside the collectives of `scenario` ended every rank's call in time with
    the same TrainerRankMemoryError, and nobody carried on with the micro-batch."""
    _ended_in_time(rows, scenario)
    for row in rows:
        error = row["error"]
        assert error["memory_error"], (scenario, error)
        assert f"rank 1 ran out of memory {FATAL[scenario]}" in error["text"]
        assert "items [0, 1, 2, 3]" in error["text"]
        assert row["seen"] == []  # nobody carried on with the micro-batch
    assert rows[0]["error"]["text"] == rows[1]["error"]["text"]


def _packing_oom_recovered(rows: list[dict]) -> None:
    """Rank 1's OOM in packing, before any collective, was agreed and every item delivered."""
    assert rows[1]["fired"] == "packing" and rows[0]["fired"] is None
    for row in rows:
        assert row["error"] is None, row["error"]
        assert sorted(row["seen"]) == [0, 1, 2, 3]  # every item delivered, once
        # The same miss on both ranks, and the items planned again after it.
        assert any(p["misses"] for p in row["profiles"].values())
        assert max(row["retries"]) >= 1
    assert rows[0]["profiles"] == rows[1]["profiles"]
    assert rows[0]["decisions"] == rows[1]["decisions"]


@pytest.mark.torchrun
@pytest.mark.parametrize("scenario", list(FATAL))
def test_oom_inside_collectives_ends_every_rank_with_the_same_error(ranks, scenario):
    _same_oom_ended_every_rank([r[scenario] for r in ranks], scenario)


@pytest.mark.torchrun
def test_oom_before_any_collective_is_agreed_and_recovered_on_every_rank(ranks):
    _packing_oom_recovered([r["packing"] for r in ranks])


@pytest.mark.torchrun
def test_oom_in_the_optimizer_step_ends_every_rank_with_the_same_error(ranks):
    rows = [r["optimizer step"] for r in ranks]
    _ended_in_time(rows, "optimizer step")
    for row in rows:
        assert row["error"]["memory_error"], row["error"]
        assert "rank 1 ran out of memory in the optimizer step (step 1)" in row["error"]["text"]
        assert sorted(row["seen"]) == [0, 1, 2, 3]  # the forwards ran; the step did not end
    assert rows[0]["error"]["text"] == rows[1]["error"]["text"]


@pytest.mark.torchrun
def test_an_oom_in_a_probe_on_first_use_ends_every_rank_with_the_same_error(ranks):
    """The layers are probed while the call plans, both TP ranks in each probe point's
    collectives: rank 1's OOM there ends both calls at once with one error naming the probe,
    before any micro-batch ran."""
    rows = [r["probe"] for r in ranks]
    _ended_in_time(rows, "probe")
    for row in rows:
        assert row["error"]["memory_error"], row["error"]
        assert ("rank 1 ran out of memory while probing the model on first use"
                in row["error"]["text"]), row["error"]["text"]
        assert row["seen"] == []
    assert rows[0]["error"]["text"] == rows[1]["error"]["text"]


@pytest.mark.torchrun
def test_an_oom_in_the_start_up_probe_under_expert_parallel_ends_every_rank(ranks):
    """Under expert parallel across the data-parallel ranks every layer mode is probed when
    TrainerRank is built, the ranks in each probe point's all-to-alls: rank 1's OOM there
    ends both constructors at once with one error naming the start-up probe."""
    rows = [r["ep-probe"] for r in ranks]
    _ended_in_time(rows, "ep-probe")
    for row in rows:
        assert row["error"]["memory_error"], row["error"]
        assert ("TrainerRank(runtime): rank 1 ran out of memory while probing the model at "
                "start-up" in row["error"]["text"]), row["error"]["text"]
    assert rows[0]["error"]["text"] == rows[1]["error"]["text"]


@pytest.mark.torchrun
@pytest.mark.parametrize("scenario", list(ERRORS))
def test_an_exception_on_one_rank_ends_every_rank(ranks, scenario):
    rows = [r[scenario] for r in ranks]
    _ended_in_time(rows, scenario)
    peer_text, own_type = ERRORS[scenario]
    assert rows[1]["error"]["type"] == own_type and "injected" in rows[1]["error"]["text"]
    peer = rows[0]["error"]
    assert peer["type"] == "TrainerRankPeerError", peer
    assert peer["failing_rank"] == 1 and peer_text in peer["text"], peer["text"]


@pytest.mark.torchrun
def test_a_break_on_every_rank_ends_the_call_without_closing_anything(ranks):
    for row in (r["break on every rank"] for r in ranks):
        # Left together at once (not after the 3 s wait for peers), and the next call runs.
        assert row["left_s"] < 3.0, row["left_s"]
        assert row["error"] is None and sorted(row["seen"]) == [0, 1, 2, 3], row["error"]


@pytest.mark.torchrun
def test_tp2_workload_fuzz_with_faults_on_one_rank(ranks):
    counts = ranks[0]["fuzz"]
    assert counts == ranks[1]["fuzz"]  # both ranks tallied the same gathered figures
    assert counts["workloads"] == 4 and counts["faults injected"] >= 3, counts
    assert counts["faults recovered"] >= 1, counts
    assert counts["calls ended on every rank by the fault"] >= 1, counts
    for key in ("escaped OOMs", "items lost", "items duplicated",
                "items yielded twice on one rank", "workloads where ranks disagree",
                "fatal errors not naming the failing rank"):
        assert counts[key] == 0, (key, counts)
    assert counts["outputs checked"] > 0


@pytest.fixture(scope="module")
def four_ranks(four_rank_launch) -> list[dict]:
    return rank_records(four_rank_launch / "phase_faults", 4)


@pytest.mark.torchrun
def test_tp2_dp2_an_oom_on_one_rank_ends_both_replicas_with_the_same_error(four_ranks):
    rows = [r["forward layer"] for r in four_ranks]
    assert rows[1]["fired"] is not None
    assert all(rows[r]["fired"] is None for r in (0, 2, 3))
    for row in rows:
        assert row["error"] is not None and row["error"]["memory_error"], row["error"]
        assert "rank 1 ran out of memory in the forward of micro-batch 0" in row["error"]["text"]
        assert row["ended_at"] - rows[1]["fired_at"] < FAULT_TIMEOUT_S
    assert len({row["error"]["text"] for row in rows}) == 1


@pytest.mark.torchrun
def test_a_fault_read_at_a_boundary_wakes_the_peer_already_past_it(ranks):
    # Rank 0 reads another replica's fault at its boundary; rank 1, past its own, waits in
    # the plan's collective: it ends with the same error at once (before: when the process
    # group timed out, or rank 0 left its world; the worker keeps it up to 10 s).
    rows = [r["boundary"] for r in ranks]
    for row in rows:
        assert row["error"].startswith("TrainerRankMemoryError: forward_micro_batches: rank 3 "
                                       "ran out of memory in the forward"), row
    assert rows[0]["error"] == rows[1]["error"]
    assert rows[1]["waited_s"] < 6, rows[1]


@pytest.mark.torchrun
def test_a_fault_on_another_replica_wakes_a_rank_waiting_in_the_waves(ranks):
    # Rank 0 waits in the DP waves' all-reduce; rank 1 (the other replica) publishes a fault
    # and keeps its groups open away from that collective: rank 0 ends with the fault's
    # error at once (without the watcher armed there: after rank 1's 12 s, or the groups'
    # 40 s timeout).
    rows = [r["waves"] for r in ranks]
    assert rows[0]["error"].startswith("TrainerRankMemoryError: forward_micro_batches: rank 1 "
                                       "ran out of memory in the forward"), rows[0]
    assert rows[0]["waited_s"] < 6, rows[0]


@pytest.mark.torchrun
def test_an_oom_on_one_cp_rank_ends_both_with_the_same_error(ranks):
    cp_ranks = [r["cp2"] for r in ranks]
    _same_oom_ended_every_rank([r["forward layer"] for r in cp_ranks], "forward layer")
    _packing_oom_recovered([r["packing"] for r in cp_ranks])
