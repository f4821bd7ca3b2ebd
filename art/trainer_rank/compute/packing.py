"""Sequences of one micro-batch -> one packed row (and back).

Every sequence keeps its own positions (0, 1, ...) and attends only to itself and, inside an
indivisible group (a GRPO group's rollouts), to the prefix it shares with its siblings: the
group's prefix tree (see compute/prefix_tree.py) is laid out once, prefix then completions, each
completion's positions continuing from the prefix so RoPE sees the angles of the unshared
sequence. Which rows attend to which is the row's `AttentionLayout`: the local spec's segmented
flash attention takes it as is, Megatron's unfused attention gets its dense bool mask, and the
Transformer Engine spec gets `PackedSeqParams` with cu_seqlens (THD, no tree: sequences are not
shared there). The row is padded to what the parallel layout needs: a multiple of TP when
sequence parallel scatters it over the TP ranks, and, with context parallelism, a multiple of
2 x CP (x TP under sequence parallel) so every CP rank holds two equal chunks of it; for TE's THD
attention every sequence is padded to a multiple of 2 x CP too (it splits each one on its own).
Padding is one extra pseudo-sequence at the end with its own causal block, so it
never touches a real token and never produces NaN rows; `unpack` drops it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from art.megatron import runnable_layouts
from art.megatron.attention_layout import AttentionLayout, AttentionSegment, KeySpan
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.trainer_rank.compute.prefix_tree import TreeNode, build_prefix_tree, validate_group

IGNORE_INDEX = -100  # target value that produces no log-probability (0.0) and no gradient
PAD_TOKEN_ID = 0  # padding is masked away from every real token, so its id does not matter


@dataclass(frozen=True)
class PackedBatch:
    tokens: Tensor  # [1, S] long, S = padded_tokens
    position_ids: Tensor  # [1, S] long: each sequence's own positions (0, 1, ...)
    attention_mask: Tensor | None  # bool [1, 1, S, S], True = masked (unfused attention)
    # The AttentionLayout (segmented flash attention) or PackedSeqParams (TE spec, THD).
    packed_seq_params: Any | None
    sequence_lengths_tokens: tuple[int, ...]
    offsets: tuple[int, ...]  # row of each sequence's first token
    logical_tokens: int
    padded_tokens: int  # S
    attention_layout: AttentionLayout | None = None
    # The row spans holding each sequence's tokens, in order (one span unless it shares).
    pieces: tuple[tuple[KeySpan, ...], ...] = ()

    @property
    def sequences(self) -> int:
        return len(self.sequence_lengths_tokens)

    shared_tokens: int = 0  # logical tokens laid out once for several sequences

    def sequence_pieces(self, index: int) -> tuple[KeySpan, ...]:
        if self.pieces:
            return self.pieces[index]
        return (KeySpan(self.offsets[index], self.sequence_lengths_tokens[index]),)

    def sequence_rows(self, index: int) -> Tensor:
        """[n_i] long: the packed row of each token of sequence `index`."""
        return torch.cat([
            torch.arange(span.start, span.end, device=self.tokens.device)
            for span in self.sequence_pieces(index)
        ])


def row_multiple_tokens(layout: ParallelLayout) -> int:
    """What the whole packed row length must be a multiple of for this layout."""
    multiple = 1
    if layout.context_parallel > 1:
        # 2 x CP equal chunks, and each CP rank's share a multiple of TP under sequence parallel.
        multiple = math.lcm(multiple, 2 * layout.context_parallel)
    if layout.sequence_parallel:
        multiple = math.lcm(multiple, layout.tensor_parallel * layout.context_parallel)
    return multiple


def sequence_multiple_tokens(layout: ParallelLayout,
                             implementation: Implementation | None = None) -> int:
    """What every single sequence is padded to: TE's THD context parallel splits each one in
    2 x CP; the segmented flash attention splits the row as a whole (see context_parallel),
    so it pads no sequence. None = the implementation is not known: pad (the larger row)."""
    if layout.context_parallel == 1 or (implementation is not None
                                         and implementation.attention_takes_tree):
        return 1
    return 2 * layout.context_parallel


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def packed_length_tokens(
    sequence_lengths_tokens: Sequence[int], layout: ParallelLayout, shared_tokens: int = 0,
    implementation: Implementation | None = None,
) -> int:
    """The padded row length `pack_sequences` produces, without building anything.

    `shared_tokens`: rows the groups' prefix trees save (`Item.shared_tokens`, summed); only
    attention that takes a tree shares (see `shares_prefixes`), and it pads no sequence.
    The memory model prices `MicroBatchShape.padded_tokens` with this.
    """
    per_sequence = sequence_multiple_tokens(layout, implementation)
    total = sum(_round_up(int(n), per_sequence) for n in sequence_lengths_tokens)
    return _round_up(total - shared_tokens, row_multiple_tokens(layout))


def packed_tokens_problem(sequence_lengths_tokens: Sequence[int], packed_tokens: int,
                          layout: ParallelLayout) -> str | None:
    """What is wrong with a packed row of `packed_tokens` for these sequences, or None: the
    row holds the longest sequence whole (the others at best share it as a prefix) and at
    most every sequence in full, padded as `pack_sequences` pads for `layout`."""
    longest = max(sequence_lengths_tokens)
    whole = packed_length_tokens(sequence_lengths_tokens, layout)
    if longest <= packed_tokens <= whole:
        return None
    padded = "" if whole == sum(sequence_lengths_tokens) else f", padded for {layout.summary}"
    return (f"is outside what {len(sequence_lengths_tokens)} sequence(s) of "
            f"{sum(sequence_lengths_tokens)} tokens can pack to: from {longest} (the longest "
            f"sequence, every other one a shared prefix of it) to {whole} (no prefix "
            f"shared{padded}); give a count in that range")


def shares_prefixes(implementation: Implementation, layout: ParallelLayout) -> bool:
    """Whether a group's shared prefix is laid out once: the built attention must take a
    tree layout (`Implementation.attention_takes_tree`: the local spec's segmented flash
    attention on CPU or CUDA, under context parallel too, or unfused with its dense mask);
    TE's THD attention cannot."""
    return implementation.attention_takes_tree


def check_layout_supported(implementation: Implementation, layout: ParallelLayout) -> None:
    """Refuse layouts whose rows the packer cannot lay out for the built attention, before any
    memory is spent on them: the packer's answer from art.megatron.runnable_layouts (context
    parallel on Megatron's unfused attention; TE's THD rows pack, and whether TrainerRank
    runs them is the same module's answer for TrainerRank)."""
    refused = runnable_layouts.refusal(layout, implementation,
                                       asker=runnable_layouts.Asker.PACKER)
    if refused is not None:
        raise ValueError(refused.message())


def pack_sequences(
    sequences: Sequence[Tensor],
    *,
    implementation: Implementation,
    layout: ParallelLayout,
    device: torch.device | str = "cpu",
    groups: Sequence[int] | None = None,
    attention: bool = True,
) -> PackedBatch:
    """Pack 1-D token tensors into one row with per-sequence positions and isolation.

    `groups`: how many consecutive sequences form each indivisible group (its prefix tree is
    laid out once when the implementation takes trees); None = every sequence on its own.
    `attention=False`: a row only the output heads see, without the attention's mask or packed
    parameters (the unfused attention's dense mask is quadratic in the row).
    """
    if len(sequences) == 0:
        raise ValueError("pack_sequences needs at least one sequence, got none")
    check_layout_supported(implementation, layout)
    validate_group(sequences)
    device = torch.device(device)
    sizes = list(groups) if groups is not None else [1] * len(sequences)
    if sum(sizes) != len(sequences) or min(sizes) < 1:
        raise ValueError(
            f"pack_sequences: groups {sizes} must be positive and cover the {len(sequences)} "
            "sequences"
        )
    share = shares_prefixes(implementation, layout)
    per_sequence = sequence_multiple_tokens(layout, implementation)
    lengths = [int(s.numel()) for s in sequences]
    tokens: list[Tensor] = []
    positions: list[tuple[int, int]] = []  # (first position, tokens) of each run of the row
    segments: list[AttentionSegment] = []
    pieces: list[list[KeySpan]] = [[] for _ in sequences]
    cursor = 0
    shared = 0
    if share:
        # Roots of equal length side by side: the segmented flash attention runs each such
        # run as one batched call (without CP, whose split keeps the row's own order).
        by_length = implementation.attention == "flash" and layout.context_parallel == 1
        cursor, shared = _lay_out_trees(sequences, sizes, device, tokens, positions, segments,
                                        pieces, roots_by_length=by_length)
    else:
        for index, sequence in enumerate(sequences):
            sequence = _as_row_tokens(sequence, device)
            length = int(sequence.numel())
            padded = _round_up(length, per_sequence)
            tokens.append(sequence)
            # CP pads inside the sequence's own block (TE's THD kernels see these tokens
            # through cu_seqlens_*_padded and skip them); positions run on through them.
            positions.append((0, padded))
            if padded > length:
                tokens.append(torch.full((padded - length,), PAD_TOKEN_ID, device=device))
            segments.append(AttentionSegment(cursor, padded))
            pieces[index].append(KeySpan(cursor, length))
            cursor += padded
    real_end = cursor
    total = _round_up(cursor, row_multiple_tokens(layout))
    if total > cursor:
        tokens.append(torch.full((total - cursor,), PAD_TOKEN_ID, device=device))
        positions.append((0, total - cursor))
        segments.append(AttentionSegment(cursor, total - cursor))
    attention_layout = AttentionLayout(total, tuple(segments))
    attention_mask: Tensor | None = None
    packed_seq_params: Any | None = None
    if attention:
        if implementation.spec == "te":
            blocks = [segment.length for segment in segments]
            packed_seq_params = _thd_params(lengths, blocks, total, real_end, device)
        elif implementation.attention == "flash":
            packed_seq_params = attention_layout
        else:
            attention_mask = attention_layout.dense_mask(device)
    merged = tuple(_merge_spans(p) for p in pieces)
    return PackedBatch(
        tokens=torch.cat(tokens).view(1, total),
        position_ids=_positions(positions, total, device).view(1, total),
        attention_mask=attention_mask,
        packed_seq_params=packed_seq_params,
        sequence_lengths_tokens=tuple(lengths),
        offsets=tuple(p[0].start for p in merged),
        logical_tokens=sum(lengths),
        padded_tokens=total,
        attention_layout=attention_layout,
        pieces=merged,
        shared_tokens=shared,
    )


def _as_row_tokens(sequence: Tensor, device: torch.device) -> Tensor:
    """The caller's tokens as the row's dtype and device: the tensor itself when it already
    is (no op per sequence on a call of many short ones)."""
    if sequence.dtype == torch.long and sequence.device == device:
        return sequence
    return sequence.to(device=device, dtype=torch.long)


def _positions(runs: Sequence[tuple[int, int]], total: int, device: torch.device) -> Tensor:
    """[total] long: each run of the row counts up from its first position. Built in a
    fixed number of ops whatever the number of runs: the row index minus each run's offset
    (its start in the row less its first position), repeated over the run."""
    offsets: list[int] = []
    lengths: list[int] = []
    start = 0
    for first, length in runs:
        offsets.append(start - first)
        lengths.append(length)
        start += length
    if len(runs) == 1:
        return torch.arange(runs[0][0], runs[0][0] + total, device=device)
    repeated = torch.repeat_interleave(torch.tensor(offsets, device=device),
                                       torch.tensor(lengths, device=device),
                                       output_size=total)
    return torch.arange(total, device=device) - repeated


def _merge_spans(spans: Sequence[KeySpan]) -> tuple[KeySpan, ...]:
    """Adjacent spans as one (a parent followed directly by its first child)."""
    out: list[KeySpan] = []
    for span in spans:
        if out and out[-1].end == span.start:
            out[-1] = KeySpan(out[-1].start, out[-1].length + span.length)
        else:
            out.append(span)
    return tuple(out)


def _lay_out_trees(sequences: Sequence[Tensor], sizes: Sequence[int], device: torch.device,
                   tokens: list[Tensor], positions: list[tuple[int, int]],
                   segments: list[AttentionSegment], pieces: list[list[KeySpan]],
                   roots_by_length: bool = False) -> tuple[int, int]:
    """Every group's prefix tree (a sequence alone is a tree of one node) laid out depth by
    depth over the whole row: all roots in group order (`roots_by_length`: by length, ties in
    group order), then all their children in their parents' order, and so on. Each node's
    segment sees its ancestors' spans and itself causally; positions continue from the
    node's depth. Depth-major order keeps the segments
    of one depth contiguous, so a recurrent layer runs each depth as one varlen call over a
    slice of the row. Returns (rows laid out, logical tokens saved)."""
    level: list[tuple[TreeNode, list[Tensor], int, tuple[KeySpan, ...]]] = []
    first = 0
    for size in sizes:
        members = [_as_row_tokens(s, device) for s in sequences[first:first + size]]
        roots = (build_prefix_tree(members) if size > 1 else
                 [TreeNode(0, int(members[0].numel()), (0,))])
        level.extend((root, members, first, ()) for root in roots)
        first += size
    if roots_by_length:
        level.sort(key=lambda entry: entry[0].length)
    cursor = 0
    while level:
        below: list[tuple[TreeNode, list[Tensor], int, tuple[KeySpan, ...]]] = []
        for node, members, offset, ancestors in level:
            span = KeySpan(cursor, node.length)
            source = members[node.source]
            whole = node.depth == 0 and node.length == source.numel()
            tokens.append(source if whole else source[node.depth:node.depth + node.length])
            positions.append((node.depth, node.length))
            segments.append(AttentionSegment(cursor, node.length, ancestors))
            for m in node.members:
                pieces[offset + m].append(span)
            context = _merge_spans((*ancestors, span))
            below.extend((child, members, offset, context) for child in node.children)
            cursor += node.length
        level = below
    return cursor, sum(int(s.numel()) for s in sequences) - cursor


def _thd_params(
    lengths: Sequence[int],
    blocks: Sequence[int],
    total: int,
    real_end: int,
    device: torch.device,
) -> Any:
    """cu_seqlens for TE's THD attention; the trailing pad is its own pseudo-sequence."""
    from megatron.core.packed_seq_params import PackedSeqParams

    real = list(lengths)
    padded = list(blocks[: len(lengths)])
    if total > real_end:
        real.append(total - real_end)
        padded.append(total - real_end)
    cu_real = torch.tensor([0, *_cumsum(real)], dtype=torch.int32, device=device)
    cu_padded = torch.tensor([0, *_cumsum(padded)], dtype=torch.int32, device=device)
    max_len = max(padded)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_real,
        cu_seqlens_kv=cu_real,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
    )


def _cumsum(values: Sequence[int]) -> list[int]:
    out: list[int] = []
    running = 0
    for value in values:
        running += value
        out.append(running)
    return out


def unpack(values: Tensor, batch: PackedBatch, *, one_op: bool = False) -> list[Tensor]:
    """values [S, ...] in packed order -> one tensor per sequence, padding dropped: views when
    every sequence is one span of the row; on a row that shares prefixes, every sequence's
    rows (its shared rows, then its own) as a copy (`_GatherSequences`).

    `one_op`: the views come from one split of the row instead of a slice per sequence (a
    call of many short sequences pays one op, not one each). Its backward builds one
    full-row gradient where slices build one per sequence and add them, so the callers use it
    for outputs a few columns wide, whose full-row gradients are small either way."""
    if values.shape[0] != batch.padded_tokens:
        raise ValueError(
            f"unpack expects values with {batch.padded_tokens} rows (the packed row), got shape "
            f"{tuple(values.shape)}"
        )
    spans = [batch.sequence_pieces(index) for index in range(batch.sequences)]
    if any(len(s) > 1 for s in spans):
        rows = [batch.sequence_rows(index) for index in range(batch.sequences)]
        return list(_GatherSequences.apply(values, *rows))
    # Every sequence is one span here; with nothing shared, no two overlap.
    if one_op and batch.shared_tokens == 0:
        tiles = _row_tiles(batch)
        out: list[Tensor] = [values] * batch.sequences
        for part, (_, index) in zip(values.split([n for n, _ in tiles]), tiles, strict=True):
            if index is not None:
                out[index] = part
        return out
    return [values[s[0].start : s[0].end] for s in spans]


def _disjoint_spans(batch: PackedBatch) -> bool:
    """Every sequence is one span of the row and no two overlap (nothing is shared: a
    sequence that is a prefix of another is one span inside the other's)."""
    return batch.shared_tokens == 0 and not any(
        len(batch.sequence_pieces(i)) > 1 for i in range(batch.sequences))


def _row_tiles(batch: PackedBatch) -> list[tuple[int, int | None]]:
    """(tokens, sequence index or None for padding) covering the row in row order, for a
    row of disjoint spans (`_disjoint_spans`)."""
    spans = sorted(((batch.sequence_pieces(i)[0], i) for i in range(batch.sequences)),
                   key=lambda entry: entry[0].start)
    tiles: list[tuple[int, int | None]] = []
    cursor = 0
    for span, index in spans:
        if span.start > cursor:
            tiles.append((span.start - cursor, None))
        tiles.append((span.length, index))
        cursor = span.end
    if batch.padded_tokens > cursor:
        tiles.append((batch.padded_tokens - cursor, None))
    return tiles


class _GatherSequences(torch.autograd.Function):
    """Each sequence's rows of a row that lays shared prefixes out once, as copies. The
    backward adds every sequence's gradient into one zeroed row: views and concatenations of
    slices would each materialise a whole-row gradient and sum them pairwise."""

    @staticmethod
    def forward(ctx: Any, values: Tensor, *rows: Tensor) -> tuple[Tensor, ...]:
        ctx.save_for_backward(*rows)
        ctx.row_shape = values.shape
        return tuple(values.index_select(0, r) for r in rows)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        rows = ctx.saved_tensors
        total = None
        for r, g in zip(rows, grads):
            if g is None:
                continue
            if total is None:
                total = g.new_zeros(ctx.row_shape)
            total.index_add_(0, r, g)
        return (total, *([None] * len(rows)))


def next_token_targets(batch: PackedBatch) -> Tensor:
    """[S] long: each position's next token within its own sequence; the last token of every
    sequence and all padding get IGNORE_INDEX, so no target ever crosses a sequence boundary.
    On a shared row the first sequence's target is kept (see `pack_targets` for the rest)."""
    per_sequence = []
    for index in range(batch.sequences):
        own = batch.tokens[0, batch.sequence_rows(index)]
        per_sequence.append(torch.cat([own[1:], own.new_full((1,), IGNORE_INDEX)]))
    return pack_targets(per_sequence, batch).row_targets


def pack_values(
    per_sequence: Sequence[Tensor], batch: PackedBatch, *, fill: float | int = IGNORE_INDEX
) -> Tensor:
    """The inverse of `unpack`: per-sequence [n_i, ...] values -> [S, ...], `fill` elsewhere.
    A shared row takes the first sequence's value (targets: see `pack_targets`)."""
    if len(per_sequence) != batch.sequences:
        raise ValueError(
            f"pack_values got {len(per_sequence)} tensors for a batch of {batch.sequences} "
            "sequences"
        )
    first = per_sequence[0]
    for index, values in enumerate(per_sequence):
        length = batch.sequence_lengths_tokens[index]
        if values.shape[0] != length:
            raise ValueError(
                f"pack_values: sequence {index} has {length} tokens but {values.shape[0]} values"
            )
    if _disjoint_spans(batch):
        # Every sequence one span of its own: the row is one concatenation in row order (an op per
        # padding gap, none per sequence), a new tensor even for one sequence.
        parts = [torch.full((n, *first.shape[1:]), fill, dtype=first.dtype, device=first.device)
                 if index is None else
                 per_sequence[index].to(device=first.device, dtype=first.dtype)
                 for n, index in _row_tiles(batch)]
        return torch.cat(parts)
    out = torch.full(
        (batch.padded_tokens, *first.shape[1:]), fill, dtype=first.dtype, device=first.device
    )
    for index in reversed(range(batch.sequences)):
        out[batch.sequence_rows(index).to(out.device)] = per_sequence[index].to(out.device)
    return out


@dataclass(frozen=True)
class PackedTargets:
    """Targets of a packed row. A shared row has one hidden state but each sequence its own
    target there (at the end of a shared prompt, the next token is each completion's first):
    the row holds the first sequence's; every other target that differs is an extra
    (row, target) pair, scored on a gathered copy of just those rows."""

    row_targets: Tensor  # [S] or [S, k] long
    extra_rows: Tensor  # [E] long
    extra_targets: Tensor  # [E] or [E, k] long
    # per sequence: (its positions that use an extra pair, the pairs' indices)
    overrides: tuple[tuple[Tensor, Tensor] | None, ...]


def pack_targets(per_sequence: Sequence[Tensor], batch: PackedBatch) -> PackedTargets:
    row_targets = pack_values(per_sequence, batch, fill=IGNORE_INDEX).long()
    extra_rows: list[Tensor] = []
    extra_targets: list[Tensor] = []
    overrides: list[tuple[Tensor, Tensor] | None] = []
    count = 0
    for index, targets in enumerate(per_sequence):
        if batch.shared_tokens == 0:
            overrides.append(None)
            continue
        rows = batch.sequence_rows(index).to(row_targets.device)
        targets = targets.to(row_targets.device).long()
        mismatch = row_targets[rows] != targets
        if mismatch.dim() > 1:  # [T, k] targets: a row differs when any column does
            mismatch = mismatch.any(dim=-1)
        differ = mismatch.nonzero().flatten()
        if differ.numel() == 0:
            overrides.append(None)
            continue
        extra_rows.append(rows[differ])
        extra_targets.append(targets[differ])
        overrides.append((differ, torch.arange(count, count + differ.numel(),
                                               device=row_targets.device)))
        count += differ.numel()
    return PackedTargets(
        row_targets=row_targets,
        extra_rows=torch.cat(extra_rows) if extra_rows else row_targets.new_empty(0),
        extra_targets=(torch.cat(extra_targets) if extra_targets
                       else row_targets.new_empty((0, *row_targets.shape[1:]))),
        overrides=tuple(overrides),
    )
