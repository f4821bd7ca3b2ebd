"""The recompute-aware decline message: the mode in force, predicted against the limit, and
the same item priced under full recompute and at the next tensor-parallel size (the probe's
ratio to the formulas carried over), with which of them would fit."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from art.megatron.recompute import EffectiveRecompute
from art.megatron.recompute_ladder import RecomputeChoice
from art.trainer_rank._request import MicroBatchShape
from art.trainer_rank._types import ForwardInput, TrainerRankMemoryError
from art.trainer_rank.compute.items import Item
from art.trainer_rank.decide.priced import MemoryModelLike, Pricing, gib
from art.trainer_rank.measuring.device import UnallocatedGradients


class EscalationPolicy(Protocol):
    @property
    def choice(self) -> RecomputeChoice: ...


class Decider(Protocol):
    """What the message reads of the admission that declined."""

    recompute: EffectiveRecompute
    full_recompute: EffectiveRecompute | None
    policy: EscalationPolicy
    next_tp_model: Callable[[], tuple[int, MemoryModelLike] | None] | None
    default_memory_model: MemoryModelLike | None

    def price(self, leaves: Sequence[ForwardInput], grad: bool,
              recompute: EffectiveRecompute | None = None, *,
              gradients: UnallocatedGradients | None = None,
              ) -> tuple[Pricing, MicroBatchShape, str]: ...

    def model_for(self, recompute: EffectiveRecompute) -> MemoryModelLike: ...


def next_tp_dynamic(admission: Decider, model: MemoryModelLike, shape: MicroBatchShape
                    ) -> tuple[int, str]:
    """The next TP size's dynamic peak for `shape`, priced like the decision: its default
    formulas scaled by the ratio of this TP size's price (the decision's coefficients) to
    this TP size's default formulas for the same shape. Without a probe the ratio is 1.
    Returns the bytes and a note for the message."""
    estimate = model.estimate(shape)
    reserve = int(estimate.reserve_bytes)
    if admission.default_memory_model is None:
        return int(estimate.dynamic_bytes), ""
    here = admission.model_for(admission.recompute).estimate(shape)
    formulas = admission.default_memory_model.estimate(shape)
    formulas_model = int(formulas.dynamic_bytes) - int(formulas.reserve_bytes)
    if formulas_model <= 0:
        return int(estimate.dynamic_bytes), ""
    ratio = (int(here.dynamic_bytes) - int(here.reserve_bytes)) / formulas_model
    needed = int(round((int(estimate.dynamic_bytes) - reserve) * ratio)) + reserve
    return needed, f" (its formulas x{ratio:.3f}, the probe's ratio to them here)"

def decline_error(
    admission: Decider,
    item: Item,
    grad: bool,
    usable_bytes: int,
    pricing: Pricing,
    shape: MicroBatchShape,
    full_pricing: Pricing | None,
    *,
    cause: str = "declined before running",
    gradients: UnallocatedGradients | None = None,
) -> TrainerRankMemoryError:
    """The recompute-aware error: the mode in force, predicted vs limit, and the same item
    priced under full recompute and at the next TP size, with which of them would fit."""
    what = (
        f"item {item.index} ({len(item.leaves)} sequence(s), {shape.logical_tokens} logical / "
        f"{shape.packed_tokens} packed tokens, {'grad' if grad else 'no-grad'}, outputs "
        f"{shape.outputs.key})"
    )
    lines = [
        f"forward_micro_batches: {what} {cause}: under {admission.recompute.summary} the predicted "
        f"dynamic peak is {gib(pricing.dynamic_bytes)} ({pricing.source}; peak with resident "
        f"{gib(pricing.peak_bytes)}) against a usable limit of {gib(usable_bytes)}."
    ]
    remedies: list[str] = []
    full = admission.full_recompute
    if grad and full is not None and full.key != admission.recompute.key:
        if full_pricing is None:
            full_pricing, _, _ = admission.price(item.leaves, grad, full,
                                                 gradients=gradients)
        fits = full_pricing.dynamic_bytes <= usable_bytes
        lines.append(
            f"Under {full.summary} it would need {gib(full_pricing.dynamic_bytes)}: "
            f"{'fits' if fits else 'does not fit'}."
        )
        if fits:
            remedies.append(
                "switch to full recompute (ART_MEGATRON_RECOMPUTE_GRANULARITY=full, "
                "ART_MEGATRON_RECOMPUTE_METHOD=uniform, ART_MEGATRON_RECOMPUTE_NUM_LAYERS=1)"
                + ("" if admission.policy.choice != RecomputeChoice.CONFIGURED else
                   " or let it escalate (ART_TRAINER_RANK_RECOMPUTE=escalate)")
            )
        ladder = getattr(admission, "ladder", None)
        if admission.policy.choice == RecomputeChoice.CONFIGURED and ladder is not None:
            # What escalation would have run: the least-work rung above that fits.
            for rung in ladder.above(shape.sequence_lengths_tokens):
                if rung.recompute.key == full.key:
                    break
                rung_pricing, _, _ = admission.price(item.leaves, grad, rung.recompute,
                                                    gradients=gradients)
                if rung_pricing.dynamic_bytes <= usable_bytes:
                    lines.append(
                        f"The least recompute above {admission.recompute.summary} that fits "
                        f"is {rung.recompute.summary} ({gib(rung_pricing.dynamic_bytes)}).")
                    remedies.insert(0, "let the trainer escalate this micro-batch "
                                       "(ART_TRAINER_RANK_RECOMPUTE=escalate runs "
                                       f"{rung.recompute.summary})")
                    break
    elif not grad:
        lines.append(
            "Without grad no activations are retained, so recompute cannot help; "
            f"{'its sequences are run one per sub-forward at best' if len(item.leaves) > 1 else 'a single sequence cannot be split'}."  # noqa: E501
        )
    elif full is not None:
        lines.append(f"{admission.recompute.summary} is already the most frugal recompute policy.")
    if admission.next_tp_model is not None:
        try:
            next_tp = admission.next_tp_model()
        except ValueError as exc:
            next_tp, reason = None, str(exc)
        else:
            reason = "no larger TP size is possible for this model"
        if next_tp is None:
            lines.append(f"A larger TP size: not priced ({reason}).")
        else:
            tp, model = next_tp
            needed, how = next_tp_dynamic(admission, model, shape)
            fits = needed <= usable_bytes
            lines.append(
                f"At TP={tp} (same recompute) it would need {gib(needed)} per rank{how}: "
                f"{'fits' if fits else 'does not fit'} (if the per-rank limit is the same)."
            )
            if fits:
                remedies.append(f"set ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE={tp}")
    if len(item.leaves) > 1:
        remedies.append("pass the group's sequences as separate top-level items")
    remedies.append("shorten the sequences or request fewer outputs")
    suggestion = "; or ".join(remedies)
    lines.append(f"Remedy: {suggestion}.")
    return TrainerRankMemoryError(
        " ".join(lines),
        predicted_peak_bytes=pricing.dynamic_bytes,
        usable_limit_bytes=usable_bytes,
        recompute_summary=admission.recompute.summary,
        suggestion=suggestion,
        indices_not_run=(item.index,),
    )
