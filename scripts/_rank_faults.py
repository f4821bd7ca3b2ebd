"""Fault-injection harness shared by the fault soaks (scripts/soak_faults.py, soak_ranks.py) and
the reliability tests: the `Injector` that makes one allocation fail as a real out-of-memory
error (or raise another exception there), the caller's documented training loop with its
backward-OOM protocol (`caller_loop`), fresh job worlds on one control store (`Worlds`), and
one workload on tensor-parallel replicas with faults on some of their ranks (`fault_trial`;
`tp_fault_trial`: one replica, a fault on its last rank).

OOMs are injected through the virtual limit itself: at the k-th allocation made in one place
inside the trainer's meter, the limit is lowered to what is live, so that allocation fails
exactly as a real out-of-memory would (torch.OutOfMemoryError, peak above the limit). The
places: packing, a transformer layer's forward, the output head, the caller's backward.
"""

from __future__ import annotations

import dataclasses
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
from art.trainer_rank.measuring import meter as meter_module

LossOf = Callable[[list[Any]], "torch.Tensor | None"]


class Injector:
    """Wraps MemoryMeter._grow: counts the allocations made in each place inside a meter with
    a limit (the trainer's, around a micro-batch; not the probe's), and at the `fail_nth`
    allocation made in `fail_location` makes that allocation fail as a real OOM (or, with
    `raises`, raise that exception there instead: a bug at that point)."""

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
            if meter.limit_bytes is None:
                # Not the trainer's meter of a micro-batch (which has the virtual limit): the
                # probe's, measuring a layer or a head on first use while a call plans.
                return original(meter, nbytes, func)
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


def detached(value: Any) -> Any:
    """An item's outputs (nested lists of ForwardOutput) with every tensor detached, so that
    they can cross to another rank (autograd graphs cannot)."""
    if isinstance(value, list):
        return [detached(v) for v in value]
    changes = {}
    for f in dataclasses.fields(value):
        item = getattr(value, f.name)
        if isinstance(item, torch.Tensor):
            changes[f.name] = item.detach()
        elif dataclasses.is_dataclass(item):
            changes[f.name] = detached(item)
    return dataclasses.replace(value, **changes)


def flatten(value: Any) -> list[Any]:
    return [x for v in value for x in flatten(v)] if isinstance(value, list) else [value]


@dataclass
class LoopResult:
    """What one call of the caller's loop saw. `seen`: outputs by item, those voided by a
    backward OOM and never yielded again left out; `voided`: items whose backward ran out of
    memory and were not yielded again; `yielded_twice`: items yielded again although no
    backward OOM voided them; `error`: the TrainerRankMemoryError that ended the call;
    `batches`: the items of every micro-batch yielded, in order (empty ones left out)."""

    seen: dict[int, Any] = field(default_factory=dict)
    voided: set[int] = field(default_factory=set)
    declined: tuple[int, ...] = ()
    yielded_twice: list[int] = field(default_factory=list)
    escaped_ooms: int = 0
    error: TrainerRankMemoryError | None = None
    batches: list[tuple[int, ...]] = field(default_factory=list)


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
            if mb.indices:
                result.batches.append(tuple(mb.indices))
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

    def __init__(self, rank: int, world: int, control: int | dist.Store,
                 tensor_parallel: int) -> None:
        """`control`: the control store, or the port rank 0 opens it on."""
        self.rank, self.world, self.tensor_parallel = rank, world, tensor_parallel
        self.control = control if isinstance(control, dist.Store) else dist.TCPStore(
            "127.0.0.1", control, world, rank == 0, timedelta(seconds=120))
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
    """One workload on a replica of all the job's ranks (TP = world) with an OOM injected on
    the last rank only, at its `nth` allocation in `location`: `fault_trial` with one fault."""
    fault_trial(worlds=worlds, make_trainer=make_trainer, inputs=inputs,
                faults={worlds.world - 1: (location, nth)}, loss_of=loss_of, compare=compare,
                counts=counts)


def fault_trial(
    *, worlds: Worlds, make_trainer: Callable[[], TrainerRank], inputs: list[Any],
    faults: dict[int, tuple[str, int]], loss_of: LossOf,
    compare: Callable[[int, Any, Any], int], counts: Counter,
) -> None:
    """One workload in a started world of replicas of `worlds.tensor_parallel` ranks each
    (data parallel over the rest): a fault-free run gives the reference outputs (gathered
    from every rank, so an item is checked wherever it runs), then the same workload runs on
    a fresh trainer with an OOM injected on each rank of `faults` (rank -> (location, nth):
    its nth allocation there), all in the same call. A fault the replica's ranks agree on
    (packing, before any collective) must be recovered; any other must end the call on every
    rank of the job with one error naming a rank that failed. Within a replica every rank
    must see the same items, declines and error. Tallies into `counts` (rank 0's figures
    are the job's); `compare(index, got, want)` checks one item's outputs and returns how many
    were compared. Leaves a started world behind (a new one after a fault that closed it)."""
    tp = worlds.tensor_parallel
    replica = worlds.rank // tp
    clean = caller_loop(make_trainer(), inputs, Injector(), loss_of=loss_of)
    if clean.error is not None or clean.escaped_ooms:
        raise AssertionError(f"the fault-free run failed: {clean.error}")
    everyone: list[Any] = [None] * worlds.world
    dist.all_gather_object(everyone, {i: detached(clean.seen[i]) for i in sorted(clean.seen)})
    reference: dict[int, Any] = {}
    for seen in everyone:
        reference.update(seen)
    if sorted(reference) != list(range(len(inputs))):
        raise AssertionError(f"the fault-free run did not run every item: {sorted(reference)}")
    location, nth = faults.get(worlds.rank, (None, 0))
    injector = Injector(location, nth)
    trainer = make_trainer()
    with injector:
        got = caller_loop(trainer, inputs, injector, loss_of=loss_of)
    fatal = trainer.phases.fault is not None
    checked = sum(compare(index, out, reference[index]) for index, out in got.seen.items())
    if fatal:  # its groups are closed: agree in the next world
        worlds.end()
        worlds.start()
    # A fatal fault's error lists the failing micro-batch's items as not run. A rank that got
    # through that micro-batch's last collective before the fault may have yielded it (e.g. an
    # OOM in the tail of the other rank's heads); its caller's backward then fails with the
    # same error. Items run: those yielded and not listed.
    run = sorted(set(got.seen) - set(got.declined)) if fatal else sorted(got.seen)
    mine = {"seen": run, "yielded": sorted(got.seen), "declined": sorted(got.declined),
            "fatal": fatal, "replica": replica, "batches": [list(b) for b in got.batches],
            "error": None if got.error is None else str(got.error), "fired": injector.fired,
            "escaped": got.escaped_ooms, "twice": len(got.yielded_twice), "checked": checked}
    ranks: list[Any] = [None] * worlds.world
    dist.all_gather_object(ranks, mine)
    replicas = [[r for r in ranks if r["replica"] == k] for k in range(worlds.world // tp)]
    counts["workloads"] += 1
    fired = [rank for rank, r in enumerate(ranks) if r["fired"] is not None]
    counts["faults injected"] += len(fired)
    if len(faults) > 1:  # a fatal first fault can end the call before another one's place
        counts["workloads where faults fired on several ranks"] += len(fired) > 1
    counts["escaped OOMs"] += sum(r["escaped"] for r in ranks)
    counts["items yielded twice on one rank"] += sum(r["twice"] for r in ranks)
    counts["outputs checked"] += sum(r["checked"] for r in ranks)
    counts["items"] += len(inputs)
    any_fatal = any(r["fatal"] for r in ranks)
    if not any_fatal:  # every rank of a replica ran, declined and raised the same
        same = ("seen", "declined", "fatal", "error")
        agreed = all({k: r[k] for k in same} == {k: group[0][k] for k in same}
                     for group in replicas for r in group)
    else:
        # The job's call ends on every rank with one error. A replica's ranks yielded the
        # same micro-batches, except that the one in flight when the call ended may have
        # reached some of them only: the failing one (its items are the error's), or, on
        # another replica, the one its ranks were in when the fault closed their groups.
        agreed = all(r["fatal"] and r["error"] == ranks[0]["error"] for r in ranks)
        for group in replicas:
            longest = max((r["batches"] for r in group), key=len)
            agreed = agreed and all(r["batches"] == longest[:len(r["batches"])]
                                    and len(longest) - len(r["batches"]) <= 1 for r in group)
    counts["workloads where ranks disagree"] += not agreed
    if not agreed and worlds.rank == 0:
        print(f"ranks disagree on workload {counts['workloads']} (faults {faults}): {ranks}",
              flush=True)
    if any_fatal:
        # What a replica ran: the micro-batches every one of its ranks yielded, less the
        # failing micro-batch's items (the error lists them as not run).
        declined = set(ranks[0]["declined"])
        ran = Counter(i for group in replicas
                      for batch in min((r["batches"] for r in group), key=len)
                      for i in batch if i not in declined)
    else:
        ran = Counter(i for group in replicas for i in group[0]["seen"])
    if any_fatal:
        counts["calls ended on every rank by the fault"] += agreed
        named = all(any(f"rank {f} ran out of memory" in (r["error"] or "") for f in fired)
                    for r in ranks)
        counts["fatal errors not naming the failing rank"] += not named
        counts["items not run after a fatal fault"] += len(inputs) - len(ran)
        counts["failing micro-batch yielded on some ranks only"] += any(
            len({len(r["batches"]) for r in group}) > 1 for group in replicas)
        counts["items duplicated"] += sum(1 for n in ran.values() if n > 1)
        return
    counts["faults recovered"] += len(fired)
    declined = {i for group in replicas for i in group[0]["declined"]}
    counts["items lost"] += sum(1 for i in range(len(inputs)) if i not in ran and i not in
                                declined)
    counts["items duplicated"] += sum(1 for n in ran.values() if n > 1) + len(
        set(ran) & declined)
    counts["items declined"] += len(declined)
