"""Implementation: the kernels a built model really uses; they decide what a layer keeps."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Implementation:
    """attention: "flash" (fused; keeps q, k, v, out and softmax stats: TE's on GPU, on the
    local spec our segmented flash attention over torch's CPU flash kernels) or "unfused"
    (Megatron's DotProductAttention; keeps s^2 scores and probabilities). norm: "fused"
    (keeps input + fp32 rstd) or "torch" (CPU composite rms_norm keeps fp32 copies).
    spec: "local" (Megatron's local layer spec) or "te" (Transformer Engine spec).
    """

    spec: str = "te"
    attention: str = "flash"
    norm: str = "fused"
    swiglu_fused: bool = True
    device: str = "cuda"

    def __post_init__(self) -> None:
        if self.spec not in ("local", "te"):
            raise ValueError(f"spec must be 'local' or 'te', got {self.spec!r}")
        if self.attention not in ("flash", "unfused"):
            raise ValueError(f"attention must be 'flash' or 'unfused', got {self.attention!r}")
        if self.norm not in ("fused", "torch"):
            raise ValueError(f"norm must be 'fused' or 'torch', got {self.norm!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")

    @property
    def norm_fused_into_linear(self) -> bool:
        """The TE spec fuses the pre-attention and pre-MLP norms into the next linear."""
        return self.spec == "te"

    @property
    def key(self) -> str:
        fused = "swiglu-fused" if self.swiglu_fused else "swiglu-unfused"
        return f"{self.spec}/{self.attention}/{self.norm}-norm/{fused}/{self.device}"

    @classmethod
    def cpu_local(cls, attention: str = "unfused") -> Implementation:
        """Megatron's local spec on CPU (no TE, no apex); attention "unfused" (Megatron's
        DotProductAttention) or "flash" (segmented flash attention, see packed_attention)."""
        return cls(spec="local", attention=attention, norm="torch", swiglu_fused=False,
                   device="cpu")

    @classmethod
    def cpu_gpu_shaped(cls) -> Implementation:
        """The local spec on CPU with stand-ins that keep what a GPU build's fused kernels keep
        (cpu_fused.py: RMSNorm, SwiGLU, RoPE) and the segmented flash attention: what the "te"
        pricing of norms, SwiGLU and attention assumes, measured on CPU."""
        return cls(spec="local", attention="flash", norm="fused", swiglu_fused=True,
                   device="cpu")

    @property
    def gpu_shaped_cpu(self) -> bool:
        return self.spec == "local" and self.device == "cpu" and self.norm == "fused"

    @classmethod
    def gpu_te(cls) -> Implementation:
        return cls()

    @classmethod
    def detect(cls) -> Implementation:
        """What `model_builder` will build on this machine."""
        from art.megatron.cpu_runtime import cuda_available, transformer_engine_available

        if cuda_available() and transformer_engine_available():
            return cls.gpu_te()
        if cuda_available():
            return cls(spec="local", attention="unfused", norm="torch", swiglu_fused=False,
                       device="cuda")
        return cls.cpu_local()
