"""Core attention over a packed row that keeps what flash attention keeps: output + logsumexp.

Each query segment of the `AttentionLayout` is computed block by block: against its own rows
(causal) and against every context span (the shared prefix it sees, in full). Consecutive
segments of one length that see only themselves (a row of many sequences, which the packer
orders by length) run as one batched call: the row's rows viewed as [segments, heads, L, d].
Every block is one call of a flash-style kernel that returns the block's output and its
logsumexp; blocks are merged by their logsumexps. Backward calls the kernel's backward per
block with the merged output and logsumexp, which gives each block's exact share of dq, dk and
dv (the softmax statistics are the whole row's). So no [S, S] mask, score or probability
tensor ever exists: saved for backward are q, k, v (the layer's own tensors), the output and
one fp32 logsumexp per head and token. Sibling segments never meet, and a prefix is computed
once for all of them.

The kernels, per device (`_kernel_for`):
- CPU: torch's CPU flash kernel, `aten::_scaled_dot_product_flash_attention_for_cpu` and its
  `_backward`; it broadcasts key/value groups to the query heads itself (GQA).
- CUDA, fp16/bf16 with a head dim that is a multiple of 8 up to 256 (and what torch's own
  `can_use_flash_attention` accepts on this GPU): FlashAttention-2 through
  `aten::_scaled_dot_product_flash_attention` / `_backward`, which take fewer key/value heads
  than query heads (head h reads group h // (heads / groups), as Megatron repeats them).
- CUDA otherwise (fp32, other head dims): the memory-efficient kernel,
  `aten::_scaled_dot_product_efficient_attention` / `_backward`. It needs as many key/value
  heads as query heads, so a GQA block is run once per position r inside a group: the query
  heads g * (heads / groups) + r of every group g, a strided view, against the groups' own
  keys, with no repeated k or v. Its logsumexp comes padded to a multiple of 32 queries.
The signatures and layouts these calls rely on are in the kernel classes' docstrings.

A Transformer Engine build runs TE's THD attention instead, which takes no tree: a tree layout
is packed only for a model built with this module (see `Implementation.attention_takes_tree`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from art.megatron.attention_layout import AttentionLayout, AttentionSegment, KeySpan
from art.megatron.context_parallel import (
    ContextParallelSplit,
    SplitRowLayout,
    all_gather_rows,
    context_parallel_group,
    sum_over_ranks,
)
from art.megatron.implementation import cuda_sdpa_kernel

# Module-level references, called at run time (the CPU tests put stand-ins here).
_FLASH_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_CUDA_FLASH_FWD = torch.ops.aten._scaled_dot_product_flash_attention
_CUDA_FLASH_BWD = torch.ops.aten._scaled_dot_product_flash_attention_backward
_CUDA_EFFICIENT_FWD = torch.ops.aten._scaled_dot_product_efficient_attention
_CUDA_EFFICIENT_BWD = torch.ops.aten._scaled_dot_product_efficient_attention_backward
_SDPA_PARAMS = torch.backends.cuda.SDPAParams
_can_use_flash = torch.backends.cuda.can_use_flash_attention
_can_use_efficient = torch.backends.cuda.can_use_efficient_attention

# The memory-efficient forward pads its logsumexp's query dim to a multiple of this
# (`kAlignLSE` in mem_eff_attention/kernel_forward.h; the meta kernel in
# torch/_meta_registrations.py says the same); its backward wants the head and batch strides
# of the logsumexp it is given to be multiples of 8 (`check_supported` in kernel_backward.h).
EFFICIENT_LSE_ALIGN = 32


def _is_cuda(t: Tensor) -> bool:
    return t.device.type == "cuda"


def _blocks(segment: AttentionSegment) -> list[tuple[KeySpan, bool]]:
    """(key span, causal) for every block the segment's queries see."""
    return [(span, False) for span in segment.context] + [
        (KeySpan(segment.start, segment.length), True)
    ]


def _heads_first(x: Tensor) -> Tensor:
    """[s, b, h, d] -> [b, h, s, d] (a view: the kernels take strided inputs)."""
    return x.permute(1, 2, 0, 3)


class _CpuFlash:
    """torch's CPU flash kernel. `_scaled_dot_product_flash_attention_for_cpu(query, key,
    value, dropout_p=0., is_causal=False, *, attn_mask=None, scale=None) -> (output,
    logsumexp)` on [b, heads, L, d] views (key/value may have fewer heads: broadcast), and
    `..._for_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
    *, attn_mask=None, scale=None) -> (grad_query, grad_key, grad_value)`."""

    name = "cpu-flash"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
                ) -> tuple[Tensor, Tensor]:
        return _FLASH_FWD(q, k, v, 0.0, causal, scale=scale)

    def backward_into(self, g: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                      causal: bool, scale: float, dq: Tensor, dk: Tensor, dv: Tensor) -> None:
        dq_block, dk_block, dv_block = _FLASH_BWD(g, q, k, v, o, lse, 0.0, causal, scale=scale)
        dq += dq_block
        dk += dk_block
        dv += dv_block


class _CudaFlash:
    """FlashAttention-2 as torch ships it (checked in torch 2.11-2.13's
    aten/src/ATen/native/transformers/cuda: attention.cu, attention_backward.cu and
    flash_attn/flash_api.cpp):

    `_scaled_dot_product_flash_attention(query, key, value, dropout_p=0., is_causal=False,
    return_debug_mask=False, *, scale=None) -> (output, logsumexp, cum_seq_q, cum_seq_k,
    max_q, max_k, rng_state, unused, debug_attn_mask)`: [b, heads, L, d] inputs, any strides
    with a contiguous last dim; key/value may have fewer heads if they divide the query's
    (`mha_fwd`: "Number of heads in key/value must divide number of heads in query"; query
    head h reads key/value head h // ratio); logsumexp is fp32 [b, heads, L] (natural log);
    cum_seq_q / cum_seq_k come back undefined (None) for dense inputs.

    `_scaled_dot_product_flash_attention_backward(grad_out, query, key, value, out,
    logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed,
    philox_offset, *, scale=None) -> (grad_query, grad_key, grad_value)`: undefined (None)
    cum_seq_q selects the dense `mha_bwd`, which reads logsumexp by pointer as a contiguous
    [b, heads, L] and sums dk / dv over the heads of a group itself; philox_seed / offset
    are read only when dropout_p > 0, so fresh tensors of the forward's kinds (uint64 [2]
    and [] on the device) stand in for the forward's rng_state / unused."""

    name = "cuda-flash"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
                ) -> tuple[Tensor, Tensor]:
        result = _CUDA_FLASH_FWD(q, k, v, 0.0, causal, False, scale=scale)
        return result[0], result[1]

    def backward_into(self, g: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                      causal: bool, scale: float, dq: Tensor, dk: Tensor, dv: Tensor) -> None:
        seed = torch.empty(2, dtype=torch.uint64, device=q.device)
        offset = torch.empty((), dtype=torch.uint64, device=q.device)
        dq_block, dk_block, dv_block = _CUDA_FLASH_BWD(
            g, q, k, v, o, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset,
            scale=scale)
        dq += dq_block
        dk += dk_block
        dv += dv_block


class _CudaEfficient:
    """The memory-efficient kernel as torch ships it (same sources, and
    mem_eff_attention/kernel_backward.h):

    `_scaled_dot_product_efficient_attention(query, key, value, attn_bias, compute_log_sumexp,
    dropout_p=0., is_causal=False, *, scale=None) -> (output, log_sumexp, philox_seed,
    philox_offset)`: as many key/value heads as query heads (`_efficient_attention_forward`
    checks it); log_sumexp is fp32 [b, heads, ceil(L / 32) * 32], rows past L are padding.

    `_scaled_dot_product_efficient_attention_backward(grad_out_, query, key, value, attn_bias,
    out, logsumexp, philox_seed, philox_offset, dropout_p, grad_input_mask, is_causal=False,
    *, scale=None) -> (grad_query, grad_key, grad_value, grad_attn_bias)`: the kernel reads
    `out` with a row stride of heads * d whatever its strides say (`o_strideM()`), so `out` is
    handed over compact; the logsumexp's head and batch strides must be multiples of 8, so
    it is handed over in the forward's padded layout. With dropout_p 0 the philox tensors
    are not read; the forward returns 0-dim int64 CPU tensors then, and so do these."""

    name = "cuda-efficient"

    @staticmethod
    def _per_slot(x: Tensor, groups: int) -> Tensor:
        """[b, heads, ...] -> [b, groups, heads / groups, ...]: slot r of group g is query
        head g * (heads / groups) + r, the heads Megatron pairs with key/value group g."""
        return x.unflatten(1, (groups, x.shape[1] // groups))

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
                ) -> tuple[Tensor, Tensor]:
        b, heads, length, dim = q.shape
        groups = k.shape[1]
        if heads == groups:
            out, lse = _CUDA_EFFICIENT_FWD(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
            return out, lse[..., :length]
        out = q.new_empty(b, length, heads, dim).transpose(1, 2)
        lse = torch.empty(b, heads, length, dtype=torch.float32, device=q.device)
        q_slots, o_slots, lse_slots = (self._per_slot(t, groups) for t in (q, out, lse))
        for r in range(heads // groups):
            part, part_lse = _CUDA_EFFICIENT_FWD(q_slots[:, :, r], k, v, None, True, 0.0, causal,
                                                 scale=scale)[:2]
            o_slots[:, :, r] = part
            lse_slots[:, :, r] = part_lse[..., :length]
            del part, part_lse
        return out, lse

    def backward_into(self, g: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                      causal: bool, scale: float, dq: Tensor, dk: Tensor, dv: Tensor) -> None:
        b, heads, length, dim = q.shape
        groups = k.shape[1]
        seed = torch.empty((), dtype=torch.long)
        offset = torch.empty((), dtype=torch.long)
        padded = -(-length // EFFICIENT_LSE_ALIGN) * EFFICIENT_LSE_ALIGN
        g_slots, q_slots, o_slots, lse_slots, dq_slots = (
            self._per_slot(t, groups) for t in (g, q, o, lse, dq))
        for r in range(heads // groups):
            out_r = o.new_empty(b, length, groups, o.shape[-1]).transpose(1, 2)
            out_r.copy_(o_slots[:, :, r])
            lse_r = lse.new_zeros(b, groups, padded)
            lse_r[..., :length] = lse_slots[:, :, r]
            dq_r, dk_r, dv_r, _ = _CUDA_EFFICIENT_BWD(
                g_slots[:, :, r], q_slots[:, :, r], k, v, None, out_r, lse_r, seed, offset, 0.0,
                [True, True, True, False], causal, scale=scale)
            del out_r, lse_r
            dq_slots[:, :, r] += dq_r
            dk += dk_r
            dv += dv_r
            del dq_r, dk_r, dv_r


_CPU_FLASH = _CpuFlash()
_KERNELS = {k.name: k for k in (_CPU_FLASH, _CudaFlash(), _CudaEfficient())}


def _kernel_for(query: Tensor, key: Tensor, value: Tensor) -> str:
    """The kernel for these [s, b, heads, d] tensors (see the module docstring). Asked
    outside the autograd function, where the inputs still say whether they need grad (torch's
    flash check refuses head dims above 192 on sm86/89 when they do)."""
    if not _is_cuda(query):
        return _CPU_FLASH.name
    q, k, v = (_heads_first(t) for t in (query, key, value))
    dim = q.shape[-1]
    if (q.dtype in (torch.float16, torch.bfloat16)
            and cuda_sdpa_kernel(q.element_size(), dim) == "flash"
            and _can_use_flash(_SDPA_PARAMS(q, k, v, None, 0.0, False, True))):
        return "cuda-flash"
    q_slot = _CudaEfficient._per_slot(q, k.shape[1])[:, :, 0]
    if _can_use_efficient(_SDPA_PARAMS(q_slot, k, v, None, 0.0, False, False)):
        return "cuda-efficient"
    raise ValueError(
        f"segmented flash attention found no CUDA kernel for {q.dtype} with head dim {dim}: "
        "torch's flash kernel takes fp16/bf16 with a head dim that is a multiple of 8 up to "
        "256 (sm80 or newer), its memory-efficient kernel the rest; neither accepts these "
        "tensors on this GPU (or both are disabled in torch.backends.cuda)"
    )


@dataclass(frozen=True)
class _QueryPiece:
    """Query rows of one segment (in the rows this rank holds) and the key blocks they see
    (in row coordinates): (span, causal), the causal one square and last. `count` > 1: the
    rows are that many consecutive segments of one length, each seeing only itself
    (causally), run as one batched kernel call (`_segments`)."""

    rows: slice
    blocks: tuple[tuple[KeySpan, bool], ...]
    count: int = 1

    @property
    def segment_tokens(self) -> int:
        return (self.rows.stop - self.rows.start) // self.count


def _segments(x: Tensor, rows: slice, count: int) -> Tensor:
    """The rows of a [b, heads, s, ...] heads-first view as the kernels take them: [b, heads,
    L, ...], or for `count` consecutive equal segments of a b = 1 row [count, heads, L, ...]
    (a view: the row's s dimension split into count x L)."""
    part = x[:, :, rows]
    if count == 1:
        return part
    return part[0].unflatten(1, (count, -1)).transpose(0, 1)


def _batched_segments_limit(kernel_name: str, segment_tokens: int, row_tokens: int) -> int:
    """How many equal segments one kernel call may take. The memory model prices one block's
    working set at the whole row; the memory-efficient kernel pads each batch element's
    logsumexp to a multiple of 32 queries, so a batch of short segments is capped where
    its padded logsumexp would pass the row's."""
    if kernel_name != "cuda-efficient":
        return row_tokens
    padded = -(-segment_tokens // EFFICIENT_LSE_ALIGN) * EFFICIENT_LSE_ALIGN
    return max(1, row_tokens // padded)


def _batched(pieces: list[_QueryPiece], kernel_name: str, row_tokens: int, batch_size: int
             ) -> list[_QueryPiece]:
    """Consecutive pieces of one length that see only themselves, merged into one batched
    piece each (a packed row of many short sequences runs a call per length, not per
    sequence). Only on a b = 1 row, whose segments the kernels can take as a batch view."""
    if batch_size != 1:
        return pieces
    merged: list[_QueryPiece] = []
    for piece in pieces:
        last = merged[-1] if merged else None
        if (last is not None and len(piece.blocks) == 1 and len(last.blocks) == 1
                and last.rows.stop == piece.rows.start
                and last.segment_tokens == piece.rows.stop - piece.rows.start
                and last.count < _batched_segments_limit(kernel_name, last.segment_tokens,
                                                         row_tokens)):
            start = last.rows.start
            merged[-1] = _QueryPiece(slice(start, piece.rows.stop),
                                     ((KeySpan(start, piece.rows.stop - start), True),),
                                     last.count + 1)
        else:
            merged.append(piece)
    return merged


def _query_pieces(layout: AttentionLayout, split: ContextParallelSplit | None,
                  kernel_name: str = "cpu-flash", batch_size: int = 1) -> list[_QueryPiece]:
    """Every segment as one piece, runs of equal context-free segments batched; under context
    parallel, every part of a segment inside one of this rank's two chunks, which sees the
    segment's context, the segment's rows before it (in full) and itself (causally)."""
    if split is None:
        return _batched([_QueryPiece(slice(seg.start, seg.end), tuple(_blocks(seg)))
                         for seg in layout.segments], kernel_name, layout.total_tokens,
                        batch_size)
    starts = [seg.start for seg in layout.segments]
    pieces = []
    local_start = 0
    for run in split.runs():
        index = bisect.bisect_right(starts, run.start) - 1
        while index < len(layout.segments) and layout.segments[index].start < run.end:
            seg = layout.segments[index]
            first, last = max(seg.start, run.start), min(seg.end, run.end)
            blocks = [(span, False) for span in seg.context]
            if first > seg.start:
                blocks.append((KeySpan(seg.start, first - seg.start), False))
            blocks.append((KeySpan(first, last - first), True))
            rows = slice(local_start + first - run.start, local_start + last - run.start)
            pieces.append(_QueryPiece(rows, tuple(blocks)))
            index += 1
        local_start += run.length
    return pieces


class _SegmentedFlash(torch.autograd.Function):
    """Under context parallel the query, key and value are this rank's rows; the keys and
    values of the whole row are gathered in forward and again in backward (only the local
    ones are saved), and the key/value gradients are summed over the CP ranks."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, query: Tensor, key: Tensor, value: Tensor, layout: AttentionLayout, scale: float,
        kernel_name: str, split: ContextParallelSplit | None,
    ) -> Tensor:
        kernel = _KERNELS[kernel_name]
        s, b, heads, dim = query.shape
        # Output in Megatron's [s, b, heads * dim] order; the kernel view writes into it, and
        # the same storage is what backward reads, so the output exists once.
        out = query.new_empty(s, b, heads, dim)
        lse = torch.empty(b, heads, s, dtype=torch.float32, device=query.device)
        key_row, value_row = _whole_row(key, value, split)
        q, k, v, o = (_heads_first(t) for t in (query, key_row, value_row, out))
        # The same pieces (and batches) in backward: worked out once, kept on ctx.
        pieces = _query_pieces(layout, split, kernel_name, b)
        for piece in pieces:
            rows, count = piece.rows, piece.count
            q_seg = _segments(q, rows, count)
            blocks = piece.blocks
            acc: Tensor | None = None  # fp32 running output, merged block by block
            running_lse: Tensor | None = None
            for span, causal in blocks:
                keys = slice(span.start, span.end)
                part, part_lse = kernel.forward(q_seg, _segments(k, keys, count),
                                                _segments(v, keys, count), causal, scale)
                if len(blocks) == 1:
                    _segments(o, rows, count).copy_(part)
                    _segments(lse, rows, count).copy_(part_lse)
                    del part, part_lse
                    break
                if acc is None or running_lse is None:
                    # fp32 blocks are their own accumulator; 16-bit ones are upcast once.
                    acc, running_lse = part.float(), part_lse.float()
                    del part, part_lse
                    continue
                merged = torch.logaddexp(running_lse, part_lse)
                acc.mul_((running_lse - merged).exp_().unsqueeze(-1))
                # In place with the 16-bit block as is: no fp32 copy of it.
                acc.addcmul_(part, (part_lse - merged).exp_().unsqueeze(-1))
                running_lse = merged
                del part, part_lse  # one block's output live at a time
            if acc is not None and running_lse is not None:
                o[:, :, rows] = acc
                lse[:, :, rows] = running_lse
                del acc, running_lse
        del key_row, value_row, k, v
        ctx.pieces = pieces
        ctx.scale = scale
        ctx.kernel_name = kernel_name
        ctx.split = split
        flat = out.view(s, b, heads * dim)
        ctx.save_for_backward(query, key, value, flat, lse)
        return flat

    @staticmethod
    def backward(ctx: Any, grad_flat: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        query, key, value, flat, lse = ctx.saved_tensors
        split: ContextParallelSplit | None = ctx.split
        kernel = _KERNELS[ctx.kernel_name]
        s, b, heads, dim = query.shape
        out = flat.view(s, b, heads, dim)
        grad = grad_flat.contiguous().view(s, b, heads, dim)
        key_row, value_row = _whole_row(key, value, split)
        # Accumulators: dq is written once per block of its own segment, dk / dv gather the
        # blocks of every segment that sees them, in fp32 for low-precision models.
        acc_dtype = torch.float32 if query.dtype in (torch.bfloat16, torch.float16) else query.dtype
        dquery = torch.zeros(query.shape, dtype=acc_dtype, device=query.device)
        dkey = torch.zeros(key_row.shape, dtype=acc_dtype, device=key.device)
        dvalue = torch.zeros(value_row.shape, dtype=acc_dtype, device=value.device)
        q, k, v, o, g = (_heads_first(t) for t in (query, key_row, value_row, out, grad))
        dq, dk, dv = (_heads_first(t) for t in (dquery, dkey, dvalue))
        for piece in ctx.pieces:
            rows, count = piece.rows, piece.count
            q_seg, o_seg, g_seg = (_segments(t, rows, count) for t in (q, o, g))
            # The whole row's statistics, contiguous [b, heads, L] as the kernels read them.
            lse_seg = _segments(lse, rows, count).contiguous()
            for span, causal in piece.blocks:
                keys = slice(span.start, span.end)
                kernel.backward_into(g_seg, q_seg, _segments(k, keys, count),
                                     _segments(v, keys, count), o_seg, lse_seg, causal,
                                     ctx.scale, _segments(dq, rows, count),
                                     _segments(dk, keys, count), _segments(dv, keys, count))
        del key_row, value_row, k, v
        if split is not None:
            # Each rank's queries saw every rank's keys: the key/value gradients are the sum.
            group = context_parallel_group()
            dkey = split.local(sum_over_ranks(dkey, group))
            dvalue = split.local(sum_over_ranks(dvalue, group))
        return (dquery.to(query.dtype), dkey.to(key.dtype), dvalue.to(value.dtype), None, None,
                None, None)


def _whole_row(key: Tensor, value: Tensor, split: ContextParallelSplit | None
               ) -> tuple[Tensor, Tensor]:
    """The keys and values of the whole row: these, or every CP rank's gathered."""
    if split is None:
        return key, value
    group = context_parallel_group()
    return all_gather_rows(key, split, group), all_gather_rows(value, split, group)


def segmented_flash_attention(
    query: Tensor, key: Tensor, value: Tensor, layout: AttentionLayout | SplitRowLayout,
    scale: float
) -> Tensor:
    """query [s, b, heads, d], key / value [s, b, groups, d] -> [s, b, heads * d].

    GQA: query head h uses key/value group h // (heads / groups), as Megatron repeats them.
    CPU and CUDA tensors (see the module docstring for the kernels). A `SplitRowLayout`:
    these are this context-parallel rank's rows of the layout's row (see context_parallel).
    """
    if query.device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"segmented flash attention runs torch's CPU or CUDA attention kernels; got "
            f"{query.device} tensors"
        )
    split = layout.split if isinstance(layout, SplitRowLayout) else None
    row = layout.layout if isinstance(layout, SplitRowLayout) else layout
    rows = split.local_tokens if split is not None else row.total_tokens
    if query.shape[0] != rows or (split is not None and split.total_tokens != row.total_tokens):
        raise ValueError(
            f"the attention layout covers {row.total_tokens} rows ({rows} on this rank) but "
            f"the query has {query.shape[0]}; pack the row and its layout together"
        )
    if query.shape[2] % key.shape[2]:
        raise ValueError(
            f"{query.shape[2]} query heads cannot share {key.shape[2]} key/value groups"
        )
    return _SegmentedFlash.apply(query, key, value, row, scale,
                                 _kernel_for(query, key, value), split)


def _megatron_module_base() -> type:
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class SegmentedFlashAttention(_megatron_module_base()):  # type: ignore[misc]
    """Drop-in for Megatron's `DotProductAttention` in the local layer spec.

    Takes the packed row's `AttentionLayout` as `packed_seq_params`; with none (a plain
    `GPTModel.forward`) the row is one causal sequence. Under context parallel it takes a
    `SplitRowLayout`: the layout and which of its rows this rank holds. A dense attention mask
    is refused: it would be the [S, S] tensor this module exists to avoid.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"segmented flash attention has no attention dropout (got {dropout}); RL "
                "scoring and training here run with attention_dropout=0"
            )
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(
                f"segmented flash attention supports the vanilla softmax only, got "
                f"{config.softmax_type!r}"
            )
        head_dim = config.kv_channels
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise ValueError("segmented flash attention takes no attention bias")
        layout: AttentionLayout | SplitRowLayout
        if self.config.context_parallel_size > 1 and not isinstance(packed_seq_params,
                                                                    SplitRowLayout):
            raise ValueError(
                f"segmented flash attention at context parallel "
                f"{self.config.context_parallel_size} needs a SplitRowLayout as "
                "packed_seq_params (which rows of the packed row this rank holds); run the model "
                "through art.trainer_rank's compute path, which splits the row"
            )
        if isinstance(packed_seq_params, (AttentionLayout, SplitRowLayout)):
            layout = packed_seq_params
        elif packed_seq_params is None and attention_mask is None:
            layout = AttentionLayout.causal_blocks([query.shape[0]])
        else:
            raise ValueError(
                "segmented flash attention takes the packed row's AttentionLayout as "
                "packed_seq_params, not a dense attention mask or THD parameters; pack with "
                "art.trainer_rank's packer for this implementation"
            )
        return segmented_flash_attention(query, key, value, layout, self.softmax_scale)
