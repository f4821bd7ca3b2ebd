"""Packed row -> decoder hidden states (after the final norm), the full row on every TP rank.

This drives the GPTModel's parts (embedding, rotary table, decoder) directly instead of
`GPTModel.forward`, for two reasons: the output head must run in token chunks (see heads.py), so
the model's own output layer is never called; and on the local spec Megatron builds the rotary
table for positions 0..S-1 of the whole row, ignoring position_ids, which would rotate a
packed sequence as if it started at its offset. Here the table is indexed by position_ids, so
every sequence sees exactly the angles it sees alone, a completion laid out after a shared
prefix included (its positions continue from the prefix). With the TE spec Megatron's THD rotary
path restarts positions per sequence from cu_seqlens itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from art.megatron.attention_layout import AttentionLayout
from art.megatron.context_parallel import (
    ContextParallelSplit,
    SplitRowLayout,
    gather_row,
    split_for_this_rank,
)
from art.trainer_rank.compute.packing import PackedBatch


def language_model(chunk: Any) -> Any:
    """The GPTModel inside Megatron's wrappers (DistributedDataParallel, Float16Module)."""
    model = chunk
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model


def unwrap_model(model: Any) -> Any:
    """The GPTModel inside DDP / Float16Module style wrappers (they keep it in `.module`)."""
    inner = model
    seen = 0
    while not hasattr(inner, "decoder") and hasattr(inner, "module") and seen < 8:
        inner = inner.module
        seen += 1
    if not hasattr(inner, "decoder") or not hasattr(inner, "embedding"):
        raise TypeError(
            f"expected a Megatron-Core GPTModel (or a wrapper holding one in .module), got "
            f"{type(model).__name__}"
        )
    return inner


def _check_single_stage(inner: Any) -> None:
    if not (inner.pre_process and inner.post_process):
        raise ValueError(
            "decoder_hidden_states runs the whole model on this rank, but this GPTModel is one "
            f"pipeline stage (pre_process={inner.pre_process}, post_process="
            f"{inner.post_process}); set ART_MEGATRON_PIPELINE_MODEL_PARALLEL_SIZE=1"
        )


def _rotary(inner: Any, batch: PackedBatch, decoder_input: Tensor,
            positions: Tensor | None = None) -> Tensor | None:
    """The rotary table at `positions` (default: the whole row's position ids)."""
    if getattr(inner, "position_embedding_type", None) != "rope":
        return None
    if getattr(batch.packed_seq_params, "qkv_format", None) == "thd":
        seq_len = inner.rotary_pos_emb.get_rotary_seq_len(
            None, inner.decoder, decoder_input, inner.config, batch.packed_seq_params
        )
        return inner.rotary_pos_emb(seq_len, packed_seq=True)
    positions = batch.position_ids[0] if positions is None else positions
    # packed_seq=True: the whole table; Megatron would otherwise cut it for this CP rank by
    # row index, and here the rows carry their own positions.
    table = inner.rotary_pos_emb(int(batch.position_ids.max().item()) + 1,
                                 packed_seq=True)  # [P, 1, 1, dim]
    return table.index_select(0, positions.to(table.device))


@dataclass(frozen=True)
class LocalRow:
    """What this rank's decoder layers are called with: the row's tokens and positions this
    CP rank holds (all of them at CP = 1) and the attention's `packed_seq_params`."""

    tokens: Tensor  # [1, rows]
    positions: Tensor  # [1, rows]
    packed_seq_params: Any
    split: ContextParallelSplit | None


def local_row(inner: Any, batch: PackedBatch) -> LocalRow:
    """This CP rank's rows of a packed row; attention sees the rest through the split
    layout (`SplitRowLayout`)."""
    if inner.config.context_parallel_size == 1:
        return LocalRow(batch.tokens, batch.position_ids, batch.packed_seq_params, None)
    split = split_for_this_rank(batch.padded_tokens)
    return LocalRow(split.local(batch.tokens, dim=1), split.local(batch.position_ids, dim=1),
                    _split_layout(batch, split), split)


def decoder_hidden_states(model: Any, batch: PackedBatch) -> Tensor:
    """[S, hidden] after the final norm, in the model dtype, with grad when grad is enabled.

    The full packed row on every TP rank: gathered from the sequence-parallel split when
    sequence parallel is on (the gather's backward splits the replicated gradient again).
    """
    from megatron.core import tensor_parallel

    inner = unwrap_model(model)
    _check_single_stage(inner)
    if batch.attention_mask is None and batch.packed_seq_params is None:
        raise ValueError(
            "the packed batch has neither an attention mask nor PackedSeqParams; build it with "
            "pack_sequences(...) so the sequences stay isolated"
        )
    sequence_parallel = bool(inner.config.sequence_parallel)
    if sequence_parallel:
        tp = inner.config.tensor_model_parallel_size
        if batch.padded_tokens % tp:
            raise ValueError(
                f"sequence parallel needs the packed row to be a multiple of TP={tp} tokens, got "
                f"{batch.padded_tokens}; pack with the same ParallelLayout the model was built with"
            )
    row = local_row(inner, batch)
    split = row.split
    # [1, S] -> [S, 1, H] ([S/TP, 1, H] under sequence parallel: the embedding scatters it).
    decoder_input = inner.embedding(input_ids=row.tokens, position_ids=row.positions)
    rotary_pos_emb = _rotary(inner, batch, decoder_input, row.positions[0])
    hidden = inner.decoder(
        hidden_states=decoder_input,
        attention_mask=batch.attention_mask,
        rotary_pos_emb=rotary_pos_emb,
        packed_seq_params=row.packed_seq_params,
    )
    if sequence_parallel:
        hidden = tensor_parallel.gather_from_sequence_parallel_region(
            hidden, tensor_parallel_output_grad=False
        )
    if split is not None:
        # Every CP rank runs the output heads on the whole row (upstream returns every output
        # for the full sequence on every rank), so its gradient here is the whole gradient.
        hidden = gather_row(hidden, split, replicated_grad=True)
    if hidden.shape[0] != batch.padded_tokens or hidden.shape[1] != 1:
        raise AssertionError(
            f"decoder returned shape {tuple(hidden.shape)}, expected "
            f"[{batch.padded_tokens}, 1, hidden]"
        )
    return hidden.reshape(batch.padded_tokens, hidden.shape[-1])


def _split_layout(batch: PackedBatch, split: ContextParallelSplit) -> SplitRowLayout:
    if not isinstance(batch.packed_seq_params, AttentionLayout):
        raise ValueError(
            f"context parallel {split.size} runs the segmented flash attention, which takes the "
            "row's AttentionLayout; this batch was packed for another attention "
            f"({type(batch.packed_seq_params).__name__}); build the model with the segmented "
            "flash attention (the runtime's choice for CP > 1; Implementation.cpu_local('flash') "
            "or Implementation.cuda_local())"
        )
    return SplitRowLayout(batch.packed_seq_params, split)
