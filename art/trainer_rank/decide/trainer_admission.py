"""The Admission one TrainerRank decides with: the signature its profiles are keyed by (model,
implementation, layout without DP, dtype; the adapter), packed lengths with or without shared
prefixes, what held outputs cost, escalation and the next tensor-parallel size."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from art.megatron.provider import Provider
from art.trainer_rank.compute.packing import packed_length_tokens, shares_prefixes
from art.trainer_rank.decide.admission import Admission, AdmissionPolicy
from art.trainer_rank.decide.priced import MemoryModelLike
from art.trainer_rank.decide.profiles import ProfileStore
from art.trainer_rank.measuring.device import held_output_bytes
from art.trainer_rank.measuring.trainer_pricing import TrainerPricing

if TYPE_CHECKING:
    from peft import LoraConfig


def adapter_signature(lora: LoraConfig | None) -> str:
    """"none", or the adapter's rank and targets, e.g. "r8:linear_fc1,linear_qkv"."""
    if lora is None:
        return "none"
    targets = lora.target_modules or []
    targets = [targets] if isinstance(targets, str) else sorted(targets)
    return f"r{lora.r}:{','.join(targets)}"


def trainer_admission(provider: Provider, pricing: TrainerPricing, profiles: ProfileStore,
                      policy: AdmissionPolicy,
                      next_tp_model: Callable[[], tuple[int, MemoryModelLike] | None]
                      ) -> tuple[Admission, bool]:
    """The Admission, and whether this trainer packs shared prefixes once."""
    layout = provider.layout
    # Gated DeltaNet layers take a tree too: each child segment continues from its parent's
    # final state and conv window (megatron/gated_delta_rows.py).
    share = shares_prefixes(provider.implementation, layout)
    admission = Admission(
        memory_model=pricing.memory_model,
        profiles=profiles,
        recompute=provider.effective_recompute,
        # Per-rank memory does not depend on the data-parallel size: leave it out.
        topology=f"{provider.geometry.name}|{provider.implementation.key}|"
        f"{replace(layout, data_parallel=1).summary}|{provider.dtype}",
        adapter=adapter_signature(provider.lora_config),
        packed_length=lambda lengths, shared=0: packed_length_tokens(
            lengths, layout, shared if share else 0, provider.implementation),
        full_recompute=pricing.full_recompute,
        ladder=pricing.ladder,
        held_output_bytes=lambda shape: held_output_bytes(
            shape, provider.geometry, provider.dtype),
        next_tp_model=next_tp_model,
        default_memory_model=pricing.default_memory_model,
        policy=policy,
        shares_prefixes=share,
    )
    return admission, share
