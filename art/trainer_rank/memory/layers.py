"""Per-layer pricing: what one transformer layer keeps and how high it peaks, by layer type.

A layer is a list of blocks in execution order (norm, projections, core attention or the
Gated DeltaNet core, MLP or experts). Each block states, for one micro-batch of `s` packed
tokens on this rank, the bytes of the tensors it creates:
- `internal`: storages it saves for its own backward (dropped when its module is recomputed);
- `output`: its output, and whether a later block saves it (`output_saved`);
- `temp`: transient working memory in its forward (freed before the next block);
- `grad_temp`: transient working memory in its backward beyond the incoming/outgoing grads.
Storages, not tensor sizes: V is a view of the fused QKV output, so whoever keeps V keeps the
whole QKV buffer, and that is what is priced.

From the blocks, `LayerCost` gives the numbers the chain composition in `model.py` needs:
`kept` (held until backward, the layer's input included when it saves it, its output
excluded), `forward` (peak above the state at the layer's start), `backward` (peak above the
state right before its backward, the incoming gradient included), `backward_held` (the same
with the incoming gradient referenced until the backward returns, as a full-recompute
checkpoint holds it), `output`.

These are the default coefficients: formulas from the built implementation's tensors. The
probe (`probe.py`) measures the same four numbers on the real layer and replaces them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from art.megatron.geometry import LINEAR_ATTENTION, ModelGeometry
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout

FP32 = 4
INT64 = 8
# fla's chunked gated delta rule works on chunks of 64 tokens; it keeps a [chunk x chunk]
# fp32 matrix per chunk and head and rebuilds the per-chunk recurrent states in backward.
GDN_CHUNK_TOKENS = 64


@dataclass(frozen=True)
class LayerCost:
    kept: int
    forward: int
    backward: int
    output: int
    saves_input: bool
    # The backward's peak when the incoming gradient stays referenced until the backward
    # returns, as a full-recompute checkpoint holds it (None: not measured).
    backward_held: int | None = None


@dataclass(frozen=True)
class Block:
    name: str
    module: str | None  # selective recompute module that covers it
    internal: float
    output: float
    output_saved: bool
    temp: float = 0.0
    grad_temp: float = 0.0


def layer_kind(geometry: ModelGeometry, index: int) -> str:
    base = "linear_attention" if geometry.layer_types[index] == LINEAR_ATTENTION else "attention"
    return base + ("_moe" if geometry.moe_layers[index] else "")


@dataclass(frozen=True)
class Dims:
    """Per-rank sizes for one micro-batch; `s` tokens of the packed row on this CP rank."""

    geometry: ModelGeometry
    layout: ParallelLayout
    implementation: Implementation
    dtype_bytes: int
    lora_rank: int
    lora_targets: frozenset[str]

    @property
    def tp(self) -> int:
        return self.layout.tensor_parallel

    def hidden_tokens(self, s: int) -> float:
        """Tokens of the residual stream on this rank (sequence parallel splits it over TP)."""
        return s / self.tp if self.layout.sequence_parallel else float(s)


def _norm_block(d: Dims, s: int, name: str, fused_into_next: bool, saves_out: bool) -> Block:
    g, b = d.geometry, d.dtype_bytes
    rows = d.hidden_tokens(s)
    if fused_into_next or d.implementation.norm == "fused":
        # Fused kernels keep the fp32 inverse rms per token; the input is kept by the caller.
        internal = rows * FP32
    else:
        # torch's composite rms_norm: fp32 upcast of the input (bf16/fp16 only), the squared
        # mean and rsqrt per row, and the normalised fp32 rows the weight multiply keeps when
        # the weight trains (with LoRA it is frozen and the multiply keeps nothing).
        upcast = rows * g.hidden_size * FP32 if b < FP32 else 0.0
        normalised = 0.0 if d.lora_rank else rows * g.hidden_size * FP32
        internal = upcast + rows * FP32 + normalised
    out = rows * g.hidden_size * b
    return Block(name, "layernorm", internal, out, saves_out, temp=rows * g.hidden_size * FP32)


# LoRA adapters per fused Megatron linear: one A/B pair per HF projection in it.
LORA_PROJECTIONS = {"linear_qkv": 3, "linear_fc1": 2}


def _lora_saved(d: Dims, s: float, target: str, adapters: int = 1) -> float:
    """What a LoRA adapter on `target` keeps besides its input: the rank intermediate of
    every projection ([s, projections x r], one storage the B matmuls keep whole) and, when
    the linear fuses several projections, their A weights concatenated each forward (a new
    tensor the A matmul keeps), once per adapter (`adapters`: local experts)."""
    if not d.lora_rank or target not in d.lora_targets:
        return 0.0
    projections = LORA_PROJECTIONS.get(target, 1)
    saved = float(s) * projections * d.lora_rank * d.dtype_bytes
    if projections > 1:
        saved += (adapters * projections * d.lora_rank * d.geometry.hidden_size
                  * d.dtype_bytes)
    return saved


def _lora_temp(d: Dims, target: str, output_bytes: float) -> float:
    """Transient bytes a LoRA adapter adds while its linear runs, each as big as the fused
    output: the per-projection deltas, their concatenation in the fused layout, the scaled
    copy (the sum with the base output is the output itself)."""
    if not d.lora_rank or target not in d.lora_targets:
        return 0.0
    return 3 * output_bytes


def _linear_input_saved(d: Dims, s: int, target: str, column: bool) -> bool:
    """The frozen base linear keeps nothing (Megatron's frozen-weight path saves only the
    weight); a LoRA adapter on it keeps the input."""
    return bool(d.lora_rank) and target in d.lora_targets


def _stand_in_swiglu_grad_temp(d: Dims, tokens: float, ffn: int) -> float:
    """The GPU-shaped CPU build's SwiGLU stand-in (art/megatron/cpu_fused.py) computes its
    backward in row chunks with five chunk-sized temporaries live at once (sigmoid, silu,
    g * up, 1 - sigmoid, silu * (1 - sigmoid)); a fused GPU kernel has none."""
    if not d.implementation.gpu_shaped_cpu:
        return 0.0
    from art.megatron.cpu_fused import CHUNK_ROWS

    return 5 * min(tokens, CHUNK_ROWS) * ffn / d.tp * d.dtype_bytes


def _mlp_blocks(d: Dims, s: int, ffn: int, tokens: float, tag: str,
                lora_tokens: float | None = None, adapters: int = 1) -> list[Block]:
    """fc1 (gate+up), SwiGLU, fc2 for `tokens` routed tokens (s for a dense MLP); routed
    experts: their LoRA adapters see `lora_tokens` rows over `adapters` local experts."""
    g, b, tp = d.geometry, d.dtype_bytes, d.tp
    fc1_out = tokens * 2 * ffn * b / tp
    act_out = tokens * ffn * b / tp
    fc2_in_saved = _linear_input_saved(d, s, "linear_fc2", column=False)
    if d.implementation.swiglu_fused:
        act_internal = 0.0  # the fused kernel keeps its input (fc1's output, saved below)
    else:
        # silu(x1) * x2: x1, x2 are views of fc1's output (kept whole); silu(x1) and one more
        # activation-sized storage are kept besides (measured with saved-tensor hooks).
        act_internal = 2 * act_out
    rows = float(s) if lora_tokens is None else lora_tokens
    return [
        Block(f"{tag}fc1", "mlp", _lora_saved(d, rows, "linear_fc1", adapters), fc1_out, True,
              temp=_lora_temp(d, "linear_fc1", fc1_out),
              # Backward: the adapter's scaled copy of the incoming gradient.
              grad_temp=_lora_temp(d, "linear_fc1", fc1_out) / 3),
        # Backward: the gradient of its input (fc1's output). The torch path never holds
        # more: its peak is the gradient of x2 and the product for silu's backward (two
        # activation-sized tensors), and by the time both halves are concatenated its saved
        # tensors and the incoming gradient are freed.
        Block(f"{tag}swiglu", "mlp", act_internal, act_out, fc2_in_saved,
              temp=act_out,
              grad_temp=fc1_out + _stand_in_swiglu_grad_temp(d, tokens, ffn)),
        Block(f"{tag}fc2", "mlp", _lora_saved(d, rows, "linear_fc2", adapters),
              d.hidden_tokens(s) * g.hidden_size * b, False,
              temp=(float(s) * g.hidden_size * b if d.layout.sequence_parallel else 0.0)
              + _lora_temp(d, "linear_fc2", d.hidden_tokens(s) * g.hidden_size * b),
              grad_temp=act_out),
    ]


def moe_dispatcher_state(d: Dims, s: int) -> float:
    """What a MoE layer's token dispatcher keeps referenced after the layer returns, until
    its next call: the routing probabilities (fp32) and map (bool) [s, experts], the
    permutation's token indices (int64, one per routed pair) and the tokens per expert."""
    g = d.geometry
    return (float(s) * g.num_experts * (FP32 + 1) + float(s) * g.moe_router_topk * INT64
            + g.num_experts * INT64)


def _moe_blocks(d: Dims, s: int, worst_case: bool) -> list[Block]:
    g, b = d.geometry, d.dtype_bytes
    ep = d.layout.expert_parallel
    local_experts = max(1, g.num_experts // ep)
    routed = float(s) * g.moe_router_topk  # token-expert pairs over all experts
    # Balanced routing spreads the pairs evenly; the worst case sends every token to this
    # rank's experts (capped at top-k per token, i.e. all tokens hit min(topk, local) experts).
    if worst_case:
        local_pairs = float(s) * min(g.moe_router_topk, local_experts)
    else:
        local_pairs = routed / ep
    # Logits and scores [s, experts] fp32, the top-k indices (int64) besides the top-k
    # probabilities (its output); the routing map [s, experts] (bool) and the permutation's
    # token indices (int64 per routed pair) the dispatcher keeps for the un-permute.
    router = Block("router", None,
                   float(s) * g.num_experts * (FP32 * 2 + 1) + float(s) * g.moe_router_topk
                   * INT64 + routed * INT64,
                   float(s) * g.moe_router_topk * FP32, True)
    dispatch = Block("dispatch", "moe", 0.0, local_pairs * g.hidden_size * b, True,
                     temp=local_pairs * g.hidden_size * b)
    # `moe` recompute checkpoints the whole MoE layer (router to combine, shared experts
    # included); `moe_act` the experts' activation; `shared_experts` the shared experts.
    experts = [replace(blk, module="moe_act" if blk.name.endswith("swiglu") else "moe")
               for blk in _mlp_blocks(d, s, g.moe_ffn_hidden_size, local_pairs, "expert ",
                                      lora_tokens=local_pairs, adapters=local_experts)]
    # The routing probabilities multiply the activation before fc2 (one fp32 per pair): the
    # multiply keeps the activation and the probabilities, fc2 keeps the product.
    act_out = local_pairs * g.moe_ffn_hidden_size * b
    experts[1] = replace(experts[1], internal=experts[1].internal + act_out
                         + local_pairs * FP32)
    blocks = [replace(router, module="moe"), dispatch, *experts]
    blocks.append(Block("combine", "moe", 0.0, d.hidden_tokens(s) * g.hidden_size * b, False,
                        temp=local_pairs * g.hidden_size * b))
    if g.shared_expert_ffn_hidden_size:
        blocks += [replace(blk, module="shared_experts")
                   for blk in _mlp_blocks(d, s, g.shared_expert_ffn_hidden_size, float(s),
                                          "shared ")]
    return blocks


def _segmented_flash_costs(d: Dims, s: int, q_bytes: float, kv_bytes: float
                           ) -> tuple[float, float, float]:
    """(kept, forward transient, backward transient) of the segmented flash attention
    (art.megatron.packed_attention) on the local spec. Kept: the fp32 logsumexp per head and
    token (q, k, v and the output are the neighbouring blocks'). Forward: one block's output
    and logsumexp, plus an fp32 running output when a segment sees a prefix. Backward: dq, dk,
    dv accumulators (fp32 for 16-bit models, then cast back) and one block's gradients. A
    segment is priced as the whole row: an upper bound (it is one sequence or tree node)."""
    heads = d.geometry.num_attention_heads / d.tp
    b = d.dtype_bytes
    acc = FP32 / b if b < FP32 else 1.0
    lse = float(s) * heads * FP32
    qkv_grads = q_bytes + 2 * kv_bytes
    forward = q_bytes * (1.0 + (FP32 / b)) + 2 * lse
    backward = qkv_grads * acc + qkv_grads + (qkv_grads if b < FP32 else 0.0) + lse
    return lse, forward, backward


def _attention_blocks(d: Dims, s: int) -> list[Block]:
    g, b, tp = d.geometry, d.dtype_bytes, d.tp
    impl = d.implementation
    heads = g.num_attention_heads / tp
    q_width = g.num_attention_heads * g.head_dim / tp
    kv_width = g.num_query_groups * g.head_dim / tp
    gate_width = q_width if g.gated_attention_output else 0.0
    qkv = float(s) * (q_width + gate_width + 2 * kv_width) * b
    te = impl.spec == "te"
    blocks = [
        _norm_block(d, s, "input norm", te, _linear_input_saved(d, s, "linear_qkv", True)),
        Block("qkv", None, _lora_saved(d, s, "linear_qkv"), qkv, True,
              temp=(float(s) * g.hidden_size * b if d.layout.sequence_parallel else 0.0)
              + _lora_temp(d, "linear_qkv", qkv),
              grad_temp=qkv + _lora_temp(d, "linear_qkv", qkv) / 2),
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
        qk_norm += 4 * float(s) * g.head_dim * FP32
    # The rotated q and k are kept only by flash attention or a core-attention checkpoint
    # (its inputs); unfused attention keeps its own reshaped copies instead.
    rope = Block("qk-norm + rope", None, qk_norm, rope_q + rope_k, impl.attention == "flash",
                 temp=rope_q + rope_k)
    if impl.attention == "flash" and impl.spec == "local":
        core_internal, core_temp, core_grad = _segmented_flash_costs(d, s, rope_q, rope_k)
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
        blocks.append(Block("output gate", None, float(s) * q_width * b, ctx, True))
    proj_out = d.hidden_tokens(s) * g.hidden_size * b
    # The projection's output only feeds the residual add, which keeps nothing.
    blocks.append(Block("proj", None, _lora_saved(d, s, "linear_proj"), proj_out,
                        False, temp=_lora_temp(d, "linear_proj", proj_out), grad_temp=ctx))
    return blocks


def _linear_attention_blocks(d: Dims, s: int, padded: int | None = None) -> list[Block]:
    """Gated DeltaNet as Megatron-Core 0.16.1 runs it (ssm/gated_delta_net.py) with the local
    spec (`art/megatron/specs`), its linears frozen (LoRA never targets them), and fla's
    kernels or their CPU counterparts (`cpu_gated_delta`), which keep fla-core 0.6's set.
    Block names are the ones `scripts/gdn_blocks.py` measures under. No s^2 term. `padded`:
    the row's tokens with each sequence padded to whole 64-token chunks (None: one sequence),
    what the delta rule's per-chunk working set grows with."""
    g, b, tp = d.geometry, d.dtype_bytes, d.tp
    la = g.linear_attention
    if la is None:
        raise ValueError(f"{g.name}: linear-attention layer without linear_attention dims")
    key = la.num_key_heads * la.key_head_dim / tp
    value = la.num_value_heads * la.value_head_dim / tp
    kheads, vheads = la.num_key_heads / tp, la.num_value_heads / tp
    repeated = la.num_value_heads > la.num_key_heads
    rows, hidden_rows = float(s), d.hidden_tokens(s)
    chunked = float(padded if padded is not None
                    else -(-s // GDN_CHUNK_TOKENS) * GDN_CHUNK_TOKENS)
    te = d.implementation.spec == "te"
    in_proj = rows * (2 * key + 2 * value + 2 * vheads) * b  # q, k, v, z (gate), beta, a
    conv = rows * (2 * key + value) * b
    out = rows * value * b
    # The input norm sits in in_proj with a frozen weight: a fused kernel keeps the fp32 rstd
    # (the input is the layer input); torch's composite keeps the fp32 upcast (the input
    # itself in fp32, counted as the layer input) and the rstd.
    norm = hidden_rows * FP32
    if not te and d.implementation.norm == "torch" and b < FP32:
        norm += hidden_rows * g.hidden_size * FP32
    # fla's chunked rule keeps the chunk-local cumulated decay (fp32) and the WY inverse A
    # ([tokens, heads, 64] in k's dtype); q, k, v and beta are the blocks' outputs above.
    delta_kept = rows * vheads * (FP32 + GDN_CHUNK_TOKENS * b)
    dk, dv = la.key_head_dim, la.value_head_dim
    if d.implementation.device == "cuda":
        # fla's kernels: the fp32 chunk matrix before its inverse, w and u (k's dtype), the
        # per-chunk states h and v_new; backward rebuilds them and adds dh (fp32) and the
        # fp32 gradients of q, k, v, w. From fla-core 0.6's chunk_gated_delta_rule_fwd/bwd
        # allocations; not measured here (no GPU).
        states = chunked / GDN_CHUNK_TOKENS * vheads * dk * dv
        delta_work = rows * vheads * ((dk + 2 * dv) * b + GDN_CHUNK_TOKENS * FP32) + states * b
        delta_grad = 2 * delta_work + states * FP32 + rows * vheads * (3 * dk + dv) * FP32
    else:
        # CPU kernels (cpu_gated_delta): forward peaks in `_outputs` masking the decay: fp32
        # padded chunk copies of q, k, v, A, w, u, q k^T, the decay's difference, fill and
        # masked result, g, beta; the identity and causal mask. Backward rebuilds q, k, v, w,
        # u, the chunk matrix and its inverse under autograd with their gradients.
        c = GDN_CHUNK_TOKENS
        delta_work = (chunked * vheads * (3 * dk + 2 * dv + 5 * c + 2) * FP32
                      + c * c * (FP32 + 1))
        delta_grad = 3 * chunked * vheads * (dk * 3 + dv * 3 + 2 * c) * FP32
    return [
        Block("input norm + in_proj", None, norm, in_proj, False,
              temp=rows * g.hidden_size * b if d.layout.sequence_parallel else 0.0,
              grad_temp=in_proj),
        # The convolution's input: q, k, v transposed to [channels, tokens] (a copy).
        Block("split, qkv transpose copy", None, 0.0, conv, True),
        # silu keeps the convolution's output ([channels, tokens + kernel - 1]).
        Block("causal conv1d + silu", None, (rows + la.conv_kernel_size - 1) / rows * conv,
              conv, False, grad_temp=2 * conv),
        # l2norm keeps its outputs (q, k per key head) and one fp32 rstd per key head.
        Block("q/k l2norm", None, rows * 2 * key * b + rows * 2 * kheads * FP32,
              rows * 2 * key * b, False, temp=rows * 2 * key * b),
        # q, k repeated to the value heads (new tensors, kept by the rule); v and the output
        # gate made contiguous (kept by the rule and by the gated norm); beta = sigmoid (kept)
        # and the fp32 softplus input of the decay.
        Block("q/k repeat, gates (g, beta)", None,
              (rows * 2 * value * b if repeated else 0.0) + 2 * out
              + rows * vheads * (b + FP32), 0.0, False),
        Block("gated delta rule", None, delta_kept, out, True, temp=delta_work,
              grad_temp=delta_grad),
        # Gated RMSNorm over each value head: the (compiled / fused) kernel keeps its inputs
        # (rule output, gate: kept above) and one fp32 rstd per value head; its output is
        # transposed into a copy for out_proj, which is frozen and keeps nothing.
        Block("gated output norm", None, rows * vheads * FP32, out, False, temp=out,
              grad_temp=2 * out),
        Block("out_proj", None, _lora_saved(d, s, "out_proj"),
              hidden_rows * g.hidden_size * b, False, grad_temp=out),
    ]


def conv_sequence_padding_bytes(d: Dims, kind: str, sequences: int) -> float:
    """A Gated DeltaNet layer on CPU convolves a packed row with each sequence's own causal
    left padding (`SegmentedCausalConv1d`): its saved input grows by kernel-1 columns of every
    conv channel per sequence. Probe and formulas price one sequence; this is the rest."""
    la = d.geometry.linear_attention
    if (sequences <= 1 or la is None or not kind.startswith("linear_attention")
            or d.implementation.device == "cuda"):
        return 0.0
    channels = (2 * la.num_key_heads * la.key_head_dim
                + la.num_value_heads * la.value_head_dim) / d.tp
    return float((sequences - 1) * (la.conv_kernel_size - 1) * channels * d.dtype_bytes)


def keeps_layer_input(d: Dims, kind: str) -> bool:
    """Whether a layer keeps its input for backward. A Gated DeltaNet layer's frozen input norm
    with torch's composite kernel in bf16/fp16 keeps its fp32 upcast instead."""
    if not kind.startswith("linear"):
        return True
    te = d.implementation.spec == "te"
    return te or d.implementation.norm != "torch" or d.dtype_bytes >= FP32


def layer_blocks(d: Dims, kind: str, s: int, worst_case_routing: bool = False,
                 padded: int | None = None) -> list[Block]:
    g, b = d.geometry, d.dtype_bytes
    te = d.implementation.spec == "te"
    mixer = (_linear_attention_blocks(d, s, padded) if kind.startswith("linear")
             else _attention_blocks(d, s))
    # The residual add after the mixer makes a new hidden tensor, which the pre-MLP norm keeps
    # when fused (or torch's in fp32, whose upcast is the tensor itself); torch's composite in
    # bf16/fp16 keeps its fp32 upcast instead (in the norm's block) and the add keeps nothing.
    fused_norm = te and not kind.endswith("_moe")
    residual = Block("residual add", None, 0.0, d.hidden_tokens(s) * g.hidden_size * b,
                     fused_norm or d.implementation.norm != "torch" or b >= FP32)
    mlp_norm = _norm_block(d, s, "pre-MLP norm", fused_norm,
                           _linear_input_saved(d, s, "linear_fc1", True) or kind.endswith("_moe"))
    if kind.endswith("_moe"):
        mlp = _moe_blocks(d, s, worst_case_routing)
    else:
        mlp = _mlp_blocks(d, s, g.ffn_hidden_size, float(s), "")
    return [*mixer, residual, mlp_norm, *mlp]


def kept_parts(blocks: list[Block], modules: frozenset[str]) -> list[float]:
    """Bytes each block keeps for backward under the selective `modules` (the layer input,
    kept by the input norm, is not among them; the last block's output is the layer's)."""
    segments = _checkpoint_segments(blocks, modules)
    kept_parts: list[float] = []
    for idx, blk in enumerate(blocks):
        seg = segments[idx]
        without_output = seg is not None and blk.module == "layernorm"
        if seg is not None and not without_output:
            # Inside an ordinary checkpoint nothing is kept: only the segment's output
            # survives, when a block after the segment saves it.
            last = idx + 1 == len(blocks) or segments[idx + 1] != seg
            part = blk.output if last and blk.output_saved else 0.0
        else:
            part = 0.0 if seg is not None else blk.internal
            starts_checkpoint = (idx + 1 < len(blocks) and segments[idx + 1] is not None
                                 and segments[idx + 1] != seg
                                 and blocks[idx + 1].module != "layernorm")
            # The checkpoint keeps its input; a norm recomputed without output frees it.
            if (blk.output_saved or starts_checkpoint) and not without_output:
                part += blk.output
        kept_parts.append(part)
    # The final block's output is the layer output, excluded from kept.
    kept_parts[-1] -= 0.0 if not blocks[-1].output_saved else blocks[-1].output
    return kept_parts


def price_layer(d: Dims, kind: str, modules: frozenset[str], s: int, *, grad: bool,
                worst_case_routing: bool = False, padded: int | None = None) -> LayerCost:
    """Default LayerCost of one layer running with the selective `modules` (empty: none);
    `padded` as in `_linear_attention_blocks`."""
    g, b = d.geometry, d.dtype_bytes
    blocks = layer_blocks(d, kind, s, worst_case_routing, padded)
    x = d.hidden_tokens(s) * g.hidden_size * b
    if not grad:
        # Nothing is saved: the peak is the residual stream (held for the add), the previous
        # block's output, the largest block's output plus its working set; core attention
        # also keeps the fused QKV buffer alive (V is a view of it). A gated attention's
        # gate is a contiguous copy out of the QKV buffer (Megatron reshapes the strided
        # split), live from the split until the output gate multiplies it in.
        # A Gated DeltaNet's rule runs on views of in_proj's and the conv's outputs (held by
        # the layer's frame) and on the repeated q, k, contiguous v, gate and decay inputs.
        gate = sum(blk.internal for blk in blocks if blk.name == "output gate")
        rule_inputs = sum(blk.output for blk in blocks
                          if blk.name in ("input norm + in_proj", "causal conv1d + silu"))
        rule_inputs += sum(blk.internal for blk in blocks
                           if blk.name == "q/k repeat, gates (g, beta)")
        peak = 0.0
        prev = x
        qkv = 0.0
        gate_live = 0.0
        for blk in blocks:
            if blk.name == "output gate":
                gate_live = 0.0
            extra = (qkv if blk.module == "core_attn" else 0.0) + gate_live
            if blk.name == "gated delta rule":
                extra += rule_inputs
            peak = max(peak, x + prev + blk.output + blk.temp + blk.internal + extra)
            prev = blk.output
            if blk.name == "qkv":
                qkv, gate_live = blk.output, gate
        kept = moe_dispatcher_state(d, s) if kind.endswith("_moe") else 0.0
        return LayerCost(int(kept), int(peak), 0, int(x), False)

    # Megatron's `moe` checkpoint wraps the whole MoE layer, its activation and shared
    # experts included.
    if "moe" in modules:
        modules = modules | {"moe_act", "shared_experts"}
    segments = _checkpoint_segments(blocks, modules)
    parts = kept_parts(blocks, modules)
    saves_input = keeps_layer_input(d, kind)
    kept = (x if saves_input else 0.0) + sum(parts)  # the input norm keeps the layer input

    # Forward: kept so far + this block's full working set (recomputed blocks still run).
    peak_f = 0.0
    so_far = 0.0
    for idx, (blk, part) in enumerate(zip(blocks, parts)):
        live = (so_far + blk.internal + blk.output + blk.temp
                + _norm_rebuilt_for(blocks, segments, idx, backward=False))
        peak_f = max(peak_f, live)
        so_far += part

    # Backward, blocks in reverse: kept up to here + what the checkpoint rebuilt for this
    # block's segment (every block of the segment up to this one, as if not recomputed) +
    # incoming grad, the residual-stream grad, the grad of its input, its grad temporaries.
    peak_b = 0.0
    own_input = x if saves_input else 0.0
    remaining = kept - own_input
    for idx in reversed(range(len(blocks))):
        blk, part, seg = blocks[idx], parts[idx], segments[idx]
        rebuilt = _norm_rebuilt_for(blocks, segments, idx)
        if seg is not None:
            for j in range(idx, -1, -1):
                if segments[j] != seg:
                    break
                rebuilt += blocks[j].internal + blocks[j].output
        grads = 2 * x + blk.output + blk.grad_temp
        # The block's output, kept by the block after it, was freed when that block's
        # backward ran (before this one's): only its internal storages are still held.
        held = remaining - (blk.output if blk.output_saved and part >= blk.output else 0.0)
        peak_b = max(peak_b, held + own_input + rebuilt + grads)
        if seg is not None and (idx + 1 == len(blocks) or segments[idx + 1] != seg):
            # The checkpoint re-runs its segment's forward here, with the incoming gradients
            # live: each rebuilt block's forward working set sits on the ones rebuilt before.
            start = idx
            while start > 0 and segments[start - 1] == seg:
                start -= 1
            before = _norm_rebuilt_for(blocks, segments, idx)
            for j in range(start, idx + 1):
                peak_b = max(peak_b, held + own_input + 2 * x + before + blocks[j].internal
                             + blocks[j].output + blocks[j].temp)
                before += blocks[j].internal + blocks[j].output
        remaining -= part
    backward = int(max(peak_b - kept, 0.0))
    # Every block's backward above keeps a residual-stream gradient live besides its input's
    # (the `2 * x`): the layer's incoming gradient is priced as held to the end already.
    return LayerCost(int(kept), int(peak_f), backward, int(x), saves_input,
                     backward_held=backward)


def _norm_rebuilt_for(blocks: list[Block], segments: list[int | None], idx: int, *,
                      backward: bool = True) -> float:
    """What recomputed norms hold while block `idx` runs, for every block between the norm
    and the next residual add. Forward: the norm's output, which Megatron discards only once
    the attention / MLP has run (`CheckpointWithoutOutput.discard_output_and_register_recompute`).
    Backward: the norm re-runs as soon as the gradient of the attention's / MLP's output
    arrives (`CheckpointWithoutOutput._recompute`); the discarded storage is restored (the
    next linear's saved input) and the re-run's own output and saved statistics stay
    referenced until the norm's backward: two outputs and the norm's internals."""
    held = 0.0
    for j in range(idx - 1, -1, -1):
        if blocks[j].name == "residual add":
            break
        if blocks[j].module == "layernorm" and segments[j] is not None:
            held += (blocks[j].internal + 2 * blocks[j].output if backward
                     else blocks[j].output)
    return held


def _checkpoint_segments(blocks: list[Block], modules: frozenset[str]) -> list[int | None]:
    """For each block, the id of the recompute checkpoint covering it (None: not recomputed).
    Consecutive blocks of one recomputed module form one checkpoint."""
    out: list[int | None] = []
    seg = 0
    for idx, blk in enumerate(blocks):
        if blk.module is None or blk.module not in modules:
            out.append(None)
            continue
        if idx == 0 or blocks[idx - 1].module != blk.module or out[-1] is None:
            seg += 1
        out.append(seg)
    return out
