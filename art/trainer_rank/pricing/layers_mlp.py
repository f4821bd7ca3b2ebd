"""MLP layer formulas: the blocks of a dense SwiGLU MLP and of a MoE layer; dispatcher state.

fc1 (gate + up), SwiGLU, fc2 for a dense MLP or each local expert; a MoE layer adds the router,
the token dispatch and combine, and shared experts, priced as `Block`s (see `layers.py`).
"""

from __future__ import annotations

from dataclasses import replace

from art.trainer_rank.pricing.layer_terms import (
    FP32,
    INT64,
    Block,
    BlockRole,
    Dims,
    linear_input_saved,
    lora_saved,
    lora_temp,
)


def _stand_in_swiglu_grad_temp(d: Dims, tokens: float, ffn: int, shards: int) -> float:
    """The GPU-shaped CPU build's SwiGLU stand-in (art/megatron/cpu_fused.py) computes its
    backward in row chunks with five chunk-sized temporaries live at once (sigmoid, silu,
    g * up, 1 - sigmoid, silu * (1 - sigmoid)); a fused GPU kernel has none."""
    if not d.implementation.gpu_shaped_cpu:
        return 0.0
    from art.megatron.cpu_fused import CHUNK_ROWS

    return 5 * min(tokens, CHUNK_ROWS) * ffn / shards * d.dtype_bytes


def mlp_blocks(d: Dims, s: int, ffn: int, tokens: float, tag: str,
               lora_tokens: float | None = None, adapters: int = 1,
               shards: int | None = None) -> list[Block]:
    """fc1 (gate+up), SwiGLU, fc2 for `tokens` routed tokens (s for a dense MLP); routed
    experts: their LoRA adapters see `lora_tokens` rows over `adapters` local experts, their
    hidden dimension split over `shards` ranks (expert TP; a dense MLP's: TP)."""
    g, b = d.geometry, d.dtype_bytes
    tp = d.tp if shards is None else shards
    fc1_out = tokens * 2 * ffn * b / tp
    act_out = tokens * ffn * b / tp
    fc2_in_saved = linear_input_saved(d, s, "linear_fc2", column=False)
    if d.implementation.swiglu_fused:
        act_internal = 0.0  # the fused kernel keeps its input (fc1's output, saved below)
    else:
        # silu(x1) * x2: x1, x2 are views of fc1's output (kept whole); silu(x1) and one more
        # activation-sized storage are kept besides (measured with saved-tensor hooks).
        act_internal = 2 * act_out
    rows = float(s) if lora_tokens is None else lora_tokens
    return [
        Block(f"{tag}fc1", "mlp", lora_saved(d, rows, "linear_fc1", adapters), fc1_out, True,
              temp=lora_temp(d, "linear_fc1", fc1_out),
              # Backward: the adapter's scaled copy of the incoming gradient.
              grad_temp=lora_temp(d, "linear_fc1", fc1_out) / 3),
        # Backward: the gradient of its input (fc1's output). The torch path never holds
        # more: its peak is the gradient of x2 and the product for silu's backward (two
        # activation-sized tensors), and by the time both halves are concatenated its saved
        # tensors and the incoming gradient are freed.
        Block(f"{tag}swiglu", "mlp", act_internal, act_out, fc2_in_saved,
              temp=act_out,
              grad_temp=fc1_out + _stand_in_swiglu_grad_temp(d, tokens, ffn, tp),
              role=BlockRole.ACTIVATION),
        Block(f"{tag}fc2", "mlp", lora_saved(d, rows, "linear_fc2", adapters),
              d.hidden_tokens(s) * g.hidden_size * b, False,
              temp=(float(s) * g.hidden_size * b if d.layout.sequence_parallel else 0.0)
              + lora_temp(d, "linear_fc2", d.hidden_tokens(s) * g.hidden_size * b),
              grad_temp=act_out),
    ]


def moe_dispatcher_state(d: Dims, s: int) -> float:
    """What a MoE layer's token dispatcher keeps referenced after the layer returns, until
    its next call: the routing probabilities (fp32) and map (bool) [tokens, experts] and the
    permutation's token indices (int64, one per routed pair), all of this rank's own tokens
    (routed before the dispatcher gathers over expert TP); and the tokens per local expert
    and the experts' restore order (int64, per expert and expert-TP rank)."""
    g = d.geometry
    own = d.hidden_tokens(s)
    return (own * g.num_experts * (FP32 + 1) + own * g.moe_router_topk * INT64
            + 2 * g.num_experts * d.layout.expert_tensor_parallel * INT64)


def moe_blocks(d: Dims, s: int, worst_case: bool, partner_s: int | None = None,
               routing_share: float = 1.0, busiest_expert_share: float = 1.0) -> list[Block]:
    """`partner_s`: the tokens (as `s` counts them) of the other ranks of this rank's EP
    group, when they run rows of their own (expert parallel across model replicas); None:
    `s`, every rank of the group runs this row. `routing_share`: the share of the even
    share this rank's experts take; `busiest_expert_share`: the busiest local expert's pairs
    over the even count per expert (the probe measures the router's, measuring/routing.py)."""
    g, b = d.geometry, d.dtype_bytes
    ep = d.layout.expert_parallel
    local_experts = max(1, g.num_experts // ep)
    # The tokens this rank routes: its own rows gathered over the expert-TP group (Megatron's
    # dispatcher gathers over it and reduce-scatters back), all s when expert TP is TP.
    tokens = expert_tokens(d, s)
    partners = tokens if partner_s is None else expert_tokens(d, partner_s)
    # This rank's experts take the pairs every rank of its EP group routes to them: its own
    # and the EP - 1 others'. Balanced routing sends 1/EP of each rank's pairs here. The
    # worst case sends every token of every EP rank here (capped at top-k per token: each
    # hits min(top-k, local) of this rank's experts).
    group_tokens = tokens + (ep - 1) * partners
    if worst_case:
        local_pairs = group_tokens * min(g.moe_router_topk, local_experts)
    else:
        local_pairs = group_tokens * g.moe_router_topk / ep * routing_share
    # Logits and scores [tokens, experts] fp32, the top-k indices (int64) besides the top-k
    # probabilities (its output); the routing map [tokens, experts] (bool) and the
    # permutation's token indices (int64 per routed pair) the dispatcher keeps for the
    # un-permute, and its tokens per expert (int64). The permute selects the probabilities
    # with a transposed copy of the map (`moe_utils.permute`, bool), which that selection
    # keeps for its backward. The router runs on this rank's rows of the residual stream
    # (Megatron's `MoELayer.route` on the sequence-parallel shard), the permutation on
    # their pairs: both before the dispatcher gathers over expert TP.
    own = d.hidden_tokens(s)
    router = Block("router", None,
                   own * g.num_experts * (FP32 * 2 + 2) + own * g.moe_router_topk
                   * INT64 * 2 + g.num_experts * INT64,
                   own * g.moe_router_topk * FP32, True, role=BlockRole.ROUTER)
    dispatch = Block("dispatch", "moe", 0.0, local_pairs * g.hidden_size * b, True,
                     temp=local_pairs * g.hidden_size * b, role=BlockRole.DISPATCH)
    # `moe` recompute checkpoints the whole MoE layer (router to combine, shared experts
    # included); `moe_act` the experts' activation; `shared_experts` the shared experts.
    experts = [replace(blk, module="moe_act" if blk.role is BlockRole.ACTIVATION else "moe")
               for blk in mlp_blocks(d, s, g.moe_ffn_hidden_size, local_pairs, "expert ",
                                     lora_tokens=local_pairs, adapters=local_experts,
                                     shards=d.layout.expert_tensor_parallel)]
    # The routing probabilities multiply the activation before fc2 (one fp32 per pair): the
    # multiply keeps the activation and the probabilities, fc2 keeps the product. The fused
    # kernel (Megatron's `weighted_bias_swiglu_impl`) multiplies inside: it keeps its input
    # (fc1's output, kept above) and the probabilities.
    # The product is the activation's size: its hidden dimension split over expert TP.
    act_out = 0.0 if d.implementation.swiglu_fused else (
        local_pairs * g.moe_ffn_hidden_size * b / d.layout.expert_tensor_parallel)
    experts[1] = replace(experts[1], internal=experts[1].internal + act_out
                         + local_pairs * FP32)
    # Megatron's MoE layer runs its shared experts first, then routes (`MoELayer.forward`):
    # what they keep is live while the routed experts run, and their backward comes last.
    blocks = [replace(blk, module="shared_experts")
              for blk in mlp_blocks(d, s, g.shared_expert_ffn_hidden_size, float(s), "shared ")
              ] if g.shared_expert_ffn_hidden_size else []
    # Without grad the routed tensors outlive the blocks that make them: the combine's moment
    # prices them all (`routed_no_grad_bytes`), the dispatch's and the experts' none.
    # An expert's moment: its fc1's output and temporaries beside its adapter's rank
    # intermediate and A weights (what fc1 keeps with grad), or its activation's.
    fc1, activation = experts[0], experts[1]
    per_expert = max(fc1.output + fc1.temp + fc1.internal,
                     activation.output + activation.temp) / local_experts
    # Balanced routing gives every expert the same pairs; the router's busiest takes more than
    # this rank's mean per expert (the even count times `routing_share`).
    busiest_over_mean = 1.0 if worst_case else min(
        float(local_experts), max(1.0, busiest_expert_share / routing_share))
    routed = routed_no_grad_bytes(d, s, local_pairs, local_experts, per_expert,
                                  busiest_over_mean)
    shared = d.hidden_tokens(s) * g.hidden_size * b if g.shared_expert_ffn_hidden_size else 0.0
    blocks += [replace(router, module="moe"), replace(dispatch, no_grad_held=0.0),
               *(replace(blk, no_grad_held=0.0) for blk in experts)]
    # The combine's backward gathers the output's gradient back to the pairs and, with several
    # local experts, sorts it back to the experts' order (a copy): both pair-sized gradients
    # are live at once, the copy beyond what the block's gradients price.
    sorted_gradient = local_pairs * g.hidden_size * b if local_experts > 1 else 0.0
    # Under expert TP the forward's reduce-scatter is an all-gather backward: this rank's share
    # of the pairs' gradient is its input, live beside the gathered pairs.
    etp = d.layout.expert_tensor_parallel
    gathered_share = local_pairs / etp * g.hidden_size * b if etp > 1 else 0.0
    blocks.append(Block("combine", "moe", 0.0, d.hidden_tokens(s) * g.hidden_size * b, False,
                        temp=combine_working_set(d, s, local_pairs, local_experts),
                        grad_temp=sorted_gradient + gathered_share, role=BlockRole.COMBINE,
                        # Beside the residual stream: the pre-MLP norm's output (the MoE
                        # layer's input) and the shared experts' output.
                        no_grad_held=d.hidden_tokens(s) * g.hidden_size * b + shared
                        + routed))
    return blocks


def routed_no_grad_bytes(d: Dims, s: int, local_pairs: float, local_experts: int,
                         per_expert_work: float, busiest_over_mean: float = 1.0) -> float:
    """What a MoE layer's routed experts hold at their highest moment without grad (Megatron's
    alltoall dispatcher and SequentialMLP, which runs one expert at a time). Beside what the
    combine holds with grad too (`combine_working_set`): what a grad run prices as kept
    instead, the layer's routing state, the probabilities travelling with this rank's
    permuted tokens, the all-to-all's output and the sorted copy, and with several local
    experts that copy itself (the experts' input). The other moment is the last expert's
    working set (`per_expert_work`: its fc1's or activation's output and temporaries) beside
    the others' outputs, before the combine."""
    g, b = d.geometry, d.dtype_bytes
    pair = g.hidden_size * b
    own_pairs = d.hidden_tokens(s) * g.moe_router_topk
    sorted_input = local_pairs * pair if local_experts > 1 else 0.0
    probabilities = FP32 * (own_pairs + (local_pairs if d.layout.expert_parallel > 1 else 0.0)
                            + (local_pairs if local_experts > 1 else 0.0))
    also_held = sorted_input + probabilities + moe_dispatcher_state(d, s)
    combine = combine_working_set(d, s, local_pairs, local_experts) + also_held
    # Before the combine: this rank's permuted tokens, the all-to-all's output, the sorted
    # copy, the other experts' outputs and the last one's working set.
    dispatched = own_pairs * pair + (local_pairs * pair if d.layout.expert_parallel > 1
                                     else 0.0)
    last_expert = (dispatched + also_held
                   + local_pairs * pair * max(0.0, 1 - busiest_over_mean / local_experts)
                   + per_expert_work * busiest_over_mean)
    return max(combine, last_expert)


def combine_working_set(d: Dims, s: int, local_pairs: float, local_experts: int) -> float:
    """What Megatron's all-to-all dispatcher (`MoEAlltoAllTokenDispatcher.combine_preprocess`)
    holds beside the layer's output while it hands the experts' output back: the layer's frame
    holds this rank's permuted tokens (the dispatch's input, a pair per routed token of this
    rank's rows) and the experts' output (a row per local pair); with several local experts
    the output is sorted back by rank (a copy). Under expert TP the experts ran on the
    pairs of every expert-TP rank, and the sorted output is reduce-scattered over it: the collective
    flattens its split input into one buffer (NCCL's list reduce-scatter; the CPU stand-in's
    stack) and writes this rank's share of the pairs into a new output."""
    g, b = d.geometry, d.dtype_bytes
    pair = g.hidden_size * b
    own_pairs = d.hidden_tokens(s) * g.moe_router_topk
    held = own_pairs * pair + local_pairs * pair
    if local_experts > 1:
        held += local_pairs * pair
    if d.layout.expert_parallel > 1:
        # The all-to-all's output (the pairs every EP rank sent here), which the layer's
        # frame holds through the combine beside this rank's permuted tokens (at EP = 1 they
        # are one tensor).
        held += local_pairs * pair
    return held + expert_tp_reduce_scatter_bytes(d, local_pairs)


def expert_tp_reduce_scatter_bytes(d: Dims, local_pairs: float) -> float:
    """Under expert TP the combine reduce-scatters the experts' sorted output over the
    expert-TP group: the collective's flattened input buffer and this rank's share of the
    pairs in a new output (0 without expert TP)."""
    etp = d.layout.expert_tensor_parallel
    if etp == 1:
        return 0.0
    pair = d.geometry.hidden_size * d.dtype_bytes
    return local_pairs * pair + local_pairs / etp * pair


def expert_tokens(d: Dims, s: int) -> float:
    """The tokens whose pairs this rank's dispatcher routes: its rows of the residual stream
    (sequence parallel splits them over TP), gathered over its expert-TP group."""
    return d.hidden_tokens(s) * d.layout.expert_tensor_parallel if (
        d.layout.sequence_parallel) else float(s)
