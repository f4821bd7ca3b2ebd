"""Data-parallel waves in lockstep, as upstream deals them.

A call's top-level items are taken in contiguous waves `[start, start + width)`; rank r of D
runs items `start + r, start + r + D, ...` of the wave. Every rank proposes the widest wave
its share fits in (one micro-batch per autograd mode), and the wave is the narrowest
proposal, so every rank's share fits and the ranks cover the items in order.

The ranks step together: before every yield they all-reduce (has a micro-batch, its proposal
for the next wave). While any rank has a micro-batch of the current wave, every rank yields
one (an empty one when its share is done, or was empty), so a collective in the caller's loop
body always meets its partners; once none has, the next wave starts at the narrowest proposal.
A share may yield more than one micro-batch (a re-plan after a run-time OOM, grad and no-grad
items); all of them report the wave in their stats.

With expert parallel across replicas (`filler` given) a share announces each micro-batch
before running it and the step pairs every rank's forwards (`paired_forwards`): the same
all-reduce carries the announcements, and a rank without a micro-batch of the step's mode runs
filler forwards before yielding its empty one.

An exception on one rank is held: that rank stops taking shares and stops constraining the
wave, the others finish the call, then it is raised there. `finish` runs on every rank once
all are done (before a held exception is raised); `guard` wraps each step's all-reduce (the
phase protocol: a peer's published fault becomes the agreed error), and a rank holding an
exception raises it when that all-reduce fails (its groups were closed by the fault it holds).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from art.trainer_rank._types import MicroBatch
from art.trainer_rank.ranks import agree as _agree
from art.trainer_rank.ranks.paired_forwards import (
    Filler,
    ForwardReady,
    StepAgreement,
    announcement,
    run_step,
)

logger = logging.getLogger("art.trainer_rank")

# A proposal that constrains nothing (a busy rank, or one that holds an exception).
NO_LIMIT = 1 << 62


@dataclass(frozen=True)
class Wave:
    """Top-level items [start, stop) of the call, dealt round-robin over the DP ranks."""

    start: int
    stop: int

    @property
    def width(self) -> int:
        return self.stop - self.start

    def share(self, dp_rank: int, dp_size: int) -> range:
        return range(self.start + dp_rank, self.stop, dp_size)


def widest_wave(start: int, total: int, dp_rank: int, dp_size: int, fitting: int,
                share_size: int) -> int:
    """The widest wave from `start` in which this rank's share is its first `fitting` items
    of `share_size` (rank r's k-th item is start + r + k * D)."""
    if fitting >= share_size:
        return total - start
    return min(total - start, dp_rank + max(1, fitting) * dp_size)


def data_parallel_group() -> Any | None:
    """This rank's data-parallel group (without CP), or None with one DP rank."""
    from megatron.core import parallel_state

    if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return None
    group = parallel_state.get_data_parallel_group(with_context_parallel=False)
    return group if dist.get_world_size(group) > 1 else None


def in_waves(
    total: int,
    propose: Callable[[int], int],
    run_share: Callable[[Wave], Iterator[MicroBatch | ForwardReady]],
    empty: Callable[[Wave], MicroBatch],
    finish: Callable[[], None] | None = None,
    guard: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
    filler: Filler | None = None,
) -> Iterator[MicroBatch]:
    """Yield this rank's micro-batches of `total` items, wave by wave. `propose(start)`: the
    widest wave from `start` this rank's share fits in; `run_share(wave)`: this rank's
    micro-batches of that wave (each announced by a ForwardReady first when `filler` pairs
    the ranks' forwards)."""
    group = data_parallel_group()
    device = _agree.collective_device() if group is not None else torch.device("cpu")
    held: BaseException | None = None
    start = 0
    wave = Wave(0, 0)
    share: Iterator[MicroBatch | ForwardReady] | None = None
    proposal: tuple[int, int] | None = None  # (start, width), kept while this rank waits
    ready: ForwardReady | None = None  # announced, not run yet (paired forwards)
    pending_backward: Callable[[], None] | None = None  # a grad filler's
    try:
        while True:
            if pending_backward is not None:
                run, pending_backward = pending_backward, None
                run()
            micro_batch: MicroBatch | None = None
            if share is not None and ready is None:
                try:
                    got = next(share)
                except StopIteration:
                    share = None
                except Exception as exc:  # noqa: BLE001 - re-raised once every rank is done
                    held, share = exc, None
                else:
                    if isinstance(got, ForwardReady):
                        ready = got
                    else:
                        micro_batch = got
            width = NO_LIMIT
            if micro_batch is None and ready is None and held is None and start < total:
                if proposal is None or proposal[0] != start:
                    try:
                        proposal = (start, max(1, min(total - start, propose(start))))
                    except Exception as exc:  # noqa: BLE001 - as above
                        held, proposal = exc, None
                if proposal is not None:
                    width = proposal[1]
            step = torch.tensor([int(micro_batch is not None or ready is not None), -width,
                                 *announcement(ready)], dtype=torch.long, device=device)
            if group is not None:
                try:
                    with guard() if guard is not None else contextlib.nullcontext():
                        dist.all_reduce(step, op=dist.ReduceOp.MAX, group=group)
                except Exception:
                    if held is not None:
                        raise held from None
                    raise
            if int(step[0]):
                if filler is not None and (int(step[2]) or int(step[3])):
                    agreed = StepAgreement.of(int(step[2]), int(step[3]), -int(step[4]))

                    def run_ready() -> MicroBatch | None:
                        nonlocal share, held
                        try:
                            return next(share)  # type: ignore[arg-type, return-value]
                        except Exception as exc:  # noqa: BLE001 - as above
                            held, share = exc, None
                            return None

                    micro_batch, used, pending_backward = run_step(agreed, ready, run_ready,
                                                                   filler)
                    if used:
                        ready = None
                yield micro_batch if micro_batch is not None else empty(wave)
                continue
            agreed = -int(step[1])
            if start >= total or agreed >= NO_LIMIT:
                break
            wave = Wave(start, start + agreed)
            start = wave.stop
            share = run_share(wave) if held is None else None
    finally:
        close = getattr(share, "close", None)
        if close is not None:
            close()
    if finish is not None:
        try:
            finish()
        except Exception:
            if held is None:
                raise
            logger.exception("finishing the call failed after an earlier error")
    if held is not None:
        raise held
