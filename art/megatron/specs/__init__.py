"""Layer specs we build ourselves (Megatron-Core `ModuleSpec`s): the hybrid Gated DeltaNet
block with the local (non-Transformer-Engine) modules."""
