"""Data-parallel lockstep: every DP rank yields the same number of micro-batches per call.

Each rank plans its own share; before every yield the ranks of the data-parallel group sum
(has a micro-batch, items in it). A rank that is done yields an empty micro-batch while any
other still has one, so a collective in the caller's loop body always meets its partners.
The same sum gives upstream's global progress fields (global_start / global_stop / count).
An exception on one rank is held until every rank is done, then raised there; `finish` runs
on every rank once all are done (before a held exception is raised), e.g. to exchange what
each rank learned in the call. `guard` wraps the step's all-reduce (the phase protocol: a
peer's published fault becomes the agreed error); a rank holding an exception raises it when
that all-reduce fails (its groups were closed by the fault it holds).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from art.trainer_rank._types import MicroBatch

logger = logging.getLogger("art.trainer_rank")


def _data_parallel_group() -> Any | None:
    from megatron.core import parallel_state

    if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return None
    group = parallel_state.get_data_parallel_group(with_context_parallel=False)
    return group if dist.get_world_size(group) > 1 else None


def in_lockstep(
    micro_batches: Iterator[MicroBatch], empty: Callable[[], MicroBatch],
    finish: Callable[[], None] | None = None,
    guard: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
) -> Iterator[MicroBatch]:
    group = _data_parallel_group()
    device = torch.device("cuda", torch.cuda.current_device()) if (
        group is not None and dist.get_backend(group) == "nccl") else torch.device("cpu")
    held: BaseException | None = None
    done = False
    started = 0
    try:
        while True:
            micro_batch: MicroBatch | None = None
            if not done:
                try:
                    micro_batch = next(micro_batches)
                except StopIteration:
                    done = True
                except Exception as exc:  # noqa: BLE001 - re-raised once every rank is done
                    held, done = exc, True
            local = 0 if micro_batch is None else len(micro_batch.indices)
            counts = torch.tensor([int(micro_batch is not None), local], dtype=torch.long,
                                  device=device)
            if group is not None:
                try:
                    with guard() if guard is not None else contextlib.nullcontext():
                        dist.all_reduce(counts, group=group)
                except Exception:
                    if held is not None:
                        raise held from None
                    raise
            if int(counts[0]) == 0:
                break
            if micro_batch is None:
                micro_batch = empty()
            count = int(counts[1])
            stats = micro_batch.stats
            stats.global_start, stats.global_count = started, count
            stats.global_stop = started + count
            stats.local_count = len(micro_batch.indices)
            started += count
            yield micro_batch
    finally:
        close = getattr(micro_batches, "close", None)
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
