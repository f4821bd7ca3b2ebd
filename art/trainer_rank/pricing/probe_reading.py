"""What the formulas correct in the probe's reading of a Gated DeltaNet layer on a row.

The probe measures a chunked layer on single sequences and reads a row of `tokens` in
`padded` chunk tokens as its whole-chunk curve at `padded` less a within-chunk slope over the
padding (pricing/chunked.py). A row laid out with a padded tail of its own (under TP's
sequence split or CP's 2 x CP chunks) runs that tail as a segment, a kernel chunk more, which
no single sequence the probe ran holds. So a row of one sequence is read where the probe's
reading holds, at one sequence of the row's tokens (padded under a chunk), and the formulas
price the rest: the formulas at the row, less the formulas read the way the probe reads its
measurements at its own points, at that one sequence (`interpolation_change`). Reading the
probe at the row's own padding would stretch its within-chunk slope over more than a chunk
of padding, which no point it measured spans. Where the probe's points are
unknown, or the row holds several sequences (whose short ones the probe's sparse-chunk line
prices), the correction is what the row's segments change against one sequence over the same
chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from art.megatron.layout import ParallelLayout
from art.trainer_rank.pricing.chunked import (
    ChunkReading,
    interpolation_change,
    padded_chunk_tokens,
)
from art.trainer_rank.pricing.coefficients import RecomputeMode
from art.trainer_rank.pricing.layer_terms import LayerCost, PricedKind
from art.trainer_rank.pricing.layers import price_layer
from art.trainer_rank.pricing.layers_gdn import conv_sequence_padding_bytes
from art.trainer_rank.pricing.passes import Unit, full_unit_peak


def probe_tokens(layout: ParallelLayout, kind: PricedKind, s: int) -> int:
    """The tokens a probe curve is read at: this rank's, except a Gated DeltaNet layer's
    under CP, which runs (and is probed at) the whole row."""
    if kind.linear and layout.context_parallel > 1:
        return s * layout.context_parallel
    return s


@dataclass(frozen=True)
class PaddedRow:
    """A row as a Gated DeltaNet layer runs it: `s` of this rank's tokens, `padded` chunk
    tokens, its segments (the padded tail one of them) and real sequences."""

    s: int
    padded: int
    segments: int
    sequences: int


@dataclass(frozen=True)
class ProbeReading:
    """The memory model's parts the correction prices with (MemoryModel passes its own)."""

    dims: Any
    layout: ParallelLayout
    coefficients: Any  # the Coefficients Protocol, or None
    worst_case_routing: bool
    hidden_bytes_per_token: int  # hidden size x dtype bytes
    # The formulas read the probe's way, by (layer kind, mode, probe points, unit start): the
    # same for every row, so the model that owns the dict keeps them.
    readings: dict[tuple[Any, ...], ChunkReading] = field(default_factory=dict, compare=False)

    def layer_change(self, kind: PricedKind, modules: frozenset[str], row: PaddedRow
                     ) -> dict[str, float] | None:
        """The correction of a layer's backward (and held backward) under `modules`."""

        def formulas(t: int | None, one: bool) -> dict[str, float]:
            layer = self._layer(kind, modules, row, t, one)
            out = {"backward": float(layer.backward)}
            if layer.backward_held is not None:
                out["backward_held"] = float(layer.backward_held)
            return out

        return self._change(kind, RecomputeMode(grad=True, modules=modules).key, None, row,
                            formulas)

    def unit_change(self, index: int, kind: PricedKind, n: int, row: PaddedRow
                    ) -> dict[str, float] | None:
        """The correction of a full-recompute unit of `n` layers' backward (`full_unit_peak`);
        its rebuilt layers also keep the conv's input with each segment's window."""

        def formulas(t: int | None, one: bool) -> dict[str, float]:
            tokens = row.s if t is None else self._local(t)
            layer = self._layer(kind, frozenset(), row, t, one)
            window = conv_sequence_padding_bytes(
                self.dims, kind, 1 if one or t is not None else row.sequences)
            layer = replace(layer, kept=int(layer.kept + window),
                            forward=int(layer.forward + window))
            x = self.dims.hidden_tokens(tokens) * self.hidden_bytes_per_token
            return {"backward": float(full_unit_peak(Unit(True, index, x, x, (layer,) * n)))}

        return self._change(kind, RecomputeMode(grad=True, full_layers=n).key, index, row,
                            formulas)

    def _layer(self, kind: PricedKind, modules: frozenset[str], row: PaddedRow,
               t: int | None, one: bool) -> LayerCost:
        """The formulas' layer: over the row (`t` None), as one sequence over its chunks
        (`one`), or as one sequence of `t` probe tokens."""
        if t is not None:
            return price_layer(self.dims, kind, modules, self._local(t), grad=True,
                               padded=padded_chunk_tokens([t]),
                               worst_case_routing=self.worst_case_routing)
        return price_layer(self.dims, kind, modules, row.s, grad=True, padded=row.padded,
                           worst_case_routing=self.worst_case_routing,
                           segments=1 if one else row.segments)

    def _change(self, kind: PricedKind, key: str, unit: int | None, row: PaddedRow,
                formulas: Callable[[int | None, bool], dict[str, float]]
                ) -> dict[str, float] | None:
        points = (self.coefficients.chunk_points(kind, key)
                  if self.coefficients is not None and row.sequences <= 1 else None)
        if points is None:
            if row.segments <= 1:
                return None
            one, whole = formulas(None, True), formulas(None, False)
            return {name: whole[name] - one[name] for name in one}
        cache_key = (kind, key, points, unit)
        reading = self.readings.get(cache_key)
        if reading is None:
            reading = self.readings[cache_key] = ChunkReading.of(
                lambda t: formulas(t, False), points)
        tokens = probe_tokens(self.layout, kind, row.s)
        one = padded_chunk_tokens([tokens])
        change = interpolation_change(reading, formulas(None, False), tokens, one)
        if one == row.padded:
            return change
        # The caller reads the probe at the row's padding: move that reading to `one`.
        at_one = self.coefficients.layer_cost(kind, key, tokens, one)
        at_row = self.coefficients.layer_cost(kind, key, tokens, row.padded,
                                              segments=row.segments)
        for name in change:
            probed_one, probed_row = getattr(at_one, name), getattr(at_row, name)
            if probed_one is not None and probed_row is not None:
                change[name] += probed_one - probed_row
        return change

    def _local(self, tokens: int) -> int:
        """This rank's tokens of a probe point (`probe_tokens`' inverse)."""
        return tokens // self.layout.context_parallel
