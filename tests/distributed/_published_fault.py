"""Harness of the 2-rank workers that publish a fault by hand (boundary_fault_worker.py,
waves_fault_worker.py): the world with its phase agreement, and a forward OOM of some rank
written to the job's store as the failing rank's `abandon` would write it."""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist
from megatron.core import parallel_state

from art.trainer_rank.ranks.phases import (
    FAULT_COUNT_KEY,
    FAULT_KEY,
    Fault,
    MicroBatchContext,
    PhaseAgreement,
)

RANK = int(os.environ["RANK"])


def two_rank_agreement(port: int, *, tensor_parallel: int,
                       group_timeout_s: float) -> PhaseAgreement:
    """Both ranks' gloo world on a control store at `port`, Megatron's groups, and this rank's
    PhaseAgreement, once every rank has one."""
    store = dist.TCPStore("127.0.0.1", port, 2, RANK == 0, timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=RANK, world_size=2,
                            timeout=timedelta(seconds=group_timeout_s))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
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
