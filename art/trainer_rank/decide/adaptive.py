"""Adaptive recompute: a micro-batch admission chose under the configured policy runs under
the least-work rung below it that fits (recompute_ladder.py), never beyond that rung's own
cold cap (no profile for it yet) or trust window; the profile it leaves is keyed by the rung."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from art.megatron.recompute_ladder import RecomputeChoice
from art.trainer_rank._types import ADMITTED, COLD_CAPPED
from art.trainer_rank.compute.items import Item

if TYPE_CHECKING:
    from art.trainer_rank.decide.admission import Admission, Plan


def lowered_plan(admission: Admission, chosen: Sequence[Item], grad: bool, usable_bytes: int
                 ) -> Plan | None:
    """Adaptive: `chosen` under the least-work rung below the configured one that fits,
    within that rung's own cold cap (no profile yet) or trust window; None: none does."""
    from art.trainer_rank.decide.admission import Plan  # noqa: F811 (the runtime import)

    if not grad or admission.policy.choice != RecomputeChoice.ADAPTIVE:
        return None
    lengths = tuple(n for it in chosen for n in it.sequence_lengths_tokens)
    for rung in admission.rungs_below(lengths):
        pricing, shape, sig = admission.price_items(chosen, grad, rung)
        if pricing.dynamic_bytes > usable_bytes:
            continue
        cold = not admission.profiles.has_profile(sig)
        if cold:
            smallest = min(chosen, key=lambda it: (it.num_tokens, it.index))
            model_max = admission.model_max_tokens(usable_bytes, smallest.outputs, grad,
                                                   start_tokens=smallest.num_tokens,
                                                   recompute=rung)
            cap = max(smallest.num_tokens,
                      int(admission.policy.cold_start_fraction * model_max))
        else:
            cap = admission.growth_cap(sig, grad, shape.outputs)
        if cap is not None and shape.packed_tokens > cap:
            continue
        note = (f"adaptive: {rung.summary} fits, less recompute than "
                f"{admission.recompute.summary}")
        if cold:
            note += f"; no profile for it yet: capped at {cap} tokens"
        return Plan(
            decision=COLD_CAPPED if cold else ADMITTED,
            items=tuple(chosen), pricing=pricing, shape=shape,
            sub_forwards=(tuple(range(sum(len(it.leaves) for it in chosen))),),
            signature=sig, recompute=rung, note=note,
        )
    return None
