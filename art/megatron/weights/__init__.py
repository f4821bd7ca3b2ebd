"""Hugging Face safetensors checkpoints <-> Megatron-Core models, sharded per rank.

`prepare_checkpoint(folder, geometry)` checks a local folder before anything is built;
`load_into(model, prepared)` fills a built model (each rank reads only its own slices);
`hf_state_dict` / `save_hf_checkpoint` export back (optionally with LoRA merged in).
One module per family (qwen3, llama, qwen3_moe) says which HF tensors make which Megatron
parameter; `layouts` says how they are split over TP / expert-TP ranks.
"""

from art.megatron.weights.checkpoint import CheckpointError, HFCheckpoint, open_checkpoint
from art.megatron.weights.family import UnsupportedCheckpointError
from art.megatron.weights.load import (
    LoadReport,
    PreparedCheckpoint,
    load_into,
    load_pretrained,
    prepare_checkpoint,
)
from art.megatron.weights.pretrained import checkpoint_folder, prepare_pretrained
from art.megatron.weights.registry import family_for

__all__ = [
    "CheckpointError", "HFCheckpoint", "LoadReport", "PreparedCheckpoint",
    "UnsupportedCheckpointError", "checkpoint_folder", "family_for", "load_into", "load_pretrained",
    "open_checkpoint", "prepare_checkpoint", "prepare_pretrained",
]
