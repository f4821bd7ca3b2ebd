"""Adaptive recompute: a micro-batch admission chose under the configured policy runs under
the least-work rung below it that fits (recompute_ladder.py), never beyond that rung's own
cold cap (no profile for it yet) or trust window; the profile it leaves is keyed by the rung."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from art.megatron.recompute import EffectiveRecompute
from art.megatron.recompute_ladder import RecomputeChoice
from art.trainer_rank._request import MicroBatchShape, OutputRequest
from art.trainer_rank.compute.items import Item
from art.trainer_rank.decide.priced import Pricing
from art.trainer_rank.decide.profiles import ProfileStore


class ChoicePolicy(Protocol):
    cold_start_fraction: float

    @property
    def choice(self) -> RecomputeChoice: ...


class RungDecider(Protocol):
    """What the choice reads of the admission."""

    recompute: EffectiveRecompute
    profiles: ProfileStore
    policy: ChoicePolicy

    def rungs_below(self, lengths: Sequence[int]) -> list[EffectiveRecompute]: ...

    def price_items(self, items: Sequence[Item], grad: bool,
                    recompute: EffectiveRecompute | None = None
                    ) -> tuple[Pricing, MicroBatchShape, str]: ...

    def model_max_tokens(self, usable_bytes: int, outputs: OutputRequest, grad: bool, *,
                         start_tokens: int = 1,
                         recompute: EffectiveRecompute | None = None) -> int: ...

    def growth_cap(self, sig: str, grad: bool, outputs: OutputRequest) -> int | None: ...


@dataclass(frozen=True)
class LoweredRung:
    """The rung below the configured policy a micro-batch runs under, priced."""

    recompute: EffectiveRecompute
    pricing: Pricing
    shape: MicroBatchShape
    signature: str
    cold: bool  # no profile for this rung yet: capped at cap_tokens
    cap_tokens: int | None


def lowered_rung(admission: RungDecider, chosen: Sequence[Item], grad: bool,
                 usable_bytes: int) -> LoweredRung | None:
    """Adaptive: `chosen` under the least-work rung below the configured one that fits,
    within that rung's own cold cap (no profile yet) or trust window; None: none does."""
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
            cap: int | None = max(smallest.num_tokens,
                                  int(admission.policy.cold_start_fraction * model_max))
        else:
            cap = admission.growth_cap(sig, grad, shape.outputs)
        if cap is not None and shape.packed_tokens > cap:
            continue
        return LoweredRung(rung, pricing, shape, sig, cold, cap)
    return None
