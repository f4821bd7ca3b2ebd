"""Adapter checkpoint slots: resident LoRA adapters named by their checkpoint paths, which one
a forward applies, per-slot optimizer state, and saving/loading them as peft checkpoints."""

from art.trainer_rank.slots.files import materialize_lora, validate_checkpoint
from art.trainer_rank.slots.routing import adapter_groups, run_by_adapter
from art.trainer_rank.slots.saving import SaveQueue, export_lora
from art.trainer_rank.slots.store import BUILTIN, PushedCheckpoint, Slot, SlotStore
from art.trainer_rank.slots.types import (
    AdapterSelection,
    CheckpointManifest,
    MaterializedCheckpoint,
    TrainerRankSlotStateError,
    Unset,
)

__all__ = [
    "BUILTIN", "AdapterSelection", "CheckpointManifest", "MaterializedCheckpoint",
    "PushedCheckpoint", "SaveQueue", "Slot", "SlotStore", "TrainerRankSlotStateError", "Unset",
    "adapter_groups", "export_lora", "materialize_lora", "run_by_adapter", "validate_checkpoint",
]
