"""The hybrid block spec: Gated DeltaNet and attention layers in the HF config's pattern.

The pattern comes from the geometry (`layer_types`, itself read from the HF `layer_types` or
`full_attention_interval`), one spec per layer of this pipeline stage. Attention layers are
Megatron's local GPT layer; Gated DeltaNet layers are the same layer with the mixer replaced
by `gated_delta_net_spec()` and no separate input norm (the norm sits in its in_proj). Dense or
MoE MLP per layer as the geometry says.
"""

from __future__ import annotations

import copy
from typing import Any

from art.megatron.geometry import LINEAR_ATTENTION, ModelGeometry
from art.megatron.specs.gated_delta_net import gated_delta_net_spec


def linear_attention_pattern(geometry: ModelGeometry) -> list[int]:
    """Megatron's `linear_attention_freq` list: 1 for Gated DeltaNet, 0 for attention."""
    return [1 if t == LINEAR_ATTENTION else 0 for t in geometry.layer_types]


def hybrid_block_spec(geometry: ModelGeometry, config: Any) -> Any:
    """TransformerBlockSubmodules for this stage's layers, local modules only."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from art.megatron.specs.norms import QkTorchRMSNorm, SequenceParallelTorchRMSNorm

    offset = get_transformer_layer_offset(config)
    specs = []
    for index in range(offset, offset + get_num_layers_to_build(config)):
        spec = copy.deepcopy(get_gpt_layer_local_spec(
            num_experts=geometry.num_experts if geometry.moe_layers[index] else None,
            qk_layernorm=geometry.qk_layernorm, normalization="RMSNorm",
        ))
        layer = spec.submodules
        # torch RMSNorms that also accept sequence parallel (see SequenceParallelTorchRMSNorm).
        layer.input_layernorm = SequenceParallelTorchRMSNorm
        layer.pre_mlp_layernorm = SequenceParallelTorchRMSNorm
        if geometry.layer_types[index] == LINEAR_ATTENTION:
            layer.input_layernorm = IdentityOp
            layer.self_attention = gated_delta_net_spec()
        elif layer.self_attention.submodules.q_layernorm is not IdentityOp:
            layer.self_attention.submodules.q_layernorm = QkTorchRMSNorm
            layer.self_attention.submodules.k_layernorm = QkTorchRMSNorm
        specs.append(spec)
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=SequenceParallelTorchRMSNorm)
