"""The two 2-rank scenarios of a fault published by hand, as the failing rank's `abandon` would
write it to the job's store; phase_faults_worker.py runs each in a world of its own (gloo,
group timeout GROUP_TIMEOUT_S) within its launch, and each returns this rank's record.

`boundary` (one TP=2 replica): a fault another replica published reaches this replica's ranks
at different moments. Rank 1 has already passed its micro-batch boundary and waits in a replica
collective (the plan's agreed limit); rank 0 reads the fault at its boundary a second later and
raises it. Rank 1 must then end with the same error at once, not when the process group times
out (or rank 0 leaves). Record: the error each rank ended with and how long rank 1's collective
took.

`waves` (two DP replicas of one rank each): rank 0 waits in the data-parallel waves' all-reduce
(ranks/lockstep.py) while rank 1, of the other replica, publishes a fault and stays away from
that collective with its process groups open (the state of a replica whose fault ended the
call and whose ranks left for the next job, seen from a peer its closed pairs did not reach).
Rank 0 must end with the published fault's error at once, not when rank 1 leaves or the
process group times out. Record: the error rank 0 ended with and how long its wave step took.

In both, the rank that is not measured keeps its process groups open (as a job's rank does
after the error: leaving would close its connections and wake the measured rank anyway) until
the measured rank has written DONE_KEY, after its wait ended, or for HOLD_S at most: a measured
rank that is not woken waits the whole HOLD_S, past the test's bound.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from art.trainer_rank.ranks import agree as _agree
from art.trainer_rank.ranks.faults import PLAN, Fault, MicroBatchContext
from art.trainer_rank.ranks.lockstep import in_waves
from art.trainer_rank.ranks.phases import FAULT_COUNT_KEY, FAULT_KEY, PhaseAgreement

RANK = int(os.environ["RANK"])
# Long enough that waiting it out fails the test's bound.
GROUP_TIMEOUT_S = 40
# The longest the unmeasured rank keeps its groups open (the measured one must end well before).
HOLD_S = {"boundary": 10, "waves": 12}
DONE_KEY = "art-test-published-fault-measured"
# Each scenario's layout: tensor parallel size (the rest data parallel).
TENSOR_PARALLEL = {"boundary": 2, "waves": 1}


def _agreement() -> PhaseAgreement:
    """This rank's PhaseAgreement, once every rank has one."""
    phases = PhaseAgreement(fault_timeout_s=20)
    dist.barrier()
    return phases


def publish_forward_oom(phases: PhaseAgreement, failing_rank: int,
                        items: tuple[int, ...]) -> None:
    """Publish an OOM of `failing_rank` in layer 1's forward of its first micro-batch."""
    context = MicroBatchContext(call=1, micro_batch=0, items=items, signature="s",
                                packed_tokens=64, usable_bytes=1000, predicted_bytes=900,
                                recompute_summary="selective recompute (core_attn)")
    fault = Fault(failing_rank, "forward", "layer 1", "OutOfMemoryError: injected", context)
    phases._store.add(FAULT_COUNT_KEY, 1)
    phases._store.set(FAULT_KEY, fault.to_json())


def _hold(store: dist.Store, seconds: float) -> None:
    """Keep this rank's groups open until the measured rank is done, or `seconds`."""
    try:
        store.wait([DONE_KEY], timedelta(seconds=seconds))
    except (RuntimeError, dist.DistError):
        pass  # not woken: it waited the whole hold, and its record says so


def _error_and_wait(call: Callable[[], None]) -> dict:
    """What `call` raised (type and text; none when it returned) and how long it took."""
    result: dict = {}
    started = time.monotonic()
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test checks the type and text
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["waited_s"] = time.monotonic() - started
    return result


def boundary(store: dist.Store) -> dict:
    phases = _agreement()
    result: dict = {}
    if RANK == 1:
        # The fault of a rank of another replica (rank 3 of a TP=2 x DP=2 job), published
        # after this rank passed its boundary check.
        publish_forward_oom(phases, 3, (2, 4))

        def plan_collective() -> None:
            with phases.collectives(PLAN, None):
                _agree.min_over_replica(1)

        result = _error_and_wait(plan_collective)
        store.set(DONE_KEY, "1")
    else:
        time.sleep(1.0)  # rank 1 is inside the all-reduce by now
        try:
            phases.check()
        except Exception as exc:  # noqa: BLE001
            result["error"] = f"{type(exc).__name__}: {exc}"
        _hold(store, HOLD_S["boundary"])
    return result


def waves(store: dist.Store) -> dict:
    phases = _agreement()
    result: dict = {}
    if RANK == 0:

        def waves_call() -> None:
            for _ in in_waves(2, lambda start: 1, lambda wave: iter(()),
                              lambda wave: None,  # type: ignore[arg-type,return-value]
                              guard=lambda: phases.between_micro_batches(2)):
                pass

        result = _error_and_wait(waves_call)
        store.set(DONE_KEY, "1")
    else:
        time.sleep(1.0)  # rank 0 is inside the all-reduce by now
        publish_forward_oom(phases, 1, (1,))
        _hold(store, HOLD_S["waves"])
    return result


SCENARIOS = {"boundary": boundary, "waves": waves}
