"""art.trainer_rank: recompute-aware micro-batch planning for Megatron-Core forwards."""
