"""Qwen3 dense: Llama's decoder plus per-head q/k RMSNorm (`self_attn.q_norm` / `k_norm`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from art.megatron.geometry import ModelGeometry
from art.megatron.weights.family import check_common_config, dense_decoder_maps
from art.megatron.weights.layouts import TensorMap


@dataclass(frozen=True)
class Qwen3:
    name: str = "qwen3"
    architectures: tuple[str, ...] = ("Qwen3ForCausalLM",)

    def check_config(self, config: Mapping[str, Any], geometry: ModelGeometry) -> None:
        check_common_config(config, self.name)

    def tensor_maps(self, geometry: ModelGeometry) -> dict[str, TensorMap]:
        return dense_decoder_maps(geometry)


FAMILY = Qwen3()
