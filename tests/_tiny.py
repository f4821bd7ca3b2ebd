"""Tiny model geometries for CPU tests (GQA, RMSNorm, SwiGLU, RoPE, qk-norm)."""

from __future__ import annotations

from art.megatron.geometry import ModelGeometry, geometry_from_hf_dict


def tiny_dense(num_layers: int = 4, hidden: int = 64, vocab: int = 256) -> ModelGeometry:
    return geometry_from_hf_dict(
        dict(
            model_type="qwen3", num_hidden_layers=num_layers, hidden_size=hidden,
            intermediate_size=3 * hidden, num_attention_heads=8, num_key_value_heads=4,
            head_dim=hidden // 4, vocab_size=vocab, max_position_embeddings=4096,
        ),
        name=f"tiny-dense-{num_layers}x{hidden}",
    )


def tiny_moe(num_layers: int = 2, hidden: int = 64, vocab: int = 256) -> ModelGeometry:
    return geometry_from_hf_dict(
        dict(
            model_type="qwen3_moe", num_hidden_layers=num_layers, hidden_size=hidden,
            intermediate_size=3 * hidden, moe_intermediate_size=hidden // 2, num_experts=4,
            num_experts_per_tok=2, num_attention_heads=8, num_key_value_heads=4,
            head_dim=hidden // 4, vocab_size=vocab, max_position_embeddings=4096,
        ),
        name=f"tiny-moe-{num_layers}x{hidden}",
    )
