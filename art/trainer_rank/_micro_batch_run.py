"""One planned micro-batch run, as values: its forwards executed (`execute` -> Execution), and
once the caller handed control back, what its loss and backward peaked at (`caller_peak` ->
CallerPeak). The orchestrator (_impl.py) yields between the two and records the outcome."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.trainer_rank._types import ForwardOutput
from art.trainer_rank.compute.execute import detached_output, pack_leaves, run_sub_forward
from art.trainer_rank.compute.items import rebuild
from art.trainer_rank.compute.packing import PackedBatch
from art.trainer_rank.decide.plan import Plan
from art.trainer_rank.measuring.device import cuda_oom_count
from art.trainer_rank.measuring.meter import MemoryMeter
from art.trainer_rank.ranks import agree as _agree
from art.trainer_rank.ranks.faults import CALLER_BACKWARD, MicroBatchContext
from art.trainer_rank.ranks.phases import PhaseAgreement
from art.trainer_rank.slots.routing import adapter_groups, run_by_adapter


@dataclass(frozen=True)
class ComputePath:
    """What a plan's forwards run on: the model as built, and the phase agreement that turns
    a failure on one rank of the replica into the same error on every rank."""

    model: torch.nn.Module
    implementation: Implementation
    layout: ParallelLayout
    device: torch.device
    head_chunk_tokens: int
    # Whether one packed row lays a group's shared prefixes out once.
    shares_prefixes: bool
    # Slot -> the adapter it runs with (sequences of different adapters never share a row).
    adapter_key: Callable[[str | None], str | None]
    phases: PhaseAgreement


@dataclass(frozen=True)
class Execution:
    """What running a plan's forwards produced: every item's outputs in its own nesting, or
    the out-of-memory error that stopped them and where."""

    outputs: list[Any]
    sub_forwards_run: int
    oom: torch.OutOfMemoryError | None = None
    # The sub-forward that ran out of memory (the first one when its packing did).
    failed_sub_forward: tuple[int, ...] | None = None
    # False when the packing vote found an OOM before any forward ran: no gradient changed.
    forward_started: bool = True


@dataclass(frozen=True)
class CallerPeak:
    """The micro-batch's measured peak through the caller's loss and backward, the maximum
    over the replica, and whether any rank of it ran out of memory there."""

    measured_peak_bytes: int
    out_of_memory: bool
    # From the start of the micro-batch's forward to the caller asking for the next one, the
    # slowest rank's (every rank of the replica reads the same).
    seconds: float = 0.0


def leaf_slots(plan: Plan) -> list[str | None]:
    """The checkpoint slot of each of the plan's sequences, in leaf order."""
    return [c for item in plan.items for c in item.checkpoints]


def decoder_passes(plan: Plan) -> int:
    """How many times `execute` runs the decoder for `plan`: once per sub-forward and, within
    one, per checkpoint slot its sequences use (each slot's adapter runs on its own)."""
    slots = leaf_slots(plan)
    return sum(len(adapter_groups([slots[i] for i in sub])) for sub in plan.sub_forwards)


def leaf_no_grad(plan: Plan) -> list[bool]:
    """Whether each of the plan's sequences asked for no grad, in leaf order."""
    return [f for item in plan.items for f in item.no_grad_leaves]


def trained_slots(plan: Plan) -> set[str]:
    """The slots a grad plan's backward gives gradients to (its sequences that take grad)."""
    return {c for c, no_grad in zip(leaf_slots(plan), leaf_no_grad(plan))
            if c is not None and not no_grad}


def execute(path: ComputePath, plan: Plan, grad: bool, context: MicroBatchContext,
            replica: int) -> Execution:
    """Run `plan`'s sub-forwards under `grad`. An OOM on a replica of one rank comes back in
    the Execution (the caller recovers); on several ranks the phase agreement raises it."""
    slot_of = leaf_slots(plan)
    prepared, oom = _prepare(path, plan, slot_of, replica)
    if oom is not None:  # agreed by every rank of the replica
        return Execution([], 0, oom, plan.sub_forwards[0], forward_started=False)
    leaves = plan.leaves
    failed_sub: tuple[int, ...] | None = None
    ran = 0
    leaf_outputs: list[ForwardOutput] = []
    try:
        with torch.set_grad_enabled(grad), path.phases.compute(context, replica):
            for sub in plan.sub_forwards:
                failed_sub = sub
                leaf_outputs.extend(run_by_adapter(
                    list(sub), [slot_of[i] for i in sub],
                    lambda part, slot: run_sub_forward(
                        path.model, [leaves[i] for i in part],
                        implementation=path.implementation, layout=path.layout,
                        device=path.device,
                        groups=plan.groups(part) if path.shares_prefixes else None,
                        head_chunk_tokens=path.head_chunk_tokens,
                        checkpoint=slot, batch=prepared.pop(tuple(part), None),
                    ),
                    adapter_key=path.adapter_key,
                ))
                ran += 1
    except torch.OutOfMemoryError as exc:
        return Execution([], ran, exc, failed_sub)
    if grad:
        # A sequence asking no grad inside a grad micro-batch gets detached outputs.
        leaf_outputs = [detached_output(out) if no_grad else out
                        for out, no_grad in zip(leaf_outputs, leaf_no_grad(plan))]
    outputs, cursor = [], 0
    for item in plan.items:
        n = len(item.leaves)
        outputs.append(rebuild(item.value, leaf_outputs[cursor:cursor + n]))
        cursor += n
    return Execution(outputs, ran)


def _prepare(path: ComputePath, plan: Plan, slot_of: list[str | None], replica: int
             ) -> tuple[dict[tuple[int, ...], PackedBatch], torch.OutOfMemoryError | None]:
    """Pack the micro-batch's first forward (its first sub-forward's first adapter group)
    before any collective of the micro-batch, then vote: an OOM there on any rank of the
    replica is the same OOM on every rank. Returns the packed batch by leaf positions, or the
    OOM when the vote found one."""
    first = plan.sub_forwards[0]
    positions = adapter_groups([slot_of[i] for i in first])[0][1]
    part = [first[p] for p in positions]
    prepared: dict[tuple[int, ...], PackedBatch] = {}
    error: torch.OutOfMemoryError | None = None
    try:
        prepared[tuple(part)] = pack_leaves(
            [plan.leaves[i] for i in part], implementation=path.implementation,
            layout=path.layout, device=path.device, groups=plan.groups(part))
    except torch.OutOfMemoryError as exc:
        error = exc
    failed_rank = path.phases.vote(error is not None, replica)
    if failed_rank is None:
        return prepared, None
    prepared.clear()
    return {}, error or torch.OutOfMemoryError(
        f"rank {failed_rank} ran out of memory packing items {plan.indices}")


def caller_peak(path: ComputePath, meter: MemoryMeter, ooms_before: int, usable_bytes: int,
                context: MicroBatchContext, replica: int, started: float) -> CallerPeak:
    """Read once the caller asks for the next micro-batch (its loss and backward done);
    `started`: `time.perf_counter()` when its forward began."""
    over = meter.limit_bytes is not None and meter.peak_bytes > meter.limit_bytes
    out_of_memory = over or cuda_oom_count(path.device) > ooms_before
    if out_of_memory and replica > 1:
        # Outside torch.autograd.backward (e.g. in the caller's loss): peers may be blocked
        # in this micro-batch's backward collectives.
        raise path.phases.abandon(torch.OutOfMemoryError(
            f"out of memory in the caller's loss/backward at {meter.peak_bytes} bytes "
            f"(usable {usable_bytes})"), CALLER_BACKWARD, "", context)
    micros = int((time.perf_counter() - started) * 1e6)
    with path.phases.collectives(CALLER_BACKWARD, context):
        oom, measured, micros = _agree.max_over_replica_of(
            (int(out_of_memory), meter.peak_bytes, micros))
    return CallerPeak(measured, bool(oom), micros / 1e6)


def micro_batch_context(plan: Plan, call: int, micro_batch: int, usable_bytes: int
                        ) -> MicroBatchContext:
    """What every rank of the replica records about `plan` while it runs (the same plan)."""
    return MicroBatchContext(
        call=call, micro_batch=micro_batch, items=tuple(plan.indices),
        signature=plan.signature, packed_tokens=plan.shape.packed_tokens,
        usable_bytes=usable_bytes, predicted_bytes=plan.pricing.dynamic_bytes,
        recompute_summary=plan.pricing.recompute.summary,
        model_bytes=plan.pricing.model_peak_bytes,
    )
