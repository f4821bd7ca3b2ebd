"""art.trainer_rank: recompute-aware micro-batch planning for Megatron-Core forwards, with
ART's public interface (every name of upstream's `__all__` imports from here)."""

from art.trainer_rank._impl import TrainerRank
from art.trainer_rank._options import TrainerRankOptions
from art.trainer_rank._types import (
    AdamParams,
    AdapterSelection,
    ForwardInput,
    ForwardOutput,
    MicroBatch,
    MicroBatchStats,
    TopK,
    TrainerRankMemoryError,
    TrainerRankPartialExecutionError,
    TrainerRankPeerError,
    TrainerRankRuntimeSupportError,
    TrainerRankSlotStateError,
    Unset,
    format_stats_table,
)
from art.trainer_rank.slots.files import materialize_lora, validate_checkpoint
from art.trainer_rank.slots.store import PushedCheckpoint
from art.trainer_rank.slots.types import CheckpointManifest, MaterializedCheckpoint

__all__ = [
    "AdamParams",
    "AdapterSelection",
    "CheckpointManifest",
    "ForwardInput",
    "ForwardOutput",
    "MaterializedCheckpoint",
    "MicroBatch",
    "MicroBatchStats",
    "PushedCheckpoint",
    "TopK",
    "TrainerRank",
    "TrainerRankMemoryError",
    "TrainerRankOptions",
    "TrainerRankPartialExecutionError",
    "TrainerRankPeerError",
    "TrainerRankRuntimeSupportError",
    "TrainerRankSlotStateError",
    "Unset",
    "format_stats_table",
    "materialize_lora",
    "validate_checkpoint",
]
