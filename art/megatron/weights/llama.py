"""Llama (2/3 shapes with default RoPE): GQA attention, SwiGLU MLP, no q/k norm."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from art.megatron.geometry import ModelGeometry
from art.megatron.weights.family import (
    UnsupportedCheckpointError,
    check_common_config,
    dense_decoder_maps,
)
from art.megatron.weights.layouts import TensorMap


@dataclass(frozen=True)
class Llama:
    name: str = "llama"
    architectures: tuple[str, ...] = ("LlamaForCausalLM",)

    def check_config(self, config: Mapping[str, Any], geometry: ModelGeometry) -> None:
        check_common_config(config, self.name)
        if geometry.qk_layernorm:
            raise UnsupportedCheckpointError(
                f"{geometry.name}: a Llama geometry with qk-norm; Llama has none (model_type "
                f"{config.get('model_type')!r})"
            )

    def tensor_maps(self, geometry: ModelGeometry) -> dict[str, TensorMap]:
        return dense_decoder_maps(geometry)


FAMILY = Llama()
