"""Layers whose kernels work in fixed-size token chunks: what they cost between chunk counts.

A Gated DeltaNet layer's delta rule pads each sequence to whole 64-token chunks (fla's
kernels allocate per chunk; the CPU kernels copy every input into padded chunks), so its
peaks are a + b x tokens + c x padded tokens: a step at each chunk boundary, and a straight
line of another slope within a chunk. A curve fitted over token counts alone cuts the steps
and under-prices a row just past a boundary. Such a layer is fitted over rows of whole
chunks (where tokens = padded tokens), and a row of `tokens` in `padded` chunk tokens is
priced from that curve at `padded`, less the within-chunk slope times the padding. The
within-chunk slope comes from the probe's points inside a chunk.

A row of many short sequences leaves most of each chunk as padding, which one sequence never
does (its padding is under one chunk). There the kernel's per-chunk working set can outgrow
the rest of the layer, which follows the tokens, and a quantity becomes the larger of two
lines in the tokens at a fixed padded length: the full-chunk line above and a sparse-chunk
line, measured on rows of one short sequence per chunk at two fills (`SparseChunks`); past
the second fill, on rows laid out like those, the chord from it to the full chunk.

The full-chunk line is measured on single sequences, and a row of several segments holds
less on it: the CPU rule's backward makes its first gradient's results at the row's tokens,
where one sequence's are views of the padded chunk gradients (`cpu_rule_backward_work`). The
memory model adds the formulas' difference between the row's segments and one sequence to
the line (`segments_change`), before the larger of the two lines is taken.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from art.megatron.geometry import LINEAR_ATTENTION, ModelGeometry
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.trainer_rank.compute.packing import packed_length_tokens, sequence_multiple_tokens
from art.trainer_rank.pricing.fit import Fit
from art.trainer_rank.pricing.layer_terms import PricedKind
from art.trainer_rank.pricing.layers_gdn import GDN_CHUNK_TOKENS

QUANTITIES = ("kept", "forward", "backward", "output", "backward_held")
# Tokens per chunk of the sparse rows: one short sequence per chunk, two fills that both
# leave the kernel's padded working set larger than the rest of the layer.
SPARSE_TOKENS_PER_CHUNK: tuple[int, int] = (1, 8)


def chunk_tokens_of(kind: PricedKind) -> int:
    """Tokens per kernel chunk of a layer kind (0: its kernels do not chunk the row)."""
    return GDN_CHUNK_TOKENS if kind.linear else 0


def padded_chunk_tokens(sequence_lengths_tokens: Iterable[int],
                        chunk_tokens: int = GDN_CHUNK_TOKENS) -> int:
    """The row's tokens with each sequence padded to whole chunks (fla's varlen layout)."""
    return sum(-(-int(n) // chunk_tokens) * chunk_tokens for n in sequence_lengths_tokens)


def _row_padded(tokens: int, padded: int | None, chunk_tokens: int) -> int:
    """The row's padded length: `padded`, or one sequence of `tokens` in whole chunks."""
    return padded if padded is not None else padded_chunk_tokens([tokens], chunk_tokens)


def row_segments(sequence_lengths_tokens: Sequence[int], layout: ParallelLayout,
                 row_tokens: int | None = None,
                 implementation: Implementation | None = None) -> list[int]:
    """The segments' lengths as `pack_sequences` lays them out in one row: each padded to the
    layout's per-sequence multiple, and the row's padded tail a segment of its own.
    `row_tokens`: the row's length when the segments are a prefix tree's nodes (the packer's
    rows, which `packed_length_tokens` of the segments would not know); `implementation`: the
    attention built, which says whether sequences are padded."""
    per_sequence = sequence_multiple_tokens(layout, implementation)
    segments = [-(-int(n) // per_sequence) * per_sequence for n in sequence_lengths_tokens]
    row = (row_tokens if row_tokens is not None
           else packed_length_tokens(sequence_lengths_tokens, layout))
    tail = row - sum(segments)
    return segments + ([tail] if tail > 0 else [])


def row_padded_chunk_tokens(sequence_lengths_tokens: Sequence[int], layout: ParallelLayout,
                            chunk_tokens: int = GDN_CHUNK_TOKENS, row_tokens: int | None = None,
                            implementation: Implementation | None = None) -> int:
    """`padded_chunk_tokens` of the row's segments (`row_segments`)."""
    return padded_chunk_tokens(
        row_segments(sequence_lengths_tokens, layout, row_tokens, implementation), chunk_tokens)


def has_chunked_layers(geometry: ModelGeometry) -> bool:
    return LINEAR_ATTENTION in geometry.layer_types


# Whole-chunk points a chunked layer's curve needs (a quadratic through three), besides one
# inside a chunk for the within-chunk slope (`split_points`).
WHOLE_CHUNK_POINTS = 3


def with_points_inside_chunks(points: Sequence[int], chunk_tokens: int = GDN_CHUNK_TOKENS
                              ) -> tuple[int, ...]:
    """`points`, and where none lies inside a chunk, half a chunk below each of the first two
    whole-chunk points (the CUDA grids are whole chunks)."""
    if any(t % chunk_tokens for t in points):
        return tuple(points)
    inside = {t - chunk_tokens // 2 for t in sorted(points)[:2]}
    return tuple(sorted(set(points) | inside))


def fewest_chunked_points(points: Sequence[int], chunk_tokens: int = GDN_CHUNK_TOKENS) -> int:
    """How many of `points` (from the smallest) a chunked layer's probe needs: a point inside
    a chunk and WHOLE_CHUNK_POINTS whole-chunk ones (all of them when fewer exist)."""
    for n in range(1, len(points) + 1):
        head = points[:n]
        if (any(t % chunk_tokens for t in head)
                and sum(1 for t in head if t % chunk_tokens == 0) >= WHOLE_CHUNK_POINTS):
            return n
    return len(points)


@dataclass(frozen=True)
class WithinChunk:
    """Per-token slope of each probed quantity while the chunk count stays the same."""

    chunk_tokens: int
    kept: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    output: float = 0.0
    backward_held: float = 0.0

    def value(self, curve: Callable[[int], float], name: str, tokens: int,
              padded: int | None, segments_change: float = 0.0) -> int:
        """Quantity `name` at `tokens` from its whole-chunk `curve` at the `padded` row
        (None: one sequence of `tokens`); `segments_change`: what the row's segments change
        from one sequence's line (see the module docstring)."""
        whole = _row_padded(tokens, padded, self.chunk_tokens)
        return int(round(curve(whole) - getattr(self, name) * (whole - tokens)
                         + segments_change))


def split_points(points: Sequence[int], rows: Sequence[dict[str, float]], chunk_tokens: int,
                 whole_chunk_curve: Callable[[Sequence[int], Sequence[float]],
                                             Callable[[int], float]]
                 ) -> tuple[tuple[int, ...], list[dict[str, float]], WithinChunk]:
    """The whole-chunk points (and their rows) to fit, and the within-chunk slopes measured
    at the other points against the curve through the whole-chunk ones."""
    whole = [i for i, t in enumerate(points) if t % chunk_tokens == 0]
    inside = [i for i, t in enumerate(points) if t % chunk_tokens]
    if not whole or not inside:
        raise ValueError(
            f"a chunked layer needs probe points at whole chunks of {chunk_tokens} tokens and "
            f"inside a chunk, got {tuple(points)}")
    whole_points = tuple(points[i] for i in whole)
    slopes: dict[str, float] = {}
    for name in (q for q in QUANTITIES if q in rows[0]):
        curve = whole_chunk_curve(whole_points, [rows[i][name] for i in whole])
        candidates = []
        for i in inside:
            t = points[i]
            padded = -(-t // chunk_tokens) * chunk_tokens
            candidates.append((curve(padded) - rows[i][name]) / (padded - t))
        # A point whose kernel's padded work sets its peak reads a flatter slope; the sparse
        # line (`SparseChunks`) prices that regime, so the full-chunk line takes the steepest.
        slopes[name] = max(candidates)
    return whole_points, [rows[i] for i in whole], WithinChunk(chunk_tokens, **slopes)


def sparse_row_lengths(padded_tokens: int, tokens_per_chunk: int,
                       chunk_tokens: int = GDN_CHUNK_TOKENS) -> list[int]:
    """The sequence lengths of a sparse probe row: one sequence of `tokens_per_chunk` tokens
    in each chunk of `padded_tokens`."""
    return [tokens_per_chunk] * (padded_tokens // chunk_tokens)


@dataclass(frozen=True)
class SparseChunks:
    """Each quantity on rows of one short sequence per chunk, at two fills, as curves over
    the padded length. Between the two fills: the line through them. Past the second fill on
    a row laid out like the sparse rows (no segment longer than a chunk): the larger of that
    line and the chord to the full chunk (the full-chunk curve at the same padded length). On
    that layout a quantity is a maximum of ops linear in the tokens, so it is convex in the
    fill: the chord bounds it from above where the kernel's padded work stops setting the
    peak between the two fills, the line where it does not. A row with longer segments holds
    fewer partly filled chunks than the sparse rows, and the full-chunk line prices it."""

    chunk_tokens: int
    tokens_per_chunk: tuple[int, int]
    quantities: tuple[tuple[str, Fit, Fit], ...]  # (name, at the first fill, at the second)

    def value(self, name: str, tokens: int, padded: int | None,
              full_chunks: Callable[[int], float] | None = None, segments: int = 1
              ) -> int | None:
        """Quantity `name` (None: not measured) at `tokens` in the `padded` row (None: one
        sequence of `tokens`) of `segments`; `full_chunks`: the quantity's curve over rows of
        whole chunks (None: the line alone)."""
        whole = _row_padded(tokens, padded, self.chunk_tokens)
        for quantity, first, second in self.quantities:
            if quantity != name:
                continue
            chunks = whole / self.chunk_tokens
            low, high = (chunks * n for n in self.tokens_per_chunk)
            at_low, at_high = first.at(whole), second.at(whole)
            line = at_low + (at_high - at_low) * (tokens - low) / (high - low)
            if (full_chunks is not None and segments * self.chunk_tokens >= whole
                    and high < tokens < whole):
                chord = at_high + (full_chunks(whole) - at_high) * (tokens - high) / (whole - high)
                line = max(line, chord)
            return int(round(line))
        return None


@dataclass(frozen=True)
class ChunkReading:
    """Quantities read the way the probe reads a chunked layer's measurements: the curve
    through their whole-chunk points, less the steepest within-chunk slope of the others
    over a row's padding (`split_points`, `WithinChunk.value`)."""

    curves: tuple[tuple[str, Fit], ...]
    within: WithinChunk

    @classmethod
    def of(cls, quantities: Callable[[int], Mapping[str, float]], points: Sequence[int],
           chunk_tokens: int = GDN_CHUNK_TOKENS) -> ChunkReading:
        """`quantities(t)`: the quantities for one sequence of `t` tokens, at each point."""
        rows = [dict(quantities(t)) for t in points]
        whole, whole_rows, within = split_points(points, rows, chunk_tokens,
                                                 lambda ts, vs: Fit.fit(ts, vs).at)
        return cls(tuple((name, Fit.fit(whole, [r[name] for r in whole_rows]))
                         for name in rows[0]), within)

    def value(self, name: str, tokens: int, padded: int) -> int:
        """Quantity `name` read at a row of `tokens` in `padded` chunk tokens."""
        curve = dict(self.curves)[name]
        return self.within.value(curve.at, name, tokens, padded)


def interpolation_change(reading: ChunkReading, row: Mapping[str, float], tokens: int,
                         padded: int) -> dict[str, float]:
    """What the probe's reading of a chunked layer misses on a row, by the formulas: the
    formulas at the row (`row`: `tokens` in `padded` chunk tokens), less the formulas read
    the way the probe reads its measurements at its points (`reading`)."""
    return {name: float(value) - reading.value(name, tokens, padded)
            for name, value in row.items()}
