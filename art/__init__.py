"""art: Megatron-Core model building (art.megatron) and the trainer rank (art.trainer_rank)."""
