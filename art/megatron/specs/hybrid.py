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
from art.megatron.implementation import Implementation
from art.megatron.specs.gated_delta_net import gated_delta_net_spec


def linear_attention_pattern(geometry: ModelGeometry) -> list[int]:
    """Megatron's `linear_attention_freq` list: 1 for Gated DeltaNet, 0 for attention."""
    return [1 if t == LINEAR_ATTENTION else 0 for t in geometry.layer_types]


def hybrid_block_spec(geometry: ModelGeometry, config: Any,
                      implementation: Implementation | None = None) -> Any:
    """TransformerBlockSubmodules for this stage's layers, local modules only. As for the dense
    local spec, `implementation` may ask for the segmented flash attention (attention "flash")
    and the fused norms' CPU stand-ins (a GPU-shaped CPU build)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from art.megatron.specs.norms import QkTorchRMSNorm, SequenceParallelTorchRMSNorm

    # torch RMSNorms that also accept sequence parallel (see SequenceParallelTorchRMSNorm), or
    # the fused kernel's stand-in, which does too.
    norm: Any = SequenceParallelTorchRMSNorm
    qk_norm: Any = QkTorchRMSNorm
    if implementation is not None and implementation.gpu_shaped_cpu:
        from art.megatron.cpu_fused import FusedRMSNorm

        norm = qk_norm = FusedRMSNorm
    flash = implementation is not None and implementation.attention == "flash"
    offset = get_transformer_layer_offset(config)
    specs = []
    for index in range(offset, offset + get_num_layers_to_build(config)):
        spec = copy.deepcopy(get_gpt_layer_local_spec(
            num_experts=geometry.num_experts if geometry.moe_layers[index] else None,
            qk_layernorm=geometry.qk_layernorm, normalization="RMSNorm",
        ))
        layer = spec.submodules
        layer.input_layernorm = norm
        layer.pre_mlp_layernorm = norm
        if geometry.layer_types[index] == LINEAR_ATTENTION:
            layer.input_layernorm = IdentityOp
            layer.self_attention = gated_delta_net_spec()
            specs.append(spec)
            continue
        if flash:
            from art.megatron.packed_attention import SegmentedFlashAttention

            layer.self_attention.submodules.core_attention = SegmentedFlashAttention
        if layer.self_attention.submodules.q_layernorm is not IdentityOp:
            layer.self_attention.submodules.q_layernorm = qk_norm
            layer.self_attention.submodules.k_layernorm = qk_norm
        specs.append(spec)
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=norm)
