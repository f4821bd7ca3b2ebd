"""Torch RMSNorms for the local (non-Transformer-Engine) layer spec: one that accepts sequence
parallel, and the per-head q/k norm."""

from __future__ import annotations

import torch


class SequenceParallelTorchRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm usable under sequence parallel with the local spec.

    Megatron's WrappedTorchNorm refuses sequence parallel only because nobody reduces the norm
    weight's gradient over TP ranks that each saw a slice of the sequence. The norm itself is
    row-wise, so a sequence shard is normalised exactly as in the full row. Marking the weight
    `sequence_parallel` lets Megatron's gradient finalisation (finalize_model_grads) all-reduce
    it, which is what Transformer Engine's and apex's norms do.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_: object) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


class QkTorchRMSNorm(torch.nn.RMSNorm):
    """Per-head q/k RMSNorm for the local spec; it sees whole heads, never sequence shards."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_: object) -> None:
        super().__init__(hidden_size, eps=eps)
