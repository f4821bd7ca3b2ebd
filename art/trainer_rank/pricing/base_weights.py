"""How many of the base model's parameters one rank holds (the resident weights term)."""

from __future__ import annotations

from art.megatron.geometry import LINEAR_ATTENTION, ModelGeometry
from art.megatron.layout import ParallelLayout


def params_per_rank(g: ModelGeometry, layout: ParallelLayout) -> float:
    """The base model's parameters one rank holds: its layers' share over TP, PP and EP
    (experts over EP and expert TP), norms and the router replicated, the embedding and the
    output layer (one when tied) split over TP."""
    tp, pp, ep = layout.tensor_parallel, layout.pipeline_parallel, layout.expert_parallel
    etp = layout.expert_tensor_parallel
    h = g.hidden_size
    total = 0.0
    for i in range(g.num_layers):
        if g.layer_types[i] == LINEAR_ATTENTION and g.linear_attention is not None:
            la = g.linear_attention
            key = la.num_key_heads * la.key_head_dim
            value = la.num_value_heads * la.value_head_dim
            mixer = h * (2 * key + 2 * value + 2 * la.num_value_heads) + value * h
            mixer += (2 * key + value) * la.conv_kernel_size
            # A_log and dt_bias per value head (split); the gated norm's weight (replicated).
            mixer += 2 * la.num_value_heads + la.value_head_dim * tp
        else:
            q = g.num_attention_heads * g.head_dim
            kv = g.num_query_groups * g.head_dim
            gate = q if g.gated_attention_output else 0
            mixer = h * (q + gate + 2 * kv) + q * h
            if g.qk_layernorm:
                mixer += 2 * g.head_dim * tp  # per-head q/k norms, replicated over TP
        if g.moe_layers[i]:
            # Experts are split over expert-TP, not TP (the /tp below is undone by * tp).
            experts = g.num_experts / ep * 3 * h * g.moe_ffn_hidden_size * tp / etp
            shared = 3 * h * g.shared_expert_ffn_hidden_size
            mlp = experts + shared + h * g.num_experts * tp  # router replicated
        else:
            mlp = 3 * h * g.ffn_hidden_size
        total += mixer + mlp + 2 * h * tp  # norms are replicated over TP
    total /= tp
    embed = g.vocab_size * h / tp
    heads = embed if g.tied_embeddings else 2 * embed
    # The final norm (replicated) lives on the last stage, with the output layer.
    return total / pp + (heads + h if pp == 1 else embed + h)
