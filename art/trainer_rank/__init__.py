"""art.trainer_rank: recompute-aware micro-batch planning for Megatron-Core forwards."""

from art.trainer_rank._impl import Runtime, TrainerRank
from art.trainer_rank._options import TrainerRankOptions
from art.trainer_rank._types import (
    ForwardInput,
    ForwardOutput,
    MicroBatch,
    MicroBatchStats,
    TopK,
    TrainerRankMemoryError,
    TrainerRankRuntimeSupportError,
    format_stats_table,
)

__all__ = [
    "ForwardInput",
    "ForwardOutput",
    "MicroBatch",
    "MicroBatchStats",
    "Runtime",
    "TopK",
    "TrainerRank",
    "TrainerRankMemoryError",
    "TrainerRankOptions",
    "TrainerRankRuntimeSupportError",
    "format_stats_table",
]
