"""Core attention over a packed row that keeps what flash attention keeps: output + logsumexp.

Each query segment of the `AttentionLayout` is computed block by block: against its own rows
(causal) and against every context span (the shared prefix it sees, in full). Every block is one
call of torch's CPU flash kernel, which returns the block's output and its logsumexp; blocks are
merged by their logsumexps. Backward calls the kernel's backward per block with the merged
output and logsumexp, which gives each block's exact share of dq, dk and dv (the softmax
statistics are the whole row's). So no [S, S] mask, score or probability tensor ever exists:
saved for backward are q, k, v (the layer's own tensors), the output and one fp32 logsumexp
per head and token. Sibling segments never meet, and a prefix is computed once for all of them.

On GPU the Transformer Engine spec's attention (THD, per-sequence causal) is what runs; this
module refuses CUDA tensors rather than pretend: a tree layout is packed only for a model built
with this module (see `Implementation.attention_takes_tree`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from art.megatron.attention_layout import AttentionLayout, AttentionSegment, KeySpan

_FLASH_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _blocks(segment: AttentionSegment) -> list[tuple[KeySpan, bool]]:
    """(key span, causal) for every block the segment's queries see."""
    return [(span, False) for span in segment.context] + [
        (KeySpan(segment.start, segment.length), True)
    ]


def _heads_first(x: Tensor) -> Tensor:
    """[s, b, h, d] -> [b, h, s, d] (a view: the kernel takes strided inputs)."""
    return x.permute(1, 2, 0, 3)


class _SegmentedFlash(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, query: Tensor, key: Tensor, value: Tensor, layout: AttentionLayout, scale: float
    ) -> Tensor:
        s, b, heads, dim = query.shape
        # Output in Megatron's [s, b, heads * dim] order; the kernel view writes into it, and
        # the same storage is what backward reads, so the output exists once.
        out = query.new_empty(s, b, heads, dim)
        lse = torch.empty(b, heads, s, dtype=torch.float32, device=query.device)
        q, k, v, o = (_heads_first(t) for t in (query, key, value, out))
        for segment in layout.segments:
            rows = slice(segment.start, segment.end)
            q_seg = q[:, :, rows]
            blocks = _blocks(segment)
            acc: Tensor | None = None  # fp32 running output, merged block by block
            running_lse: Tensor | None = None
            for span, causal in blocks:
                keys = slice(span.start, span.end)
                part, part_lse = _FLASH_FWD(q_seg, k[:, :, keys], v[:, :, keys], 0.0, causal,
                                            scale=scale)
                if len(blocks) == 1:
                    o[:, :, rows] = part
                    lse[:, :, rows] = part_lse
                    del part, part_lse
                    break
                if acc is None or running_lse is None:
                    acc, running_lse = part.float(), part_lse
                    continue
                merged = torch.logaddexp(running_lse, part_lse)
                acc.mul_((running_lse - merged).exp_().unsqueeze(-1))
                acc.addcmul_(part.float(), (part_lse - merged).exp_().unsqueeze(-1))
                running_lse = merged
                del part, part_lse  # one block's output live at a time
            if acc is not None and running_lse is not None:
                o[:, :, rows] = acc
                lse[:, :, rows] = running_lse
        ctx.layout = layout
        ctx.scale = scale
        flat = out.view(s, b, heads * dim)
        ctx.save_for_backward(query, key, value, flat, lse)
        return flat

    @staticmethod
    def backward(ctx: Any, grad_flat: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        query, key, value, flat, lse = ctx.saved_tensors
        layout: AttentionLayout = ctx.layout
        s, b, heads, dim = query.shape
        out = flat.view(s, b, heads, dim)
        grad = grad_flat.contiguous().view(s, b, heads, dim)
        # Accumulators: dq is written once per block of its own segment, dk / dv gather the
        # blocks of every segment that sees them, in fp32 for low-precision models.
        acc_dtype = torch.float32 if query.dtype in (torch.bfloat16, torch.float16) else query.dtype
        dquery = torch.zeros(query.shape, dtype=acc_dtype, device=query.device)
        dkey = torch.zeros(key.shape, dtype=acc_dtype, device=key.device)
        dvalue = torch.zeros(value.shape, dtype=acc_dtype, device=value.device)
        q, k, v, o, g = (_heads_first(t) for t in (query, key, value, out, grad))
        dq, dk, dv = (_heads_first(t) for t in (dquery, dkey, dvalue))
        for segment in layout.segments:
            rows = slice(segment.start, segment.end)
            q_seg, o_seg, g_seg = q[:, :, rows], o[:, :, rows], g[:, :, rows]
            lse_seg = lse[:, :, rows].contiguous()
            for span, causal in _blocks(segment):
                keys = slice(span.start, span.end)
                dq_block, dk_block, dv_block = _FLASH_BWD(
                    g_seg, q_seg, k[:, :, keys], v[:, :, keys], o_seg, lse_seg, 0.0, causal,
                    scale=ctx.scale,
                )
                dq[:, :, rows] += dq_block
                dk[:, :, keys] += dk_block
                dv[:, :, keys] += dv_block
        return (dquery.to(query.dtype), dkey.to(key.dtype), dvalue.to(value.dtype), None, None)


def segmented_flash_attention(
    query: Tensor, key: Tensor, value: Tensor, layout: AttentionLayout, scale: float
) -> Tensor:
    """query [s, b, heads, d], key / value [s, b, groups, d] -> [s, b, heads * d].

    GQA: query head h uses key/value group h // (heads / groups), as Megatron repeats them.
    """
    if query.device.type != "cpu":
        raise ValueError(
            f"segmented flash attention runs torch's CPU flash kernels; got {query.device} "
            "tensors. On GPU build the Transformer Engine spec (THD attention)"
        )
    if query.shape[0] != layout.total_tokens:
        raise ValueError(
            f"the attention layout covers {layout.total_tokens} rows but the query has "
            f"{query.shape[0]}; pack the row and its layout together"
        )
    if query.shape[2] % key.shape[2]:
        raise ValueError(
            f"{query.shape[2]} query heads cannot share {key.shape[2]} key/value groups"
        )
    return _SegmentedFlash.apply(query, key, value, layout, scale)


def _megatron_module_base() -> type:
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class SegmentedFlashAttention(_megatron_module_base()):  # type: ignore[misc]
    """Drop-in for Megatron's `DotProductAttention` in the local layer spec.

    Takes the packed row's `AttentionLayout` as `packed_seq_params`; with none (a plain
    `GPTModel.forward`) the row is one causal sequence. A dense attention mask is refused: it
    would be the [S, S] tensor this module exists to avoid.
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
        if config.context_parallel_size != 1:
            raise ValueError(
                f"segmented flash attention does not split rows over context-parallel ranks "
                f"(context parallel {config.context_parallel_size}); set "
                "ART_MEGATRON_CONTEXT_PARALLEL_SIZE=1"
            )
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
        if isinstance(packed_seq_params, AttentionLayout):
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
