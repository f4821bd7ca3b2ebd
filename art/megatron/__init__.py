"""art.megatron: settings, recompute policy, model building and CPU runtime for Megatron-Core."""
