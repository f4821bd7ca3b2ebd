"""The segmented flash attention's CUDA path (art.megatron.packed_attention), without a GPU.

Stand-ins take the place of torch's CUDA SDPA aten kernels: the module-level references the
code calls are monkeypatched, `_is_cuda` says CPU tensors are CUDA ones, and torch's
`can_use_*` checks are replaced, so the CUDA code path runs on CPU tensors. Each stand-in has
the real kernel's exact signature and return tuple (`torch.ops.aten.<op>.default._schema` in
torch 2.13, and its meta kernel), refuses what the real kernel refuses or reads inputs the way
it does where that matters (heads, strides, logsumexp layouts), records its arguments, and
computes in fp64 from the inputs it was given (the backward from the out and logsumexp it
was handed, as the real kernels do). Real-GPU tests at the end skip without CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from art.megatron import packed_attention as pa
from art.megatron.attention_layout import AttentionLayout, AttentionSegment, KeySpan
from art.megatron.geometry import geometry_from_hf_dict
from art.megatron.implementation import Implementation, cuda_sdpa_kernel
from art.megatron.layout import ParallelLayout
from art.trainer_rank.compute.packing import pack_sequences, shares_prefixes
from art.trainer_rank.measuring.meter import MemoryMeter
from art.trainer_rank.pricing.layer_terms import Dims
from art.trainer_rank.pricing.layers_attention import segmented_flash_costs

# A prompt, a deeper shared part with two children, a sibling completion, and a pad block.
TREE = AttentionLayout(16, (
    AttentionSegment(0, 5), AttentionSegment(5, 2, (KeySpan(0, 5),)),
    AttentionSegment(7, 2, (KeySpan(0, 7),)), AttentionSegment(9, 3, (KeySpan(0, 7),)),
    AttentionSegment(12, 3, (KeySpan(0, 5),)), AttentionSegment(15, 1),
))
SCALE = 0.3  # not 1/sqrt(d): a kernel left at its default scale would show


def _qkv(s, heads, groups, dim, dtype=torch.float32, seed=0, batch=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, batch, h, dim, generator=g, dtype=dtype).requires_grad_()
            for h in (heads, groups, groups)]


def _reference(q, k, v, layout, scale=SCALE):
    """fp64 masked softmax with Megatron's GQA (group h // (heads / groups) per head)."""
    rep = q.shape[2] // k.shape[2]
    qq = q.double().permute(1, 2, 0, 3)
    kk, vv = (t.double().repeat_interleave(rep, dim=2).permute(1, 2, 0, 3) for t in (k, v))
    scores = (qq @ kk.transpose(-1, -2)) * scale
    scores = scores.masked_fill(layout.dense_mask()[0, 0], float("-inf"))
    out = scores.softmax(-1) @ vv
    return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)


def _scores(q, k, causal, scale):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        assert q.shape[2] == k.shape[2], "causal blocks are square"
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s


def _math_forward(q, k, v, causal, scale):
    with _disable_current_modes():  # the stand-in's own fp64 work is not the kernel's memory
        s = _scores(q, k, causal, scale)
        lse = s.logsumexp(-1)
        return (s - lse.unsqueeze(-1)).exp() @ v.double(), lse


def _math_backward(g, q, k, v, out, lse, causal, scale):
    """Flash-style backward from the given out and logsumexp (not recomputed ones)."""
    with _disable_current_modes():
        p = (_scores(q, k, causal, scale) - lse.double().unsqueeze(-1)).exp()
        g, out = g.double(), out.double()
        dv = p.transpose(-1, -2) @ g
        dp = g @ v.double().transpose(-1, -2)
        ds = p * (dp - (g * out).sum(-1, keepdim=True))
        return ds @ k.double() * scale, ds.transpose(-1, -2) @ q.double() * scale, dv


def _heads_second(values, dtype):
    """A new [b, L, heads, d] tensor seen as [b, heads, L, d], as the kernels return."""
    b, heads, length, dim = values.shape
    out = torch.empty(b, length, heads, dim, dtype=dtype).transpose(1, 2)
    return out.copy_(values)


def _new(values, dtype):
    return torch.empty(values.shape, dtype=dtype).copy_(values)


class StandIns:
    """The four CUDA kernels, recording (kernel, pass, L, S, heads, groups, causal, scale)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    # aten::_scaled_dot_product_flash_attention(Tensor query, Tensor key, Tensor value,
    #   float dropout_p=0., bool is_causal=False, bool return_debug_mask=False, *,
    #   float? scale=None) -> (Tensor output, Tensor logsumexp, Tensor cum_seq_q,
    #   Tensor cum_seq_k, SymInt max_q, SymInt max_k, Tensor rng_state, Tensor unused,
    #   Tensor debug_attn_mask)
    def flash_fwd(self, query, key, value, dropout_p=0.0, is_causal=False,
                  return_debug_mask=False, *, scale=None):
        b, heads, length, dim = query.shape
        groups, keys = key.shape[1], key.shape[2]
        assert dropout_p == 0.0 and not return_debug_mask and scale is not None
        assert all(t.stride(-1) == 1 for t in (query, key, value))
        assert heads % groups == 0 and dim % 8 == 0 and dim <= 256  # mha_fwd's checks
        self.calls.append(("flash", "fwd", length, keys, heads, groups, is_causal, scale))
        rep = heads // groups
        with _disable_current_modes():
            k, v = (t.repeat_interleave(rep, dim=1) for t in (key, value))
        out, lse = _math_forward(query, k, v, is_causal, scale)
        return (_heads_second(out, query.dtype), _new(lse, torch.float32), None, None, length,
                keys,
                torch.empty(2, dtype=torch.uint64), torch.empty((), dtype=torch.uint64),
                torch.empty(0, dtype=query.dtype))

    # aten::_scaled_dot_product_flash_attention_backward(Tensor grad_out, Tensor query,
    #   Tensor key, Tensor value, Tensor out, Tensor logsumexp, Tensor cum_seq_q,
    #   Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal,
    #   Tensor philox_seed, Tensor philox_offset, *, float? scale=None)
    #   -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)
    def flash_bwd(self, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                  max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                  scale=None):
        b, heads, length, dim = query.shape
        groups, keys = key.shape[1], key.shape[2]
        assert cum_seq_q is None and cum_seq_k is None  # the dense mha_bwd
        assert (max_q, max_k) == (length, keys) and dropout_p == 0.0 and scale is not None
        assert philox_seed.dtype == torch.uint64 and philox_offset.dtype == torch.uint64
        # mha_bwd reads softmax_lse by pointer as a contiguous fp32 [b, heads, L].
        assert logsumexp.dtype == torch.float32 and logsumexp.is_contiguous()
        assert tuple(logsumexp.shape) == (b, heads, length)
        self.calls.append(("flash", "bwd", length, keys, heads, groups, is_causal, scale))
        rep = heads // groups
        with _disable_current_modes():
            k, v = (t.repeat_interleave(rep, dim=1) for t in (key, value))
        dq, dk, dv = _math_backward(grad_out, query, k, v, out, logsumexp, is_causal, scale)
        with _disable_current_modes():  # mha_bwd sums dk / dv over each group's heads
            dk, dv = (t.unflatten(1, (groups, rep)).sum(2) for t in (dk, dv))
        return (_heads_second(dq, query.dtype), _heads_second(dk, key.dtype),
                _heads_second(dv, value.dtype))

    # aten::_scaled_dot_product_efficient_attention(Tensor query, Tensor key, Tensor value,
    #   Tensor? attn_bias, bool compute_log_sumexp, float dropout_p=0., bool is_causal=False,
    #   *, float? scale=None) -> (Tensor output, Tensor log_sumexp, Tensor philox_seed,
    #   Tensor philox_offset)
    def efficient_fwd(self, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                      is_causal=False, *, scale=None):
        b, heads, length, dim = query.shape
        assert attn_bias is None and compute_log_sumexp and dropout_p == 0.0
        assert key.shape[1] == heads and value.shape[1] == heads  # no GQA in this kernel
        assert all(t.stride(-1) == 1 for t in (query, key, value)) and scale is not None
        self.calls.append(("efficient", "fwd", length, key.shape[2], heads, key.shape[1],
                           is_causal, scale))
        out, lse = _math_forward(query, key, value, is_causal, scale)
        padded = -(-length // 32) * 32
        lse_padded = torch.full((b, heads, padded), float("nan"))  # rows past L: padding
        lse_padded[..., :length] = lse
        return (_heads_second(out, query.dtype), lse_padded, torch.empty((), dtype=torch.long),
                torch.empty((), dtype=torch.long))

    # aten::_scaled_dot_product_efficient_attention_backward(Tensor grad_out_, Tensor query,
    #   Tensor key, Tensor value, Tensor attn_bias, Tensor out, Tensor logsumexp,
    #   Tensor philox_seed, Tensor philox_offset, float dropout_p, bool[4] grad_input_mask,
    #   bool is_causal=False, *, float? scale=None) -> (Tensor, Tensor, Tensor, Tensor)
    def efficient_bwd(self, grad_out_, query, key, value, attn_bias, out, logsumexp,
                      philox_seed, philox_offset, dropout_p, grad_input_mask, is_causal=False,
                      *, scale=None):
        b, heads, length, dim = query.shape
        assert attn_bias is None and dropout_p == 0.0 and scale is not None
        assert list(grad_input_mask) == [True, True, True, False]
        assert key.shape[1] == heads and value.shape[1] == heads
        # check_supported in kernel_backward.h.
        assert heads <= 1 or logsumexp.stride(1) % 8 == 0, "LSE is not correctly aligned"
        assert b <= 1 or logsumexp.stride(0) % 8 == 0, "LSE is not correctly aligned"
        self.calls.append(("efficient", "bwd", length, key.shape[2], heads, key.shape[1],
                           is_causal, scale))
        # The kernel reads out with a row stride of heads * d (o_strideM()), whatever the
        # tensor's own row stride, and the logsumexp by its batch and head strides.
        read_out = torch.as_strided(out, (b, heads, length, out.shape[-1]),
                                    (out.stride(0), out.stride(1), heads * out.shape[-1], 1),
                                    out.storage_offset())
        read_lse = torch.as_strided(logsumexp, (b, heads, length),
                                    (logsumexp.stride(0), logsumexp.stride(1), 1),
                                    logsumexp.storage_offset())
        dq, dk, dv = _math_backward(grad_out_, query, key, value, read_out, read_lse,
                                    is_causal, scale)
        return (_heads_second(dq, query.dtype), _heads_second(dk, key.dtype),
                _heads_second(dv, value.dtype), None)


@pytest.fixture
def stand_ins(monkeypatch):
    """The CUDA path on CPU tensors; `flash` on the object picks torch's flash check."""
    kernels = StandIns()
    kernels.flash = True
    monkeypatch.setattr(pa, "_is_cuda", lambda t: True)
    monkeypatch.setattr(pa, "_can_use_flash", lambda params: kernels.flash)
    monkeypatch.setattr(pa, "_can_use_efficient", lambda params: True)
    monkeypatch.setattr(pa, "_CUDA_FLASH_FWD", kernels.flash_fwd)
    monkeypatch.setattr(pa, "_CUDA_FLASH_BWD", kernels.flash_bwd)
    monkeypatch.setattr(pa, "_CUDA_EFFICIENT_FWD", kernels.efficient_fwd)
    monkeypatch.setattr(pa, "_CUDA_EFFICIENT_BWD", kernels.efficient_bwd)
    return kernels


def _expected_blocks(layout, kernel, heads, groups):
    """(L, S, causal) of every block in execution order; the efficient kernel runs each
    block once per query slot of a group, with as many heads as there are groups."""
    calls = []
    for segment in layout.segments:
        for span, causal in [(c, False) for c in segment.context] + [
                (KeySpan(segment.start, segment.length), True)]:
            if kernel == "flash":
                calls.append((segment.length, span.length, heads, groups, causal))
            else:
                calls += [(segment.length, span.length, groups, groups, causal)] * (
                    heads // groups)
    return calls


def _assert_equals_reference(q, k, v, layout, out, grad, got) -> None:
    """`out` and the gradients `got` (for `grad`) equal the fp64 masked softmax's."""
    want_out = _reference(q, k, v, layout)
    want = torch.autograd.grad(want_out, (q, k, v), grad.double())
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)


def _run(q, k, v, layout, kernel_name):
    out = pa._SegmentedFlash.apply(q, k, v, layout, SCALE, kernel_name, None)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    return out, grad, torch.autograd.grad(out, (q, k, v), grad)


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
@pytest.mark.parametrize("heads,groups", [(4, 2), (6, 2), (4, 4)], ids=["gqa2", "gqa3", "mha"])
@pytest.mark.parametrize("layout", [TREE, AttentionLayout.causal_blocks([6, 1, 9])],
                         ids=["tree", "causal-blocks"])
def test_stand_in_kernels_give_the_masked_softmax(stand_ins, kernel, heads, groups, layout):
    """Stand-ins (no GPU here): each CUDA kernel's path, in fp32, equals an fp64 dense masked
    softmax in output and gradients to 1e-5, and the kernels were called per block with the
    block's key span, its causal flag (only the diagonal block), the layer's scale, and the
    heads their kernel takes (flash: all query heads against the groups; efficient: one call
    per query slot, as many heads as groups)."""
    q, k, v = _qkv(16, heads, groups, 8)
    out, grad, got = _run(q, k, v, layout, f"cuda-{kernel}")
    _assert_equals_reference(q, k, v, layout, out, grad, got)
    expected = _expected_blocks(layout, kernel, heads, groups)
    for direction in ("fwd", "bwd"):
        seen = [c for c in stand_ins.calls if c[1] == direction]
        assert all(c[0] == kernel and c[-1] == SCALE for c in seen)
        assert [c[2:7] for c in seen] == expected


@pytest.mark.parametrize("kernel,calls_per_slot", [("flash", 2), ("efficient", 5)])
def test_equal_segments_are_batched_within_the_kernels_limits(stand_ins, kernel,
                                                               calls_per_slot):
    """Stand-ins (no GPU here): 16 sequences of 8 tokens and a 16-token one. The flash
    kernel takes the 16 as one batched call; the memory-efficient one pads each batch
    element's logsumexp to 32 queries, so its batches stop at 144 // 32 = 4 segments (four
    calls) and the pricing's row-sized logsumexp still bounds them. Both still equal the
    masked softmax, and every batched call has the batch's shape."""
    layout = AttentionLayout.causal_blocks([8] * 16 + [16])
    q, k, v = _qkv(144, 4, 2, 8)
    out, grad, got = _run(q, k, v, layout, f"cuda-{kernel}")
    _assert_equals_reference(q, k, v, layout, out, grad, got)
    slots = 1 if kernel == "flash" else 2
    for direction in ("fwd", "bwd"):
        seen = [c for c in stand_ins.calls if c[1] == direction]
        assert len(seen) == calls_per_slot * slots
        assert [c[2] for c in seen][-slots:] == [16] * slots
        assert all(c[2:4] == (8, 8) for c in seen[:-slots])


def test_batch_above_one_reads_the_efficient_backward_out_compact(stand_ins):
    """Stand-in (no GPU here): with b = 2 the segment's output view has a row stride of
    b x heads x d; the efficient backward reads heads x d, so it must be handed a compact
    copy. Gradients still equal the reference."""
    q, k, v = _qkv(16, 4, 2, 8, batch=2)
    out, grad, got = _run(q, k, v, TREE, "cuda-efficient")
    want = torch.autograd.grad(_reference(q, k, v, TREE), (q, k, v), grad.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)


def test_kernel_choice_follows_dtype_head_dim_and_torch_checks(stand_ins):
    """Stand-ins (no GPU here): bf16/fp16 with a head dim that is a multiple of 8 take the
    flash kernel when torch's check allows it; fp32, odd head dims, or a refused check take
    the memory-efficient one; CPU tensors never leave the CPU kernel."""
    q, k, v = _qkv(16, 4, 2, 8, dtype=torch.bfloat16)
    assert pa._kernel_for(q, k, v) == "cuda-flash"
    stand_ins.flash = False
    assert pa._kernel_for(q, k, v) == "cuda-efficient"
    stand_ins.flash = True
    assert pa._kernel_for(*_qkv(16, 4, 2, 8)) == "cuda-efficient"
    assert pa._kernel_for(*_qkv(16, 4, 2, 12, dtype=torch.float16)) == "cuda-efficient"
    assert (cuda_sdpa_kernel(2, 256), cuda_sdpa_kernel(2, 264), cuda_sdpa_kernel(4, 128)) == (
        "flash", "efficient", "efficient")


def test_cpu_tensors_stay_on_the_cpu_kernel(monkeypatch):
    """Stand-ins installed but `_is_cuda` left alone: CPU tensors run the CPU flash kernel
    and no CUDA stand-in is called."""
    kernels = StandIns()
    for name in ("_CUDA_FLASH_FWD", "_CUDA_FLASH_BWD", "_CUDA_EFFICIENT_FWD",
                 "_CUDA_EFFICIENT_BWD"):
        monkeypatch.setattr(pa, name, lambda *a, **kw: kernels.calls.append(a))
    q, k, v = _qkv(16, 4, 2, 8)
    out = pa.segmented_flash_attention(q, k, v, TREE, SCALE)
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert kernels.calls == []
    torch.testing.assert_close(out.double(), _reference(q, k, v, TREE), rtol=1e-5, atol=1e-5)


def test_bfloat16_accumulates_gradients_in_fp32(stand_ins, monkeypatch):
    """Stand-ins (no GPU here): a bf16 layer's dq / dk / dv gather their blocks in fp32
    accumulators (each kernel adds into fp32 views), and the result is cast back to bf16."""
    seen: list[torch.dtype] = []
    kernel = pa._KERNELS["cuda-flash"]
    original = kernel.backward_into

    def spy(*args):
        seen.extend(t.dtype for t in args[-3:])
        return original(*args)

    monkeypatch.setattr(kernel, "backward_into", spy)
    q, k, v = _qkv(16, 4, 2, 8, dtype=torch.bfloat16)
    out = pa.segmented_flash_attention(q, k, v, TREE, SCALE)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert seen and set(seen) == {torch.float32}
    assert all(g.dtype == torch.bfloat16 for g in grads)
    torch.testing.assert_close(out.double(), _reference(q, k, v, TREE), rtol=0.03, atol=0.03)


def test_cuda_without_te_is_its_own_implementation(monkeypatch):
    """detect() on CUDA without Transformer Engine builds the local spec with the segmented
    attention, which takes a tree: it shares prefixes, packs the layout (not a dense mask),
    and torch's CUDA rms_norm decides the norm it is priced with."""
    from art.megatron import cpu_runtime, implementation

    monkeypatch.setattr(cpu_runtime, "cuda_available", lambda: True)
    monkeypatch.setattr(cpu_runtime, "transformer_engine_available", lambda: False)
    monkeypatch.setattr(implementation, "torch_cuda_rms_norm_fused", lambda: True)
    impl = Implementation.detect()
    assert impl == Implementation.cuda_local()
    assert impl.key == "local/flash/fused-norm/swiglu-unfused/cuda"
    monkeypatch.setattr(implementation, "torch_cuda_rms_norm_fused", lambda: False)
    assert Implementation.detect().norm == "torch"
    layout = ParallelLayout(tensor_parallel=2, sequence_parallel=True)
    assert shares_prefixes(impl, layout)
    assert not shares_prefixes(Implementation.gpu_te(), layout)
    prompt = torch.arange(1, 9)
    rollouts = [torch.cat([prompt, torch.tensor([20, 21])]), torch.cat([prompt,
                                                                         torch.tensor([30])])]
    batch = pack_sequences(rollouts, implementation=impl, layout=layout, groups=[2])
    assert batch.shared_tokens == 8 and batch.attention_mask is None
    assert isinstance(batch.packed_seq_params, AttentionLayout)
    assert batch.packed_seq_params.is_tree


def test_model_builder_puts_the_segmented_attention_in_the_cuda_local_spec():
    """The CUDA-without-TE spec's core attention is the segmented attention (dense and
    hybrid specs), not Megatron's unfused DotProductAttention."""
    from art.megatron.geometry import load_geometry
    from art.megatron.model_builder import layer_spec
    from art.megatron.packed_attention import SegmentedFlashAttention

    spec = layer_spec(load_geometry("tiny-qwen3"), Implementation.cuda_local())
    assert spec.submodules.self_attention.submodules.core_attention is SegmentedFlashAttention


# ---- pricing ---------------------------------------------------------------------------

GEOMETRY = geometry_from_hf_dict(dict(
    model_type="qwen3", num_hidden_layers=1, hidden_size=64, intermediate_size=192,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    vocab_size=64, max_position_embeddings=16384), name="attn-probe")


class AllocatingStandIns(StandIns):
    """StandIns that also allocate, on the meter, what torch's CUDA kernels allocate beside
    their outputs (flash_api.cpp): the forward's rng tensors; the backward's fp32 dq
    accumulator [b, L rounded to 128, heads, d rounded to 32], fp32 softmax_d [b, heads, L
    rounded to 128] and, with GQA, dk / dv for every query head before the group sum."""

    def flash_bwd(self, grad_out, query, key, value, *rest, **kw):
        b, heads, length, dim = query.shape
        rows = -(-length // 128) * 128
        held = [torch.empty(b, rows, heads, -(-dim // 32) * 32),
                torch.empty(b, heads, rows)]
        if key.shape[1] != heads:
            held += [torch.empty(b, key.shape[2], heads, dim, dtype=key.dtype)
                     for _ in ("dk", "dv")]
        result = super().flash_bwd(grad_out, query, key, value, *rest, **kw)
        del held
        return result


def test_a_cuda_row_runs_within_its_priced_transients(monkeypatch):
    """Stand-ins (no GPU here) that allocate what the CUDA flash kernels allocate: a 4k bf16
    prefix-tree row's forward and backward working sets stay under the CUDA-priced terms
    (`segmented_flash_costs` for `Implementation.cuda_local()`); the backward, whose row-sized
    accumulators dominate, within 60-100 % of its term (the forward holds one segment's
    working set, which the row-sized term bounds); nothing is S x S."""
    kernels = AllocatingStandIns()
    monkeypatch.setattr(pa, "_is_cuda", lambda t: True)
    monkeypatch.setattr(pa, "_can_use_flash", lambda params: True)
    monkeypatch.setattr(pa, "_CUDA_FLASH_FWD", kernels.flash_fwd)
    monkeypatch.setattr(pa, "_CUDA_FLASH_BWD", kernels.flash_bwd)
    d = Dims(GEOMETRY, ParallelLayout(), Implementation.cuda_local(), 2, 0, frozenset())
    s, prompt, child = 4096, 3600, 124
    layout = AttentionLayout(s, (AttentionSegment(0, prompt), *[
        AttentionSegment(prompt + child * i, child, (KeySpan(0, prompt),)) for i in range(4)]))
    q, k, v = _qkv(s, 4, 2, 16, dtype=torch.bfloat16)
    kept, forward, backward = segmented_flash_costs(d, s, s * 64 * 2, s * 32 * 2)
    assert kept == s * 4 * 4  # the fp32 logsumexp per head and token
    with MemoryMeter() as meter:
        out = pa.segmented_flash_attention(q, k, v, layout, 0.25)
        forward_seen = meter.peak_bytes - out.untyped_storage().nbytes() - kept
        grad = torch.randn_like(out)
        base = meter.live_bytes
        torch.autograd.grad(out, (q, k, v), grad)
        backward_seen = meter.peak_bytes - base
    assert 0 < forward_seen <= forward, (forward_seen, forward)
    assert 0.6 * backward <= backward_seen <= backward, (backward_seen, backward)
    assert meter.peak_bytes < 8 * 2**20  # a 4k x 4k fp32 score matrix alone is 64 MiB


# ---- real CUDA ---------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("dtype,dim,kernel", [(torch.bfloat16, 64, "cuda-flash"),
                                               (torch.float16, 128, "cuda-flash"),
                                               (torch.float32, 64, "cuda-efficient")])
def test_on_cuda_equals_the_masked_softmax(dtype, dim, kernel):
    """The real kernels on a GPU (skipped without one): a GQA prefix-tree row equals the
    fp64 masked softmax in output and gradients (bf16/fp16 to 3e-2, fp32 to 1e-4) through the
    kernel expected."""
    q, k, v = (t.detach().cuda().requires_grad_() for t in _qkv(16, 6, 2, dim, dtype=dtype))
    assert pa._kernel_for(q, k, v) == kernel
    out = pa.segmented_flash_attention(q, k, v, TREE, SCALE)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    cpu = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    want_out = _reference(*cpu, TREE)
    want = torch.autograd.grad(want_out, cpu, grad.cpu().double())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.cpu().double(), want_out, rtol=tol, atol=tol)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu().double(), b, rtol=tol, atol=tol)


@needs_cuda
def test_on_cuda_a_long_tree_row_never_holds_s_squared():
    """The real kernels (skipped without a GPU): an 8k bf16 row with a 3k shared prompt runs
    forward and backward with a peak far below one fp32 [heads, S, S] score tensor."""
    s, prompt, child = 8192, 3000, 1298
    layout = AttentionLayout(s, (AttentionSegment(0, prompt), *[
        AttentionSegment(prompt + child * i, child, (KeySpan(0, prompt),)) for i in range(4)]))
    q, k, v = (t.detach().cuda().requires_grad_()
               for t in _qkv(s, 8, 2, 128, dtype=torch.bfloat16))
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = pa.segmented_flash_attention(q, k, v, layout, 1 / math.sqrt(128))
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert torch.cuda.max_memory_allocated() - base < 8 * s * s * 4 // 4  # 1/4 of [8, S, S] fp32
