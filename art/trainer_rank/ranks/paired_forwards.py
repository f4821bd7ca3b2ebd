"""Forwards paired over data-parallel ranks whose MoE layers exchange tokens.

With expert parallel carved from the data-parallel ranks (`agree.experts_cross_replicas`),
every MoE layer's dispatch and combine is an all-to-all over ranks of other model replicas,
and those plan their own items: one may have a micro-batch where another has none (the last
wave's empty share, a grad and a no-grad micro-batch, a no-grad group split into several
forwards). A forward whose partners do not run one waits in its first all-to-all for ever.

So the ranks step together: a share announces its next micro-batch (`ForwardReady`: grad or
not, how many decoder passes) before running it, the ranks all-reduce the announcements, and
the step runs the grad micro-batches first. A rank with nothing of that mode runs as many
filler passes (one padding token, the same autograd mode, the configured recompute, a zero
loss) and keeps its own micro-batch for a later step; a rank with fewer passes than the most
runs fillers for the rest. A grad filler's backward runs when the caller asks for the next
micro-batch, where the other ranks' callers run theirs, so the backward's all-to-alls pair up
too. Every rank of a step therefore runs the same recompute: rungs other than the configured
policy are not chosen in this layout (`TrainerRank` forces `configured`).

`dp_rank_forward` holds every grad graph until the caller's backward after the call, so a
grad filler's backward could not meet its partners there: its grad micro-batch runs when every
rank announces one with the same number of passes, else every rank raises before any forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from art.trainer_rank._types import MicroBatch, TrainerRankRuntimeSupportError
from art.trainer_rank.ranks import agree as _agree


@dataclass(frozen=True)
class ForwardReady:
    """A planned micro-batch about to run `forwards` decoder passes, with or without grad."""

    grad: bool
    forwards: int


# Runs `forwards` filler passes with `grad`; returns the grad passes' backward (None without).
Filler = Callable[[bool, int], Callable[[], None] | None]


def fault_scope_ranks(paired: bool) -> int:
    """The ranks one forward's collectives span, as the phase protocol counts them: the
    replica's, or with paired forwards more than one (its partners are other replicas' ranks:
    a fault then ends the call on every rank, where a local retry would leave them in an
    all-to-all)."""
    replica = _agree.replica_size()
    return max(2, replica) if paired else replica


@dataclass(frozen=True)
class StepAgreement:
    """What the ranks' announcements agree for one step: the autograd mode and the most
    decoder passes of any rank running that mode (0: no rank announced a micro-batch)."""

    grad: bool
    forwards: int
    # Fewest grad passes over the ranks (a rank with no grad micro-batch counts 0).
    fewest_grad_forwards: int

    @classmethod
    def of(cls, grad_forwards: int, nograd_forwards: int, fewest_grad_forwards: int
           ) -> StepAgreement:
        if grad_forwards:
            return cls(True, grad_forwards, fewest_grad_forwards)
        return cls(False, nograd_forwards, fewest_grad_forwards)


def announcement(ready: ForwardReady | None) -> tuple[int, int, int]:
    """This rank's (grad passes, no-grad passes, -grad passes) for a MAX all-reduce."""
    if ready is None:
        return 0, 0, 0
    if ready.grad:
        return ready.forwards, 0, -ready.forwards
    return 0, ready.forwards, 0


def run_step(agreed: StepAgreement, ready: ForwardReady | None,
             run_ready: Callable[[], MicroBatch | None], filler: Filler
             ) -> tuple[MicroBatch | None, bool, Callable[[], None] | None]:
    """One agreed step on this rank: its announced micro-batch when its mode is the step's
    (`run_ready` runs it), then filler passes up to the step's count. Returns (the micro-batch
    run, whether the announcement was used, the fillers' pending backward)."""
    micro_batch = None
    used = ready is not None and ready.grad == agreed.grad
    extra = agreed.forwards
    if used:
        assert ready is not None
        micro_batch = run_ready()
        extra = agreed.forwards - ready.forwards
    backward = filler(agreed.grad, extra) if extra > 0 else None
    return micro_batch, used, backward


def paired_call(source: Iterator[MicroBatch | ForwardReady], filler: Filler, group: Any,
                device: torch.device,
                guard: Callable[[], contextlib.AbstractContextManager[None]] | None = None
                ) -> Iterator[MicroBatch]:
    """`dp_rank_forward`'s micro-batches, stepped with the other ranks of `group` (see the
    module docstring); a grad step whose ranks announce different passes raises on all."""
    ready: ForwardReady | None = None
    pending_backward: Callable[[], None] | None = None
    done = False
    while True:
        if pending_backward is not None:
            run, pending_backward = pending_backward, None
            run()
        if ready is None and not done:
            try:
                got = next(source)
            except StopIteration:
                done = True
            else:
                if not isinstance(got, ForwardReady):
                    raise RuntimeError("a paired share yielded a micro-batch it did not announce")
                ready = got
        grad_forwards, nograd_forwards, negative_grad = announcement(ready)
        step = torch.tensor([int(ready is not None), grad_forwards, nograd_forwards,
                             negative_grad], dtype=torch.long, device=device)
        with guard() if guard is not None else contextlib.nullcontext():
            dist.all_reduce(step, op=dist.ReduceOp.MAX, group=group)
        if not int(step[0]):
            return
        agreed = StepAgreement.of(int(step[1]), int(step[2]), -int(step[3]))
        if agreed.grad and agreed.fewest_grad_forwards != agreed.forwards:
            raise TrainerRankRuntimeSupportError(
                "dp_rank_forward with grad under expert parallel across data-parallel ranks: "
                f"this rank's grad items run as {grad_forwards} forward(s), and the ranks' "
                f"range from {agreed.fewest_grad_forwards} to {agreed.forwards}. Each MoE "
                "layer's all-to-all needs every rank in the same forwards and backward, and "
                "the caller's backward after this call cannot pair a filler's: give every "
                "rank grad items that fit in the same number of forwards (equal shares, or a "
                "larger limit), use forward_micro_batches (its waves pair every forward), or "
                "keep the expert-parallel group inside TP x CP (upstream's default, EP = CP)")

        def run_ready() -> MicroBatch:
            return next(source)  # type: ignore[return-value]

        micro_batch, used, pending_backward = run_step(agreed, ready, run_ready, filler)
        if used:
            ready = None
        if micro_batch is not None:
            yield micro_batch
