"""Qwen3-MoE: Qwen3 attention; every layer's MLP a routed mixture of SwiGLU experts.

The router is `mlp.gate.weight` (replicated); expert e of layer i is
`model.layers.<i>.mlp.experts.<e>.{gate,up,down}_proj.weight` (transformers saves them per
expert), Megatron's `mlp.experts.local_experts.<e - first local expert>`. Megatron's softmax
over the top-k logits equals HF's routing only with `norm_topk_prob=True`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from art.megatron.geometry import ModelGeometry
from art.megatron.weights.family import (
    UnsupportedCheckpointError,
    attention_maps,
    check_common_config,
    embedding_maps,
    swiglu_maps,
)
from art.megatron.weights.layouts import REPLICATED, HFTensor, TensorMap


@dataclass(frozen=True)
class Qwen3Moe:
    name: str = "qwen3_moe"
    architectures: tuple[str, ...] = ("Qwen3MoeForCausalLM",)

    def check_config(self, config: Mapping[str, Any], geometry: ModelGeometry) -> None:
        check_common_config(config, self.name)
        if not config.get("norm_topk_prob", False):
            raise UnsupportedCheckpointError(
                f"{self.name} checkpoint with norm_topk_prob = "
                f"{config.get('norm_topk_prob', False)!r}: Megatron's router renormalises the "
                "top-k probabilities (HF's norm_topk_prob=True) only"
            )
        if not all(geometry.moe_layers):
            dense = [i for i, moe in enumerate(geometry.moe_layers) if not moe]
            raise UnsupportedCheckpointError(
                f"{self.name} checkpoint with dense MLP layers {dense} (mlp_only_layers / "
                "decoder_sparse_step): the model built here makes every layer MoE"
            )

    def tensor_maps(self, geometry: ModelGeometry) -> dict[str, TensorMap]:
        g = geometry
        maps = embedding_maps(g)
        for i in range(g.num_layers):
            maps.update(attention_maps(g, i))
            router = TensorMap(
                f"decoder.layers.{i}.mlp.router.weight",
                (HFTensor(f"model.layers.{i}.mlp.gate.weight", (g.num_experts, g.hidden_size)),),
                REPLICATED,
            )
            maps[router.megatron_name] = router
            for e in range(g.num_experts):
                maps.update(swiglu_maps(
                    f"decoder.layers.{i}.mlp.experts.{e}", f"model.layers.{i}.mlp.experts.{e}",
                    g.hidden_size, g.moe_ffn_hidden_size, expert=True,
                ))
        return maps


FAMILY = Qwen3Moe()
