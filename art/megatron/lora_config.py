"""What a peft `LoraConfig` selects on a Megatron GPT model, and what this LoRA cannot do
faithfully (rejected before any model is built)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from peft import LoraConfig

    from art.megatron.geometry import ModelGeometry

HF_PROJECTIONS: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)
MEGATRON_TO_HF: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}


def requested_projections(target_modules: Any) -> frozenset[str]:
    """peft target_modules -> the HF projection names they select. Raises on unknown names."""
    if target_modules is None:
        raise ValueError(
            "LoraConfig.target_modules is None; name the projections, e.g. "
            "['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'] "
            "or 'all-linear'"
        )
    if isinstance(target_modules, str):
        if target_modules == "all-linear":
            return frozenset(HF_PROJECTIONS)
        raise ValueError(
            f"LoraConfig.target_modules={target_modules!r}: a regular expression is not "
            "supported; give a list of projection names or 'all-linear'"
        )
    selected: set[str] = set()
    for name in target_modules:
        if name in HF_PROJECTIONS:
            selected.add(name)
        elif name in MEGATRON_TO_HF:
            selected.update(MEGATRON_TO_HF[name])
        elif name == "all-linear":
            selected.update(HF_PROJECTIONS)
        else:
            raise ValueError(
                f"LoRA target module {name!r} is not known; use HF names "
                f"({', '.join(HF_PROJECTIONS)}) or Megatron names ({', '.join(MEGATRON_TO_HF)})"
            )
    if not selected:
        raise ValueError("LoraConfig.target_modules is empty; nothing would be trained")
    return frozenset(selected)


def lora_scaling(config: LoraConfig) -> float:
    r = int(config.r)
    alpha = float(config.lora_alpha)
    return alpha / math.sqrt(r) if getattr(config, "use_rslora", False) else alpha / r


def validate_lora_config(config: LoraConfig, geometry: ModelGeometry | None = None) -> None:
    """Reject what this LoRA cannot do faithfully, before any model is built."""
    if int(config.r) < 1:
        raise ValueError(f"LoraConfig.r must be >= 1, got {config.r}")
    requested_projections(config.target_modules)
    if float(getattr(config, "lora_dropout", 0.0) or 0.0) != 0.0:
        raise ValueError(
            f"LoraConfig.lora_dropout={config.lora_dropout}: dropout on the LoRA input is not "
            "supported (it would differ between TP ranks); set it to 0"
        )
    if getattr(config, "bias", "none") != "none":
        raise ValueError(f"LoraConfig.bias={config.bias!r} is not supported; use 'none'")
    if getattr(config, "use_dora", False):
        raise ValueError("LoraConfig.use_dora=True (DoRA) is not supported; use plain LoRA")

__all__ = ["HF_PROJECTIONS", "MEGATRON_TO_HF", "lora_scaling", "requested_projections",
           "validate_lora_config"]
