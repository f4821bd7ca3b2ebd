"""Gated DeltaNet on CPU: the kernels that stand in for fla (values, gradients, and the set
they keep for backward), and the tiny hybrids built and trained through the local spec."""

from __future__ import annotations

import itertools

import pytest
import torch
from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

from art.megatron.cpu_gated_delta import (
    CHUNK_TOKENS,
    apply_gated_norm,
    chunk_gated_delta_rule,
    l2norm,
)
from art.megatron.gated_delta_rows import segmented_causal_conv
from art.megatron.recurrent_layout import RecurrentLayout


def _delta_inputs(dtype: torch.dtype, decay: float, tokens: int = 150, heads: int = 3,
                  seed: int = 0, key_dim: int = 16, value_dim: int = 8) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(1, tokens, heads, key_dim, generator=gen),
                                          dim=-1)
            for _ in range(2))
    v = torch.randn(1, tokens, heads, value_dim, generator=gen)
    g = -torch.rand(1, tokens, heads, generator=gen) * decay  # log decay, fp32 as Megatron's
    beta = torch.rand(1, tokens, heads, generator=gen).sigmoid()
    return [x.to(dtype).requires_grad_(True) for x in (q, k, v)] + [
        g.requires_grad_(True), beta.to(dtype).requires_grad_(True)]


@pytest.mark.parametrize("decay", [0.5, 50.0])
def test_chunked_rule_equals_megatrons_torch_core(decay):
    """Same outputs and gradients as Megatron's own torch core (the reference), over two full
    chunks and a partial one, with mild and with strong decay (whose padded tail once gave
    inf * 0 in backward)."""
    ours, ref = _delta_inputs(torch.float32, decay), _delta_inputs(torch.float32, decay)
    out, _ = chunk_gated_delta_rule(*ours)
    expected, _ = torch_chunk_gated_delta_rule(*ref)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    weight = torch.randn_like(out)
    (out * weight).sum().backward()
    (expected * weight).sum().backward()
    for name, a, b in zip("qkvgb", ours, ref):
        assert torch.isfinite(a.grad).all(), name
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)


def _saved(fn, *args) -> tuple[list[torch.Tensor], torch.Tensor]:
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return saved, out


def test_chunked_rule_keeps_fla_cores_saved_set():
    """fla-core 0.6 ChunkGatedDeltaRuleFunction keeps q, k, v, the chunk-local cumulated g
    (fp32), beta and A ([B, T, H, 64] in k's dtype); nothing else survives the forward."""
    q, k, v, g, beta = _delta_inputs(torch.bfloat16, 1.0)
    saved, out = _saved(lambda *a: chunk_gated_delta_rule(*a)[0], q, k, v, g, beta)
    assert out.dtype == torch.bfloat16
    assert len(saved) == 6
    for given, kept in zip((q, k, v), saved[:3]):
        assert kept.untyped_storage().data_ptr() == given.untyped_storage().data_ptr()
    g_cum, beta_kept, a = saved[3:]
    assert g_cum.dtype == torch.float32 and g_cum.shape == g.shape
    torch.testing.assert_close(g_cum[0, :CHUNK_TOKENS], g[0, :CHUNK_TOKENS].detach().cumsum(0))
    assert beta_kept.untyped_storage().data_ptr() == beta.untyped_storage().data_ptr()
    assert a.dtype == torch.bfloat16 and a.shape == (*k.shape[:3], CHUNK_TOKENS)


def test_packed_sequences_run_one_recurrence_each():
    """Three sequences packed in one row (fla's varlen cu_seqlens; the conv as causal_conv1d's
    seq_idx): outputs and gradients equal running each sequence alone, and what the rule keeps
    is [B, T, ...] in storage of its own size (no padded chunk storage kept alive, in fp32
    too)."""
    lengths = (70, 64, 20)
    packed = _delta_inputs(torch.float32, 0.5, tokens=sum(lengths))
    alone = [[x.detach()[:, a:a + n].clone().requires_grad_(True) for x in packed]
             for a, n in zip((0, 70, 134), lengths)]
    cu = torch.tensor([0, 70, 134, 154])
    saved, out = _saved(lambda *a: chunk_gated_delta_rule(*a, cu_seqlens=cu)[0], *packed)
    one, _ = _saved(lambda *a: chunk_gated_delta_rule(*a)[0], *_delta_inputs(torch.float32, 0.5))
    for t in saved + one:
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), t.shape
    expected = torch.cat([chunk_gated_delta_rule(*xs)[0] for xs in alone], dim=1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    weight = torch.randn_like(out)
    (out * weight).sum().backward()
    (expected * weight).sum().backward()
    for i, name in enumerate("qkvgb"):
        torch.testing.assert_close(packed[i].grad, torch.cat([xs[i].grad for xs in alone], 1),
                                   rtol=1e-4, atol=1e-5, msg=name)
    conv = torch.nn.Conv1d(6, 6, 4, groups=6, padding=3)
    x = torch.randn(1, 6, sum(lengths))
    y = segmented_causal_conv(x, conv.weight, conv.bias, RecurrentLayout.sequences(lengths))
    expected_conv = torch.cat([conv(x[..., a:a + n])[..., :n]
                               for a, n in zip((0, 70, 134), lengths)], dim=-1)
    torch.testing.assert_close(y, expected_conv)


@pytest.mark.parametrize("cut", [64, 70, 1, 149])
def test_a_sequence_continued_from_its_final_state_equals_the_whole(cut):
    """fla's contract for initial and final states: a sequence run as two pieces, the second
    from the first's final state, gives the whole sequence's outputs and final state, and the
    gradients reach the first piece through the handed-over state. In varlen mode each
    sequence has its own [heads, dk, dv] state."""
    whole = _delta_inputs(torch.float32, 0.5)
    pieces = [[x.detach()[:, a:b].clone().requires_grad_(True) for x in whole]
              for a, b in ((0, cut), (cut, 150))]
    out, final = chunk_gated_delta_rule(*whole, output_final_state=True)
    first, state = chunk_gated_delta_rule(*pieces[0], output_final_state=True)
    second, end = chunk_gated_delta_rule(*pieces[1], initial_state=state,
                                         output_final_state=True)
    assert state.shape == (1, 3, 16, 8) and state.dtype == torch.float32
    torch.testing.assert_close(torch.cat([first, second], 1), out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(end, final, rtol=1e-5, atol=1e-6)
    weight = torch.randn_like(out)
    ((out * weight).sum() + final.sum()).backward()
    ((torch.cat([first, second], 1) * weight).sum() + end.sum()).backward()
    for i, name in enumerate("qkvgb"):
        torch.testing.assert_close(whole[i].grad,
                                   torch.cat([pieces[0][i].grad, pieces[1][i].grad], 1),
                                   rtol=1e-4, atol=1e-5, msg=name)
    # Varlen: two sequences, each continued from its own state.
    h0 = torch.randn(2, 3, 16, 8, requires_grad=True)
    xs = _delta_inputs(torch.float32, 0.5, tokens=100, seed=3)
    cu = torch.tensor([0, 30, 100])
    out, finals = chunk_gated_delta_rule(*xs, initial_state=h0, output_final_state=True,
                                         cu_seqlens=cu)
    for n, (a, b) in enumerate(((0, 30), (30, 100))):
        alone, end = chunk_gated_delta_rule(*(x[:, a:b] for x in xs), initial_state=h0[n:n + 1],
                                            output_final_state=True)
        torch.testing.assert_close(out[:, a:b], alone, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(finals[n:n + 1], end, rtol=1e-5, atol=1e-6)
    finals.sum().backward()
    assert h0.grad is not None and torch.isfinite(h0.grad).all()
    with pytest.raises(ValueError, match="initial_state must be"):
        chunk_gated_delta_rule(*xs, initial_state=h0[:1], cu_seqlens=cu)


def _backward_peak_bytes(lengths: tuple[int, ...]) -> int:
    """Peak bytes the rule's backward allocates on a packed row of `lengths`."""
    from art.trainer_rank.measuring.meter import MemoryMeter

    # Heads and head sizes of the calibration hybrids: the state ([heads, 32, 32] per chunk)
    # is large enough next to the chunk's own work for the split to show.
    q, k, v, g, beta = _delta_inputs(torch.float32, 0.5, tokens=sum(lengths), heads=4,
                                     seed=1, key_dim=32, value_dim=32)
    cu = torch.tensor([0, *itertools.accumulate(lengths)])
    out, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
    incoming = torch.ones_like(out)
    meter = MemoryMeter(device="cpu")
    with meter:
        out.backward(incoming)
    return meter.peak_bytes


def test_backward_allocates_the_same_however_the_row_splits_into_sequences():
    """The memory model prices a Gated DeltaNet layer by the row's tokens and padded chunks
    alone, so the rule's backward must allocate the same for one sequence over ten chunks as
    for ten one-chunk sequences or any other split of the same tokens into the same chunks,
    in any order: a sequence start zeroes the state inside the single-sequence graph."""
    whole_chunks = {lengths: _backward_peak_bytes(lengths)
                    for lengths in ((640,), (64,) * 10, (128,) * 5, (192, 64, 64, 320))}
    assert len(set(whole_chunks.values())) == 1, whole_chunks
    padded = {lengths: _backward_peak_bytes(lengths)
              for lengths in ((84,) + (20,) * 8, (20,) * 8 + (84,), (20, 84) + (20,) * 7)}
    assert len(set(padded.values())) == 1, padded


def test_l2norm_keeps_output_and_one_fp32_rstd_per_row():
    x = torch.randn(1, 40, 2, 16, dtype=torch.bfloat16, requires_grad=True)
    saved, y = _saved(l2norm, x)
    assert [t.dtype for t in saved] == [torch.bfloat16, torch.float32]
    assert saved[0].data_ptr() == y.data_ptr() and saved[1].shape == (1, 40, 2)
    x32 = x.detach().float().requires_grad_(True)
    ref = torch.nn.functional.normalize(x32, dim=-1, eps=0.0)
    ours = l2norm(x32)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    w = torch.randn_like(ref)
    (ref * w).sum().backward()
    x2 = x.detach().float().requires_grad_(True)
    (l2norm(x2) * w).sum().backward()
    torch.testing.assert_close(x2.grad, x32.grad, rtol=1e-5, atol=1e-6)


class _Mixer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out_norm = torch.nn.RMSNorm(16, eps=1e-6)
        self.act_fn = torch.nn.functional.silu


def test_gated_norm_stand_in_equals_eager_and_keeps_what_compiled_keeps():
    mixer = _Mixer()
    with torch.no_grad():
        mixer.out_norm.weight.uniform_(0.5, 1.5)
    x, gate = (torch.randn(1, 30, 4, 16, requires_grad=True) for _ in range(2))
    x2, gate2 = (t.detach().clone().requires_grad_(True) for t in (x, gate))
    saved, ours = _saved(apply_gated_norm, mixer, x, gate)
    # Megatron's _apply_gated_norm body, eager.
    ref = mixer.out_norm(x2.reshape(-1, 16)) * torch.nn.functional.silu(gate2.reshape(-1, 16))
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    w = torch.randn_like(ref)
    (ours * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gate.grad, gate2.grad, rtol=1e-5, atol=1e-5)
    assert [tuple(t.shape) for t in saved] == [(30 * 4, 16), (16,), (30 * 4, 16), (30 * 4, 1)]
