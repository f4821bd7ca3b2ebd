"""Which checkpoint a provider's "pretrained" weights come from, checked before any build.

The provider's geometry remembers the config.json it was read from. A local checkpoint
folder (config.json beside *.safetensors) is the only source: a shipped config name has no
weights, and nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from art.megatron.geometry import MODEL_CONFIG_DIR
from art.megatron.weights.checkpoint import CheckpointError
from art.megatron.weights.load import PreparedCheckpoint, prepare_checkpoint


def checkpoint_folder(provider: Any) -> Path:
    """The local folder the provider's model config came from; raises when it has none."""
    geometry = provider.geometry
    source = Path(geometry.source) if geometry.source else None
    if source is None or source.parent == MODEL_CONFIG_DIR:
        origin = "a shipped config" if source is not None else "a geometry given in code"
        raise CheckpointError(
            f"model_initialization='pretrained': {geometry.name!r} is {origin}, which has no "
            "weights. Pass model_identifier=<local folder with config.json and *.safetensors> "
            "(nothing is downloaded), or model_initialization='random' for random weights"
        )
    return source.parent if source.name == "config.json" else source


def prepare_pretrained(provider: Any) -> PreparedCheckpoint:
    """Check the provider's checkpoint folder against its geometry (as configured, e.g. with
    fewer layers) before the model is built."""
    return prepare_checkpoint(checkpoint_folder(provider), provider.geometry)
