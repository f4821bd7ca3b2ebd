"""Provider: a model config plus the ART_MEGATRON_* settings -> a Megatron-Core model, and an
exact account of what Megatron will do with it (layout, implementation, recompute per layer).

Construction validates everything and builds nothing, so the planner can price a model (and
what-if recompute policies) on a machine that could never hold it. `build_model` is the only
step that allocates weights; it needs Megatron's parallel state (`initialize_distributed`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from art.megatron import model_builder, runnable_layouts
from art.megatron.default_layout import default_layout, visible_cuda_gpus
from art.megatron.distributed import DistributedState
from art.megatron.distributed import initialize_distributed as _initialize_distributed
from art.megatron.geometry import ModelGeometry, load_geometry
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.megatron.recompute import EffectiveRecompute, resolve_recompute
from art.megatron.settings import Settings, load_settings

if TYPE_CHECKING:
    from peft import LoraConfig


_RECOMPUTE_VARIABLES: dict[str, str] = {
    "recompute_granularity": "ART_MEGATRON_RECOMPUTE_GRANULARITY",
    "recompute_method": "ART_MEGATRON_RECOMPUTE_METHOD",
    "recompute_num_layers": "ART_MEGATRON_RECOMPUTE_NUM_LAYERS",
    "recompute_modules": "ART_MEGATRON_RECOMPUTE_MODULES",
}


class Provider:
    """Settings + geometry -> TransformerConfig, GPTModel (+ LoRA) and `effective_recompute`."""

    def __init__(
        self,
        model: str | Path | ModelGeometry,
        *,
        settings: Settings | None = None,
        lora: LoraConfig | None = None,
        dtype: str | None = None,
        implementation: Implementation | None = None,
    ) -> None:
        self.settings: Settings = settings if settings is not None else load_settings()
        self.geometry: ModelGeometry = (
            model if isinstance(model, ModelGeometry) else load_geometry(model)
        )
        self.implementation: Implementation = (
            implementation or Implementation.detect(self.settings.context_parallel_size))
        self.dtype: str = dtype or self.geometry.dtype
        if self.dtype not in model_builder.DTYPES:
            raise ValueError(
                f"dtype {self.dtype!r} is not one of {', '.join(model_builder.DTYPES)}"
            )
        self.lora_config: LoraConfig | None = lora
        self._world_size: int | None = None
        self._warned_delta_rule = False
        self._validate()

    def _validate(self) -> None:
        """Check layout, implementation and LoRA against the model, and resolve recompute.
        Runs at construction and again after every field a `provider_configure` hook sets."""
        self._check_layout()
        self._check_implementation()
        if self.lora_config is not None:
            from art.megatron.lora import validate_lora_config

            validate_lora_config(self.lora_config, self.geometry)
        s = self.settings
        try:
            self.effective_recompute: EffectiveRecompute = self.recompute_as(
                s.recompute_granularity, s.recompute_method, s.recompute_num_layers,
                s.recompute_modules,
            )
        except ValueError as exc:
            # The rule that failed depends on the model (layer count, MoE): name the settings
            # it came from so the user knows which variable to change.
            named = ", ".join(
                s.source_of(f) if s.source_of(f) != "default" else f"{_RECOMPUTE_VARIABLES[f]} "
                f"(default {getattr(s, f)})" for f in _RECOMPUTE_VARIABLES
            )
            raise ValueError(f"{named}: {exc} (model {self.geometry.name})") from None

    @classmethod
    def from_env(
        cls,
        model: str | Path | ModelGeometry,
        *,
        env: Mapping[str, str] | None = None,
        lora: LoraConfig | None = None,
        dtype: str | None = None,
        implementation: Implementation | None = None,
    ) -> Provider:
        return cls(model, settings=load_settings(env), lora=lora, dtype=dtype,
                   implementation=implementation)

    # ------------------------------------------------------------------ what Megatron will do
    @property
    def layout(self) -> ParallelLayout:
        """The parallel layout; data parallel is known once distributed is initialised."""
        return self.settings.layout(self._world_size)

    def recompute_as(
        self,
        granularity: str | None,
        method: str | None = None,
        num_layers: int | None = None,
        modules: tuple[str, ...] | list[str] | None = None,
    ) -> EffectiveRecompute:
        """The per-layer policy Megatron would run for these knobs on this model and layout.

        Price-only (nothing is built); validated exactly like the configured policy, so a
        what-if such as full/uniform/1 for escalation fails here if Megatron would fail.
        """
        layout = self.settings.layout()
        return resolve_recompute(
            granularity=granularity,
            method=method,
            num_layers=num_layers,
            modules=None if modules is None else tuple(modules),
            moe_layers=self.geometry.moe_layers,
            layer_types=self.geometry.layer_types,
            pipeline_stages=layout.pipeline_parallel,
            virtual_chunks=layout.virtual_pipeline_parallel,
            norm_fused_into_linear=self.implementation.norm_fused_into_linear,
            has_mla=False,
            # model_builder builds MoE experts as SequentialMLP (moe_grouped_gemm=False).
            has_grouped_gemm=False,
            has_shared_experts=self.geometry.shared_expert_ffn_hidden_size > 0,
        )

    def describe(self) -> str:
        """Human-readable account: model, layout, implementation, recompute per layer."""
        er = self.effective_recompute
        counts: dict[str, int] = {}
        for lr in er.layers:
            label = {"full": "in a full checkpoint", "none": "keep everything"}.get(
                lr.mode, "selective " + "+".join(sorted(lr.selective_modules)))
            label += " (Gated DeltaNet)" if lr.layer_type == "linear_attention" else ""
            counts[label] = counts.get(label, 0) + 1
        return "\n".join(
            [
                f"model {self.geometry.name}: {self.geometry.num_layers} layers, hidden "
                f"{self.geometry.hidden_size}, dtype {self.dtype}",
                f"layout {self.layout.summary}; implementation {self.implementation.key}",
                f"recompute: {er.summary} [{er.key}]",
                "  " + "; ".join(f"{n} layer(s) {label}" for label, n in counts.items()),
                f"  {er.describe_layers()}",
            ]
        )

    # ------------------------------------------------------------------ building
    def initialize_distributed(self) -> DistributedState:
        """torch.distributed + Megatron parallel state for this layout (torchrun env or one
        local process). Idempotent; also fixes the data-parallel size from the world size."""
        layout = self.settings.layout()
        state = _initialize_distributed(
            tensor_parallel=layout.tensor_parallel,
            context_parallel=layout.context_parallel,
            pipeline_parallel=layout.pipeline_parallel,
            virtual_pipeline_parallel=self.settings.virtual_pipeline_model_parallel_size,
            expert_parallel=layout.expert_parallel,
            expert_tensor_parallel=self.settings.expert_tensor_parallel_size,
        )
        self._world_size = state.world_size
        self.settings.layout(state.world_size)  # raises when the world does not divide
        return state

    def _check_buildable(self) -> None:
        if not self.geometry.is_hybrid or self.implementation.device == "cpu":
            return  # on CPU, cpu_runtime supplies the Gated DeltaNet kernels
        import importlib.util

        if importlib.util.find_spec("fla") is None:
            raise ValueError(
                f"{self.geometry.name} has Gated DeltaNet layers; Megatron-Core's GatedDeltaNet "
                "needs the `fla` package (flash-linear-attention) on CUDA. Install "
                "flash-linear-attention, or price it without building (estimate / plan)"
            )
        from art.megatron.fla_support import fla_delta_rule_refusal

        refusal = fla_delta_rule_refusal()
        if refusal is not None and self.implementation.delta_rule == "fla":
            raise ValueError(
                f"{self.geometry.name}: the build asks for fla's delta rule "
                f"({self.implementation.key}), but {refusal}; or build with "
                "Implementation.detect(), which runs the pure-torch rule (slower) here")
        if refusal is not None and not self._warned_delta_rule:
            self._warned_delta_rule = True
            warnings.warn(f"{self.geometry.name}: the Gated DeltaNet layers run the pure-torch "
                          f"delta rule (correct, slower than fla's kernels): {refusal}",
                          stacklevel=3)

    def transformer_config(self):
        """Megatron's TransformerConfig; its recompute fields are checked against ours."""
        self._check_buildable()
        config = model_builder.build_transformer_config(
            self.geometry,
            layout=self.settings.layout(),
            recompute=self.settings.recompute_config(),
            dtype=self.dtype,
            implementation=self.implementation,
            expert_tensor_parallel=self.settings.layout().expert_tensor_parallel,
        )
        expected = self.effective_recompute
        if config.recompute_granularity != expected.granularity or (
            expected.granularity == "selective"
            and tuple(config.recompute_modules) != expected.modules
        ):
            raise RuntimeError(
                f"Megatron's config says recompute {config.recompute_granularity} "
                f"{config.recompute_modules}, the provider resolved {expected.summary}; "
                "the two must agree for memory estimates to hold"
            )
        return config

    def build_model(self, seed: int = 0) -> Any:
        """Build this rank's GPTModel in training mode; with a LoRA config the adapters are
        applied and only they are trainable."""
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError(
                "Megatron's parallel state is not initialised; call "
                "provider.initialize_distributed() before build_model()"
            )
        self._check_parallel_state_matches(parallel_state)
        if self.settings.virtual_pipeline_model_parallel_size not in (None, 1):
            raise ValueError(
                "ART_MEGATRON_VIRTUAL_PIPELINE_MODEL_PARALLEL_SIZE > 1: this provider prices "
                "interleaved virtual chunks but builds one chunk per stage only; unset it to "
                "build a model"
            )
        config = self.transformer_config()
        model = model_builder.build_gpt_model(
            self.geometry, config, implementation=self.implementation, seed=seed
        )
        if self.lora_config is not None:
            from art.megatron.lora import apply_lora

            apply_lora(model, self.lora_config, seed=seed)
        return model

    # ------------------------------------------------------------------ validation
    def _check_layout(self) -> None:
        g, s = self.geometry, self.settings
        tp = s.tensor_model_parallel_size
        etp = s.expert_tensor_parallel_size or tp
        checks = [
            ("num_attention_heads", g.num_attention_heads, tp, "TENSOR_MODEL_PARALLEL_SIZE"),
            ("num_key_value_heads", g.num_query_groups, tp, "TENSOR_MODEL_PARALLEL_SIZE"),
            ("intermediate_size", g.ffn_hidden_size, tp, "TENSOR_MODEL_PARALLEL_SIZE"),
            ("vocab_size", g.vocab_size, tp, "TENSOR_MODEL_PARALLEL_SIZE"),
        ]
        if g.is_moe:
            checks += [
                ("num_experts", g.num_experts, s.expert_model_parallel_size,
                 "EXPERT_MODEL_PARALLEL_SIZE"),
                ("moe_intermediate_size", g.moe_ffn_hidden_size, etp,
                 "EXPERT_TENSOR_PARALLEL_SIZE" if s.expert_tensor_parallel_size else
                 "TENSOR_MODEL_PARALLEL_SIZE (expert TP defaults to it)"),
            ]
        elif s.expert_model_parallel_size > 1:
            named = s.named("expert_model_parallel_size",
                            f"ART_MEGATRON_EXPERT_MODEL_PARALLEL_SIZE={s.expert_model_parallel_size}")
            raise ValueError(f"{named} but {g.name} has no MoE layers; unset it")
        if g.linear_attention is not None:
            la = g.linear_attention
            checks += [
                ("linear_num_key_heads", la.num_key_heads, tp, "TENSOR_MODEL_PARALLEL_SIZE"),
                ("linear_num_value_heads", la.num_value_heads, tp,
                 "TENSOR_MODEL_PARALLEL_SIZE"),
            ]
        fields = {"TENSOR_MODEL_PARALLEL_SIZE": "tensor_model_parallel_size",
                  "EXPERT_MODEL_PARALLEL_SIZE": "expert_model_parallel_size",
                  "EXPERT_TENSOR_PARALLEL_SIZE": "expert_tensor_parallel_size"}
        for what, value, size, variable in checks:
            if value % size:
                field = fields.get(variable.split()[0], "")
                named = s.named(field, f"{variable}={size}") if field else f"{variable}={size}"
                raise ValueError(
                    f"{g.name}: {what}={value} is not divisible by {named}; Megatron "
                    f"shards it evenly. Choose a size that divides {value}"
                )
        chunks = s.pipeline_model_parallel_size * (s.virtual_pipeline_model_parallel_size or 1)
        if g.num_layers % chunks:
            raise ValueError(
                f"{g.name}: {g.num_layers} layers cannot be split evenly over "
                + s.named("pipeline_model_parallel_size",
                          f"PIPELINE_MODEL_PARALLEL_SIZE={s.pipeline_model_parallel_size}")
                + " x "
                f"VIRTUAL_PIPELINE_MODEL_PARALLEL_SIZE="
                f"{s.virtual_pipeline_model_parallel_size or 1}"
            )

    def _check_implementation(self) -> None:
        """Refuse what runnable_layouts says Megatron-Core does not build here (context
        parallel outside the segmented flash attention, or on MoE layers)."""
        s = self.settings
        refused = runnable_layouts.refusal(s.layout(), self.implementation, self.geometry,
                                           asker=runnable_layouts.Asker.PROVIDER)
        if refused is not None:
            raise ValueError(refused.message(s.named(refused.setting, refused.subject)))

    def _check_parallel_state_matches(self, parallel_state: Any) -> None:
        layout = self.settings.layout()
        seen = {
            "TENSOR_MODEL_PARALLEL_SIZE": (
                parallel_state.get_tensor_model_parallel_world_size(), layout.tensor_parallel),
            "PIPELINE_MODEL_PARALLEL_SIZE": (
                parallel_state.get_pipeline_model_parallel_world_size(),
                layout.pipeline_parallel),
            "CONTEXT_PARALLEL_SIZE": (
                parallel_state.get_context_parallel_world_size(), layout.context_parallel),
        }
        for variable, (actual, wanted) in seen.items():
            if actual != wanted:
                raise RuntimeError(
                    f"Megatron's parallel state has {variable}={actual} but the settings say "
                    f"{wanted}; one process initialised Megatron with other settings "
                    "(parallel state is global: one layout per process)"
                )

    def __repr__(self) -> str:
        return (
            f"Provider({self.geometry.name!r}, layout={self.layout.summary!r}, "
            f"dtype={self.dtype!r}, recompute={self.effective_recompute.summary!r}, "
            f"lora={'r=' + str(self.lora_config.r) if self.lora_config else None})"
        )



# Fields a `provider_configure(provider)` hook may read and set, in the names of Megatron's
# TransformerConfig (what upstream's provider exposes): provider field -> ModelGeometry field.
GEOMETRY_FIELDS: dict[str, str] = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_query_groups",
    "kv_channels": "head_dim",
    "vocab_size": "vocab_size",
    "num_moe_experts": "num_experts",
    "moe_router_topk": "moe_router_topk",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "qk_layernorm": "qk_layernorm",
    "rotary_base": "rope_theta",
    "seq_length": "max_position_embeddings",
    "layernorm_epsilon": "norm_epsilon",
    "share_embeddings_and_output_weights": "tied_embeddings",
}
# Provider field -> Settings field (the ART_MEGATRON_* values).
SETTINGS_FIELDS: tuple[str, ...] = (
    "tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "sequence_parallel", "recompute_granularity",
    "recompute_method", "recompute_num_layers", "recompute_modules",
)


def _resized(values: tuple, n: int) -> tuple:
    """A per-layer tuple cut or extended (repeating its pattern) to n layers."""
    if n <= len(values):
        return values[:n]
    return tuple(values[i % len(values)] for i in range(n))


def _geometry_property(field_name: str) -> property:
    def get(self: Provider) -> Any:
        return getattr(self.geometry, field_name)

    def set_(self: Provider, value: Any) -> None:
        import dataclasses

        changes: dict[str, Any] = {field_name: value}
        if field_name == "num_layers":
            changes["layer_types"] = _resized(self.geometry.layer_types, int(value))
            changes["moe_layers"] = _resized(self.geometry.moe_layers, int(value))
        self.geometry = dataclasses.replace(self.geometry, **changes)
        self._validate()

    return property(get, set_)


def _settings_property(field_name: str) -> property:
    def get(self: Provider) -> Any:
        return getattr(self.settings, field_name)

    def set_(self: Provider, value: Any) -> None:
        import dataclasses

        if isinstance(value, list):
            value = tuple(value)
        sources = dict(self.settings.sources)
        sources[field_name] = f"provider_configure: {field_name}={value!r}"
        changes: dict[str, Any] = {field_name: value}
        # Sequence parallel follows TP (on exactly when TP > 1) unless it was set explicitly.
        if field_name == "tensor_model_parallel_size" and "sequence_parallel" not in sources:
            changes["sequence_parallel"] = int(value) > 1
        self.settings = dataclasses.replace(
            self.settings, **changes, sources=tuple(sources.items()))
        self._validate()

    return property(get, set_)


for _name, _field in GEOMETRY_FIELDS.items():
    setattr(Provider, _name, _geometry_property(_field))
for _name in SETTINGS_FIELDS:
    setattr(Provider, _name, _settings_property(_name))

def _dtype_name(torch_dtype: Any) -> str:
    import torch

    names = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
    if isinstance(torch_dtype, str) and torch_dtype in model_builder.DTYPES:
        return torch_dtype
    if torch_dtype not in names:
        raise ValueError(
            f"torch_dtype {torch_dtype!r} is not one of torch.bfloat16, torch.float16, "
            "torch.float32"
        )
    return names[torch_dtype]


def get_provider(
    model: str | Path | ModelGeometry,
    *,
    torch_dtype: Any = None,
    allow_unvalidated_arch: bool = False,
    model_support_key: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Provider:
    """The provider for `model` (a shipped name, an HF id whose last part is shipped, a
    config.json or an HF folder) with the ART_MEGATRON_* settings of `env` (default the
    process environment). `torch_dtype` defaults to bfloat16 as upstream.

    `allow_unvalidated_arch` and `model_support_key` are accepted for upstream's call
    signature; here every architecture the geometry reader accepts is checked by the
    provider's own layout and build checks, so neither changes anything."""
    import torch

    del allow_unvalidated_arch, model_support_key
    if isinstance(model, str) and not Path(model).exists() and "/" in model:
        from art.megatron.geometry import MODEL_CONFIG_DIR

        short = model.rstrip("/").rsplit("/", 1)[-1]
        if (MODEL_CONFIG_DIR / f"{short}.json").is_file():
            model = short
    geometry = model if isinstance(model, ModelGeometry) else load_geometry(model)
    dtype = _dtype_name(torch.bfloat16 if torch_dtype is None else torch_dtype)
    world = os.environ.get("WORLD_SIZE", "1")
    # Upstream's default layout over the visible GPUs when no layout size is set (a process
    # outside torchrun is a world of one).
    settings = default_layout(load_settings(env), geometry, visible_gpus=visible_cuda_gpus(),
                              world_size=int(world) if world.isdigit() else 1)
    return Provider(geometry, settings=settings, dtype=dtype)



def main(argv: list[str] | None = None) -> int:
    """`python -m art.megatron.provider MODEL`: the parsed settings and what Megatron will do
    (layout, implementation, recompute per layer) for the current ART_MEGATRON_* environment."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m art.megatron.provider", description=main.__doc__
    )
    parser.add_argument("model", help="shipped model name or path to a config.json / folder")
    parser.add_argument("--implementation", choices=("detect", "te", "local", "cuda-local"),
                        default="detect",
                        help="price for this kernel set (default: what this machine builds; "
                             "cuda-local: CUDA without Transformer Engine)")
    parser.add_argument("--dtype", default=None)
    args = parser.parse_args(argv)
    impl = {"detect": None, "te": Implementation.gpu_te(), "local": Implementation.cpu_local(),
            "cuda-local": Implementation.cuda_local()}[args.implementation]
    try:
        provider = Provider.from_env(args.model, dtype=args.dtype, implementation=impl)
    except ValueError as error:
        print(f"error: {error}")
        return 2
    print(provider.settings)
    print(provider.describe())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
