"""Attention layer formulas: the blocks of a softmax-attention mixer and the segmented flash costs.

Norm, fused QKV projection, qk-norm and RoPE, core attention (segmented flash on the local spec,
over torch's CPU or CUDA kernels; TE's flash; or Megatron's unfused DotProductAttention with its
[heads, s, s] scores), the optional output gate and the output projection, priced as `Block`s
(see `layers.py`).
"""

from __future__ import annotations

from art.trainer_rank.pricing.layer_terms import (
    FP32,
    Block,
    BlockRole,
    Dims,
    linear_input_saved,
    lora_saved,
    lora_temp,
    norm_block,
)


def segmented_flash_costs(d: Dims, s: int, q_bytes: float, kv_bytes: float
                          ) -> tuple[float, float, float]:
    """(kept, forward transient, backward transient) of the segmented flash attention
    (art.megatron.packed_attention) on the local spec. Kept: the fp32 logsumexp per head and
    token (q, k, v and the output are the neighbouring blocks'). Forward: one block's output
    and logsumexp, plus an fp32 running output when a segment sees a prefix. Backward: dq, dk,
    dv accumulators (fp32 for 16-bit models, then cast back) and one block's gradients. A
    segment is priced as the whole row: an upper bound (it is one sequence or tree node).
    That is torch's CPU flash kernel; on CUDA the kept logsumexp is the same and the
    transients are the CUDA kernels' (`_cuda_segmented_transients`)."""
    heads = d.geometry.num_attention_heads / d.tp
    b = d.dtype_bytes
    acc = FP32 / b if b < FP32 else 1.0
    lse = float(s) * heads * FP32
    qkv_grads = q_bytes + 2 * kv_bytes
    if d.implementation.device == "cuda":
        forward, backward = _cuda_segmented_transients(d, s, q_bytes, kv_bytes, lse)
    else:
        forward = q_bytes * (1.0 + (FP32 / b)) + 2 * lse
        backward = qkv_grads * acc + qkv_grads + (qkv_grads if b < FP32 else 0.0) + lse
    return lse, *_with_context_parallel_gathers(d, kv_bytes, acc, forward, backward)


def _with_context_parallel_gathers(d: Dims, kv_bytes: float, acc: float, forward: float,
                                   backward: float) -> tuple[float, float]:
    """Under context parallel the attention gathers the whole row's keys and values (kept
    through the kernels; the second gather's per-rank parts sit beside the first's row), in
    forward and again in backward, where the key/value gradient accumulators span the
    whole row before their sum over CP."""
    cp = d.layout.context_parallel
    if cp == 1:
        return forward, backward
    kv_row = cp * kv_bytes
    forward = 2 * kv_row + max(kv_row, forward)
    backward = 2 * kv_row + max(kv_row, backward + 2 * (kv_row - kv_bytes) * acc)
    return forward, backward


# FlashAttention-2's forward splits the keys of a block with few query tiles over several
# CTAs (`set_params_splitkv` in torch's flash_api.cpp, called by `mha_fwd` with num_splits 0:
# a heuristic filling 2 CTAs per SM) and keeps fp32 partial outputs for them, [splits, b,
# heads, L, head dim rounded]. It does so only while b x heads x query tiles of 64 stay under
# 1.6 x the SMs, so splits x tiles stays below a few waves of CTAs: priced as 4 x SMs tiles
# of 64 queries, at the SM count of an H100 / H200 (132).
SPLITKV_SMS = 132


def _cuda_segmented_transients(d: Dims, s: int, q_bytes: float, kv_bytes: float, lse: float
                               ) -> tuple[float, float]:
    """(forward, backward) transients of the segmented flash attention on CUDA, per kernel
    (`Implementation.cuda_sdpa_kernel`), from what torch's kernels allocate (torch 2.11-2.13:
    flash_attn/flash_api.cpp `mha_fwd` / `mha_bwd`, attention_backward.cu
    `_efficient_attention_backward`); not measured here (no GPU). As on CPU a segment is
    priced as the whole row.

    Both: the block output and an fp32 running output (16-bit: an upcast copy; fp32: the
    first block's output itself), the block, running and merged logsumexps and one merge
    weight; backward the fp32 dq / dk / dv accumulators, the segment's logsumexp copy, the
    cast back for 16-bit models.
    flash, forward: the split-key fp32 partial outputs (see SPLITKV_SMS). Backward per block:
    dq, dk, dv in the model dtype, dq's fp32 accumulator ([b, L rounded to 128, heads, d
    rounded]), softmax_d ([b, heads, L rounded], fp32) and, with GQA, dk and dv for every
    query head before their sum over the group ([b, S, heads, d] each).
    efficient (one call per query slot of a group, heads / groups of them): forward the
    call's output and padded logsumexp, in 16-bit its fp32 output accumulator; backward the
    compact output and padded logsumexp handed to it, its contiguous grad_out, dq, dk, dv
    for the call, its fp32 delta and a workspace priced as fp32 dq / dk / dv."""
    from art.megatron.implementation import cuda_sdpa_kernel

    g, b = d.geometry, d.dtype_bytes
    acc = FP32 / b if b < FP32 else 1.0
    qkv_grads = q_bytes + 2 * kv_bytes
    heads = g.num_attention_heads / d.tp
    rep = g.num_attention_heads / g.num_query_groups
    forward = q_bytes * (1.0 + acc) + 4 * lse
    backward = qkv_grads * acc + lse + (qkv_grads if b < FP32 else 0.0)
    if cuda_sdpa_kernel(b, g.head_dim) == "flash":
        rounded = -(-g.head_dim // (32 if g.head_dim <= 128 else 64)) * (
            32 if g.head_dim <= 128 else 64)
        forward += 4 * SPLITKV_SMS * 64 * rounded * FP32
        rows = -(-s // 128) * 128
        dq_accum = rows * heads * rounded * FP32
        expanded = 2 * q_bytes if rep > 1 else 0.0
        backward += qkv_grads + dq_accum + rows * heads * FP32 + expanded
    else:
        call_q = q_bytes / rep
        call_lse = -(-s // 32) * 32 * heads / rep * FP32
        forward += (call_q if rep > 1 else 0.0) + call_lse + (call_q * acc if b < FP32 else 0.0)
        call_grads = call_q + 2 * kv_bytes
        backward += 2 * call_q + call_lse + call_grads + lse / rep + call_grads * FP32 / b
    return forward, backward


def attention_blocks(d: Dims, s: int) -> list[Block]:
    g, b, tp = d.geometry, d.dtype_bytes, d.tp
    impl = d.implementation
    heads = g.num_attention_heads / tp
    q_width = g.num_attention_heads * g.head_dim / tp
    kv_width = g.num_query_groups * g.head_dim / tp
    gate_width = q_width if g.gated_attention_output else 0.0
    qkv = float(s) * (q_width + gate_width + 2 * kv_width) * b
    te = impl.spec == "te"
    blocks = [
        norm_block(d, s, "input norm", te, linear_input_saved(d, s, "linear_qkv", True)),
        Block("qkv", None, lora_saved(d, s, "linear_qkv"), qkv, True,
              temp=(float(s) * g.hidden_size * b if d.layout.sequence_parallel else 0.0)
              + lora_temp(d, "linear_qkv", qkv),
              grad_temp=qkv + lora_temp(d, "linear_qkv", qkv) / 2, role=BlockRole.QKV),
    ]
    rope_q = float(s) * q_width * b
    rope_k = float(s) * kv_width * b
    qk_norm = 0.0
    if g.qk_layernorm:
        # Per-head norm: torch keeps fp32 rows (see the block norm), fused keeps rstd only.
        per_row = g.head_dim * FP32 if impl.norm == "torch" and not d.lora_rank else FP32
        if impl.norm == "torch" and b < FP32:
            per_row += g.head_dim * FP32  # the fp32 upcast of each head's row
        qk_norm = float(s) * (heads + g.num_query_groups / tp) * per_row
        # q comes out of the fused GQA layout [groups, (q heads, k, v)] as a copy, which the
        # q-norm keeps as its input (k is a view of the QKV buffer, kept with it); with one
        # group per rank (MQA) q is a plain view too.
        if g.num_query_groups / tp > 1:
            qk_norm += rope_q
        elif impl.gpu_shaped_cpu:
            qk_norm += rope_q  # the fused norm makes the strided view contiguous and keeps it
        if impl.gpu_shaped_cpu:
            qk_norm += rope_k  # k is a strided view of the QKV buffer: the same for k
    if impl.spec != "te" and not impl.gpu_shaped_cpu:
        # Unfused RoPE builds cos and sin of the table per call, for q and for k, and its
        # multiplies keep them: 4 x [s, rotary dim] fp32 (the fused kernel keeps the table).
        qk_norm += 4 * float(s) * g.rotary_dim * FP32
    # The rotated q and k are kept only by flash attention or a core-attention checkpoint
    # (its inputs); unfused attention keeps its own reshaped copies instead.
    rope = Block("qk-norm + rope", None, qk_norm, rope_q + rope_k, impl.attention == "flash",
                 temp=rope_q + rope_k)
    if impl.attention == "flash" and impl.spec == "local":
        core_internal, core_temp, core_grad = segmented_flash_costs(d, s, rope_q, rope_k)
    elif impl.attention == "flash":
        # Flash attention keeps q, k, v (inputs) plus the output and fp32 softmax statistics.
        core_internal = float(s) * heads * FP32
        core_temp = 0.0
        core_grad = rope_q + 2 * rope_k + float(s) * heads * FP32
    else:
        # Megatron's DotProductAttention: GQA repeats k and v to every head (new tensors),
        # scores [heads, s, s] in the model dtype, softmax probabilities (fp32 upcast on CPU
        # for low precision), all kept for the bmm backward. Masking does not shrink them.
        repeated = float(s) * q_width * b * 2 if g.num_query_groups != g.num_attention_heads else 0
        scores = heads * float(s) * float(s) * b
        probs = heads * float(s) * float(s) * max(b, FP32 if b < FP32 else b)
        # The query's contiguous copy (GQA reshape) is the first bmm's saved input.
        core_internal = repeated + probs + (scores if b < FP32 else 0.0) + rope_q
        # Plus the contiguous copies of the query (GQA reshape) and of the context (permute).
        core_temp = scores + 2 * float(s) * q_width * b
        # Backward: the probabilities' gradient, the softmax backward's output and the masked
        # fill's gradient are each [heads, s, s] fp32 at the same time.
        core_grad = 3 * heads * float(s) * float(s) * FP32
    ctx = float(s) * q_width * b
    blocks.append(rope)
    blocks.append(Block("core attention", "core_attn", core_internal, ctx, True,
                        temp=core_temp, grad_temp=core_grad))
    if g.gated_attention_output:
        blocks.append(Block("output gate", None, float(s) * q_width * b, ctx, True,
                            role=BlockRole.OUTPUT_GATE))
    proj_out = d.hidden_tokens(s) * g.hidden_size * b
    # The projection's output only feeds the residual add, which keeps nothing.
    blocks.append(Block("proj", None, lora_saved(d, s, "linear_proj"), proj_out,
                        False, temp=lora_temp(d, "linear_proj", proj_out), grad_temp=ctx))
    return blocks
