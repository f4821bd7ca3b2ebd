"""Implementation: the kernels a built model really uses; they decide what a layer keeps."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Implementation:
    """attention: "flash" (fused; keeps q, k, v, out and softmax stats: TE's with the TE
    spec; on the local spec our segmented flash attention, over torch's CPU flash kernel on
    CPU and torch's CUDA flash / memory-efficient SDPA kernels on CUDA) or "unfused"
    (Megatron's DotProductAttention; keeps s^2 scores and probabilities). norm: "fused"
    (keeps input + fp32 rstd: TE's, or torch's CUDA `_fused_rms_norm`) or "torch" (the
    CPU composite rms_norm keeps fp32 copies). spec: "local" (Megatron's local layer spec)
    or "te" (Transformer Engine spec). delta_rule: the Gated DeltaNet layers' chunked delta
    rule, "fla" (fla's Triton kernels, CUDA only) or "torch" (`cpu_gated_delta`: the same
    contract and saved set in plain torch; on CPU always, on CUDA where fla refuses its
    backward, see fla_support.py).
    """

    spec: str = "te"
    attention: str = "flash"
    norm: str = "fused"
    swiglu_fused: bool = True
    device: str = "cuda"
    delta_rule: str = "fla"

    def __post_init__(self) -> None:
        if self.spec not in ("local", "te"):
            raise ValueError(f"spec must be 'local' or 'te', got {self.spec!r}")
        if self.attention not in ("flash", "unfused"):
            raise ValueError(f"attention must be 'flash' or 'unfused', got {self.attention!r}")
        if self.norm not in ("fused", "torch"):
            raise ValueError(f"norm must be 'fused' or 'torch', got {self.norm!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cpu":
            # fla's kernels need a GPU: every CPU build runs the torch rule.
            object.__setattr__(self, "delta_rule", "torch")
        if self.delta_rule not in ("fla", "torch"):
            raise ValueError(f"delta_rule must be 'fla' or 'torch', got {self.delta_rule!r}")

    @property
    def norm_fused_into_linear(self) -> bool:
        """The TE spec fuses the pre-attention and pre-MLP norms into the next linear."""
        return self.spec == "te"

    @property
    def attention_takes_tree(self) -> bool:
        """Whether the built core attention takes a prefix-tree `AttentionLayout`: the local
        spec's segmented flash attention (CPU or CUDA) takes it as is, Megatron's unfused
        attention as its dense mask. TE's THD attention takes per-sequence cu_seqlens only,
        so a TE build packs every sequence in full (see README, "On a GPU cluster")."""
        return self.spec == "local"

    @property
    def key(self) -> str:
        fused = "swiglu-fused" if self.swiglu_fused else "swiglu-unfused"
        # The torch rule is named only where it is not the device's own (CUDA).
        rule = "/torch-delta-rule" if self.device == "cuda" and self.delta_rule == "torch" else ""
        return f"{self.spec}/{self.attention}/{self.norm}-norm/{fused}/{self.device}{rule}"

    @classmethod
    def cpu_local(cls, attention: str = "flash") -> Implementation:
        """Megatron's local spec on CPU (no TE, no apex); attention "flash" (the segmented
        flash attention over torch's CPU flash kernel, see packed_attention: the default, as
        on a CUDA build without TE) or "unfused" (Megatron's DotProductAttention, which keeps
        s^2 scores and probabilities)."""
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
    def gpu_te(cls, delta_rule: str = "fla") -> Implementation:
        return cls(delta_rule=delta_rule)

    @classmethod
    def cuda_local(cls, norm: str = "fused", delta_rule: str = "fla") -> Implementation:
        """A CUDA build without Transformer Engine: Megatron's local spec with the segmented
        flash attention over torch's CUDA SDPA kernels (packed rows and prefix trees, no
        s^2 term), torch's RMSNorm (torch >= 2.8 runs it as the fused CUDA kernel
        `_fused_rms_norm`, which keeps the input and an fp32 rstd: norm "fused"; `detect`
        checks that the kernel is registered and says "torch" otherwise), unfused SwiGLU
        and RoPE (their fusions need TE or Megatron's compiled extensions here)."""
        return cls(spec="local", attention="flash", norm=norm, swiglu_fused=False,
                   device="cuda", delta_rule=delta_rule)

    def for_context_parallel(self) -> Implementation:
        """What the runtime builds for CP > 1 on this implementation's device: the local spec
        with the segmented flash attention (see `detect`)."""
        if self.spec == "local" and self.attention == "flash":
            return self
        if self.device == "cuda":
            return Implementation.cuda_local("fused" if self.norm == "fused" else "torch",
                                             self.delta_rule)
        return Implementation.cpu_local("flash")

    @classmethod
    def detect(cls, context_parallel: int = 1) -> Implementation:
        """What `model_builder` will build on this machine. Context parallel runs in the
        segmented flash attention (see context_parallel.py), so CP > 1 builds the local spec
        with it on CUDA without Transformer Engine even where TE is installed. On CPU the
        local spec with the segmented flash attention is built at every layout."""
        from art.megatron.cpu_runtime import cuda_available, transformer_engine_available

        if not cuda_available():
            return cls.cpu_local()
        if transformer_engine_available() and context_parallel == 1:
            return cls.gpu_te(detected_delta_rule())
        return cls.detected_cuda_local()

    @classmethod
    def detected_cuda_local(cls) -> Implementation:
        """The CUDA build without Transformer Engine on this machine: torch's fused RMSNorm
        where its kernel is registered, and fla's delta rule unless fla would refuse it."""
        return cls.cuda_local("fused" if torch_cuda_rms_norm_fused() else "torch",
                              detected_delta_rule())


def detected_delta_rule() -> str:
    """fla's delta rule, or where fla would refuse its backward the torch rule (slower,
    correct; fla_support.py)."""
    from art.megatron.fla_support import fla_delta_rule_refusal

    return "torch" if fla_delta_rule_refusal() is not None else "fla"


def torch_cuda_rms_norm_fused() -> bool:
    """Whether this torch has a CUDA kernel for `aten::_fused_rms_norm`, which
    `aten::rms_norm` (torch.nn.RMSNorm) calls for CUDA tensors whose weight has the input's
    dtype (torch's layer_norm.cpp, `rms_norm_symint`); its autograd saves the input, the
    weight and the fp32 rstd (derivatives.yaml). CPU builds have only the composite."""
    import torch

    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm",
                                                                   "CUDA"))
    except (AttributeError, RuntimeError):
        return False


def cuda_sdpa_kernel(dtype_bytes: int, head_dim: int) -> str:
    """Which of torch's CUDA SDPA kernels the segmented flash attention calls for a model
    of this dtype and head size: "flash" (FlashAttention-2, fp16/bf16, head dim a multiple
    of 8 up to 256: `mha_fwd`'s checks in aten/.../flash_attn/flash_api.cpp) or
    "efficient" (the memory-efficient CUTLASS kernel: fp32 and every other head size).
    packed_attention asks torch's own `can_use_flash_attention` at run time too (GPU
    generation, sm86/89 head-dim limits); this is the part the memory model can know."""
    return "flash" if dtype_bytes == 2 and head_dim % 8 == 0 and head_dim <= 256 else "efficient"
