"""Qwen3.5 (dense): Gated DeltaNet layers and gated full-attention layers (`layer_types`).

What differs from Qwen3 in the checkpoint:
- norms (input, post-attention, q/k, final) are zero-centred: HF multiplies by 1 + w, the
  Megatron norms by w, so the maps carry an offset of 1;
- the full-attention q_proj holds [query head, output-gate head] per head (linear_qkv keeps
  the gate heads after each group's query heads);
- a Gated DeltaNet layer's input norm is its in_proj's `layer_norm_weight`; in_proj is
  in_proj_qkv / _z / _b / _a laid out per rank as [q, k, v, z, beta, alpha] shards, the
  conv as [q, k, v] shards; its gated output norm is plain (ones-initialised, not centred).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from art.megatron.geometry import ATTENTION, LINEAR_ATTENTION, ModelGeometry
from art.megatron.weights.family import (
    UnsupportedCheckpointError,
    check_common_config,
    embedding_maps,
    swiglu_maps,
    text_config,
)
from art.megatron.weights.layouts import (
    COLUMN,
    GATED_QKV,
    REPLICATED,
    ROW,
    SECTIONS,
    HFTensor,
    TensorMap,
)

CENTRED = 1.0  # Megatron norm weight = HF weight + 1


def _norm(megatron_name: str, hf_name: str, size: int) -> TensorMap:
    return TensorMap(megatron_name, (HFTensor(hf_name, (size,)),), REPLICATED, offset=CENTRED)


def _attention(g: ModelGeometry, i: int) -> list[TensorMap]:
    h, d = g.hidden_size, g.head_dim
    q_rows, kv_rows = g.num_attention_heads * d, g.num_query_groups * d
    hf, mg = f"model.layers.{i}.self_attn", f"decoder.layers.{i}.self_attention"
    return [
        _norm(f"decoder.layers.{i}.input_layernorm.weight",
              f"model.layers.{i}.input_layernorm.weight", h),
        TensorMap(f"{mg}.linear_qkv.weight", (
            HFTensor(f"{hf}.q_proj.weight", (2 * q_rows, h)),
            HFTensor(f"{hf}.k_proj.weight", (kv_rows, h)),
            HFTensor(f"{hf}.v_proj.weight", (kv_rows, h)),
        ), GATED_QKV, head_dim=d),
        TensorMap(f"{mg}.linear_proj.weight", (HFTensor(f"{hf}.o_proj.weight", (h, q_rows)),),
                  ROW),
        _norm(f"{mg}.q_layernorm.weight", f"{hf}.q_norm.weight", d),
        _norm(f"{mg}.k_layernorm.weight", f"{hf}.k_norm.weight", d),
    ]


def _gated_delta_net(g: ModelGeometry, i: int) -> list[TensorMap]:
    la = g.linear_attention
    if la is None:
        raise UnsupportedCheckpointError(f"{g.name}: linear-attention layer without its dims")
    h = g.hidden_size
    qk, v = la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim
    nv = la.num_value_heads
    hf, mg = f"model.layers.{i}.linear_attn", f"decoder.layers.{i}.self_attention"
    return [
        _norm(f"{mg}.in_proj.layer_norm_weight", f"model.layers.{i}.input_layernorm.weight", h),
        TensorMap(f"{mg}.in_proj.weight", (
            HFTensor(f"{hf}.in_proj_qkv.weight", (2 * qk + v, h)),
            HFTensor(f"{hf}.in_proj_z.weight", (v, h)),
            HFTensor(f"{hf}.in_proj_b.weight", (nv, h)),
            HFTensor(f"{hf}.in_proj_a.weight", (nv, h)),
        ), SECTIONS, sections=(qk, qk, v, v, nv, nv)),
        TensorMap(f"{mg}.conv1d.weight", (
            HFTensor(f"{hf}.conv1d.weight", (2 * qk + v, 1, la.conv_kernel_size)),
        ), SECTIONS, sections=(qk, qk, v)),
        TensorMap(f"{mg}.A_log", (HFTensor(f"{hf}.A_log", (nv,)),), COLUMN),
        TensorMap(f"{mg}.dt_bias", (HFTensor(f"{hf}.dt_bias", (nv,)),), COLUMN),
        TensorMap(f"{mg}.out_norm.weight",
                  (HFTensor(f"{hf}.norm.weight", (la.value_head_dim,)),), REPLICATED),
        TensorMap(f"{mg}.out_proj.weight", (HFTensor(f"{hf}.out_proj.weight", (h, v)),), ROW),
    ]


@dataclass(frozen=True)
class Qwen3_5:
    name: str = "qwen3_5_text"
    architectures: tuple[str, ...] = ("Qwen3_5ForCausalLM",)

    def check_config(self, config: Mapping[str, Any], geometry: ModelGeometry) -> None:
        check_common_config(config, self.name)
        cfg = text_config(config)
        rope = cfg.get("rope_parameters") or {}
        hf_types = tuple(LINEAR_ATTENTION if t == LINEAR_ATTENTION else ATTENTION
                         for t in cfg.get("layer_types") or ())
        checks = [
            ("attn_output_gate", bool(cfg.get("attn_output_gate", True)),
             geometry.gated_attention_output),
            ("partial_rotary_factor",
             float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))),
             geometry.rotary_fraction),
            ("layer_types", hf_types, tuple(geometry.layer_types)),
        ]
        for what, seen, built in checks:
            if seen != built:
                raise UnsupportedCheckpointError(
                    f"{self.name} checkpoint with {what} = {seen!r}, but the model was built "
                    f"with {built!r}; build it from this checkpoint's config")

    def tensor_maps(self, geometry: ModelGeometry) -> dict[str, TensorMap]:
        g = geometry
        maps = embedding_maps(g)
        final = maps["decoder.final_layernorm.weight"]
        maps[final.megatron_name] = replace(final, offset=CENTRED)
        for i in range(g.num_layers):
            mixer = (_gated_delta_net(g, i) if g.layer_types[i] == LINEAR_ATTENTION
                     else _attention(g, i))
            mixer.append(_norm(f"decoder.layers.{i}.pre_mlp_layernorm.weight",
                               f"model.layers.{i}.post_attention_layernorm.weight",
                               g.hidden_size))
            maps.update({m.megatron_name: m for m in mixer})
            maps.update(swiglu_maps(f"decoder.layers.{i}.mlp", f"model.layers.{i}.mlp",
                                    g.hidden_size, g.ffn_hidden_size))
        return maps


FAMILY = Qwen3_5()
