"""Fault-injection harness shared by the fault soaks (scripts/soak_faults.py, soak_ranks.py) and
the reliability tests: the `Injector` that makes one allocation fail as a real out-of-memory
error (or raise another exception there), the caller's documented training loop with its
backward-OOM protocol (`caller_loop`), fresh job worlds on one control store (`Worlds`), and
one workload on a tensor-parallel replica with a fault on its last rank (`tp_fault_trial`).

OOMs are injected through the virtual limit itself: at the k-th allocation made in one place
inside the trainer's meter, the limit is lowered to what is live, so that allocation fails
exactly as a real out-of-memory would (torch.OutOfMemoryError, peak above the limit). The
places: packing, a transformer layer's forward, the output head, the caller's backward.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from art.trainer_rank import TrainerRank, TrainerRankMemoryError
from art.trainer_rank.memory import meter as meter_module

LossOf = Callable[[list[Any]], "torch.Tensor | None"]


class Injector:
    """Wraps MemoryMeter._grow: counts the allocations made in each place, and at the
    `fail_nth` allocation made in `fail_location` makes that allocation fail as a real OOM
    (or, with `raises`, raise that exception there instead: a bug at that point)."""

    def __init__(self, fail_location: str | None = None, fail_nth: int = 0,
                 raises: type[Exception] | None = None) -> None:
        self.fail_location = fail_location
        self.fail_nth = fail_nth
        self.raises = raises
        self.counts: Counter = Counter()
        self.in_caller_backward = False
        self.fired: str | None = None
        self.fired_at: float | None = None  # wall clock, to time how fast every rank ended
        self._original = meter_module.MemoryMeter._grow

    def _location(self) -> str:
        if self.in_caller_backward:
            return "caller backward"
        frame = sys._getframe(2)
        while frame is not None:
            path = frame.f_code.co_filename
            if path.endswith("compute/heads.py"):
                return "head"
            if path.endswith("compute/packing.py"):
                return "packing"
            if "megatron/core/transformer" in path:
                return "layer forward"
            frame = frame.f_back
        return "other"

    def __enter__(self) -> Injector:
        injector, original = self, self._original

        def grow(meter: Any, nbytes: int, func: Any) -> None:
            where = injector._location()
            injector.counts[where] += 1
            if (injector.fired is None and where == injector.fail_location
                    and injector.counts[where] == injector.fail_nth):
                injector.fired = where
                injector.fired_at = time.time()
                if injector.raises is not None:
                    raise injector.raises(
                        f"injected at allocation {injector.fail_nth} in the {where}")
                meter.limit_bytes = meter._live_bytes  # this allocation now crosses it
            return original(meter, nbytes, func)

        meter_module.MemoryMeter._grow = grow
        return self

    def __exit__(self, *exc: object) -> None:
        meter_module.MemoryMeter._grow = self._original


def flatten(value: Any) -> list[Any]:
    return [x for v in value for x in flatten(v)] if isinstance(value, list) else [value]


@dataclass
class LoopResult:
    """What one call of the caller's loop saw. `seen`: outputs by item, those voided by a
    backward OOM and never yielded again left out; `voided`: items whose backward ran out of
    memory and were not yielded again; `yielded_twice`: items yielded again although no
    backward OOM voided them; `error`: the TrainerRankMemoryError that ended the call."""

    seen: dict[int, Any] = field(default_factory=dict)
    voided: set[int] = field(default_factory=set)
    declined: tuple[int, ...] = ()
    yielded_twice: list[int] = field(default_factory=list)
    escaped_ooms: int = 0
    error: TrainerRankMemoryError | None = None


def caller_loop(trainer: TrainerRank, inputs: list[Any], injector: Injector, *,
                loss_of: LossOf, grad: bool = True) -> LoopResult:
    """The documented training loop: an OOM in the caller's own backward is caught and the
    loop iterates on (the trainer undoes the gradients and yields those items again). The
    injector must be entered by the caller; it is told when the backward runs."""
    result = LoopResult()
    try:
        for mb in trainer.forward_micro_batches(inputs, no_grad=not grad):
            for index in mb.indices:
                if index in result.seen and index not in result.voided:
                    result.yielded_twice.append(index)
                result.voided.discard(index)
            result.seen.update(zip(mb.indices, mb.outputs))
            if not grad:
                continue
            loss = loss_of([o for out in mb.outputs for o in flatten(out)])
            injector.in_caller_backward = True
            try:
                if loss is not None:
                    loss.backward()
            except torch.OutOfMemoryError:
                result.voided.update(mb.indices)
            finally:
                injector.in_caller_backward = False
            del loss
    except TrainerRankMemoryError as exc:
        result.error = exc
        result.declined = exc.indices_not_run
    except torch.OutOfMemoryError:
        result.escaped_ooms += 1
    for index in result.voided:
        result.seen.pop(index, None)
    return result


class Worlds:
    """Fresh job worlds for one torchrun launch: each its own namespace of one control store,
    its own process groups and Megatron's groups (a fault in a phase with collectives closes a
    world's groups; the next workload starts a new one)."""

    def __init__(self, rank: int, world: int, control_port: int, tensor_parallel: int) -> None:
        self.rank, self.world, self.tensor_parallel = rank, world, tensor_parallel
        self.control = dist.TCPStore("127.0.0.1", control_port, world, rank == 0,
                                     timedelta(seconds=120))
        self.started = 0

    def start(self) -> None:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        self.started += 1
        store = dist.PrefixStore(f"world{self.started}/", self.control)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=60))
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=self.tensor_parallel)
        model_parallel_cuda_manual_seed(1234)

    def end(self) -> None:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def tp_fault_trial(
    *, worlds: Worlds, make_trainer: Callable[[], TrainerRank], inputs: list[Any],
    location: str, nth: int, loss_of: LossOf, compare: Callable[[int, Any, Any], int],
    counts: Counter,
) -> None:
    """One workload on a replica of all the job's ranks (TP = world), in a started world:
    a fault-free run gives each rank its reference outputs, then the same workload runs on a
    fresh trainer with an OOM injected on the last rank only, at its `nth` allocation in
    `location`. A fault the ranks can agree on (packing, before any collective) must be
    recovered; any other must end the call on every rank with the same error naming the
    failing rank. Tallies into `counts` (rank 0's figures are the job's); `compare(index,
    got, want)` checks one item's outputs against the reference and returns how many were
    compared. Leaves a started world behind (a new one after a fault that closed it)."""
    failing = worlds.world - 1
    clean = caller_loop(make_trainer(), inputs, Injector(), loss_of=loss_of)
    if clean.error is not None or clean.escaped_ooms or len(clean.seen) != len(inputs):
        raise AssertionError(f"the fault-free run did not run every item: {clean.error}")
    injector = Injector(location, nth) if worlds.rank == failing else Injector()
    trainer = make_trainer()
    with injector:
        got = caller_loop(trainer, inputs, injector, loss_of=loss_of)
    fatal = trainer.phases.fault is not None
    checked = sum(compare(index, out, clean.seen[index]) for index, out in got.seen.items())
    if fatal:  # its groups are closed: agree in the next world
        worlds.end()
        worlds.start()
    # A fatal fault's error lists the failing micro-batch's items as not run. A rank that got
    # through that micro-batch's last collective before the fault may have yielded it (e.g. an
    # OOM in the tail of the other rank's heads); its caller's backward then fails with the
    # same error. Items run: those yielded and not listed.
    run = sorted(set(got.seen) - set(got.declined)) if fatal else sorted(got.seen)
    mine = {"seen": run, "yielded": sorted(got.seen), "declined": sorted(got.declined),
            "fatal": fatal,
            "error": None if got.error is None else str(got.error), "fired": injector.fired,
            "escaped": got.escaped_ooms, "twice": len(got.yielded_twice), "checked": checked}
    ranks: list[Any] = [None] * worlds.world
    dist.all_gather_object(ranks, mine)
    counts["workloads"] += 1
    counts["faults injected"] += sum(r["fired"] is not None for r in ranks)
    counts["escaped OOMs"] += sum(r["escaped"] for r in ranks)
    counts["items yielded twice on one rank"] += sum(r["twice"] for r in ranks)
    counts["outputs checked"] += sum(r["checked"] for r in ranks)
    counts["items"] += len(inputs)
    agreed = all({k: r[k] for k in ("seen", "declined", "fatal", "error")}
                 == {k: ranks[0][k] for k in ("seen", "declined", "fatal", "error")}
                 for r in ranks)
    counts["workloads where ranks disagree"] += not agreed
    if not agreed and worlds.rank == 0:
        print(f"ranks disagree on workload {counts['workloads']} (fault in {location}, "
              f"allocation {nth}): {ranks}", flush=True)
    if any(r["fatal"] for r in ranks):
        counts["calls ended on every rank by the fault"] += agreed
        named = all(f"rank {failing} ran out of memory" in (r["error"] or "") for r in ranks)
        counts["fatal errors not naming the failing rank"] += not named
        counts["items not run after a fatal fault"] += len(inputs) - len(ranks[0]["seen"])
        counts["failing micro-batch yielded on some ranks only"] += len(
            {tuple(r["yielded"]) for r in ranks}) > 1
        return
    if ranks[failing]["fired"] is not None:
        counts["faults recovered"] += 1
    done = set(ranks[0]["seen"]) | set(ranks[0]["declined"])  # the others agree (counted)
    counts["items lost"] += sum(1 for i in range(len(inputs)) if i not in done)
    counts["items duplicated"] += len(set(ranks[0]["seen"]) & set(ranks[0]["declined"]))
    counts["items declined"] += len(ranks[0]["declined"])
