"""One grad call run as several sub-forwards whose graphs all live until the caller's backward
(`dp_rank_forward`): how whole items are cut into sub-forwards, and what the call then peaks
at, as named terms.

Sub-forward j runs while the graphs of the ones before it are held, so its forward peaks at
what they retain plus its own forward peak. The caller's backward then runs the graphs in
reverse order of creation (autograd orders its ready queue by sequence number, and every node
of a later graph has a higher one), so sub-forward j's backward runs while the earlier ones
are still whole and the later ones have left only their outputs, which the caller holds. The
call's dynamic peak is the largest of these moments; Megatron's unfused-attention score
buffer is one buffer kept at the largest size any of them asked for.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from art.megatron.recompute import EffectiveRecompute
from art.trainer_rank._request import MicroBatchShape
from art.trainer_rank._types import (
    ADMITTED,
    DECLINED,
    ESCALATED,
    SPLIT,
    TrainerRankMemoryError,
)
from art.trainer_rank.compute.items import Item
from art.trainer_rank.decide.plan import Plan, PlanRequest
from art.trainer_rank.decide.priced import MemoryModelLike, Pricing, gib
from art.trainer_rank.measuring.device import UnallocatedGradients
from art.trainer_rank.pricing.estimate import Estimate


class CallPricer(Protocol):
    """What planning a whole call reads of the admission (which plans a call through it)."""

    memory_model: MemoryModelLike
    recompute: EffectiveRecompute
    full_recompute: EffectiveRecompute | None

    def price_items(self, items: Sequence[Item], grad: bool,
                    recompute: EffectiveRecompute | None = None, *,
                    gradients: UnallocatedGradients | None = None,
                    ) -> tuple[Pricing, MicroBatchShape, str]: ...

    def rungs_above(self, lengths: Sequence[int]) -> list[EffectiveRecompute]: ...

    def rungs_below(self, lengths: Sequence[int]) -> list[EffectiveRecompute]: ...


def token_balanced_chunks(items: Sequence[Item], count: int) -> list[list[Item]]:
    """`items` cut, in order, into `count` contiguous runs of nearly equal tokens (each at
    least one item): the k-th cut is the item boundary nearest k/count of the tokens."""
    count = max(1, min(count, len(items)))
    ends = list(itertools.accumulate(item.num_tokens for item in items))
    total = ends[-1] if ends else 0
    cuts: list[int] = []  # items before each cut
    for k in range(1, count):
        low = (cuts[-1] if cuts else 0) + 1
        high = len(items) - (count - k)  # leave one item for every later run
        target = total * k / count
        cuts.append(min(range(low, high + 1), key=lambda n: (abs(ends[n - 1] - target), n)))
    bounds = [0, *cuts, len(items)]
    return [list(items[a:b]) for a, b in zip(bounds, bounds[1:])]


@dataclass(frozen=True)
class SubForwardBytes:
    """One sub-forward's own moments (the profile's correction applied): forward and backward
    peaks, what it retains until its backward, its outputs, its score buffer."""

    forward: int
    backward: int
    retained: int
    outputs: int
    score_buffer: int

    @classmethod
    def of(cls, estimate: Estimate, correction: float) -> SubForwardBytes:
        def scaled(n: int) -> int:
            return int(round(n * correction))

        return cls(
            forward=scaled(estimate.forward_peak_bytes),
            backward=scaled(estimate.backward_peak_bytes),
            retained=scaled(estimate.retained_after_forward_bytes),
            outputs=scaled(estimate.outputs_bytes),
            score_buffer=estimate.score_buffer_bytes,
        )


@dataclass(frozen=True)
class HeldPeak:
    """The binding moment of a held split: which sub-forward, in which pass, and what the
    others hold then (beside that sub-forward's own peak)."""

    sub_forward: int
    phase: str  # "forward" | "backward"
    own_bytes: int  # the binding sub-forward's own peak in that pass
    graphs_before_bytes: int  # retained by the sub-forwards before it
    outputs_after_bytes: int  # outputs of the ones after it (backward only)
    score_buffer_growth_bytes: int  # the shared score buffer above its own size

    @property
    def held_bytes(self) -> int:
        return (self.graphs_before_bytes + self.outputs_after_bytes
                + self.score_buffer_growth_bytes)

    @property
    def core_bytes(self) -> int:
        return self.own_bytes + self.held_bytes

    @property
    def note(self) -> str:
        parts = [f"graphs of {self.sub_forward} earlier sub-forward(s)"]
        if self.phase == "backward":
            parts.append("outputs of the later ones")
        if self.score_buffer_growth_bytes:
            parts.append("the shared score buffer's growth")
        return (f"sub-forward {self.sub_forward + 1}'s {self.phase}: " + ", ".join(parts))


def held_peak(sub_forwards: Sequence[SubForwardBytes]) -> HeldPeak:
    """The largest moment of the call, sub-forwards run in the given order."""
    largest_buffer = max(s.score_buffer for s in sub_forwards)
    best: HeldPeak | None = None
    before = 0
    for j, own in enumerate(sub_forwards):
        after = sum(s.outputs for s in sub_forwards[j + 1:])
        growth = largest_buffer - own.score_buffer
        for phase, own_peak, outputs_after in (("forward", own.forward, 0),
                                               ("backward", own.backward, after)):
            moment = HeldPeak(j, phase, own_peak, before, outputs_after, growth)
            if best is None or moment.core_bytes > best.core_bytes:
                best = moment
        before += own.retained
    assert best is not None
    return best


def price_held_split(admission: CallPricer, chunks: Sequence[Sequence[Item]], grad: bool,
                     recompute: EffectiveRecompute | None = None, *,
                     gradients: UnallocatedGradients | None = None,
                     ) -> tuple[Pricing, MicroBatchShape, str]:
    """`chunks` run one after another with every graph held until the caller's backward: the
    binding sub-forward's pricing, with what the others hold
    at that moment as its held terms."""
    priced = [admission.price_items(chunk, grad, recompute, gradients=gradients)
              for chunk in chunks]
    if len(priced) == 1:
        return priced[0]
    own = []
    for pricing, _, _ in priced:
        model = int(pricing.estimate.dynamic_bytes) - int(pricing.estimate.reserve_bytes)
        corrected = (model if pricing.profile_dynamic_bytes is None else
                     pricing.profile_dynamic_bytes - int(pricing.estimate.reserve_bytes))
        own.append(SubForwardBytes.of(pricing.estimate, corrected / model if model > 0
                                      else 1.0))
    peak = held_peak(own)
    pricing, shape, sig = priced[peak.sub_forward]
    mine = own[peak.sub_forward]
    own_core = max(mine.forward, mine.backward)
    largest = max(int(p.estimate.largest_allocation_bytes) for p, _, _ in priced)
    reserve = admission.memory_model.allocator_reserve_bytes(peak.core_bytes, largest)
    held_reserve = max(0, reserve - int(pricing.estimate.reserve_bytes))
    return replace(pricing, held_bytes=peak.core_bytes - own_core,
                   held_reserve_bytes=held_reserve, held_note=peak.note), shape, sig


def plan_call(admission: CallPricer, request: PlanRequest, what: str = "dp_rank_forward"
              ) -> Plan:
    """All of the request's items in one call: whole when it fits, else 2, 4, ...
    sub-forwards of whole items (token-balanced, in order) priced with every graph held
    together; then the same ladder under full recompute when escalation is allowed; else
    declined."""
    grad, usable_bytes, gradients = request.grad, request.usable_bytes, request.gradients
    items = sorted(request.pending, key=lambda it: it.index)
    policies: list[EffectiveRecompute] = [admission.recompute]
    if grad:
        lengths = tuple(n for it in items for n in it.sequence_lengths_tokens)
        # Adaptive: the rungs below the configured one first; then, escalating, above it.
        policies = [*admission.rungs_below(lengths), admission.recompute,
                    *admission.rungs_above(lengths)]
    tried: list[tuple[EffectiveRecompute, int, Pricing]] = []
    for recompute in policies:
        count = 1
        while True:
            chunks = token_balanced_chunks(items, count)
            pricing, shape, sig = price_held_split(admission, chunks, grad, recompute,
                                                   gradients=gradients)
            tried.append((recompute, len(chunks), pricing))
            if pricing.dynamic_bytes <= usable_bytes:
                return _call_plan(admission, items, chunks, recompute, pricing, shape, sig,
                                  rejected=len(tried) - 1)
            if len(chunks) >= len(items):
                break
            count = min(len(items), 2 * count)
    error = call_decline_error(admission, items, grad, usable_bytes, tried, what)
    pricing, shape, sig = admission.price_items(items, grad, gradients=gradients)
    return Plan(decision=DECLINED, items=tuple(items), pricing=pricing, shape=shape,
                sub_forwards=(), signature=sig, error=error,
                rejected_candidates=len(tried))


def _call_plan(admission: CallPricer, items: list[Item], chunks: list[list[Item]],
               recompute: EffectiveRecompute, pricing: Pricing, shape: MicroBatchShape,
               sig: str, rejected: int) -> Plan:
    sub_forwards, cursor = [], 0
    for chunk in chunks:
        n = sum(len(it.leaves) for it in chunk)
        sub_forwards.append(tuple(range(cursor, cursor + n)))
        cursor += n
    other = recompute is not admission.recompute
    escalate = other and recompute in admission.rungs_above(
        tuple(n for it in items for n in it.sequence_lengths_tokens))
    notes = []
    if len(chunks) > 1:
        notes.append(f"{len(items)} items in {len(chunks)} sub-forwards, every graph held "
                     "until the caller's backward")
    if escalate:
        notes.append(f"{admission.recompute.summary} does not fit; escalated to "
                     f"{recompute.summary}, the least recompute above it that fits")
    elif other:
        notes.append(f"adaptive: {recompute.summary} fits, less recompute than "
                     f"{admission.recompute.summary}")
    return Plan(
        decision=ESCALATED if escalate else (SPLIT if len(chunks) > 1 else ADMITTED),
        items=tuple(items), pricing=pricing, shape=shape, sub_forwards=tuple(sub_forwards),
        signature=sig, escalate=escalate, recompute=recompute if other else None,
        note="; ".join(notes), rejected_candidates=rejected,
    )


def call_decline_error(admission: CallPricer, items: Sequence[Item], grad: bool, usable_bytes: int,
                       tried: Sequence[tuple[EffectiveRecompute, int, Pricing]], what: str
                       ) -> TrainerRankMemoryError:
    """Why a whole call cannot run: the request, every rung priced, and what would work."""
    sequences = sum(len(it.leaves) for it in items)
    tokens = sum(it.num_tokens for it in items)
    request = (f"{len(items)} item(s), {sequences} sequence(s), {tokens} logical tokens, "
               f"{'grad' if grad else 'no-grad'}")
    rungs = "; ".join(
        f"{recompute.summary} in {count} sub-forward(s): {gib(pricing.dynamic_bytes)}"
        for recompute, count, pricing in tried)
    best = min(tried, key=lambda t: t[2].dynamic_bytes)[2]
    remedies = []
    if len(items) > 1:
        remedies.append(f"call {what} with fewer items at a time, running the caller's "
                        "backward after each")
    full = admission.full_recompute
    if grad and full is not None and not any(r.key == full.key for r, _, _ in tried):
        remedies.append("switch to full recompute (ART_MEGATRON_RECOMPUTE_GRANULARITY=full)")
    remedies.append("use forward_micro_batches, which runs the backward of each micro-batch "
                    "before the next")
    remedies.append("shorten the sequences or request fewer outputs")
    suggestion = "; or ".join(remedies)
    split = ("a single item cannot be split" if len(items) == 1 else
             "it does not fit in any split")
    message = (
        f"{what}: the request ({request}) is declined before running: {split}; every graph "
        "stays live "
        f"until the caller's backward, and against a usable limit of {gib(usable_bytes)} "
        f"the rungs priced {rungs}. Remedy: {suggestion}."
    )
    return TrainerRankMemoryError(
        message, predicted_peak_bytes=best.dynamic_bytes, usable_limit_bytes=usable_bytes,
        recompute_summary=admission.recompute.summary, suggestion=suggestion,
        indices_not_run=tuple(it.index for it in items))
