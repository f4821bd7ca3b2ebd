"""GPU-shaped CPU kernels: stand-ins for the fused kernels a GPU build runs, keeping for backward
exactly what those kernels keep, so the memory a "te"-priced layer keeps is measured on CPU
instead of only read from the kernels' source.

- `FusedRMSNorm` / `fused_rms_norm`: Transformer Engine 2.x keeps the input and one fp32
  reciprocal standard deviation per row (transformer_engine/pytorch/ops/basic/rmsnorm.py,
  `RMSNorm.op_forward`: `ctx.save_for_backward(x, rstdevs)`); torch's composite rms_norm
  keeps fp32 copies of the rows instead.
- `fused_swiglu`: keeps its input only (transformer_engine/pytorch/ops/basic/swiglu.py,
  `SwiGLU`, which caches the input for the backward; Megatron's own fused path,
  megatron/core/fusions/fused_bias_swiglu.py `SwiGLUFunction.forward`, does the same); the
  torch path keeps silu's input and output and both halves for the product.
- `fused_rope`: keeps the rotary frequencies only, not the rotated tensor or cos/sin copies
  (transformer_engine/pytorch/attention/rope.py, `FusedRoPEFunc.forward`:
  `ctx.save_for_backward(freqs, ...)`), and like that kernel rotates the first d2 dims of each
  head for frequencies of d2 dims (partial rotary), passing the rest through.

Each computes in row chunks into its preallocated output, so, like a fused kernel, it
allocates its output (and in backward its gradients) and only chunk-sized temporaries.
Numerically each equals the torch path (tests/megatron/test_cpu_fused.py). The flash-style
attention stand-in is art/megatron/packed_attention.py (SegmentedFlashAttention).
"""

from __future__ import annotations

from typing import Any

import torch

# Rows per chunk: temporaries stay a few rows whatever the row length (a fused kernel has none).
CHUNK_ROWS = 16


def _chunks(rows: int) -> range:
    return range(0, rows, CHUNK_ROWS)


class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x2 = x.contiguous().view(-1, x.shape[-1])
        y = torch.empty_like(x2)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        with torch.no_grad():
            for i in _chunks(x2.shape[0]):
                rows = x2[i:i + CHUNK_ROWS].float()
                r = torch.rsqrt(rows.pow(2).mean(-1) + eps)
                rstd[i:i + CHUNK_ROWS] = r
                y[i:i + CHUNK_ROWS] = (rows * r[:, None]).to(x.dtype) * weight
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, weight, rstd = ctx.saved_tensors
        dy2 = dy.contiguous().view(-1, x2.shape[-1])
        dx = torch.empty_like(x2)
        dw = torch.zeros(x2.shape[-1], dtype=torch.float32, device=x2.device)
        w = weight.float()
        for i in _chunks(x2.shape[0]):
            r = rstd[i:i + CHUNK_ROWS, None]
            xhat = x2[i:i + CHUNK_ROWS].float() * r
            g = dy2[i:i + CHUNK_ROWS].float()
            dw += (g * xhat).sum(0)
            g = g * w
            dx[i:i + CHUNK_ROWS] = (r * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(
                dx.dtype)
        grad_weight = dw.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx.view(ctx.shape), grad_weight, None


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, keeping (input, fp32 rstd) for backward."""
    return _FusedRMSNorm.apply(x, weight, eps)


class FusedRMSNorm(torch.nn.Module):
    """Drop-in for the local spec's norms (input, pre-MLP, final, per-head q/k) with the fused
    kernel's saved set. Accepts sequence parallel: its weight is marked so Megatron reduces
    its gradient over TP ranks, as Transformer Engine's norm does."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: object) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(getattr(config, "sequence_parallel", False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_rms_norm(x, self.weight, self.eps)


class _FusedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        x2 = x.contiguous().view(-1, x.shape[-1])
        half = x2.shape[-1] // 2
        y = torch.empty(x2.shape[0], half, dtype=x.dtype, device=x.device)
        with torch.no_grad():
            for i in _chunks(x2.shape[0]):
                a, b = x2[i:i + CHUNK_ROWS, :half], x2[i:i + CHUNK_ROWS, half:]
                y[i:i + CHUNK_ROWS] = torch.nn.functional.silu(a) * b
        ctx.save_for_backward(x2)
        ctx.shape = x.shape
        return y.view(*x.shape[:-1], half)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor]:
        (x2,) = ctx.saved_tensors
        half = x2.shape[-1] // 2
        dy2 = dy.contiguous().view(-1, half)
        dx = torch.empty_like(x2)
        for i in _chunks(x2.shape[0]):
            a, b = x2[i:i + CHUNK_ROWS, :half], x2[i:i + CHUNK_ROWS, half:]
            g = dy2[i:i + CHUNK_ROWS]
            sig = torch.sigmoid(a)
            silu = a * sig
            dx[i:i + CHUNK_ROWS, half:] = g * silu
            dx[i:i + CHUNK_ROWS, :half] = g * b * (sig + silu * (1 - sig))
        return (dx.view(ctx.shape),)


def fused_swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(first half) x second half of the last dimension, keeping only `x` for backward."""
    return _FusedSwiGLU.apply(x)


def bias_swiglu(x: torch.Tensor, bias: torch.Tensor | None, fp8_input_store: bool = False,
                cpu_offload_input: bool = False) -> torch.Tensor:
    """Megatron's `bias_swiglu_impl` signature (MLP with bias_activation_fusion)."""
    if fp8_input_store or cpu_offload_input:
        raise ValueError("the CPU SwiGLU stand-in keeps its input as is: fp8_input_store="
                         f"{fp8_input_store}, cpu_offload_input={cpu_offload_input} are GPU "
                         "options; turn them off on CPU")
    return fused_swiglu(x if bias is None else x + bias)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotate_half_transposed(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((second, -first), dim=-1)


class _FusedRoPE(torch.autograd.Function):
    # The first `rotary` dims of each head are rotated, the rest pass through (partial
    # rotary: transformer_engine's kernel takes freqs of d2 <= d dims the same way).
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        rotary = freqs.shape[-1]
        out = torch.empty_like(t)
        with torch.no_grad():
            for i in _chunks(t.shape[0]):
                f = freqs[i:i + CHUNK_ROWS] if freqs.shape[0] > 1 else freqs
                rows = t[i:i + CHUNK_ROWS, ..., :rotary]
                out[i:i + CHUNK_ROWS, ..., :rotary] = (rows * f.cos().to(t.dtype)
                                                       + _rotate_half(rows) * f.sin().to(t.dtype))
            out[..., rotary:] = t[..., rotary:]
        ctx.save_for_backward(freqs)
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None]:
        (freqs,) = ctx.saved_tensors
        rotary = freqs.shape[-1]
        dt = torch.empty_like(dy)
        for i in _chunks(dy.shape[0]):
            f = freqs[i:i + CHUNK_ROWS] if freqs.shape[0] > 1 else freqs
            g = dy[i:i + CHUNK_ROWS, ..., :rotary]
            sin = f.sin().to(dy.dtype)
            dt[i:i + CHUNK_ROWS, ..., :rotary] = (g * f.cos().to(dy.dtype)
                                                  + _rotate_half_transposed(g * sin))
        dt[..., rotary:] = dy[..., rotary:]
        return dt, None


def fused_rope(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of `t` [s, b, heads, d] with `freqs` [s or 1, 1, 1, d2 <= d]
    (non-interleaved: the first d2 dims of each head rotated, the rest passed through),
    keeping only `freqs` for backward."""
    if freqs.shape[-1] > t.shape[-1] or freqs.shape[-1] % 2:
        raise ValueError(f"the RoPE stand-in rotates an even number of each head's dims, at most "
                         f"the head's: freqs dim {freqs.shape[-1]}, head dim {t.shape[-1]}")
    return _FusedRoPE.apply(t, freqs)
