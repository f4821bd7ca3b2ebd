"""What every decoder family shares: the family protocol, the config checks, and the
Megatron <-> HF maps of embeddings, attention, norms and a dense SwiGLU MLP.

Megatron names here are global: `decoder.layers.<i>` is layer i of the whole model (HF
numbering), `mlp.experts.<e>` is global expert e. The loader translates the names a rank's
model really has (local layer and expert indices, LoRA and DDP wrappers, TE's fused norms)
into these before looking them up.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from art.megatron.geometry import ModelGeometry
from art.megatron.weights.layouts import (
    COLUMN,
    GATE_UP,
    QKV,
    REPLICATED,
    ROW,
    VOCAB,
    HFTensor,
    TensorMap,
)


class UnsupportedCheckpointError(ValueError):
    """The checkpoint's architecture or one of its config settings is not something the
    model built here computes."""


class Family(Protocol):
    name: str
    architectures: tuple[str, ...]

    def check_config(self, config: Mapping[str, Any], geometry: ModelGeometry) -> None: ...

    def tensor_maps(self, geometry: ModelGeometry) -> dict[str, TensorMap]: ...


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    return config.get("text_config") or config


def check_common_config(config: Mapping[str, Any], family: str) -> None:
    """Settings that would make the HF model compute something Megatron's build does not."""
    cfg = text_config(config)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    checks = [
        ("hidden_act", cfg.get("hidden_act", "silu"), "silu"),
        ("attention_bias", bool(cfg.get("attention_bias", False)), False),
        ("mlp_bias", bool(cfg.get("mlp_bias", False)), False),
        ("rope type", rope.get("rope_type", rope.get("type", "default")), "default"),
        ("use_sliding_window", bool(cfg.get("use_sliding_window", False)), False),
    ]
    for what, seen, wanted in checks:
        if seen != wanted:
            raise UnsupportedCheckpointError(
                f"{family} checkpoint with {what} = {seen!r}: the Megatron model built here "
                f"computes {what} = {wanted!r} only, so its outputs would differ"
            )


def _layer(i: int) -> str:
    return f"model.layers.{i}"


def embedding_maps(g: ModelGeometry) -> dict[str, TensorMap]:
    h, v = g.hidden_size, g.vocab_size
    maps = [
        TensorMap("embedding.word_embeddings.weight",
                  (HFTensor("model.embed_tokens.weight", (v, h)),), VOCAB),
        TensorMap("decoder.final_layernorm.weight", (HFTensor("model.norm.weight", (h,)),),
                  REPLICATED),
    ]
    if not g.tied_embeddings:
        maps.append(TensorMap("output_layer.weight", (HFTensor("lm_head.weight", (v, h)),),
                              VOCAB))
    return {m.megatron_name: m for m in maps}


def attention_maps(g: ModelGeometry, i: int) -> dict[str, TensorMap]:
    h, d = g.hidden_size, g.head_dim
    q_rows, kv_rows = g.num_attention_heads * d, g.num_query_groups * d
    hf, mg = f"{_layer(i)}.self_attn", f"decoder.layers.{i}.self_attention"
    maps = [
        TensorMap(f"decoder.layers.{i}.input_layernorm.weight",
                  (HFTensor(f"{_layer(i)}.input_layernorm.weight", (h,)),), REPLICATED),
        TensorMap(f"{mg}.linear_qkv.weight", (
            HFTensor(f"{hf}.q_proj.weight", (q_rows, h)),
            HFTensor(f"{hf}.k_proj.weight", (kv_rows, h)),
            HFTensor(f"{hf}.v_proj.weight", (kv_rows, h)),
        ), QKV, head_dim=d),
        TensorMap(f"{mg}.linear_proj.weight", (HFTensor(f"{hf}.o_proj.weight", (h, q_rows)),),
                  ROW),
        TensorMap(f"decoder.layers.{i}.pre_mlp_layernorm.weight",
                  (HFTensor(f"{_layer(i)}.post_attention_layernorm.weight", (h,)),), REPLICATED),
    ]
    if g.qk_layernorm:
        maps += [
            TensorMap(f"{mg}.q_layernorm.weight", (HFTensor(f"{hf}.q_norm.weight", (d,)),),
                      REPLICATED),
            TensorMap(f"{mg}.k_layernorm.weight", (HFTensor(f"{hf}.k_norm.weight", (d,)),),
                      REPLICATED),
        ]
    return {m.megatron_name: m for m in maps}


def swiglu_maps(megatron_prefix: str, hf_prefix: str, hidden: int, ffn: int,
                *, expert: bool = False) -> dict[str, TensorMap]:
    """A SwiGLU MLP: gate/up fused into linear_fc1, down in linear_fc2."""
    maps = [
        TensorMap(f"{megatron_prefix}.linear_fc1.weight", (
            HFTensor(f"{hf_prefix}.gate_proj.weight", (ffn, hidden)),
            HFTensor(f"{hf_prefix}.up_proj.weight", (ffn, hidden)),
        ), GATE_UP, expert=expert),
        TensorMap(f"{megatron_prefix}.linear_fc2.weight",
                  (HFTensor(f"{hf_prefix}.down_proj.weight", (hidden, ffn)),), ROW,
                  expert=expert),
    ]
    return {m.megatron_name: m for m in maps}


def dense_decoder_maps(g: ModelGeometry) -> dict[str, TensorMap]:
    maps = embedding_maps(g)
    for i in range(g.num_layers):
        maps.update(attention_maps(g, i))
        maps.update(swiglu_maps(f"decoder.layers.{i}.mlp", f"{_layer(i)}.mlp", g.hidden_size,
                                g.ffn_hidden_size))
    return maps


__all__ = ["COLUMN", "Family", "UnsupportedCheckpointError", "attention_maps",
           "check_common_config", "dense_decoder_maps", "embedding_maps", "swiglu_maps",
           "text_config"]
