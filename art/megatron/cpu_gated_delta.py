"""Gated DeltaNet kernels in plain torch that keep for backward what fla's GPU kernels keep:
on CPU, and on CUDA where fla refuses its backward (fla_support.py).

Megatron-Core 0.16.1's `GatedDeltaNet` calls two fla functions: `l2norm` on q and k, and
`chunk_gated_delta_rule`. fla's Triton kernels do not run without a GPU, and Megatron's own
torch core (`torch_chunk_gated_delta_rule`) keeps several times more for backward than fla
does, so a CPU measurement taken with it says nothing about the GPU. The two functions here
compute the same thing in plain torch and save exactly fla's set, in fla's dtypes:

- `l2norm`: the normalised output (input dtype) and one fp32 rstd per row, as
  `L2NormFunction.forward` in fla-core 0.6 (`fla/modules/l2norm.py`).
- `chunk_gated_delta_rule`: q, k, v as given, the chunk-local cumulative decay g (fp32),
  beta, and the per-chunk inverse `A = (I + L)^-1` of the WY representation in k's dtype,
  as `ChunkGatedDeltaRuleFunction.forward` in fla-core 0.6
  (`fla/ops/gated_delta_rule/chunk.py`: `ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g,
  beta, A, initial_state, cu_seqlens)`, with the rstds None when the l2norm runs outside);
  per-sequence initial states in and final states out, [sequences, heads, dk, dv] fp32, in
  varlen mode.
  Everything else (w, u, the per-chunk states, v_new) is rebuilt in backward, as fla's
  `chunk_gated_delta_rule_bwd` rebuilds it.

Layout as fla's: [batch, tokens, heads, dim]; g and beta [batch, tokens, heads]; chunks of 64
tokens. Arithmetic in fp32; A is rounded to k's dtype before use, as fla uses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

CHUNK_TOKENS = 64


@dataclass(frozen=True)
class _Chunking:
    """How a row of tokens is cut into chunks: each sequence (`cu_seqlens`, as fla's varlen
    mode) is padded to whole chunks of its own, so no chunk spans two sequences."""

    starts: tuple[int, ...]
    lengths: tuple[int, ...]

    @classmethod
    def of(cls, tokens: int, cu_seqlens: torch.Tensor | None) -> _Chunking:
        if cu_seqlens is None:
            return cls((0,), (tokens,))
        bounds = [int(b) for b in cu_seqlens.tolist()]
        if bounds[0] != 0 or bounds[-1] != tokens or any(
                b <= a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(
                f"cu_seqlens must rise strictly from 0 to the {tokens} tokens of the row, got "
                f"{bounds}")
        return cls(tuple(bounds[:-1]), tuple(b - a for a, b in zip(bounds, bounds[1:])))

    def chunks(self, length: int) -> int:
        return max(1, -(-length // CHUNK_TOKENS))

    @property
    def total_chunks(self) -> int:
        return sum(self.chunks(n) for n in self.lengths)

    @property
    def first_chunk_of_sequence(self) -> tuple[int, ...]:
        """The chunk index where each sequence starts (its recurrent state starts over)."""
        firsts, cursor = [], 0
        for n in self.lengths:
            firsts.append(cursor)
            cursor += self.chunks(n)
        return tuple(firsts)


def _pad_tokens(x: torch.Tensor, total: int, edge: bool) -> torch.Tensor:
    """A copy of x with dim 1 (tokens) padded to `total` with zeros, or with the last token
    repeated (`edge`: for the cumulated decay, whose chunk-local sum stays flat over
    zero-padded raw decay). The padded tail comes after every real token, so causality keeps
    it from changing any real output. Always a copy, also without padding, so the working set
    grows with the padded length alone (no cheaper case at whole chunks)."""
    shape = list(x.shape)
    shape[1] = total - x.shape[1]
    if edge and shape[1]:
        tail = x[:, -1:].expand(-1, shape[1], *x.shape[2:])
    else:
        tail = x.new_zeros(shape)
    return torch.cat([x, tail], dim=1)


def _chunked(x: torch.Tensor, layout: _Chunking, edge: bool = False) -> torch.Tensor:
    """[B, T, H, ...] -> [B, H, N, C, ...] fp32, each sequence padded (differentiable)."""
    x = x.float()
    x = torch.cat([_pad_tokens(x[:, start:start + n], layout.chunks(n) * CHUNK_TOKENS, edge)
                   for start, n in zip(layout.starts, layout.lengths)], dim=1)
    b, t, h = x.shape[:3]
    x = x.reshape(b, layout.total_chunks, CHUNK_TOKENS, h, *x.shape[3:])
    return x.permute(0, 3, 1, 2, *range(4, x.dim())).contiguous()


def _unchunked(x: torch.Tensor, layout: _Chunking) -> torch.Tensor:
    """[B, H, N, C, ...] -> [B, T, H, ...] (the padded tails dropped; may view padded
    storage: see `_compact`)."""
    b, h, n, c = x.shape[:4]
    x = x.permute(0, 2, 3, 1, *range(4, x.dim()))
    x = x.reshape(b, n * c, h, *x.shape[4:])
    parts, cursor = [], 0
    for length in layout.lengths:
        parts.append(x[:, cursor:cursor + length])
        cursor += layout.chunks(length) * CHUNK_TOKENS
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _compact(x: torch.Tensor) -> torch.Tensor:
    """x in storage of its own size: a view of padded storage, saved or returned, would keep
    the padding alive (fla's tensors are [B, T, ...])."""
    if x.untyped_storage().nbytes() > x.numel() * x.element_size() or not x.is_contiguous():
        return x.clone(memory_format=torch.contiguous_format)
    return x


def _decay(g: torch.Tensor, include_diagonal: bool) -> torch.Tensor:
    """exp(g_i - g_j) on the causal part of each chunk, 0 elsewhere; [B, H, N, C, C]."""
    keep = torch.ones(CHUNK_TOKENS, CHUNK_TOKENS, dtype=torch.bool, device=g.device).tril(
        0 if include_diagonal else -1)
    diff = g.unsqueeze(-1) - g.unsqueeze(-2)
    # Masked before exp: above the diagonal the difference is positive and may overflow.
    return torch.where(keep, diff, torch.full_like(diff, -math.inf)).exp()


def _strict_kkt(k: torch.Tensor, beta: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """L[i, j] = beta_i (k_i . k_j) exp(g_i - g_j) for j < i, per chunk (fla's
    chunk_scaled_dot_kkt_fwd)."""
    return beta.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * _decay(g, include_diagonal=False)


def _outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, a: torch.Tensor, scale: float, layout: _Chunking,
             initial_state: torch.Tensor | None = None, want_final_state: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked gated delta rule from the WY inverse `a`; all [B, H, N, C, ...] fp32.
    Each sequence of `layout` starts from its `initial_state` ([sequences, H, dk, dv] fp32;
    zero without one); the final states come back in the same layout. Differentiable in
    every input (backward rebuilds through it)."""
    b, h, n, _, dk = k.shape
    dv = v.shape[-1]
    w = a @ (k * (beta * g.exp()).unsqueeze(-1))
    u = a @ (v * beta.unsqueeze(-1))
    intra = (q @ k.transpose(-1, -2)) * _decay(g, include_diagonal=True) * scale
    q_decayed = q * (g.exp() * scale).unsqueeze(-1)
    g_last = g[..., -1]
    k_to_end = k * (g_last.unsqueeze(-1) - g).exp().unsqueeze(-1)
    starts = layout.first_chunk_of_sequence
    last = {start + layout.chunks(length) - 1: index
            for index, (start, length) in enumerate(zip(starts, layout.lengths))}
    first = {start: index for index, start in enumerate(starts)}
    state = q.new_zeros(b, h, dk, dv)
    outs, finals = [], []
    for i in range(n):
        if i in first:
            if i:
                # Zeroed by a product rather than replaced: the graph, and with it what
                # backward allocates, stays the one of a single sequence over the same
                # chunks, whatever the split of the row into sequences.
                state = state * 0.0
            if initial_state is not None:
                state = state + initial_state[first[i]].unsqueeze(0)
        v_new = u[:, :, i] - w[:, :, i] @ state
        outs.append(q_decayed[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * g_last[:, :, i, None, None].exp() + k_to_end[:, :, i].transpose(
            -1, -2) @ v_new
        if want_final_state and i in last:
            finals.append(state)
    final = None
    if want_final_state:
        # [sequences, H, dk, dv] as fla returns them in varlen mode (batch 1), else [B, ...].
        final = torch.cat(finals, dim=0) if b == 1 else finals[-1]
    return torch.stack(outs, dim=2), final


class _ChunkGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, initial_state: torch.Tensor | None, scale: float,
                output_final_state: bool, layout: _Chunking
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        g_cum = _chunked(g, layout).cumsum(-1)  # chunk-local cumulative decay, fp32
        k_c, beta_c = _chunked(k, layout), _chunked(beta, layout)
        eye = torch.eye(CHUNK_TOKENS, device=k.device)
        inverse = torch.linalg.solve_triangular(
            eye + _strict_kkt(k_c, beta_c, g_cum), eye.expand(*k_c.shape[:3], -1, -1),
            upper=False, unitriangular=True)
        # fla's solve_tril writes A in k's dtype; it is saved and used in that precision.
        a_saved = _compact(_unchunked(inverse, layout).to(k.dtype))
        del inverse
        a_c = _chunked(a_saved, layout)
        h0 = None if initial_state is None else initial_state.float()
        out, final = _outputs(_chunked(q, layout), k_c, _chunked(v, layout), g_cum, beta_c,
                              a_c, scale, layout, h0, output_final_state)
        g_saved = _compact(_unchunked(g_cum, layout))
        # fla keeps the initial state for backward too (ctx.save_for_backward(..., A,
        # initial_state, cu_seqlens)).
        ctx.save_for_backward(q, k, v, g_saved, beta, a_saved, initial_state)
        ctx.scale = scale
        ctx.layout = layout
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
        return _compact(_unchunked(out, layout).to(q.dtype)), final

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor, d_final: torch.Tensor | None) -> tuple:
        q, k, v, g_cum, beta, a_saved, initial_state = ctx.saved_tensors
        layout = ctx.layout
        with torch.enable_grad():
            # Rebuilt in fp32 from the saved set, as leaves; chunking happens under autograd.
            leaves = [x.detach().float().requires_grad_(True)
                      for x in (q, k, v, g_cum, beta, a_saved)]
            h0 = (None if initial_state is None
                  else initial_state.detach().float().requires_grad_(True))
            q_l, k_l, v_l, g_l, beta_l, a_l = leaves
            a_c = _chunked(a_l, layout)
            out, final = _outputs(
                _chunked(q_l, layout), _chunked(k_l, layout), _chunked(v_l, layout),
                _chunked(g_l, layout, edge=True), _chunked(beta_l, layout), a_c, ctx.scale,
                layout, h0, d_final is not None)
            roots, grads = [out], [_chunked(d_out, layout)]
            if d_final is not None and final is not None:
                roots.append(final)
                grads.append(d_final.float())
            inputs = leaves + ([h0] if h0 is not None else [])
            dq, dk, dv, dg, dbeta, da, *dh0 = torch.autograd.grad(
                roots, inputs, grads, allow_unused=True)
            # A = (I + L)^-1, so dL = -A^T dA A^T on L's strictly lower part.
            a_det, da_c = a_c.detach(), _chunked(da, layout)
            d_lower = -(a_det.transpose(-1, -2) @ da_c @ a_det.transpose(-1, -2)).tril(-1)
            lower = _strict_kkt(_chunked(k_l, layout), _chunked(beta_l, layout),
                                _chunked(g_l, layout, edge=True))
            dk2, dg2, dbeta2 = torch.autograd.grad(lower, [k_l, g_l, beta_l], d_lower)
        dk, dg, dbeta = dk + dk2, dg + dg2, dbeta + dbeta2
        # g was cumulated within each chunk: its gradient is the reverse cumulative sum.
        dg = _chunked(dg, layout).flip(-1).cumsum(-1).flip(-1)
        dg = _unchunked(dg, layout)
        q_t, k_t, v_t, g_t, b_t = ctx.dtypes
        d_initial = None
        if initial_state is not None and dh0 and dh0[0] is not None:
            d_initial = dh0[0].to(initial_state.dtype)
        return (dq.to(q_t), dk.to(k_t), dv.to(v_t), dg.to(g_t), dbeta.to(b_t), d_initial,
                None, None, None)


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None,
    output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None, head_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's `chunk_gated_delta_rule` (fla-core's order and defaults): q, k [B, T, H, dk],
    v [B, T, H, dv], g and beta [B, T, H]; `cu_seqlens` (varlen mode: batch 1, one
    recurrence per sequence of the row); `initial_state` [sequences, H, dk, dv] (varlen) or
    [B, H, dk, dv], and with `output_final_state` the final states in that layout, fp32."""
    if head_first:
        raise ValueError("head_first=True: the CPU gated delta rule takes fla's [B, T, H, D]")
    if use_qk_l2norm_in_kernel:
        raise ValueError(
            "use_qk_l2norm_in_kernel=True: Megatron normalises q and k before the call; "
            "apply l2norm first"
        )
    layout = _Chunking.of(q.shape[1], cu_seqlens)
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"cu_seqlens (packed sequences) needs batch 1, got batch {q.shape[0]}")
    states = len(layout.lengths) if cu_seqlens is not None else q.shape[0]
    if cu_seqlens is None and q.shape[0] != 1 and (initial_state is not None
                                                   or output_final_state):
        raise ValueError("the CPU gated delta rule takes states for batch 1 (or varlen) rows")
    want = (states, k.shape[2], k.shape[3], v.shape[3])
    if initial_state is not None and tuple(initial_state.shape) != want:
        raise ValueError(f"initial_state must be [sequences, heads, dk, dv] = {list(want)}, "
                         f"got {list(initial_state.shape)}")
    if scale is None:
        scale = k.shape[-1] ** -0.5
    return _ChunkGatedDeltaRule.apply(q, k, v, g, beta, initial_state, float(scale),
                                      output_final_state, layout)


class _L2Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, eps: float, output_dtype: torch.dtype | None
                ) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).sum(-1) + eps)  # fp32, one per row
        y = (xf * rstd.unsqueeze(-1)).to(output_dtype or x.dtype)
        ctx.save_for_backward(y, rstd)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        y, rstd = ctx.saved_tensors
        yf, dyf, r = y.float(), dy.float(), rstd.unsqueeze(-1)
        dx = dyf * r - (dyf * yf).sum(-1, keepdim=True) * yf * r
        return dx.to(y.dtype), None, None


def l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None
           ) -> torch.Tensor:
    """fla's `l2norm`: x / sqrt(sum(x^2) + eps) over the last dim."""
    return _L2Norm.apply(x, eps, output_dtype)


class _GatedRMSNorm(torch.autograd.Function):
    """rms_norm(x) * weight * silu(gate) over the last dim, fp32 inside, x's dtype out."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        y = xf * rstd * weight.float() * torch.nn.functional.silu(gate.float())
        ctx.save_for_backward(x, weight, gate, rstd)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        x, weight, gate, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        gf, dyf, wf = gate.float(), dy.float(), weight.float()
        sig = torch.sigmoid(gf)
        act = gf * sig
        d_gate = dyf * normed * wf * sig * (1 + gf * (1 - sig))
        d_weight = (dyf * act * normed).reshape(-1, x.shape[-1]).sum(0)
        d_normed = dyf * act * wf
        dx = rstd * (d_normed - normed * (d_normed * normed).mean(-1, keepdim=True))
        return dx.to(x.dtype), d_gate.to(gate.dtype), d_weight.to(weight.dtype), None


def apply_gated_norm(module: Any, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """CPU stand-in for `GatedDeltaNet._apply_gated_norm`, which Megatron compiles
    (`@jit_fuser` = torch.compile). The compiled function keeps x, the norm weight, gate and an
    fp32 rstd per row for backward (seen with saved-tensor hooks, torch 2.13); this keeps the
    same, where the eager function keeps several fp32 copies; and it needs no compiler."""
    if module.act_fn is not torch.nn.functional.silu:
        raise ValueError(f"gated output norm with {module.act_fn}; silu expected")
    norm = module.out_norm
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    weight = norm.tp_weight() if hasattr(norm, "tp_weight") else norm.weight
    rows = x.reshape(-1, x.shape[-1])
    return _GatedRMSNorm.apply(rows, gate.reshape(-1, gate.shape[-1]), weight, eps)
