"""Adaptive recompute's two packings of a queue, weighed by the step-time line.

Packed under the least-work rung its first item fits alone, a micro-batch recomputes as little
as possible but holds fewer items. Packed as the configured policy packs and then lowered to
the least-work rung that very micro-batch fits, it holds as many items as the configured policy
runs together, and recomputes no more than it. Which is faster per token depends on what a
micro-batch costs beside its FLOPs; the step-time line (step_time.py), fitted from the grad
micro-batches that ran, says. Before there is a line, the packed one runs.

Functions of the frozen Admission (admission.py; `Admission` here is what they read of it)
and a request, as held_split.py's are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from art.megatron.recompute import EffectiveRecompute
from art.megatron.recompute_ladder import RecomputeLadder
from art.trainer_rank._request import MicroBatchShape, OutputRequest
from art.trainer_rank._types import ADMITTED, COLD_CAPPED
from art.trainer_rank.compute.items import Item
from art.trainer_rank.decide.plan import Plan, PlanRequest
from art.trainer_rank.decide.priced import Pricing
from art.trainer_rank.decide.step_time import StepTimeFit
from art.trainer_rank.measuring.device import UnallocatedGradients

RUNS = (ADMITTED, COLD_CAPPED)


class Admission(Protocol):
    """What adaptive's packings read of the admission (which plans through them)."""

    recompute: EffectiveRecompute
    ladder: RecomputeLadder | None

    def price_items(self, items: Sequence[Item], grad: bool,
                    recompute: EffectiveRecompute | None = None, *,
                    gradients: UnallocatedGradients | None = None,
                    ) -> tuple[Pricing, MicroBatchShape, str]: ...

    def rungs_below(self, lengths: Sequence[int]) -> list[EffectiveRecompute]: ...

    def cap(self, items: Sequence[Item], request: PlanRequest, sig: str,
            outputs: OutputRequest, recompute: EffectiveRecompute | None = None
            ) -> tuple[bool, int | None]: ...

    def admitted(self, chosen: Sequence[Item], pricing: Pricing, shape: MicroBatchShape,
                 sig: str, cold: bool, cap_tokens: int | None, rejected: int = 0, *,
                 recompute: EffectiveRecompute | None = None) -> Plan: ...


def packs_two_ways(admission: Admission, items: Sequence[Item]) -> bool:
    """Adaptive with rungs below the configured one, and grad items to pack."""
    first = next((it for it in items if it.grad), None)
    return first is not None and bool(admission.rungs_below(first.sequence_lengths_tokens))


def least_work_rung_plan(admission: Admission, items: Sequence[Item], request: PlanRequest
                         ) -> Plan | None:
    """`items` as one grad micro-batch under the least-work rung they fit together (the rungs
    below the configured one, then the configured one), within that rung's cap; None when
    none does."""
    lengths = [n for it in items for n in it.sequence_lengths_tokens]
    for rung in [*admission.rungs_below(lengths), admission.recompute]:
        pricing, shape, sig = admission.price_items(items, True, rung,
                                                    gradients=request.gradients)
        if pricing.dynamic_bytes > request.usable_bytes:
            continue
        cold, cap = admission.cap(items, request, sig, shape.outputs, rung)
        if cap is None or shape.packed_tokens <= cap:
            return admission.admitted(items, pricing, shape, sig, cold, cap, recompute=rung)
    return None


def seconds_per_token(admission: Admission, plan: Plan, fit: StepTimeFit) -> float:
    """What the line predicts `plan` takes, per token of its sequences."""
    assert admission.ladder is not None  # two packings exist only with a ladder
    ladder, lengths = admission.ladder, plan.shape.sequence_lengths_tokens
    seconds = fit.predict_seconds(ladder.forward_flops(lengths),
                                  ladder.flops(plan.recompute or admission.recompute, lengths))
    return seconds / max(1, sum(lengths))


def packed_is_quicker(admission: Admission, least_work: Plan, packed: Plan,
                      fit: StepTimeFit | None) -> bool:
    """Whether the line predicts the packed plan no slower per token (true without a line)."""
    if fit is None:
        return True
    return (seconds_per_token(admission, packed, fit)
            <= seconds_per_token(admission, least_work, fit))


def quicker(admission: Admission, least_work: Plan, packed: Plan, fit: StepTimeFit | None
            ) -> Plan:
    """Of the two packings, the one the line predicts faster per token (the packed one on a
    tie, and while there is no line), its note saying why."""
    if packed.indices == least_work.indices and packed.recompute == least_work.recompute:
        return least_work
    if fit is None:
        return replace(packed, note="; ".join(n for n in (
            packed.note, "packed as configured (no step times yet)") if n))
    packed_s = seconds_per_token(admission, packed, fit)
    least_s = seconds_per_token(admission, least_work, fit)
    if packed_s <= least_s:
        fast, fast_s, slow_s, packing = packed, packed_s, least_s, "packed as configured"
    else:
        fast, fast_s, slow_s, packing = least_work, least_s, packed_s, "packed under its rung"
    return replace(fast, note="; ".join(n for n in (fast.note, (
        f"{packing}: {fast_s * 1e6:.2f} us/token predicted against {slow_s * 1e6:.2f} "
        f"({fit.summary})")) if n))


def quicker_of_next(admission: Admission, request: PlanRequest, least_work: Plan,
                    as_configured: Plan) -> Plan:
    """A queue's next micro-batch (`PlanMode.NEXT`): `least_work` packed under its first
    item's least-work rung, or `as_configured` (the configured packing) lowered."""
    if as_configured.decision not in RUNS or least_work.decision not in RUNS:
        return least_work
    packed = least_work_rung_plan(admission, as_configured.items, request) or as_configured
    return quicker(admission, least_work, packed, request.step_time)


def quicker_wave(admission: Admission, least_work_items: Sequence[Item],
                 packed_items: Sequence[Item], request: PlanRequest) -> int:
    """A wave's width (`PlanMode.WAVE`): the count of `least_work_items` (the prefix that fits
    under its first grad item's least-work rung) or of `packed_items` (the longer prefix the
    configured policy fits), whichever the line predicts faster. `request`: the packed
    prefix's grad items, with the limit and step times."""
    least_grad = tuple(it for it in least_work_items if it.grad)
    packed = least_work_rung_plan(admission, request.pending, request)
    if packed is None or not least_grad:
        return len(least_work_items)
    least_work = least_work_rung_plan(admission, least_grad, replace(request, pending=least_grad))
    if least_work is None or packed_is_quicker(admission, least_work, packed, request.step_time):
        return len(packed_items)
    return len(least_work_items)


def packed_wave_noted(admission: Admission, plan: Plan, first_item_rung: EffectiveRecompute,
                      fit: StepTimeFit | None) -> Plan:
    """A wave's plan under the least-work rung its items fit together; when that rung is above
    the one its first item fits alone, the wave was packed as configured, and its note says
    why."""
    rung = plan.recompute or admission.recompute
    if rung.key == first_item_rung.key:
        return plan
    why = f"the step-time line predicts it faster per token ({fit.summary})" if fit else \
        "no step times yet"
    return replace(plan, note="; ".join(n for n in (plan.note, f"packed as configured: {why}")
                                        if n))
