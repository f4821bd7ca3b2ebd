"""Chunked output heads equal an unchunked reference; memory stays one chunk wide."""

from __future__ import annotations

import pytest
import torch

from art.megatron.layout import ParallelLayout
from art.megatron.model_builder import RecomputeConfig, build_gpt_model, build_transformer_config
from art.trainer_rank.compute.heads import compute_heads, output_weight
from art.trainer_rank.compute.packing import IGNORE_INDEX
from art.trainer_rank.measuring.meter import MemoryMeter

from _tiny import tiny_dense

TOKENS = 40


@pytest.fixture(scope="module")
def model(megatron_process):
    geometry = tiny_dense(num_layers=1, vocab=1024)  # vocab >> hidden, as in real models
    config = build_transformer_config(
        geometry, layout=ParallelLayout(), recompute=RecomputeConfig("selective"), dtype="float32"
    )
    return build_gpt_model(geometry, config, seed=0)


def _inputs(model, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = output_weight(model)
    hidden = torch.randn(TOKENS, weight.shape[1], generator=generator)
    targets = torch.randint(0, weight.shape[0], (TOKENS,), generator=generator)
    targets[[0, 7, 8, TOKENS - 1]] = IGNORE_INDEX
    return hidden, targets


def _reference(weight, hidden, targets, top_k):
    """The whole row at once, straight from the definition."""
    logits = (hidden @ weight.t()).float()
    logprobs = torch.log_softmax(logits, dim=-1)
    valid = targets != IGNORE_INDEX
    picked = logprobs.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    target_logprobs = torch.where(valid, picked, torch.zeros_like(picked))
    top_values, top_tokens = logprobs.topk(top_k, dim=-1)
    return target_logprobs, top_values, top_tokens, logits


@pytest.mark.parametrize("chunk_tokens", [1, 3, 16, TOKENS, 1000])
def test_chunked_heads_equal_the_unchunked_reference_with_gradients(model, chunk_tokens):
    weight = output_weight(model)
    hidden, targets = _inputs(model)
    hidden_ref = hidden.clone().requires_grad_(True)
    reference = _reference(weight, hidden_ref, targets, top_k=4)
    loss_ref = reference[0].sum() + 0.5 * reference[1].sum() + 0.01 * reference[3].pow(2).sum()
    (weight_grad_ref, hidden_grad_ref) = torch.autograd.grad(loss_ref, [weight, hidden_ref])

    hidden = hidden.requires_grad_(True)
    out = compute_heads(
        model, hidden, target_tokens=targets, top_k=4, logits=True, chunk_tokens=chunk_tokens
    )
    torch.testing.assert_close(out.target_logprobs, reference[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.top_k_logprobs, reference[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(out.top_k_tokens, reference[2])
    torch.testing.assert_close(out.logits, reference[3], rtol=1e-5, atol=1e-5)
    assert out.target_logprobs.dtype == out.top_k_logprobs.dtype == torch.float32
    loss = out.target_logprobs.sum() + 0.5 * out.top_k_logprobs.sum() + 0.01 * out.logits.pow(
        2
    ).sum()
    weight_grad, hidden_grad = torch.autograd.grad(loss, [weight, hidden])
    torch.testing.assert_close(weight_grad, weight_grad_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(hidden_grad, hidden_grad_ref, rtol=1e-4, atol=1e-5)


def test_ignored_targets_give_zero_and_no_gradient(model):
    hidden, targets = _inputs(model, seed=1)
    hidden.requires_grad_(True)
    out = compute_heads(model, hidden, target_tokens=targets, chunk_tokens=6)
    ignored = targets == IGNORE_INDEX
    assert out.top_k_logprobs is None and out.logits is None and out.top_k_tokens is None
    assert torch.all(out.target_logprobs[ignored] == 0.0)
    assert torch.all(out.target_logprobs[~ignored] < 0.0)
    (grad,) = torch.autograd.grad(out.target_logprobs.sum(), [hidden])
    assert torch.all(grad[ignored] == 0.0)
    assert torch.all(grad[~ignored].abs().sum(dim=-1) > 0)


def test_no_grad_outputs_carry_no_graph(model):
    hidden, targets = _inputs(model)
    with torch.no_grad():
        out = compute_heads(model, hidden.requires_grad_(True), target_tokens=targets, top_k=2)
    assert not out.target_logprobs.requires_grad and not out.top_k_logprobs.requires_grad


@pytest.mark.parametrize("top_k", [0, 3])
def test_heads_hold_one_chunk_of_logits_not_the_whole_row(model, top_k):
    """Log-probs and top-k keep one [chunk, vocab] fp32 block alive at a time, in forward and in
    backward; only logits=True holds the whole row's logits. The output weight is frozen here,
    as under LoRA: a trainable one adds its own gradient buffer to the backward."""
    weight = output_weight(model)
    hidden, targets = _inputs(model)
    chunk_tokens = 4
    chunk_bytes = chunk_tokens * weight.shape[0] * 4
    full_logits_bytes = TOKENS * weight.shape[0] * 4
    # [S] log-probs, the log-normalizer, [S, k] values and ids, and small per-chunk vectors.
    outputs_bytes = TOKENS * (4 + 4 + 12 * top_k) + 1024
    hidden.requires_grad_(True)
    weight.requires_grad_(False)
    try:
        with MemoryMeter(device="cpu") as meter:
            out = compute_heads(
                model, hidden, target_tokens=targets, top_k=top_k, chunk_tokens=chunk_tokens
            )
            forward_peak = meter.peak_bytes
            meter.reset_peak()
            before_backward = meter.live_bytes
            loss = out.target_logprobs.sum()
            if top_k:
                loss = loss + out.top_k_logprobs.sum()
            loss.backward()
            backward_extra = meter.peak_bytes - before_backward
    finally:
        weight.requires_grad_(True)
    assert chunk_bytes < forward_peak < chunk_bytes + outputs_bytes
    # Backward: one chunk, hidden's gradient buffer, the outputs' gradients.
    assert chunk_bytes < backward_extra < chunk_bytes + hidden.numel() * 4 + outputs_bytes
    with MemoryMeter(device="cpu") as meter, torch.no_grad():
        compute_heads(model, hidden, target_tokens=targets, logits=True, chunk_tokens=4)
    assert meter.peak_bytes >= full_logits_bytes


def test_bad_arguments_are_refused_with_the_value_seen(model):
    hidden, targets = _inputs(model)
    vocab = output_weight(model).shape[0]
    bad_targets = targets.clone()
    bad_targets[3] = vocab
    with pytest.raises(ValueError, match=f"target token id {vocab} is outside"):
        compute_heads(model, hidden, target_tokens=bad_targets)
    with pytest.raises(ValueError, match="top_k"):
        compute_heads(model, hidden, target_tokens=None, top_k=vocab + 1)
    with pytest.raises(ValueError, match="hidden"):
        compute_heads(model, hidden[:, :-1], target_tokens=None)
    with pytest.raises(ValueError, match="chunk_tokens"):
        compute_heads(model, hidden, target_tokens=None, chunk_tokens=0)
    with pytest.raises(ValueError, match=r"per packed token\), got \(39,\)"):
        compute_heads(model, hidden, target_tokens=targets[:-1])


def test_bfloat16_model_projects_in_bf16_and_returns_fp32(megatron_process):
    geometry = tiny_dense(num_layers=1, vocab=512)
    config = build_transformer_config(
        geometry, layout=ParallelLayout(), recompute=RecomputeConfig("selective"),
        dtype="bfloat16",
    )
    model = build_gpt_model(geometry, config, seed=0)
    weight = output_weight(model)
    assert weight.dtype == torch.bfloat16
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(24, geometry.hidden_size, generator=generator).to(torch.bfloat16)
    targets = torch.randint(0, 512, (24,), generator=generator)
    hidden_ref = hidden.clone().requires_grad_(True)
    logprobs_ref = torch.log_softmax((hidden_ref @ weight.t()).float(), dim=-1)
    picked_ref = logprobs_ref.gather(1, targets.unsqueeze(1)).squeeze(1)
    (grad_ref,) = torch.autograd.grad(picked_ref.sum(), [hidden_ref])

    hidden.requires_grad_(True)
    out = compute_heads(model, hidden, target_tokens=targets, top_k=2, chunk_tokens=5)
    assert out.target_logprobs.dtype == out.top_k_logprobs.dtype == torch.float32
    torch.testing.assert_close(out.target_logprobs, picked_ref, rtol=1e-3, atol=1e-3)
    (grad,) = torch.autograd.grad(out.target_logprobs.sum(), [hidden])
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.float(), grad_ref.float(), rtol=2e-2, atol=2e-3)
