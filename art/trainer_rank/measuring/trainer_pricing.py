"""The memory models one TrainerRank prices with: its own (probe coefficients, each policy's
measured when first priced; the head chunk it runs),
the same without coefficients, and the one a doubled tensor-parallel size would have."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any

import torch

from art.megatron.recompute import EffectiveRecompute
from art.megatron.recompute_ladder import RecomputeChoice, RecomputeLadder, build_ladder
from art.trainer_rank.measuring.device import device_usable_bytes
from art.trainer_rank.measuring.probing import TrainerProbe
from art.trainer_rank.pricing.model import MemoryModel
from art.trainer_rank.ranks import agree as _agree


@dataclass(frozen=True)
class TrainerPricing:
    memory_model: Any  # a MemoryModel, or whatever the runtime brought
    probe: TrainerProbe | None
    default_memory_model: Any | None  # the same without probe coefficients, when it has them
    full_recompute: EffectiveRecompute | None  # the most frugal rung, if resolvable
    ladder: RecomputeLadder  # every rung a micro-batch may run, the configured one first


def trainer_pricing(provider: Any, model: torch.nn.Module, given: Any, *, probe_layers: bool,
                    recompute_choice: RecomputeChoice, test_memory_limit_bytes: int | None,
                    cache_dir: str | None, head_chunk_tokens: int,
                    probe_guard: Callable[[], AbstractContextManager[None]] | None = None
                    ) -> TrainerPricing:
    """The runtime's own memory model when it brings one; else MemoryModel with probe
    coefficients (when `probe_layers`), priced with the head chunk this trainer runs.
    `probe_guard`: what a probe run now (under expert parallel) runs inside (the fault
    protocol's, `PhaseAgreement.probing`)."""
    try:
        full = provider.recompute_as("full", "uniform", 1)
    except ValueError:
        full = None
    ladder = RecomputeLadder(build_ladder(provider.effective_recompute, provider.recompute_as),
                             provider.geometry, provider.layout.tensor_parallel)
    probe: TrainerProbe | None = None
    memory_model = given
    if memory_model is None:
        coefficients = None
        if probe_layers:
            # Measured coefficients, not the default formulas: every policy this trainer
            # may run, escalation included, each when first priced (the configured one's
            # grad and no-grad modes apart, then the other rungs'), except under expert
            # parallel, where all of them are probed now (`probing`'s docstring says why).
            policies: list[EffectiveRecompute] = []
            later = [provider.effective_recompute]
            if recompute_choice != RecomputeChoice.CONFIGURED:
                later += [rung.recompute for rung in ladder.rungs]
            if provider.layout.expert_parallel > 1:
                policies, later = later, []
            usable = _agree.min_over_replica(device_usable_bytes(
                next(model.parameters()).device, test_memory_limit_bytes))
            # The probe runs only at sizes whose micro-batch fits the limit (what it
            # allocates is the trainer's too), grad and no-grad separately.
            probe = coefficients = TrainerProbe(
                provider, model, policies=policies, on_first_use=later, cache_dir=cache_dir,
                default_model=replace(MemoryModel.for_provider(provider),
                                      head_chunk_tokens=head_chunk_tokens),
                usable_bytes=usable, head_chunk_tokens=head_chunk_tokens,
                guard=probe_guard or contextlib.nullcontext,
            )
        memory_model = replace(MemoryModel.for_provider(provider, coefficients=coefficients),
                               head_chunk_tokens=head_chunk_tokens)
    with_coefficients = getattr(memory_model, "with_coefficients", None)
    default_memory_model = (
        with_coefficients(None)
        if with_coefficients is not None and memory_model.coefficients is not None else None)
    return TrainerPricing(memory_model, probe, default_memory_model, full, ladder)


def next_tp_memory_model(provider: Any, head_chunk_tokens: int) -> tuple[int, MemoryModel]:
    """The tensor-parallel size twice this one, and the memory model it would price with."""
    settings = provider.settings
    tp = settings.tensor_model_parallel_size * 2
    other = type(provider)(
        provider.geometry,
        # Sequence parallel is the default once TP > 1; a user who turned it off keeps it off.
        settings=replace(
            settings,
            tensor_model_parallel_size=tp,
            sequence_parallel=settings.sequence_parallel
            or settings.tensor_model_parallel_size == 1,
        ),
        lora=provider.lora_config,
        dtype=provider.dtype,
        implementation=provider.implementation,
    )
    return tp, replace(MemoryModel.for_provider(other), head_chunk_tokens=head_chunk_tokens)
