"""Gated DeltaNet layer formulas: the blocks of a linear-attention mixer, its conv padding.

The input norm inside in_proj, the causal convolution, q/k l2norm, the gated delta rule (fla's
chunked kernels on GPU, their CPU counterparts otherwise) and the gated output norm, priced as
`Block`s (see `layers.py`).
"""

from __future__ import annotations

from art.trainer_rank.pricing.layer_terms import (
    FP32,
    Block,
    BlockRole,
    Dims,
    PricedKind,
    lora_saved,
)

# fla's chunked gated delta rule works on chunks of 64 tokens; it keeps a [chunk x chunk]
# fp32 matrix per chunk and head and rebuilds the per-chunk recurrent states in backward.
GDN_CHUNK_TOKENS = 64


def linear_attention_blocks(d: Dims, s: int, padded: int | None = None,
                            rule_calls: tuple[tuple[int, ...], ...] | None = None,
                            segments: int = 1) -> list[Block]:
    """Gated DeltaNet as Megatron-Core 0.16.1 runs it (ssm/gated_delta_net.py) with the local
    spec (`art/megatron/specs`), its linears frozen (LoRA never targets them), and fla's
    kernels or their CPU counterparts (`cpu_gated_delta`), which keep fla-core 0.6's set.
    Block names are the ones `scripts/gdn_blocks.py` measures under. No s^2 term. `padded`:
    the row's tokens with each sequence padded to whole 64-token chunks (None: one sequence),
    what the delta rule's per-chunk working set grows with; `segments`: how many segments
    (sequences, the row's padded tail) the rule's one call over the row runs, which decides
    what its backward holds at the row's tokens (`cpu_rule_backward_work`). `rule_calls`: a
    row of prefix trees, whose rule runs one call per depth (each call's segment lengths): its
    working sets are the largest call's, and without grad what it holds at once is one call's
    (`tree_rule_no_grad_bytes`)."""
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
    dk = la.key_head_dim
    delta_work, delta_grad = rule_work(d, rows, chunked, segments=segments)
    no_grad_work = None
    if rule_calls is not None:
        no_grad_work = tree_rule_no_grad_bytes(d, rule_calls)
        per_call = [rule_work(d, float(sum(call)), float(padded_chunk_tokens(call)),
                              segments=len(call))
                    for call in rule_calls]
        delta_work = max(w for w, _ in per_call)
        # Backward runs the calls last first; each call's input gradients stay until the
        # split's backward concatenates all of them, when they and the concatenation exist.
        # A call that started from its parents' states also returns their gradient (fp32),
        # which flows on to the call above through the stacked copy. A call that handed its
        # final states to the depth below gets their gradient back (one per segment of the
        # call), and the CPU rule rebuilds those final states beside it.
        grads_per_token = vheads * (2 * dk * b + la.value_head_dim * b + FP32 + b)
        state = vheads * dk * la.value_head_dim * FP32
        finals_held = 1 if d.implementation.delta_rule == "fla" else 2
        last = len(rule_calls) - 1
        delta_grad = max(
            max(g + grads_per_token * sum(sum(later) for later in rule_calls[index + 1:])
                + (2 * len(rule_calls[index]) * state if index else 0.0)
                + (finals_held * len(rule_calls[index]) * state if index < last else 0.0)
                for index, (_, g) in enumerate(per_call)),
            2 * grads_per_token * rows)
    return [
        Block("input norm + in_proj", None, norm, in_proj, False,
              temp=rows * g.hidden_size * b if d.layout.sequence_parallel else 0.0,
              grad_temp=in_proj, role=BlockRole.RULE_INPUT),
        # The convolution's input: q, k, v transposed to [channels, tokens] (a copy).
        Block("split, qkv transpose copy", None, 0.0, conv, True),
        # silu keeps the convolution's output ([channels, tokens + kernel - 1]).
        Block("causal conv1d + silu", None, (rows + la.conv_kernel_size - 1) / rows * conv,
              conv, False, grad_temp=2 * conv, role=BlockRole.RULE_INPUT),
        # l2norm keeps its outputs (q, k per key head) and one fp32 rstd per key head.
        Block("q/k l2norm", None, rows * 2 * key * b + rows * 2 * kheads * FP32,
              rows * 2 * key * b, False, temp=rows * 2 * key * b),
        # q, k repeated to the value heads (new tensors, kept by the rule); v and the output
        # gate made contiguous (kept by the rule and by the gated norm); beta = sigmoid (kept)
        # and the fp32 softplus input of the decay, and -exp(A_log) (one fp32 per head) that
        # scales it. Held by the layer's frame, not kept: the contiguous alpha and the fp32
        # decay g (the rule keeps its own chunk-local copy).
        Block("q/k repeat, gates (g, beta)", None,
              (rows * 2 * vheads * dk * b if repeated else 0.0) + 2 * out
              + rows * vheads * (b + FP32) + vheads * FP32, 0.0, False,
              temp=rows * vheads * (b + FP32),
              role=BlockRole.RULE_INPUT_COPIES),
        Block("gated delta rule", None, delta_kept, out, True, temp=delta_work,
              grad_temp=delta_grad, role=BlockRole.DELTA_RULE, no_grad_work=no_grad_work),
        # Gated RMSNorm over each value head: the (compiled / fused) kernel keeps its inputs
        # (rule output, gate: kept above) and one fp32 rstd per value head; its output is
        # transposed into a copy for out_proj, which is frozen and keeps nothing.
        Block("gated output norm", None, rows * vheads * FP32, out, False, temp=out,
              grad_temp=2 * out),
        Block("out_proj", None, lora_saved(d, s, "out_proj"),
              hidden_rows * g.hidden_size * b, False, grad_temp=out),
    ]


def rule_work(d: Dims, tokens: float, padded: float, finals: float = 0.0,
              segments: int = 1) -> tuple[float, float]:
    """The gated delta rule's forward and backward working sets (beyond what it keeps) for
    one call over `tokens` tokens in `padded` chunk tokens; `finals`: the bytes of the final
    states the call returns, which its forward holds from where it writes them; `segments`:
    how many segments (cu_seqlens) the call runs."""
    la = d.geometry.linear_attention
    assert la is not None
    b = d.dtype_bytes
    vheads = la.num_value_heads / d.tp
    dk, dv = la.key_head_dim, la.value_head_dim
    if d.implementation.delta_rule == "fla":
        # fla's kernels: the fp32 chunk matrix before its inverse, w and u (k's dtype), the
        # per-chunk states h and v_new; backward rebuilds them and adds dh (fp32) and the
        # fp32 gradients of q, k, v, w. From fla-core 0.6's chunk_gated_delta_rule_fwd/bwd
        # allocations; not measured here (no GPU).
        states = padded / GDN_CHUNK_TOKENS * vheads * dk * dv
        work = tokens * vheads * ((dk + 2 * dv) * b + GDN_CHUNK_TOKENS * FP32) + states * b
        grad = 2 * work + states * FP32 + tokens * vheads * (3 * dk + dv) * FP32
        # fla allocates the final states with the per-chunk states, before the outputs.
        return work + finals, grad
    return (cpu_rule_forward_work(padded, vheads, dk, dv, finals),
            cpu_rule_backward_work(padded, tokens, vheads, dk, dv, segments))


def cpu_rule_forward_work(padded: float, heads: float, dk: int, dv: int,
                          finals: float = 0.0) -> float:
    """The CPU rule's (`cpu_gated_delta`) forward working set at its highest moment, all fp32
    over the padded chunks (P tokens, per value head). Every moment holds the padded chunk
    copies of q, k, v, g, beta and A, w and u, and the identity; which one is highest depends
    on the head dims and the chunk count:
    - masking the decay for the intra-chunk scores: q k^T, the difference, the masked
      difference and its exp (C wide each), the causal mask;
    - in the chunk loop (intra scores, the decayed q and k kept for it), at the last chunk:
      adding a chunk's output (the state, the outputs so far, v_new, both products and the
      sum: P + 3C of v per head), or updating the state (the old one, its decayed copy, the
      k^T v_new product and the sum: four states, P + C of v);
    - stacking the chunk outputs (the outputs and their stacked copy, v_new, the state).
    `finals` (the final states returned): each sequence's is the loop's state at its last
    chunk, held in a list (the last sequence's is the loop's own state until the loop ends),
    and the list's concatenation is made before the outputs are stacked; the decay is masked
    before any of them exists."""
    c, p, f = GDN_CHUNK_TOKENS, float(padded), FP32
    chunks = p * heads * (2 * dk + dv + 2 + c)  # q, k, v, g, beta, A
    identity = c * c * f
    rule = (chunks + p * heads * (dk + dv)) * f + identity  # and w, u
    decay = rule + p * heads * 4 * c * f + c * c  # the mask: one byte a position
    loop = rule + p * heads * (2 * dk + c) * f  # decayed q, k to the chunk's end, intra
    state, per_chunk_v = heads * dk * dv * f, c * heads * dv * f
    earlier = max(finals - state, 0.0)
    add = loop + state + (p / c + 3) * per_chunk_v + earlier
    update = loop + 4 * state + (p / c + 1) * per_chunk_v + earlier
    stack = loop + state + (2 * p / c + 1) * per_chunk_v + earlier + finals
    return max(decay, add, update, stack)


def cpu_rule_backward_work(padded: float, tokens: float, heads: float, dk: int, dv: int,
                           segments: int = 1) -> float:
    """What the CPU rule's backward allocates at its highest moment. It rebuilds the forward
    under autograd from the saved set (fp32 padded chunks) and takes two gradients: through
    the chunk loop (which keeps every chunk's state), then through the chunk matrix. The
    counts below are the storages live at each moment (a live-storage snapshot at the peak,
    head dims 16-128 with dk != dv, 1-25 chunks); which moment is highest depends on the head
    dims and the chunk count, and the first gradient's moments differ below three chunks.
    Counted in fp32 tensors of the padded chunks per value head: C-wide (scores, decay,
    the inverse and their gradients), dk-wide and dv-wide (q, k, w, v, u and gradients), one
    per chunk and head (g, beta); then the chunk states (dk x dv) and chunk-sized v slices;
    the second gradient also holds what the first one returned: the gradients of q, k, v,
    beta and A (dk, dk, dv, 1 and C wide) and of g (one [tokens, heads], made fresh by the
    edge padding's backward). Over one segment those five are views of the padded chunk
    gradients, padded tokens long: `_chunked`'s one slice spans the row, an alias whose
    backward passes the padding cat's narrowed gradient on uncopied. Over several segments
    (`segments`) each slice's backward writes its rows into a fresh tensor of the row's
    tokens, and the padded chunk gradients die."""
    c, p, h = GDN_CHUNK_TOKENS, float(padded), float(heads)
    chunks = p / c
    ph, state, v_chunk, k_chunk = p * h, h * dk * dv, c * h * dv, c * h * dk
    first_results = (p if segments <= 1 else float(tokens)) * h * (c + 2 * dk + dv + 1)
    # Through the chunk matrix: its own working set, then the first gradient's results.
    second = ph * (9 * c + dk + 2 * dv + 1) + first_results + tokens * h
    if chunks >= 3:
        first = ph * 6 + max(
            ph * (7 * c + 9 * dk + 5 * dv) + chunks * state + (chunks - 1) * v_chunk,
            ph * (5 * c + 11 * dk + 5 * dv) + chunks * state + (chunks - 1) * v_chunk,
            ph * (5 * c + 9 * dk + 7 * dv) + (chunks - 1) * state + (chunks - 2) * v_chunk)
    elif chunks == 2:
        first = ph * (5 * c + 6 * dk + 4 * dv + 6) + 4 * state + 3 * v_chunk + k_chunk
    else:
        first = ph * (4 * c + 6 * dk + 7) + max(ph * 5 * dv + 4 * state, ph * 7 * dv + state)
    # The causal mask (one byte a position) and per-chunk, per-head scalars.
    return max(first, second) * FP32 + c * c + 8 * h * chunks


def conv_sequence_padding_bytes(d: Dims, kind: PricedKind, sequences: int,
                                tree: bool = False) -> float:
    """A Gated DeltaNet layer convolves a packed row segment by segment, each after its
    window (`gated_delta_rows.segmented_causal_conv`: zeros for a sequence's start, the path's
    last inputs for a prefix-tree child): its saved input grows by kernel-1 columns of every
    conv channel per segment. Probe and formulas price one sequence; this is the rest. On a
    GPU causal-conv1d takes a row of plain sequences without windows (its seq_idx); a tree
    always takes the windows."""
    la = d.geometry.linear_attention
    if (sequences <= 1 or la is None or not kind.linear
            or (d.implementation.device == "cuda" and not tree)):
        return 0.0
    channels = (2 * la.num_key_heads * la.key_head_dim
                + la.num_value_heads * la.value_head_dim) / d.tp
    return float((sequences - 1) * (la.conv_kernel_size - 1) * channels * d.dtype_bytes)



def prefix_tree_state_bytes(d: Dims, continued_segments: int) -> float:
    """What one Gated DeltaNet layer keeps for backward when a row's prefix trees hand their
    parents' final states on: each continued segment's initial state, [value heads / TP, dk,
    dv] fp32, which fla's kernel saves with the depth's call."""
    la = d.geometry.linear_attention
    if la is None or not continued_segments:
        return 0.0
    return float(continued_segments * la.num_value_heads / d.tp * la.key_head_dim
                 * la.value_head_dim * FP32)


def padded_chunk_tokens(lengths: tuple[int, ...]) -> int:
    return sum(-(-int(n) // GDN_CHUNK_TOKENS) * GDN_CHUNK_TOKENS for n in lengths)


def tree_rule_no_grad_bytes(d: Dims, calls: tuple[tuple[int, ...], ...]) -> float:
    """Without grad, what the gated delta rule over a row of prefix trees holds at its highest
    moment beside the row's rule inputs (`gated_delta_rows.delta_rule_over_row`; its calls'
    inputs are views of the row's). The row runs one call per depth and nothing of a call
    outlives it but its output: the chunk-local decay and the WY inverse it makes (what the
    rule keeps with grad) and its working set die as it returns. So a call's moment is its own
    working set and inverse beside the outputs of the calls before it, its stacked initial
    states (held by the layer's frame while it runs) and the final states it returns for the
    depth below (from where the rule writes them). After the last call the calls' outputs and
    their concatenation are held: the row's output twice. Every moment also holds the
    contiguous alpha the layer's frame keeps beside the rule, which the no-grad rule inputs
    leave out (they count beta and the fp32 decay): over a plain row the row's decay copy,
    priced with the inverse though the CPU rule makes it after its peak, stands in for it,
    where a call's copy covers only the call's tokens. On CUDA the no-grad composition holds
    the rule's output at the whole row already (fla allocates each call's inside it), which
    covers the calls before it and its own."""
    la = d.geometry.linear_attention
    assert la is not None
    b = d.dtype_bytes
    vheads = la.num_value_heads / d.tp
    per_token = vheads * la.value_head_dim * b
    state = prefix_tree_state_bytes(d, 1)
    cuda = d.implementation.device == "cuda"
    tokens = float(sum(sum(call) for call in calls))
    peak = tokens * per_token * (1 if cuda else 2)
    before = 0.0
    for index, call in enumerate(calls):
        call_tokens = float(sum(call))
        stacked = len(call) * state if index else 0.0
        finals = len(call) * state if index < len(calls) - 1 else 0.0
        work, _ = rule_work(d, call_tokens, float(padded_chunk_tokens(call)), finals)
        decay_and_inverse = call_tokens * vheads * (FP32 + GDN_CHUNK_TOKENS * b)
        outputs_before = 0.0 if cuda else before * per_token
        peak = max(peak, work + decay_and_inverse + outputs_before + stacked)
        before += call_tokens
    alpha = tokens * vheads * b
    return peak + alpha


def prefix_tree_extra_forward_bytes(d: Dims, kind: PricedKind, s: int,
                                    calls: tuple[tuple[int, ...], ...]) -> float:
    """With grad, what a Gated DeltaNet layer's forward over a row of prefix trees holds
    beyond its formulas with the rule at its largest call (`gated_delta_rows.
    delta_rule_over_row`): during a call, the outputs of the calls before it and, at its end,
    the final states it returns for the depth below (its stacked initial states the rule
    keeps: `prefix_tree_state_bytes`, a term of the whole pass). The concatenation of the
    calls' outputs comes after every call's working set is freed: it holds the row's output
    once more, which counts where that exceeds the largest call's working set. (Without grad
    the rule's block prices the calls one at a time: `tree_rule_no_grad_bytes`.)"""
    la = d.geometry.linear_attention
    if la is None or len(calls) < 2 or not kind.linear:
        return 0.0
    state = prefix_tree_state_bytes(d, 1)
    per_token = la.num_value_heads / d.tp * la.value_head_dim * d.dtype_bytes
    during = 0.0
    before = 0
    for index, call in enumerate(calls):
        finals = len(call) * state if index < len(calls) - 1 else 0.0
        during = max(during, before * per_token + finals)
        before += sum(call)
    work = max(rule_work(d, float(sum(call)), float(padded_chunk_tokens(call)))[0]
               for call in calls)
    return max(during, float(s) * per_token - work)


def linear_attention_keeps_input(d: Dims) -> bool:
    """Whether a Gated DeltaNet layer keeps its input for backward: its frozen input norm with
    torch's composite kernel in bf16/fp16 keeps its fp32 upcast instead."""
    te = d.implementation.spec == "te"
    return te or d.implementation.norm != "torch" or d.dtype_bytes >= FP32
