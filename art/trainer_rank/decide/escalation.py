"""Run one micro-batch under another recompute rung than the model was built with.

Megatron-Core 0.16.1 decides full recompute at forward time (TransformerBlock.forward checks
`config.recompute_granularity == 'full' and self.training`, then reads recompute_method and
recompute_num_layers), so setting the shared TransformerConfig is enough to checkpoint layers
in full. Selective recompute, however, is captured at construction into module attributes
(attention `checkpoint_core_attention`, layer `recompute_mlp` / `recompute_*_layernorm`,
MoE `moe_layer_recompute` / `shared_experts_recompute`, experts `activation_recompute`, MLA
`recompute_up_proj`), each read at forward time. So a rung sets the config for its full
layers and every layer's flags to what the rung runs there: off inside a full checkpoint
(otherwise the layer would nest selective checkpoints inside the full one and recompute them
twice in backward), the rung's modules elsewhere.

The switch must stay in place until the caller's backward has finished (the checkpoints
re-run their parts then). If the caller defers backward past the restore, results are still
identical (recompute is deterministic); only the memory profile differs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from art.megatron.recompute import EffectiveRecompute, LayerRecompute

SELECTIVE_FLAGS: tuple[str, ...] = (
    "checkpoint_core_attention",
    "recompute_input_layernorm",
    "recompute_pre_mlp_layernorm",
    "recompute_mlp",
    "moe_layer_recompute",
    "shared_experts_recompute",
    "activation_recompute",
    "recompute_up_proj",
)


def _transformer_configs(model: torch.nn.Module) -> list:
    from megatron.core.transformer import TransformerConfig

    seen: dict[int, object] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, TransformerConfig):
            seen.setdefault(id(config), config)
    return list(seen.values())


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer layers (Megatron's TransformerLayer, Gated DeltaNet ones too)."""
    return [m for m in model.modules()
            if hasattr(m, "recompute_mlp") and hasattr(m, "layer_number")]


def _layer_flags(layer: torch.nn.Module, lr: LayerRecompute | None
                 ) -> list[tuple[torch.nn.Module, str, bool]]:
    """(module, flag, value) for every selective flag of `layer` under `lr` (None: all off)."""
    modules = frozenset() if lr is None or lr.full_checkpoint_unit is not None \
        else lr.selective_modules
    norms = frozenset() if lr is None else lr.recomputed_norms
    wanted = {
        "checkpoint_core_attention": "core_attn" in modules,
        "recompute_input_layernorm": "layernorm" in modules and "input" in norms,
        "recompute_pre_mlp_layernorm": "layernorm" in modules and "pre_mlp" in norms,
        "recompute_mlp": "mlp" in modules,
        "moe_layer_recompute": "moe" in modules,
        "shared_experts_recompute": "shared_experts" in modules,
        "activation_recompute": "moe_act" in modules,
        "recompute_up_proj": "mla_up_proj" in modules,
    }
    out = []
    for module in layer.modules():
        for name in SELECTIVE_FLAGS:
            if isinstance(module.__dict__.get(name), bool):
                out.append((module, name, wanted[name]))
    return out


@contextlib.contextmanager
def _switched(model: torch.nn.Module, granularity: str | None, method: str | None,
              num_layers: int | None,
              flags: list[tuple[torch.nn.Module, str, bool]]) -> Iterator[None]:
    configs = _transformer_configs(model)
    if not configs:
        raise TypeError(
            f"{type(model).__name__} holds no Megatron TransformerConfig; switching the "
            "recompute of a micro-batch needs a Megatron-Core model"
        )
    saved_configs = [
        (c, c.recompute_granularity, c.recompute_method, c.recompute_num_layers) for c in configs
    ]
    saved_flags = [(module, name, module.__dict__[name]) for module, name, _ in flags]
    try:
        for c in configs:
            # Assigned attribute by attribute: TransformerConfig validates only in __post_init__.
            c.recompute_granularity = granularity
            c.recompute_method = method
            c.recompute_num_layers = num_layers
        for module, name, value in flags:
            setattr(module, name, value)
        yield
    finally:
        for c, granularity, method, layers in saved_configs:
            c.recompute_granularity = granularity
            c.recompute_method = method
            c.recompute_num_layers = layers
        for module, name, value in saved_flags:
            setattr(module, name, value)


def running_recompute(model: torch.nn.Module, recompute: EffectiveRecompute
                      ) -> contextlib.AbstractContextManager[None]:
    """Inside the block, `model` recomputes exactly what `recompute` says, layer by layer.
    Its layers are matched by Megatron's global `layer_number`."""
    flags: list[tuple[torch.nn.Module, str, bool]] = []
    for layer in _layers(model):
        index = int(layer.layer_number) - 1
        if not 0 <= index < len(recompute.layers):
            raise ValueError(
                f"layer_number {index + 1} is outside the {len(recompute.layers)} layers of "
                "the recompute policy; the policy was resolved for another model"
            )
        flags += _layer_flags(layer, recompute.layers[index])
    full = recompute.granularity == "full"
    return _switched(model, recompute.granularity, recompute.method if full else None,
                     recompute.num_layers if full else None, flags)


def full_recompute(model: torch.nn.Module, num_layers: int = 1
                   ) -> contextlib.AbstractContextManager[None]:
    """Inside the block, `model` checkpoints every layer (uniform, `num_layers` per unit)."""
    flags = [(module, name, False) for module in model.modules() for name in SELECTIVE_FLAGS
             if isinstance(module.__dict__.get(name), bool)]
    return _switched(model, "full", "uniform", num_layers, flags)
