"""Run one micro-batch under full recompute on a model built with another policy.

Megatron-Core 0.16.1 decides full recompute at forward time (TransformerBlock.forward checks
`config.recompute_granularity == 'full' and self.training`, then reads recompute_method and
recompute_num_layers), so flipping the shared TransformerConfig is enough to checkpoint every
layer. Selective recompute, however, is captured at construction into module attributes
(attention/block `checkpoint_core_attention`, layer `recompute_mlp` / `recompute_*_layernorm`,
MoE `moe_layer_recompute` / `shared_experts_recompute`, experts `activation_recompute`, MLA
`recompute_up_proj`). A model built for full recompute has all of them False, so they are
switched off too: otherwise each checkpointed layer would nest selective checkpoints inside
the full one and recompute attention twice in backward.

The switch must stay in place until the caller's backward has finished (the full checkpoint
re-runs its layers then). If the caller defers backward past the restore, results are still
identical (recompute is deterministic); only the memory profile differs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

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


@contextlib.contextmanager
def full_recompute(model: torch.nn.Module, num_layers: int = 1) -> Iterator[None]:
    """Inside the block, `model` checkpoints every layer (uniform, `num_layers` per unit)."""
    configs = _transformer_configs(model)
    if not configs:
        raise TypeError(
            f"full_recompute: {type(model).__name__} holds no Megatron TransformerConfig; "
            "escalation needs a Megatron-Core model"
        )
    saved_configs = [
        (c, c.recompute_granularity, c.recompute_method, c.recompute_num_layers) for c in configs
    ]
    saved_flags: list[tuple[torch.nn.Module, str, object]] = []
    for module in model.modules():
        for name in SELECTIVE_FLAGS:
            value = module.__dict__.get(name)
            if isinstance(value, bool) and value:
                saved_flags.append((module, name, value))
    try:
        for c in configs:
            # Assigned attribute by attribute: TransformerConfig validates only in __post_init__.
            c.recompute_granularity = "full"
            c.recompute_method = "uniform"
            c.recompute_num_layers = num_layers
        for module, name, _ in saved_flags:
            setattr(module, name, False)
        yield
    finally:
        for c, granularity, method, layers in saved_configs:
            c.recompute_granularity = granularity
            c.recompute_method = method
            c.recompute_num_layers = layers
        for module, name, value in saved_flags:
            setattr(module, name, value)
