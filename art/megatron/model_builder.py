"""Geometry + layout + recompute + dtype -> Megatron-Core TransformerConfig and GPTModel.

Local layer spec on CPU (or without Transformer Engine), TE spec when TE and CUDA exist.
Megatron's parallel state must be initialised first (see `distributed.initialize_distributed`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from art.megatron import cpu_runtime
from art.megatron.geometry import ATTENTION, ModelGeometry
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.megatron.specs.norms import QkTorchRMSNorm, SequenceParallelTorchRMSNorm

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


@dataclass(frozen=True)
class RecomputeConfig:
    """The raw Megatron recompute knobs (already validated by `recompute.resolve_recompute`)."""

    granularity: str | None = None
    method: str | None = None
    num_layers: int | None = None
    modules: tuple[str, ...] | None = None


def build_transformer_config(
    geometry: ModelGeometry,
    *,
    layout: ParallelLayout,
    recompute: RecomputeConfig,
    dtype: str | None = None,
    implementation: Implementation | None = None,
    expert_tensor_parallel: int | None = None,
):
    """`expert_tensor_parallel`: None keeps Megatron's default (= tensor parallel), which is
    what `initialize_distributed` sets up when not told otherwise."""
    from megatron.core.transformer import TransformerConfig

    impl = implementation or Implementation.detect()
    dtype = dtype or geometry.dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if ATTENTION not in geometry.layer_types:
        raise ValueError(f"{geometry.name} has no attention layers")
    torch_dtype = DTYPES[dtype]
    kwargs: dict = dict(
        num_layers=geometry.num_layers,
        hidden_size=geometry.hidden_size,
        ffn_hidden_size=geometry.ffn_hidden_size,
        num_attention_heads=geometry.num_attention_heads,
        num_query_groups=geometry.num_query_groups,
        kv_channels=geometry.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=geometry.norm_epsilon,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=geometry.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        params_dtype=torch_dtype,
        pipeline_dtype=torch_dtype,
        tensor_model_parallel_size=layout.tensor_parallel,
        pipeline_model_parallel_size=layout.pipeline_parallel,
        context_parallel_size=layout.context_parallel,
        expert_model_parallel_size=layout.expert_parallel,
        virtual_pipeline_model_parallel_size=(
            layout.virtual_pipeline_parallel if layout.virtual_pipeline_parallel > 1 else None
        ),
        sequence_parallel=layout.sequence_parallel,
        use_cpu_initialization=impl.device == "cpu",
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        # Fused kernels exist only on GPU; on CPU the torch paths are what is built. RoPE
        # fusion is Transformer Engine's kernel (Megatron-Core 0.16.1 refuses the config
        # without TE), and the local spec's fused softmax needs Megatron's compiled softmax
        # extension, which a CUDA machine without TE does not have either: both only with TE.
        bias_activation_fusion=impl.swiglu_fused,
        masked_softmax_fusion=impl.device == "cuda" and impl.spec == "te",
        persist_layer_norm=False,
        bias_dropout_fusion=impl.device == "cuda",
        apply_rope_fusion=impl.device == "cuda" and impl.spec == "te",
        recompute_granularity=recompute.granularity,
        recompute_method=recompute.method,
        recompute_num_layers=recompute.num_layers,
    )
    if expert_tensor_parallel is not None:
        kwargs["expert_tensor_parallel_size"] = expert_tensor_parallel
    if geometry.gated_attention_output:
        kwargs["attention_output_gate"] = True
    if geometry.is_hybrid:
        from art.megatron.specs.hybrid import linear_attention_pattern

        la = geometry.linear_attention
        assert la is not None
        kwargs.update(
            experimental_attention_variant="gated_delta_net",
            linear_attention_freq=linear_attention_pattern(geometry),
            linear_conv_kernel_dim=la.conv_kernel_size,
            linear_key_head_dim=la.key_head_dim,
            linear_value_head_dim=la.value_head_dim,
            linear_num_key_heads=la.num_key_heads,
            linear_num_value_heads=la.num_value_heads,
        )
    if recompute.granularity == "selective" and recompute.modules is not None:
        kwargs["recompute_modules"] = list(recompute.modules)
    if geometry.is_moe:
        kwargs.update(
            num_moe_experts=geometry.num_experts,
            moe_router_topk=geometry.moe_router_topk,
            moe_ffn_hidden_size=geometry.moe_ffn_hidden_size,
            moe_token_dispatcher_type="alltoall",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
        )
        if geometry.shared_expert_ffn_hidden_size:
            kwargs["moe_shared_expert_intermediate_size"] = geometry.shared_expert_ffn_hidden_size
    context_parallel = kwargs.get("context_parallel_size", 1)
    if geometry.is_hybrid and context_parallel > 1:
        # Megatron-Core asserts CP == 1 for Gated DeltaNet, whose own forward does not split
        # the row; the layer built here gathers the whole row over CP and runs the recurrence
        # on it (specs/gated_delta_net.py), so the config is checked at CP = 1 and then given
        # the real size.
        kwargs["context_parallel_size"] = 1
    config = TransformerConfig(**kwargs)
    config.context_parallel_size = context_parallel
    if impl.gpu_shaped_cpu:
        from art.megatron.cpu_runtime import GPU_SHAPED_CONFIG_FLAG

        setattr(config, GPU_SHAPED_CONFIG_FLAG, True)
    if impl.device == "cuda" and impl.delta_rule == "torch" and geometry.is_hybrid:
        from art.megatron.specs.gated_delta_net import TORCH_DELTA_RULE_CONFIG_FLAG

        setattr(config, TORCH_DELTA_RULE_CONFIG_FLAG, True)
    return config


def layer_spec(geometry: ModelGeometry, implementation: Implementation, config=None):
    """Megatron's layer spec for this implementation. With the local spec and a config that
    turns sequence parallel on, the torch norms are swapped for ones that accept it (see
    specs/norms.py), and a block spec for this pipeline stage is returned so the final norm
    is too."""
    from megatron.core.models.gpt import gpt_layer_specs

    num_experts = geometry.num_experts or None
    if geometry.is_hybrid:
        if implementation.spec == "te":
            from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
                get_transformer_block_with_experimental_attention_variant_spec,
            )

            from art.megatron.specs.gated_delta_net import with_packed_gated_delta_net

            # Megatron's own GatedDeltaNet refuses packed rows: its mixers are ours.
            return with_packed_gated_delta_net(
                get_transformer_block_with_experimental_attention_variant_spec(config))
        from art.megatron.specs.hybrid import hybrid_block_spec

        return hybrid_block_spec(geometry, config, implementation)
    if implementation.spec == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, qk_layernorm=geometry.qk_layernorm
        )
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts, qk_layernorm=geometry.qk_layernorm, normalization="RMSNorm"
    )
    if implementation.attention == "flash":
        spec = _with_segmented_flash_attention(spec)
    if implementation.gpu_shaped_cpu:
        from art.megatron.cpu_fused import FusedRMSNorm

        return _local_block_spec_with_norms(spec, config, FusedRMSNorm, FusedRMSNorm)
    if config is None or not config.sequence_parallel:
        return spec
    return _local_block_spec_with_norms(spec, config, SequenceParallelTorchRMSNorm,
                                        QkTorchRMSNorm)


def _with_segmented_flash_attention(spec):
    """The local spec with Megatron's unfused DotProductAttention replaced by the segmented
    flash attention (same constructor, no parameters, keeps output + logsumexp only)."""
    import copy

    from art.megatron.packed_attention import SegmentedFlashAttention

    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = SegmentedFlashAttention
    return spec


def _local_block_spec_with_norms(spec, config, norm, qk_norm):
    """The local spec with `norm` as input, pre-MLP and final norm and `qk_norm` as per-head
    q/k norm; a block spec for this pipeline stage when `config` is given (the final norm is
    the block's), else the layer spec."""
    import copy

    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    spec = copy.deepcopy(spec)
    layer = spec.submodules
    layer.input_layernorm = norm
    layer.pre_mlp_layernorm = norm
    attention = layer.self_attention.submodules
    if attention.q_layernorm is not IdentityOp:
        attention.q_layernorm = qk_norm
        attention.k_layernorm = qk_norm
    if config is None:
        return spec
    # A TransformerBlockSubmodules is used as given, so it lists only this stage's layers.
    return TransformerBlockSubmodules(
        layer_specs=[spec] * get_num_layers_to_build(config),
        layer_norm=norm,
    )


def build_gpt_model(
    geometry: ModelGeometry,
    config,
    *,
    implementation: Implementation | None = None,
    seed: int = 0,
):
    """Build a GPTModel on this rank's device, in the config's dtype, in training mode."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    cpu_runtime.install()
    impl = implementation or Implementation.detect()
    torch.manual_seed(seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(geometry, impl, config),
        vocab_size=geometry.vocab_size,
        max_sequence_length=geometry.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=geometry.tied_embeddings,
        position_embedding_type="rope",
        rotary_percent=geometry.rotary_fraction,
        rotary_base=int(geometry.rope_theta),
    )
    model = model.to(dtype=config.params_dtype)
    if impl.device == "cuda":
        model = model.cuda()
    model.train()
    return model
