"""One agreement protocol between the ranks of a job, phase by phase of a micro-batch.

Phases, in order: plan (collectives only: the agreed limit and plan, and a probe's on first
use, which measures a layer mode or a head on the replica's ranks together), prepare
(packing the micro-batch's first forward: this rank's own allocations, no collective),
forward and heads
(Megatron's tensor-parallel collectives), caller backward (the caller's `loss.backward()`:
collectives again), optimizer step (gradient reduction over data-parallel ranks, the
gradient norm over model-parallel ranks). An out-of-memory error is handled by where it
happened:

- prepare: no peer can be inside a collective of this micro-batch yet, so every rank of the
  replica reaches the vote that follows it (an all-reduce on a buffer allocated up front).
  The vote agrees on the failure, every rank records the same miss, and the items are
  planned again (smaller, split, escalated or declined): recovered, on every rank.
- any phase when the model replica is one rank: no peer can be inside a collective of this
  micro-batch, so the rank records the miss and plans the items again (an OOM in a probe
  ends the call with a TrainerRankMemoryError naming the probe, nothing closed).
- forward, heads, caller backward, optimizer step or a probe in the plan on a replica of
  several ranks: a peer may be blocked in a collective the failing rank will never enter.
  The failing rank publishes a `Fault` to the job's store (the c10d rendezvous store: a side
  channel that no blocked collective can hold up), then closes its process groups (gloo:
  every pair, which fails a peer's pending collective at once; NCCL: abort). A rank whose
  collective then fails reads the `Fault` (waiting at most the fault timeout), closes its
  own groups (so ranks blocked on it fail in turn) and raises the same
  `TrainerRankMemoryError`; a rank of another replica sees the `Fault` at its next
  micro-batch boundary. No rank carries on alone: the process groups are closed, and every
  rank of the job ends with that one error.

A collective waiting on a peer that neither finishes nor fails ends when the process group's
own timeout fires (`init_process_group(timeout=...)`; gloo raises, NCCL's watchdog aborts);
the fault timeout bounds how long a rank then waits for the `Fault` that names the cause.

Other exceptions (a bug, a caller's exception) raised on one rank inside these phases take the
same path with an "error" fault: the failing rank raises its own exception, every other rank
a `TrainerRankPeerError` naming the failing rank, the phase and the exception. A caller that
leaves the micro-batch loop on one rank only (its loop body raised) closes the generator while
the micro-batch is with it: that rank waits up to the fault timeout for the other ranks of its
replica to leave at the same micro-batch (a `break` on every rank ends there, nothing closed),
and otherwise publishes the departure as an "error" fault.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from art.trainer_rank._types import TrainerRankMemoryError, TrainerRankPeerError
from art.trainer_rank.ranks import agree as _agree
from art.trainer_rank.ranks.faults import (
    CALLER_BACKWARD,
    CALLER_LOOP,
    ERROR,
    FORWARD,
    OOM,
    OPTIMIZER_STEP,
    PLAN,
    PREPARE,
    Fault,
    MicroBatchContext,
    Phase,
    Probing,
    first_line,
    is_communication_error,
    probe_memory_error,
    where_in_model,
)

logger = logging.getLogger("art.trainer_rank")


FAULT_KEY = "art_trainer_rank/fault"
FAULT_COUNT_KEY = "art_trainer_rank/fault_count"
LEFT_KEY = "art_trainer_rank/left"
# A p2p tag no one sends on: a receive on it that times out closes the gloo pair.
_CLOSE_TAG = 0x7A27
# The vote's value for "no failure": above every rank number, so MIN finds the lowest failing rank.
_NO_FAILURE = 2**62
# How often the watcher asks the store, while collectives are in flight.
_WATCH_INTERVAL_S = 0.1


class PhaseAgreement:
    """The protocol for one TrainerRank (see the module docstring)."""

    def __init__(self, fault_timeout_s: float) -> None:
        self.fault_timeout_s = float(fault_timeout_s)
        self.fault: Fault | None = None
        self._store: Any = None
        self._vote: torch.Tensor | None = None
        # Held by the watcher while it acts and by the main thread when it disarms it or
        # closes the groups, so the groups are closed once, and never after the phase ended.
        self._lock = threading.Lock()
        self._closed = False
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            from torch.distributed import distributed_c10d

            self._store = distributed_c10d._get_default_store()
            self.rank = dist.get_rank()
            device = (torch.device("cuda", torch.cuda.current_device())
                      if dist.get_backend() == "nccl" else torch.device("cpu"))
            # Allocated once, here: a vote right after an OOM, or the agreement that ends a
            # step, must not need new memory.
            self._vote = torch.zeros(1, dtype=torch.int64, device=device)
            self._watch = threading.Event()
            threading.Thread(target=_watch_for_faults, args=(weakref.ref(self), self._watch),
                             name="art-trainer-rank-faults", daemon=True).start()
        else:
            self.rank = 0
            self._watch = threading.Event()

    # -- agreement points ------------------------------------------------------------------

    def check(self) -> None:
        """At a micro-batch boundary: raise the job's fault if any rank published one. This
        rank's groups are closed first: a peer of its replica that read the store a moment
        earlier is past this boundary, in a collective this rank will not join, and would
        otherwise wait there for the process group's timeout."""
        if self.fault is None and self._store is not None:
            if self._store.check([FAULT_KEY]):
                self.fault = Fault.from_json(self._store.get(FAULT_KEY).decode())
        if self.fault is not None:
            self.close()
            raise self.fault.error()

    def vote(self, failed: bool, replica_size: int) -> int | None:
        """Every rank of the replica at the same point, no collective in flight: the lowest
        failing global rank, or None when every rank got through."""
        if replica_size == 1 or self._vote is None:
            return self.rank if failed else None
        with self.collectives(PREPARE, None):
            self._vote.fill_(self.rank if failed else _NO_FAILURE)
            dist.all_reduce(self._vote, op=dist.ReduceOp.MIN, group=_agree.replica_group())
            lowest = int(self._vote.item())
        return None if lowest == _NO_FAILURE else lowest

    # -- failures --------------------------------------------------------------------------

    def abandon(self, exc: BaseException, phase: Phase, where: str,
                context: MicroBatchContext | None) -> BaseException:
        """This rank failed where peers may be blocked in a collective: publish the fault,
        close this rank's process groups, and return what this rank raises: the agreed
        TrainerRankMemoryError for an out-of-memory error, else its own exception."""
        oom = isinstance(exc, torch.OutOfMemoryError)
        mine = Fault(self.rank, phase, where, first_line(exc), context,
                     OOM if oom else ERROR, type(exc).__name__)
        if oom and exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)  # drop the tensors the frames held
        self.fault = mine
        if self._store is not None:
            if self._store.add(FAULT_COUNT_KEY, 1) == 1:
                self._store.set(FAULT_KEY, mine.to_json())
            else:  # another rank failed first: its fault is the job's
                self.fault = self._wait_for_fault() or mine
        logger.error("rank %d: %s", self.rank, self.fault.error())
        self.close()
        return self.fault.error() if oom else exc

    def peer_failed(self, exc: BaseException, phase: Phase) -> BaseException:
        """A collective failed on this rank: the error of the fault a peer published, after
        closing this rank's groups in turn; an error naming the failed collective when no
        rank published one within the fault timeout."""
        if self.fault is None:
            self.fault = self._wait_for_fault()
        self.close()
        if self.fault is None:
            return RuntimeError(
                f"a collective of the {phase} failed on rank {self.rank} and no rank reported "
                f"a fault within {self.fault_timeout_s:g} s (ART_TRAINER_RANK_FAULT_TIMEOUT_S): "
                f"{first_line(exc)}"
            )
        return self.fault.error()

    def close(self) -> None:
        """Close this rank's process groups, once."""
        with self._lock:
            if not self._closed:
                self._closed = True
                close_process_groups()

    def _wait_for_fault(self) -> Fault | None:
        if self._store is None:
            return None
        try:
            self._store.wait([FAULT_KEY], timedelta(seconds=self.fault_timeout_s))
        except (RuntimeError, dist.DistError):
            return None
        return Fault.from_json(self._store.get(FAULT_KEY).decode())

    def publishes(self, exc: BaseException, size: int) -> bool:
        """Whether this rank's exception must be published before it leaves: peers may be
        blocked on it (several ranks), and it is not itself the report of a peer's fault."""
        return (size > 1 and self._store is not None and not is_communication_error(exc)
                and not isinstance(exc, (TrainerRankMemoryError, TrainerRankPeerError)))

    # -- guards ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def collectives(self, phase: Phase, context: MicroBatchContext | None) -> Iterator[None]:
        """Collectives of this protocol or of the compute path: a failed one becomes the
        job's agreed error."""
        if self.fault is not None:
            raise self.fault.error()
        try:
            yield
        except Exception as exc:
            if (self._store is None or isinstance(exc, TrainerRankMemoryError)
                    or not is_communication_error(exc)):
                raise
            raise self.peer_failed(exc, phase) from exc

    @contextlib.contextmanager
    def watching(self, replica_size: int) -> Iterator[None]:
        """While collectives of a micro-batch may be in flight (a replica of several ranks),
        a thread watches the store: a fault published by another rank closes this rank's
        groups, which wakes a collective this rank is blocked in (the main thread cannot be
        reached otherwise)."""
        if replica_size == 1:
            yield
            return
        self._watch.set()
        try:
            yield
        finally:
            with self._lock:
                self._watch.clear()

    @contextlib.contextmanager
    def between_micro_batches(self, group_size: int) -> Iterator[None]:
        """The data-parallel waves' all-reduce (ranks/lockstep.py): a collective of the plan
        whose peers are other replicas' ranks. A fault there (on any replica) ends the job's
        call, so the watcher is armed while this rank waits in it: a peer that raised after a
        fault and left for good cannot leave this rank blocked until the process group's
        timeout, even when its closed pairs did not reach this collective."""
        with self.collectives(PLAN, None), self.watching(group_size):
            yield

    @contextlib.contextmanager
    def probing(self, size: int, when: Probing = Probing.ON_FIRST_USE) -> Iterator[None]:
        """A probe: a layer or a head measured on `size` ranks together (the replica's TP/CP
        collectives; under expert parallel at start-up, the job's all-to-alls). A failure on
        one rank is published as in the forward, so every rank ends with it: an OOM as one
        TrainerRankMemoryError naming the probe, anything else as the failing rank's own
        error and a TrainerRankPeerError on the others. On one rank an OOM becomes that
        error, with nothing closed."""
        with self.collectives(PLAN, None), self.watching(size):
            try:
                yield
            except Exception as exc:
                if self.publishes(exc, size):
                    raise self.abandon(exc, PLAN, when, None) from None
                if isinstance(exc, torch.OutOfMemoryError):
                    raise probe_memory_error(self.rank, first_line(exc), when,
                                             closed=False) from exc
                raise

    @contextlib.contextmanager
    def compute(self, context: MicroBatchContext, replica_size: int) -> Iterator[None]:
        """The forward and heads of one micro-batch. An OOM on a replica of one rank is left
        to the caller (recovered locally); on several ranks it ends the job's call."""
        with self.collectives(FORWARD, context), self.watching(replica_size):
            try:
                yield
            except Exception as exc:
                if not self.publishes(exc, replica_size):
                    raise
                phase, where = where_in_model(exc)
                raise self.abandon(exc, phase, where, context) from None

    @contextlib.contextmanager
    def optimizer_step(self, step: int) -> Iterator[None]:
        """One optimizer step. Its collectives span the job (data-parallel gradient reduction,
        the model-parallel gradient norm), so a failure on any rank is published and every
        rank ends the step with it; the ranks leave the step together (one all-reduce on a
        buffer allocated up front), so a rank that failed after its last collective (in its
        own parameter update) still takes the others with it."""
        job = dist.get_world_size() if self._store is not None else 1
        where = f"step {step}"
        with self.collectives(OPTIMIZER_STEP, None), self.watching(job):
            try:
                yield
            except Exception as exc:
                if not self.publishes(exc, job):
                    raise
                raise self.abandon(exc, OPTIMIZER_STEP, where, None) from None
            if job > 1 and self._vote is not None:
                self._vote.fill_(1)
                dist.all_reduce(self._vote)

    @contextlib.contextmanager
    def caller_phase(self, context: MicroBatchContext, replica_size: int) -> Iterator[None]:
        """While a micro-batch is with the caller: its backward (through
        torch.autograd.backward) is guarded like the forward."""
        BACKWARD_GUARD.acquire()
        token = (self, context, replica_size)
        _CALLER.stack.append(token)
        try:
            with self.watching(replica_size):
                yield
        except GeneratorExit:
            if replica_size > 1 and self._store is not None:
                self._left_loop(context, replica_size)
            raise
        finally:
            if token in _CALLER.stack:
                _CALLER.stack.remove(token)
            BACKWARD_GUARD.release()

    def _left_loop(self, context: MicroBatchContext, replica_size: int) -> None:
        """The caller closed the micro-batch generator while this micro-batch was with it (an
        exception in its loop body, or a break). A break on every rank of the replica at the
        same micro-batch ends the call there; otherwise the departure is published, since the
        other ranks are in (or about to enter) collectives this rank will not join."""
        if self.fault is not None or self._closed:
            return  # the call already ends on every rank with the published fault
        root = dist.get_global_rank(_agree.replica_group(), 0)
        key = f"{LEFT_KEY}/{root}/{context.call}/{context.micro_batch}"
        deadline = time.monotonic() + self.fault_timeout_s
        try:
            left = self._store.add(key, 1)
            while left < replica_size and time.monotonic() < deadline:
                if self._store.check([FAULT_KEY]):
                    return  # a peer's fault: its error reaches the peers, nothing to add
                time.sleep(_WATCH_INTERVAL_S / 2)
                left = self._store.add(key, 0)
        except (RuntimeError, dist.DistError):
            return  # the store is gone: the job is over
        if left >= replica_size:
            return
        self.abandon(RuntimeError(
            f"the caller left the micro-batch loop (an exception in its loop body, or a break "
            f"on this rank only) while micro-batch {context.micro_batch} was with it; the other "
            f"ranks of its replica did not leave within {self.fault_timeout_s:g} s"),
            CALLER_LOOP, "", context)


def _watch_for_faults(agreement_ref: Any, armed: threading.Event) -> None:
    """The watcher thread of one PhaseAgreement; ends with it, or after closing the groups."""
    while True:
        armed.wait(timeout=1.0)
        agreement = agreement_ref()
        if agreement is None:
            return
        with agreement._lock:
            if armed.is_set() and not agreement._closed:
                try:
                    published = agreement._store.check([FAULT_KEY])
                    if published and agreement.fault is None:
                        agreement.fault = Fault.from_json(
                            agreement._store.get(FAULT_KEY).decode())
                except (RuntimeError, dist.DistError):
                    return  # the store is gone: the job is over
                if published:
                    logger.error("rank %d: a peer published a fault: %s", agreement.rank,
                                 agreement.fault.error() if agreement.fault else "")
                    agreement._closed = True
                    close_process_groups()
                    return
        del agreement
        time.sleep(_WATCH_INTERVAL_S)


class _CallerState(threading.local):
    def __init__(self) -> None:
        self.stack: list[tuple[PhaseAgreement, MicroBatchContext, int]] = []


_CALLER = _CallerState()


class _BackwardGuard:
    """torch.autograd.backward (what Tensor.backward calls) routed through the innermost
    caller phase of the calling thread, installed while any caller phase of the process is
    open and the original restored when the last one closes. Counted over threads: another
    thread's open phase keeps it installed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = 0
        self._original: Any = None
        self._installed: Any = None

    def acquire(self) -> None:
        with self._lock:
            self._open += 1
            if self._open > 1:
                return
            self._original = original = torch.autograd.backward

            def backward(*args: Any, **kwargs: Any) -> Any:
                if not _CALLER.stack:
                    return original(*args, **kwargs)
                agreement, context, replica_size = _CALLER.stack[-1]
                with agreement.collectives(CALLER_BACKWARD, context):
                    try:
                        return original(*args, **kwargs)
                    except Exception as exc:
                        # One rank: the caller catches an OOM and iterates on (recovered
                        # locally).
                        if not agreement.publishes(exc, replica_size):
                            raise
                        raise agreement.abandon(exc, CALLER_BACKWARD, "", context) from None

            backward.__doc__ = original.__doc__
            self._installed = torch.autograd.backward = backward

    def release(self) -> None:
        with self._lock:
            self._open -= 1
            if self._open > 0:
                return
            # Someone who replaced it after us keeps theirs (and calls ours until they restore).
            if torch.autograd.backward is self._installed:
                torch.autograd.backward = self._original
            self._original = self._installed = None


BACKWARD_GUARD = _BackwardGuard()


def close_process_groups() -> None:
    """Close every process group of this rank so that no peer stays blocked on it: NCCL
    aborts its communicators; gloo has no abort that wakes a peer, but a receive that times
    out closes its pair, and a peer's pending or next operation on that pair fails at once."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    from torch.distributed import distributed_c10d

    if dist.get_backend() == "nccl":
        distributed_c10d._abort_process_group()
        return
    # Outside every dispatch mode: a rank closes its groups right after an OOM, often inside
    # the trainer's meter, whose limit that OOM has reached; an allocation counted there
    # would raise again here and leave the groups open, its peers blocked on them.
    with _disable_current_modes():
        probe = torch.empty(1)
        for group in list(distributed_c10d._world.pg_map):
            try:
                me, size = group.rank(), group.size()
            except RuntimeError:
                continue
            for peer in range(size):
                if peer == me:
                    continue
                try:
                    group.recv([probe], peer, _CLOSE_TAG).wait(
                        timedelta(milliseconds=1))
                except RuntimeError:
                    pass
    logger.warning("rank %d: process groups closed", dist.get_rank())
