"""The decoder families we load, and which one a HF config names (by `architectures`, then
`model_type`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from art.megatron.weights import llama, qwen3, qwen3_5, qwen3_moe
from art.megatron.weights.family import Family, UnsupportedCheckpointError, text_config


def families() -> tuple[Family, ...]:
    return (qwen3.FAMILY, llama.FAMILY, qwen3_moe.FAMILY, qwen3_5.FAMILY)


def family_for(config: Mapping[str, Any]) -> Family:
    """The family of a HF config, by its `architectures` entry (then `model_type`)."""
    cfg = text_config(config)
    names = list(cfg.get("architectures") or config.get("architectures") or [])
    model_type = str(cfg.get("model_type", ""))
    for family in families():
        if any(n in family.architectures for n in names) or (
            not names and model_type == family.name
        ):
            return family
    supported = sorted(a for f in families() for a in f.architectures)
    seen = names[0] if names else f"model_type {model_type!r}"
    raise UnsupportedCheckpointError(
        f"architecture {seen} is not supported for loading weights; supported: "
        f"{', '.join(supported)}"
    )
