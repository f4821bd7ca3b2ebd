"""Sequences of one micro-batch -> one packed row (and back).

Every sequence keeps its own positions (0, 1, ...) and attends only to itself: the local spec
(CPU, unfused attention) gets a block-diagonal causal bool mask, the Transformer Engine spec
gets `PackedSeqParams` with cu_seqlens (THD format) instead, so no S x S mask exists on GPU.
The row is padded to what the parallel layout needs: a multiple of TP when sequence parallel
scatters it over the TP ranks, and, with context parallelism, every sequence to a multiple of
2 x CP (the load-balanced split gives each CP rank two chunks of every sequence). Padding is
one extra pseudo-sequence at the end with its own causal block, so it never touches a real
token and never produces NaN rows; `unpack` drops it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout

IGNORE_INDEX = -100  # target value that produces no log-probability (0.0) and no gradient
PAD_TOKEN_ID = 0  # padding is masked away from every real token, so its id does not matter


@dataclass(frozen=True)
class PackedBatch:
    tokens: Tensor  # [1, S] long, S = padded_tokens
    position_ids: Tensor  # [1, S] long, restarting at 0 for every sequence
    attention_mask: Tensor | None  # bool [1, 1, S, S], True = masked (local spec)
    packed_seq_params: Any | None  # megatron PackedSeqParams (TE spec)
    sequence_lengths_tokens: tuple[int, ...]
    offsets: tuple[int, ...]  # start of each sequence in the row
    logical_tokens: int
    padded_tokens: int  # S

    @property
    def sequences(self) -> int:
        return len(self.sequence_lengths_tokens)


def row_multiple_tokens(layout: ParallelLayout) -> int:
    """What the whole packed row length must be a multiple of for this layout."""
    multiple = 1
    if layout.sequence_parallel:
        multiple = math.lcm(multiple, layout.tensor_parallel)
    if layout.context_parallel > 1:
        multiple = math.lcm(multiple, 2 * layout.context_parallel)
    return multiple


def sequence_multiple_tokens(layout: ParallelLayout) -> int:
    """What every single sequence is padded to (context parallel splits each one in 2 x CP)."""
    return 2 * layout.context_parallel if layout.context_parallel > 1 else 1


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def packed_length_tokens(sequence_lengths_tokens: Sequence[int], layout: ParallelLayout) -> int:
    """The padded row length `pack_sequences` produces, without building anything.

    The memory model prices `MicroBatchShape.padded_tokens` with this.
    """
    per_sequence = sequence_multiple_tokens(layout)
    total = sum(_round_up(int(n), per_sequence) for n in sequence_lengths_tokens)
    return _round_up(total, row_multiple_tokens(layout))


def check_layout_supported(implementation: Implementation, layout: ParallelLayout) -> None:
    """Refuse layouts the built model cannot run, before any memory is spent on them.

    Sequence parallel is accepted on both specs: model_builder swaps the local spec's torch
    norms for ones that run on sequence shards.
    """
    if layout.context_parallel > 1 and implementation.spec == "local":
        raise ValueError(
            f"context parallel {layout.context_parallel} needs the Transformer Engine layer spec: "
            "Megatron-Core's unfused DotProductAttention (local spec) only supports context "
            "parallel size 1. Set ART_MEGATRON_CONTEXT_PARALLEL_SIZE=1 and use tensor parallel"
        )


def _block_causal_mask(block_lengths: Sequence[int], total: int, device: torch.device) -> Tensor:
    """bool [1, 1, S, S], True = masked: causal inside each block, nothing across blocks."""
    block_id = torch.repeat_interleave(
        torch.arange(len(block_lengths), device=device),
        torch.tensor(list(block_lengths), device=device),
    )
    if block_id.numel() != total:
        raise AssertionError(f"blocks cover {block_id.numel()} tokens, row has {total}")
    positions = torch.arange(total, device=device)
    allowed = (block_id[:, None] == block_id[None, :]) & (positions[None, :] <= positions[:, None])
    return (~allowed).view(1, 1, total, total)


def pack_sequences(
    sequences: Sequence[Tensor],
    *,
    implementation: Implementation,
    layout: ParallelLayout,
    device: torch.device | str = "cpu",
) -> PackedBatch:
    """Pack 1-D token tensors into one row with per-sequence positions and isolation."""
    if len(sequences) == 0:
        raise ValueError("pack_sequences needs at least one sequence, got none")
    check_layout_supported(implementation, layout)
    device = torch.device(device)
    per_sequence = sequence_multiple_tokens(layout)
    lengths: list[int] = []
    pieces: list[Tensor] = []
    positions: list[Tensor] = []
    offsets: list[int] = []
    blocks: list[int] = []  # causal blocks: each (padded) sequence, then the trailing pad
    cursor = 0
    for index, sequence in enumerate(sequences):
        if sequence.dim() != 1 or sequence.numel() == 0:
            raise ValueError(
                f"sequence {index} must be a non-empty 1-D token tensor, got shape "
                f"{tuple(sequence.shape)}"
            )
        if sequence.dtype.is_floating_point or sequence.dtype == torch.bool:
            raise ValueError(f"sequence {index} must hold integer token ids, got {sequence.dtype}")
        length = int(sequence.numel())
        padded = _round_up(length, per_sequence)
        lengths.append(length)
        offsets.append(cursor)
        pieces.append(sequence.to(device=device, dtype=torch.long))
        positions.append(torch.arange(length, device=device))
        if padded > length:
            # CP pads inside the sequence's own block: TE's THD kernels see these
            # tokens through cu_seqlens_*_padded and skip them.
            pieces.append(torch.full((padded - length,), PAD_TOKEN_ID, device=device))
            positions.append(torch.arange(length, padded, device=device))
        blocks.append(padded)
        cursor += padded
    total = _round_up(cursor, row_multiple_tokens(layout))
    if total > cursor:
        pieces.append(torch.full((total - cursor,), PAD_TOKEN_ID, device=device))
        positions.append(torch.arange(total - cursor, device=device))
        blocks.append(total - cursor)
    tokens = torch.cat(pieces).view(1, total)
    position_ids = torch.cat(positions).view(1, total)
    attention_mask: Tensor | None = None
    packed_seq_params: Any | None = None
    if implementation.spec == "te":
        packed_seq_params = _thd_params(lengths, blocks, total, cursor, device)
    else:
        attention_mask = _block_causal_mask(blocks, total, device)
    return PackedBatch(
        tokens=tokens,
        position_ids=position_ids,
        attention_mask=attention_mask,
        packed_seq_params=packed_seq_params,
        sequence_lengths_tokens=tuple(lengths),
        offsets=tuple(offsets),
        logical_tokens=sum(lengths),
        padded_tokens=total,
    )


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


def unpack(values: Tensor, batch: PackedBatch) -> list[Tensor]:
    """values [S, ...] in packed order -> one tensor per sequence, padding dropped (views)."""
    if values.shape[0] != batch.padded_tokens:
        raise ValueError(
            f"unpack expects values with {batch.padded_tokens} rows (the packed row), got shape "
            f"{tuple(values.shape)}"
        )
    return [
        values[start : start + length]
        for start, length in zip(batch.offsets, batch.sequence_lengths_tokens)
    ]


def next_token_targets(batch: PackedBatch) -> Tensor:
    """[S] long: each position's next token within its own sequence; the last token of every
    sequence and all padding get IGNORE_INDEX, so no target ever crosses a sequence boundary."""
    targets = torch.full_like(batch.tokens[0], IGNORE_INDEX)
    for start, length in zip(batch.offsets, batch.sequence_lengths_tokens):
        targets[start : start + length - 1] = batch.tokens[0, start + 1 : start + length]
    return targets


def pack_values(
    per_sequence: Sequence[Tensor], batch: PackedBatch, *, fill: float | int = IGNORE_INDEX
) -> Tensor:
    """The inverse of `unpack`: per-sequence [n_i, ...] values -> [S, ...], `fill` elsewhere."""
    if len(per_sequence) != batch.sequences:
        raise ValueError(
            f"pack_values got {len(per_sequence)} tensors for a batch of {batch.sequences} "
            "sequences"
        )
    first = per_sequence[0]
    out = torch.full(
        (batch.padded_tokens, *first.shape[1:]), fill, dtype=first.dtype, device=first.device
    )
    for index, (values, start, length) in enumerate(
        zip(per_sequence, batch.offsets, batch.sequence_lengths_tokens)
    ):
        if values.shape[0] != length:
            raise ValueError(
                f"pack_values: sequence {index} has {length} tokens but {values.shape[0]} values"
            )
        out[start : start + length] = values.to(out.device)
    return out
