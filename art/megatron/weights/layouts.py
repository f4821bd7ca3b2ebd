"""How one Megatron parameter shard is made of Hugging Face tensors, in both directions.

A family module says, for every Megatron parameter, which HF tensor(s) it holds and in which
layout; this module turns that into `Piece`s: contiguous ranges along one dimension that sit
at one place in the HF tensor and at another in this rank's shard. Loading copies each piece
from the file into the shard; export copies it back out. One description serves both, so a
round trip is exact by construction.

Layouts (Megatron-Core 0.16.1, local and TE specs):
- replicated: the whole tensor on every rank (norms, the MoE router).
- column: split on dim 0 (column-parallel linears).
- row: split on dim 1 (row-parallel linears: linear_proj, linear_fc2).
- vocab: split on dim 0 over the padded vocabulary; rows past the real vocabulary are zeros.
- qkv: Megatron's fused linear_qkv, rows grouped per KV group: for each group its query heads,
  then its key head, then its value head; TP gives each rank whole groups.
- gate_up: the gated linear_fc1, [gate shard; up shard] on each rank (not a slice of the
  concatenation).
- gated_qkv: linear_qkv with the attention output gate (Qwen3.5's full attention): per KV
  group its query heads, their gate heads, its key head, its value head; HF's q_proj holds
  [query head, gate head] per head.
- sections: a parameter made of several HF tensors (or of consecutive row ranges of one:
  `sections`) that each rank holds as [section 0 shard; section 1 shard; ...]: the Gated
  DeltaNet in_proj [q_r, k_r, v_r, z_r, beta_r, alpha_r] and its conv [q_r, k_r, v_r].
A map's `offset` is added on load and taken off on export (HF's zero-centred norm weights,
which multiply by 1 + w, into Megatron norms that multiply by w).
"""

from __future__ import annotations

from dataclasses import dataclass

REPLICATED = "replicated"
COLUMN = "column"
ROW = "row"
VOCAB = "vocab"
QKV = "qkv"
GATE_UP = "gate_up"
GATED_QKV = "gated_qkv"
SECTIONS = "sections"
LAYOUTS = (REPLICATED, COLUMN, ROW, VOCAB, QKV, GATE_UP, GATED_QKV, SECTIONS)


@dataclass(frozen=True)
class HFTensor:
    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorMap:
    """One Megatron parameter (global layer and expert numbering) and its HF sources."""

    megatron_name: str
    hf: tuple[HFTensor, ...]
    layout: str
    # Expert weights are split over the expert-tensor-parallel group, the rest over TP.
    expert: bool = False
    head_dim: int = 0  # qkv and gated_qkv only
    # sections only: rows of each section, in order, over the HF tensors laid end to end.
    sections: tuple[int, ...] = ()
    offset: float = 0.0  # Megatron value = HF value + offset

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"{self.megatron_name}: unknown layout {self.layout!r}")
        if self.layout == SECTIONS:
            rows = sum(t.shape[0] for t in self.hf)
            if not self.sections or sum(self.sections) != rows:
                raise ValueError(f"{self.megatron_name}: sections {self.sections} must cover "
                                 f"the {rows} rows of {[t.name for t in self.hf]}")
            return
        wanted = {QKV: 3, GATE_UP: 2, GATED_QKV: 3}.get(self.layout, 1)
        if len(self.hf) != wanted:
            raise ValueError(
                f"{self.megatron_name}: layout {self.layout} takes {wanted} HF tensor(s), got "
                f"{[t.name for t in self.hf]}"
            )


@dataclass(frozen=True)
class Piece:
    """Rows (dim 0) or columns (dim 1) [hf_start, hf_start + length) of HF tensor `hf_name`
    are rows/columns [local_start, local_start + length) of this rank's shard."""

    hf_name: str
    dim: int
    hf_start: int
    local_start: int
    length: int


class LayoutError(ValueError):
    """A Megatron shard that does not fit the HF tensors it is made of."""


def _split(total: int, size: int, what: str, tmap: TensorMap) -> int:
    if total % size:
        raise LayoutError(
            f"{tmap.megatron_name}: {what} = {total} does not divide by the parallel size {size}"
        )
    return total // size


def pieces(tmap: TensorMap, *, rank: int, size: int,
           local_shape: tuple[int, ...]) -> list[Piece]:
    """The pieces of this rank's shard, checked against its shape."""
    first = tmap.hf[0]
    layout = tmap.layout
    if layout == REPLICATED:
        expected = first.shape
        result = [Piece(first.name, 0, 0, 0, first.shape[0])]
    elif layout == COLUMN:
        per = _split(first.shape[0], size, "rows", tmap)
        expected = (per, *first.shape[1:])
        result = [Piece(first.name, 0, rank * per, 0, per)]
    elif layout == ROW:
        per = _split(first.shape[1], size, "columns", tmap)
        expected = (first.shape[0], per, *first.shape[2:])
        result = [Piece(first.name, 1, rank * per, 0, per)]
    elif layout == VOCAB:
        rows = local_shape[0] if local_shape else 0
        if rows * size < first.shape[0]:
            raise LayoutError(
                f"{tmap.megatron_name}: {rows} vocabulary rows per rank x {size} rank(s) < "
                f"{first.name} {list(first.shape)}; the model's vocabulary is smaller than the "
                "checkpoint's"
            )
        expected = (rows, *first.shape[1:])
        start = rank * rows
        real = max(0, min(rows, first.shape[0] - start))
        result = [Piece(first.name, 0, start, 0, real)] if real else []
    elif layout == GATE_UP:
        gate, up = tmap.hf
        if gate.shape != up.shape:
            raise LayoutError(
                f"{tmap.megatron_name}: {gate.name} {list(gate.shape)} and {up.name} "
                f"{list(up.shape)} must have the same shape"
            )
        per = _split(gate.shape[0], size, "rows", tmap)
        expected = (2 * per, *gate.shape[1:])
        result = [Piece(gate.name, 0, rank * per, 0, per),
                  Piece(up.name, 0, rank * per, per, per)]
    elif layout == SECTIONS:
        result, expected = _section_pieces(tmap, rank, size)
    else:
        result, expected = _qkv_pieces(tmap, rank, size)
    if tuple(local_shape) != tuple(expected):
        raise LayoutError(
            f"{tmap.megatron_name}: this rank's shard has shape {list(local_shape)}, but "
            f"{', '.join(f'{t.name} {list(t.shape)}' for t in tmap.hf)} split {layout} over "
            f"{size} rank(s) give {list(expected)}; the model was built from another config "
            "than the checkpoint's"
        )
    return result


def _qkv_pieces(tmap: TensorMap, rank: int, size: int) -> tuple[list[Piece], tuple[int, ...]]:
    q, k, v = tmap.hf
    d = tmap.head_dim
    if d <= 0 or k.shape != v.shape or k.shape[0] % d or q.shape[0] % k.shape[0]:
        raise LayoutError(
            f"{tmap.megatron_name}: {q.name} {list(q.shape)}, {k.name} {list(k.shape)}, "
            f"{v.name} {list(v.shape)} are not query/key/value projections with head_dim {d}"
        )
    groups = k.shape[0] // d
    per_group = q.shape[0] // groups  # query rows of one KV group (with gates: x 2)
    local_groups = _split(groups, size, "KV groups", tmap)
    block = per_group + 2 * d
    out: list[Piece] = []
    for j in range(local_groups):
        g = rank * local_groups + j
        if tmap.layout == GATED_QKV:
            # HF rows of the group: [query h, gate h] per head; Megatron: queries, then gates.
            heads = per_group // (2 * d)
            for h in range(heads):
                hf_head = g * per_group + 2 * h * d
                out += [Piece(q.name, 0, hf_head, j * block + h * d, d),
                        Piece(q.name, 0, hf_head + d, j * block + (heads + h) * d, d)]
        else:
            out.append(Piece(q.name, 0, g * per_group, j * block, per_group))
        out += [
            Piece(k.name, 0, g * d, j * block + per_group, d),
            Piece(v.name, 0, g * d, j * block + per_group + d, d),
        ]
    return out, (local_groups * block, *q.shape[1:])


def _section_pieces(tmap: TensorMap, rank: int, size: int
                    ) -> tuple[list[Piece], tuple[int, ...]]:
    # Each section's rows sit in one HF tensor; find it and the section's first row there.
    spans: list[tuple[str, int]] = []
    tensor, row, cursor = 0, 0, 0
    for length in tmap.sections:
        while row >= tmap.hf[tensor].shape[0]:
            tensor, row = tensor + 1, 0
        if row + length > tmap.hf[tensor].shape[0]:
            raise LayoutError(f"{tmap.megatron_name}: a section of {length} rows crosses the "
                              f"end of {tmap.hf[tensor].name} {list(tmap.hf[tensor].shape)}")
        spans.append((tmap.hf[tensor].name, row))
        row += length
    out: list[Piece] = []
    for (name, start), length in zip(spans, tmap.sections):
        per = _split(length, size, "section rows", tmap)
        out.append(Piece(name, 0, start + rank * per, cursor, per))
        cursor += per
    return out, (cursor, *tmap.hf[0].shape[1:])
