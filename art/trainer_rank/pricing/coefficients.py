"""What measured coefficients are keyed by and what they answer: a layer's recompute mode as a
typed record (its string form is what probe caches persist), and the Protocol every source of
coefficients (the layer probe) meets for the memory model."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from art.megatron.geometry import ModelGeometry
from art.trainer_rank._request import OutputRequest
from art.trainer_rank.pricing.layer_terms import LayerCost, PricedKind


@dataclass(frozen=True)
class RecomputeMode:
    """How one layer (or one full-recompute unit) runs: with or without grad, which modules it
    recomputes selectively, and how many layers one full-recompute checkpoint spans (0: none)."""

    grad: bool
    modules: frozenset[str] = frozenset()
    full_layers: int = 0

    @property
    def key(self) -> str:
        """The stable string form, as probe caches and coefficient files store it:
        "none", "sel:core_attn+mlp", "full:2", "nograd", "nograd:full:2"."""
        if not self.grad:
            return f"nograd:full:{self.full_layers}" if self.full_layers else "nograd"
        if self.full_layers:
            return f"full:{self.full_layers}"
        return "sel:" + "+".join(sorted(self.modules)) if self.modules else "none"

    def __str__(self) -> str:
        return self.key


@dataclass(frozen=True)
class LayerMode:
    """One (layer kind, recompute mode) pair the probe measures."""

    kind: PricedKind
    mode: RecomputeMode

    @property
    def sort_key(self) -> tuple[str, list[str], bool, int]:
        return (self.kind, sorted(self.mode.modules), self.mode.grad, self.mode.full_layers)


@dataclass(frozen=True)
class MeasuredTail:
    """A tail measured at one row size: what it keeps, its forward peak, and its backward
    peak with, of that, the moment of the head's backward (without the caller's own ops,
    which a row of shared prefixes runs per sequence instead)."""

    kept_bytes: int
    forward_bytes: int
    backward_bytes: int
    head_backward_bytes: int
    # The largest row the tail was measured at (0: not told): past it the memory model
    # prices the growth from there by its formulas rather than the curve's extrapolation.
    measured_up_to_tokens: int = 0


class Coefficients(Protocol):
    """Measured per-layer and tail costs the memory model prices with instead of its formulas;
    None from a lookup means "not measured": the formulas price that part."""

    @property
    def key(self) -> str: ...

    def layer_cost(self, kind: PricedKind, mode: str, s: int, padded: int | None = None,
                   segments_change: Mapping[str, float] | None = None, segments: int = 1
                   ) -> LayerCost | None: ...

    def tail_cost(self, outputs: OutputRequest, grad: bool, s: int
                  ) -> MeasuredTail | None: ...

    def chunk_points(self, kind: PricedKind, mode: str) -> tuple[int, ...] | None: ...

    def partial_for(self, geometry: ModelGeometry) -> bool: ...
