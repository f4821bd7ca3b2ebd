"""A filler forward: one padding token through the decoder, so that this rank's MoE layers
meet the all-to-alls of expert-parallel partners that run a micro-batch of their own
(`ranks/paired_forwards.py`). It runs the configured recompute and adds nothing to any
gradient: its loss is zero."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.trainer_rank.compute.forward import decoder_hidden_states
from art.trainer_rank.compute.packing import pack_sequences
from art.trainer_rank.ranks.faults import CALLER_BACKWARD, FORWARD, Phase
from art.trainer_rank.ranks.phases import PhaseAgreement

FILLER_TOKENS = 1


def filler_passes(model: Any, *, implementation: Implementation, layout: ParallelLayout,
                  device: torch.device, grad: bool, forwards: int
                  ) -> Callable[[], None] | None:
    """Run `forwards` decoder passes over one padding token with `grad`; with grad, return
    their backward (a zero loss), which the caller runs where its partners run theirs."""
    losses = []
    with torch.set_grad_enabled(grad):
        for _ in range(forwards):
            batch = pack_sequences([torch.zeros(FILLER_TOKENS, dtype=torch.long)],
                                   implementation=implementation, layout=layout, device=device)
            hidden = decoder_hidden_states(model, batch)
            if grad:
                losses.append(hidden.float().sum() * 0.0)
            del hidden, batch
    if not losses:
        return None

    def backward() -> None:
        torch.autograd.backward(losses)
        losses.clear()

    return backward


@dataclass(frozen=True)
class FillerPasses:
    """Filler passes (compute/filler.py) guarded as a forward is: a partner's published fault
    wakes this rank out of their all-to-all, and this rank's own failure is published."""

    model: Any
    implementation: Implementation
    layout: ParallelLayout
    device: torch.device
    phases: PhaseAgreement
    ranks: int

    def __call__(self, grad: bool, forwards: int) -> Callable[[], None] | None:
        with self._guard(FORWARD):
            backward = filler_passes(self.model, implementation=self.implementation,
                                     layout=self.layout, device=self.device, grad=grad,
                                     forwards=forwards)
        if backward is None:
            return None

        def guarded_backward() -> None:
            with self._guard(CALLER_BACKWARD):
                backward()

        return guarded_backward

    @contextlib.contextmanager
    def _guard(self, phase: Phase) -> Iterator[None]:
        with self.phases.collectives(phase, None), self.phases.watching(self.ranks):
            try:
                yield
            except Exception as exc:
                if not self.phases.publishes(exc, self.ranks):
                    raise
                raise self.phases.abandon(exc, phase, "a filler forward", None) from None
