"""Segmented flash attention (art.megatron.packed_attention): exact against a masked softmax
for per-sequence and prefix-tree layouts, keeps only output + logsumexp beyond q, k, v, and
its transients are what the memory model prices for it."""

from __future__ import annotations

import math

import pytest
import torch

from art.megatron.attention_layout import AttentionLayout, AttentionSegment, KeySpan
from art.megatron.geometry import geometry_from_hf_dict
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.megatron.packed_attention import segmented_flash_attention
from art.trainer_rank.measuring.meter import MemoryMeter
from art.trainer_rank.pricing.layer_terms import Dims
from art.trainer_rank.pricing.layers_attention import segmented_flash_costs

# A prompt, a deeper shared part with two children, a sibling completion, and a pad block.
TREE = AttentionLayout(16, (
    AttentionSegment(0, 5), AttentionSegment(5, 2, (KeySpan(0, 5),)),
    AttentionSegment(7, 2, (KeySpan(0, 7),)), AttentionSegment(9, 3, (KeySpan(0, 7),)),
    AttentionSegment(12, 3, (KeySpan(0, 5),)), AttentionSegment(15, 1),
))


def _qkv(s: int, heads: int, groups: int, dim: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, 1, h, dim, generator=g, dtype=dtype).requires_grad_()
            for h in (heads, groups, groups)]


def _reference(q, k, v, layout: AttentionLayout) -> torch.Tensor:
    """fp64 masked softmax with Megatron's GQA (key/value groups repeated to the heads)."""
    rep = q.shape[2] // k.shape[2]
    qq = q.double().permute(1, 2, 0, 3)
    kk, vv = (t.double().repeat_interleave(rep, dim=2).permute(1, 2, 0, 3) for t in (k, v))
    scores = (qq @ kk.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(layout.dense_mask()[0, 0], float("-inf"))
    out = scores.softmax(-1) @ vv
    return out.permute(2, 0, 1, 3).reshape(q.shape[0], 1, -1)


def _assert_equals_reference(q, k, v, layout: AttentionLayout) -> None:
    """Output and gradients of the segmented attention equal the fp64 masked softmax."""
    out = segmented_flash_attention(q, k, v, layout, 1 / math.sqrt(q.shape[-1]))
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want_out = _reference(q, k, v, layout)
    want = torch.autograd.grad(want_out, (q, k, v), grad.double())
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", [TREE, AttentionLayout.causal_blocks([6, 1, 9])],
                         ids=["tree", "causal-blocks"])
def test_equals_the_masked_softmax_in_output_and_gradients(layout):
    _assert_equals_reference(*_qkv(16, 4, 2, 8), layout)


def test_bfloat16_stays_close_to_the_fp64_reference():
    q, k, v = _qkv(16, 4, 2, 8, dtype=torch.bfloat16)
    out = segmented_flash_attention(q, k, v, TREE, 1 / math.sqrt(8))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _reference(q, k, v, TREE), rtol=0.03, atol=0.03)


def test_keeps_only_output_and_logsumexp_beyond_its_inputs():
    s, heads, groups, dim = 512, 4, 2, 16
    q, k, v = _qkv(s, heads, groups, dim)
    inputs = {t.untyped_storage().data_ptr() for t in (q, k, v)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    layout = AttentionLayout(s, (AttentionSegment(0, 200),
                                 *[AttentionSegment(200 + 78 * i, 78, (KeySpan(0, 200),))
                                   for i in range(4)]))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        segmented_flash_attention(q, k, v, layout, 0.25)
    extra = sum(n for ptr, n in saved.items() if ptr not in inputs)
    assert extra == s * heads * dim * 4 + heads * s * 4  # the output + the fp32 logsumexp


def test_an_8k_row_runs_within_the_priced_transients():
    """The module's working sets stay under the memory model's terms for it: backward (the
    full-row dq/dk/dv accumulators) within 60-100%; forward holds one segment's working set,
    under the row-sized term the model prices as its bound. Nothing is S x S."""
    geometry = geometry_from_hf_dict(dict(
        model_type="qwen3", num_hidden_layers=1, hidden_size=64, intermediate_size=192,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64,
        max_position_embeddings=16384), name="attn-probe")
    d = Dims(geometry, ParallelLayout(), Implementation.cpu_local("flash"), 4, 0, frozenset())
    s = 8192
    prompt = 3000
    layout = AttentionLayout(s, (AttentionSegment(0, prompt), *[
        AttentionSegment(prompt + 1298 * i, 1298, (KeySpan(0, prompt),)) for i in range(4)]))
    q, k, v = _qkv(s, 4, 2, 16)
    q_bytes, kv_bytes = s * 64 * 4, s * 32 * 4
    kept, forward, backward = segmented_flash_costs(d, s, q_bytes, kv_bytes)
    with MemoryMeter() as meter:
        out = segmented_flash_attention(q, k, v, layout, 0.25)
        forward_seen = meter.peak_bytes - out.untyped_storage().nbytes() - kept
        grad = torch.randn_like(out)
        base = meter.live_bytes
        torch.autograd.grad(out, (q, k, v), grad)
        backward_seen = meter.peak_bytes - base
    # One segment at a time: the prompt's single block output, or a completion's block output
    # plus its fp32 running output; the row term bounds both.
    per_token = 64 * 4
    expected = max(prompt * per_token, 2 * 1298 * per_token)
    assert expected <= forward_seen <= 1.1 * expected <= forward, (forward_seen, expected)
    assert 0.6 * backward <= backward_seen <= backward, (backward_seen, backward)
    assert meter.peak_bytes < 16 * 2**20  # an 8k x 8k fp32 score matrix alone is 256 MiB


# Runs of equal segments that see only themselves (batched), a shared prompt with two children
# (not batched), and a run broken by another length.
RUNS = AttentionLayout(40, (
    AttentionSegment(0, 3), AttentionSegment(3, 3), AttentionSegment(6, 3),
    AttentionSegment(9, 5), AttentionSegment(14, 5),
    AttentionSegment(19, 2, (KeySpan(14, 5),)), AttentionSegment(21, 2, (KeySpan(14, 5),)),
    AttentionSegment(23, 3), AttentionSegment(26, 7), AttentionSegment(33, 7),
))


def test_equal_segments_run_as_one_batched_call_with_the_same_results(monkeypatch):
    """Consecutive equal segments with no context take one kernel call per run, forward and
    backward, and the results still equal the masked softmax; segments with a context and
    runs broken by another length are not merged."""
    import art.megatron.packed_attention as pa

    batches: dict[str, list[int]] = {"fwd": [], "bwd": []}
    forward, backward = pa._FLASH_FWD, pa._FLASH_BWD

    def counting_forward(q, *args, **kwargs):
        batches["fwd"].append(q.shape[0])
        return forward(q, *args, **kwargs)

    def counting_backward(g, *args, **kwargs):
        batches["bwd"].append(g.shape[0])
        return backward(g, *args, **kwargs)

    monkeypatch.setattr(pa, "_FLASH_FWD", counting_forward)
    monkeypatch.setattr(pa, "_FLASH_BWD", counting_backward)
    _assert_equals_reference(*_qkv(40, 4, 2, 8), RUNS)
    # 3 x 3, 5 + 5 (the prompt), each child: context block + its own, 3, 7 x 2
    assert batches["fwd"] == [3, 2, 1, 1, 1, 1, 1, 2]
    assert batches["bwd"] == batches["fwd"]
