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

Here: a layer's kind, its blocks in order, and their composition under recompute. Each mixer
and MLP kind prices its blocks in its own module (`layers_attention.py`, `layers_gdn.py` for
Gated DeltaNet, `layers_mlp.py` for dense and MoE MLPs); the records and the terms they share
are in `layer_terms.py`.
"""

from __future__ import annotations

from dataclasses import replace

from art.megatron.geometry import ModelGeometry
from art.trainer_rank.pricing.layer_terms import (
    FP32,
    Block,
    BlockRole,
    Dims,
    LayerCost,
    PricedKind,
    linear_input_saved,
    norm_block,
)
from art.trainer_rank.pricing.layers_attention import attention_blocks
from art.trainer_rank.pricing.layers_gdn import (
    linear_attention_blocks,
    linear_attention_keeps_input,
)
from art.trainer_rank.pricing.layers_mlp import mlp_blocks, moe_blocks, moe_dispatcher_state

# The modules Megatron's `moe` checkpoint covers besides the router, dispatch and experts.
MOE_CHECKPOINT_MODULES = frozenset({"moe_act", "shared_experts"})


def layer_kind(geometry: ModelGeometry, index: int) -> PricedKind:
    return PricedKind.of(geometry.layer_types[index], geometry.moe_layers[index])


def keeps_layer_input(d: Dims, kind: PricedKind) -> bool:
    """Whether a layer keeps its input for backward (its input norm does; a Gated DeltaNet
    layer's may not, see `linear_attention_keeps_input`; under CP its norm runs on the
    gathered whole row, which it keeps instead: `linear_attention_over_context_parallel`)."""
    if not kind.linear:
        return True
    return d.layout.context_parallel == 1 and linear_attention_keeps_input(d)


def layer_blocks(d: Dims, kind: PricedKind, s: int, worst_case_routing: bool = False,
                 padded: int | None = None,
                 rule_calls: tuple[tuple[int, ...], ...] | None = None,
                 segments: int = 1, expert_partner_s: int | None = None,
                 expert_routing_share: float = 1.0, busiest_expert_share: float = 1.0
                 ) -> list[Block]:
    g, b = d.geometry, d.dtype_bytes
    te = d.implementation.spec == "te"
    cp = d.layout.context_parallel
    if kind.linear and cp > 1:
        mixer = linear_attention_over_context_parallel(d, s, padded, rule_calls, segments)
    elif kind.linear:
        mixer = linear_attention_blocks(d, s, padded, rule_calls, segments)
    else:
        mixer = attention_blocks(d, s)
    # The residual add after the mixer makes a new hidden tensor, which the pre-MLP norm keeps
    # when fused (or torch's in fp32, whose upcast is the tensor itself); torch's composite in
    # bf16/fp16 keeps its fp32 upcast instead (in the norm's block) and the add keeps nothing.
    fused_norm = te and not kind.moe
    residual = Block("residual add", None, 0.0, d.hidden_tokens(s) * g.hidden_size * b,
                     fused_norm or d.implementation.norm != "torch" or b >= FP32,
                     role=BlockRole.RESIDUAL_ADD)
    mlp_norm = norm_block(d, s, "pre-MLP norm", fused_norm,
                          linear_input_saved(d, s, "linear_fc1", True) or kind.moe)
    if kind.moe:
        mlp = moe_blocks(d, s, worst_case_routing, expert_partner_s, expert_routing_share,
                         busiest_expert_share)
    else:
        mlp = mlp_blocks(d, s, g.ffn_hidden_size, float(s), "")
    return [*mixer, residual, mlp_norm, *mlp]


def linear_attention_over_context_parallel(d: Dims, s: int, padded: int | None,
                                           rule_calls: tuple[tuple[int, ...], ...] | None,
                                           segments: int = 1) -> list[Block]:
    """A Gated DeltaNet mixer under context parallel (specs/gated_delta_net.py): its input is
    gathered to the whole row (the per-rank parts beside the gathered row while it is
    assembled), the mixer runs over the whole row, and this rank's rows of its output are
    copied out. Backward: the output's whole-row gradient (zero outside this rank's rows),
    and the input's whole-row gradient copied for its sum over CP."""
    g, b = d.geometry, d.dtype_bytes
    row_tokens = s * d.layout.context_parallel
    row = float(row_tokens) * g.hidden_size * b
    local = d.hidden_tokens(s) * g.hidden_size * b
    gathered = d.hidden_tokens(row_tokens) * g.hidden_size * b
    # The input norm sits in in_proj, after the gather: what it keeps of its input is the
    # gathered row, not the layer's own rows (which nothing keeps under CP).
    gather = Block("CP gather (whole row)", None, 0.0, gathered,
                   linear_attention_keeps_input(d), temp=row, grad_temp=2 * row)
    rows_out = Block("CP local rows", None, 0.0, local, False, grad_temp=row)
    mixer = [replace(blk, stream=local + gathered)
             for blk in linear_attention_blocks(d, row_tokens, padded, rule_calls, segments)]
    return [gather, *mixer, rows_out]


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


def price_layer(d: Dims, kind: PricedKind, modules: frozenset[str], s: int, *, grad: bool,
                worst_case_routing: bool = False, padded: int | None = None,
                rule_calls: tuple[tuple[int, ...], ...] | None = None,
                segments: int = 1, expert_partner_s: int | None = None,
                expert_routing_share: float = 1.0, busiest_expert_share: float = 1.0
                ) -> LayerCost:
    """Default LayerCost of one layer running with the selective `modules` (empty: none);
    `padded`, `rule_calls` and `segments` as in `linear_attention_blocks`;
    `expert_partner_s`, `expert_routing_share` and `busiest_expert_share` as `moe_blocks`'
    `partner_s`, `routing_share` and `busiest_expert_share`."""
    g, b = d.geometry, d.dtype_bytes
    blocks = layer_blocks(d, kind, s, worst_case_routing, padded, rule_calls, segments,
                          expert_partner_s, expert_routing_share, busiest_expert_share)
    x = d.hidden_tokens(s) * g.hidden_size * b
    if not grad:
        # Nothing is saved: the peak is the residual stream (held for the add), the previous
        # block's output, the largest block's output plus its working set; core attention
        # also keeps the fused QKV buffer alive (V is a view of it). A gated attention's
        # gate is a contiguous copy out of the QKV buffer (Megatron reshapes the strided
        # split), live from the split until the output gate multiplies it in.
        # A Gated DeltaNet's rule runs on views of in_proj's and the conv's outputs (held by
        # the layer's frame) and on the repeated q, k, contiguous v, gate and decay inputs.
        gate = sum(blk.internal for blk in blocks if blk.role is BlockRole.OUTPUT_GATE)
        rule_inputs = sum(blk.output for blk in blocks if blk.role is BlockRole.RULE_INPUT)
        rule_inputs += sum(blk.internal for blk in blocks
                           if blk.role is BlockRole.RULE_INPUT_COPIES)
        peak = 0.0
        prev = x
        qkv = 0.0
        gate_live = 0.0
        # The layer's input is priced beside the layer (the caller holds it); the residual
        # stream the layer itself holds is the add's output, once the add has run. A
        # sub-layer's normed input stays referenced by the layer's frame until the sub-layer
        # has returned (beside the block right after the norm it is that block's `prev`).
        residual = sub_input = 0.0
        after_norm = False
        for blk in blocks:
            if blk.role is BlockRole.OUTPUT_GATE:
                gate_live = 0.0
            extra = (qkv if blk.module == "core_attn" else 0.0) + gate_live
            stream = residual if blk.stream is None else blk.stream - x + residual
            held = stream + prev + blk.output + (0.0 if after_norm else sub_input)
            if blk.role is BlockRole.DELTA_RULE:
                extra += rule_inputs
                if d.implementation.device != "cuda":
                    # The CPU rule peaks masking the decay, before its output exists, and the
                    # layer holds no hidden-sized tensor beside its input there (its norm sits
                    # in in_proj, whose normed rows die with the linear); under CP its
                    # gathered whole-row input is held beside.
                    held = prev + (blk.stream - x if blk.stream is not None else 0.0)
            work = blk.temp + blk.internal if blk.no_grad_work is None else blk.no_grad_work
            if blk.no_grad_held is not None:
                held, work = stream, blk.no_grad_held
            peak = max(peak, held + work + extra)
            prev = blk.output
            after_norm = blk.role is BlockRole.SUB_LAYER_INPUT
            if after_norm:
                sub_input = blk.output
            if blk.role is BlockRole.RESIDUAL_ADD:
                # The attention's frame returns after its add, releasing its normed input.
                residual, sub_input = blk.output, 0.0
            if blk.role is BlockRole.QKV:
                qkv, gate_live = blk.output, gate
        kept = moe_dispatcher_state(d, s) if kind.moe else 0.0
        return LayerCost(int(kept), int(peak), 0, int(x), False)

    # Megatron's `moe` checkpoint wraps the whole MoE layer, its activation and shared
    # experts included: one checkpoint, with no seam between its blocks.
    moe_checkpoint = kind.moe and "moe" in modules
    if moe_checkpoint:
        blocks = [replace(blk, module="moe") if blk.module in MOE_CHECKPOINT_MODULES else blk
                  for blk in blocks]
    segments = _checkpoint_segments(blocks, modules)
    parts = kept_parts(blocks, modules)
    if moe_checkpoint:
        # The checkpoint's run without grad leaves the token dispatcher's routing state
        # referenced until the rebuild routes again (as a layer's run without grad does).
        router = next(i for i, blk in enumerate(blocks) if blk.role is BlockRole.ROUTER)
        parts[router] += moe_dispatcher_state(d, s)
    saves_input = keeps_layer_input(d, kind)
    kept = (x if saves_input else 0.0) + sum(parts)  # the input norm keeps the layer input

    # Forward: kept so far + this block's full working set (recomputed blocks still run).
    # A Gated DeltaNet's rule also runs beside what the layer's frame holds though backward
    # keeps none of it: in_proj's and the conv's outputs (split into the rule's inputs), the
    # gates' working copies; the CPU rule peaks before its own output exists.
    frame_held = sum(blk.output for blk in blocks
                     if blk.role is BlockRole.RULE_INPUT and not blk.output_saved)
    frame_held += sum(blk.temp for blk in blocks if blk.role is BlockRole.RULE_INPUT_COPIES)
    # Inside the `moe` checkpoint (run without grad) nothing is kept, but the MoE layer's
    # frame still holds the experts' input (the dispatch's output) through the combine, which
    # a grad run keeps anyway (the experts' fc1 saves it; the experts' own blocks price it
    # with their adapters' saved input).
    experts_input = 0.0
    peak_f = 0.0
    so_far = 0.0
    for idx, (blk, part) in enumerate(zip(blocks, parts)):
        live = (so_far + blk.internal + blk.output + blk.temp
                + _norm_rebuilt_for(blocks, segments, idx, backward=False))
        if blk.role is BlockRole.DELTA_RULE:
            live += frame_held - (blk.output if d.implementation.device != "cuda" else 0.0)
        if blk.role is BlockRole.COMBINE:
            live += experts_input
        peak_f = max(peak_f, live)
        so_far += part
        if moe_checkpoint and blk.role is BlockRole.DISPATCH:
            experts_input = blk.output

    # Backward, blocks in reverse: kept up to here + what the checkpoint rebuilt for this
    # block's segment (every block of the segment up to this one, as if not recomputed) +
    # incoming grad, the residual-stream grad, the grad of its input, its grad temporaries.
    peak_b = 0.0
    own_input = x if saves_input else 0.0
    remaining = kept - own_input
    # Once the `moe` checkpoint's backward has run, its detached input and that input's
    # gradient stay referenced (`moe_checkpoint_retained`) through the rest of the layer.
    # Once the router's backward has run, the token dispatcher still holds the routing state
    # (`moe_dispatcher_state`): live through the backward of the blocks below it.
    retained_moe = 0.0
    routing_state = 0.0
    moe_input = (next(i for i, blk in enumerate(blocks) if blk.module == "moe") - 1
                 if moe_checkpoint else None)
    for idx in reversed(range(len(blocks))):
        blk, part, seg = blocks[idx], parts[idx], segments[idx]
        if idx == moe_input:  # the block whose output the checkpoint took as its input
            retained_moe = moe_checkpoint_retained(blk.output)
        rebuilt = _norm_rebuilt_for(blocks, segments, idx) + retained_moe + routing_state
        if seg is not None:
            for j in range(idx, -1, -1):
                if segments[j] != seg:
                    break
                rebuilt += blocks[j].internal + _rebuilt_output(blocks, segments, j)
        # The residual stream's gradient and the one flowing to the block's input: the
        # layer's own rows, also for a Gated DeltaNet mixer under CP, whose whole-row input
        # gradient appears only at the gather's backward (its `grad_temp`).
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
                before += blocks[j].internal + _rebuilt_output(blocks, segments, j)
        remaining -= part
        if blk.role is BlockRole.ROUTER:
            routing_state = moe_dispatcher_state(d, s)
    backward = int(max(peak_b - kept, 0.0))
    # Every block's backward above keeps a residual-stream gradient live besides its input's
    # (the `2 * x`): the layer's incoming gradient is priced as held to the end already.
    return LayerCost(int(kept), int(peak_f), backward, int(x), saves_input,
                     backward_held=backward)


def _rebuilt_output(blocks: list[Block], segments: list[int | None], idx: int) -> float:
    """Of a block a checkpoint rebuilt, whether its output is still held when the
    checkpoint's backward runs: when a later block saved it, or when it is the checkpoint's
    output (CheckpointFunction.backward holds the rebuilt outputs until it returns)."""
    last = idx + 1 == len(blocks) or segments[idx + 1] != segments[idx]
    return blocks[idx].output if blocks[idx].output_saved or last else 0.0


def moe_checkpoint_retained(checkpoint_input: float) -> float:
    """What Megatron's `moe` checkpoint leaves referenced after its backward: its input,
    which CheckpointFunction.backward detached and made a leaf, and that leaf's gradient.
    The token dispatcher keeps the routing probabilities (`self.probs`), whose graph reaches
    back to the leaf, until the layer's next call."""
    return 2 * checkpoint_input


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
        if blocks[j].role is BlockRole.RESIDUAL_ADD:
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
