"""The GPU-shaped CPU stand-ins (art/megatron/cpu_fused.py) equal the torch path numerically
and keep for backward exactly the fused kernels' saved set (input + fp32 rstd for RMSNorm,
the input for SwiGLU, the frequencies for RoPE)."""

from __future__ import annotations

import pytest
import torch

from art.megatron.cpu_fused import CHUNK_ROWS, FusedRMSNorm, fused_rope, fused_swiglu

ROWS = CHUNK_ROWS + 37  # more than one chunk, the last one partial


def _saved(fn, *inputs):
    """(output, tensors autograd keeps for backward: ids of the inputs or (shape, dtype))."""
    saved = []

    def pack(t):
        known = next((name for name, x in inputs if t.data_ptr() == x.data_ptr()), None)
        saved.append(known or (tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def _grads(out, grad, tensors):
    return torch.autograd.grad(out, tensors, grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_torch_and_keeps_input_and_fp32_rstd(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, 2, 48, generator=g).to(dtype).requires_grad_()
    norm = FusedRMSNorm(type("C", (), {"params_dtype": dtype})(), 48, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=g) + 0.5)
    reference = torch.nn.functional.rms_norm(x.float(), (48,), norm.weight.float(), 1e-6)
    out, saved = _saved(lambda: norm(x), ("x", x), ("weight", norm.weight))
    assert saved == ["x", "weight", ((ROWS * 2,), torch.float32)]
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), reference, **tol)
    grad = torch.randn(out.shape, generator=g).to(dtype)
    dx, dw = _grads(out, grad, (x, norm.weight))
    rx, rw = _grads(reference, grad.float(), (x, norm.weight))
    torch.testing.assert_close(dx.float(), rx.float(), **tol)
    torch.testing.assert_close(dw.float(), rw.float(), **tol)


def test_swiglu_equals_torch_and_keeps_only_its_input():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, 1, 64, generator=g, requires_grad=True)
    a, b = x.chunk(2, dim=-1)
    reference = torch.nn.functional.silu(a) * b
    out, saved = _saved(lambda: fused_swiglu(x), ("x", x))
    assert saved == ["x"]
    torch.testing.assert_close(out, reference)
    grad = torch.randn(out.shape, generator=g)
    torch.testing.assert_close(_grads(out, grad, (x,))[0], _grads(reference, grad, (x,))[0])


@pytest.mark.parametrize("rotary", [16, 4])
def test_rope_equals_megatrons_torch_path_and_keeps_only_the_frequencies(rotary):
    """The whole head rotated, or its first `rotary` dims (partial rotary, as Qwen3.5's
    attention: transformer_engine's fused kernel takes frequencies narrower than the head)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    g = torch.Generator().manual_seed(2)
    t = torch.randn(ROWS, 1, 4, 16, generator=g, requires_grad=True)
    freqs = torch.rand(ROWS, 1, 1, rotary, generator=g) * 6.0
    reference = _apply_rotary_pos_emb_bshd(t, freqs)
    out, saved = _saved(lambda: fused_rope(t, freqs), ("freqs", freqs))
    assert saved == ["freqs"]
    torch.testing.assert_close(out, reference)
    grad = torch.randn(out.shape, generator=g)
    torch.testing.assert_close(_grads(out, grad, (t,))[0], _grads(reference, grad, (t,))[0])


def test_gpu_shaped_build_uses_the_stand_ins_and_equals_the_local_flash_build(megatron_process):
    from art.megatron import cpu_fused
    from art.megatron.implementation import Implementation
    from art.megatron.layout import ParallelLayout
    from art.megatron.model_builder import (
        RecomputeConfig,
        build_gpt_model,
        build_transformer_config,
    )
    from art.trainer_rank.measuring.meter import MemoryMeter

    from _tiny import tiny_dense

    geometry = tiny_dense(num_layers=2)
    tokens = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(0))
    results = {}
    for name, impl in (("local", Implementation.cpu_local("flash")),
                       ("gpu-shaped", Implementation.cpu_gpu_shaped())):
        config = build_transformer_config(geometry, layout=ParallelLayout(),
                                          recompute=RecomputeConfig(), dtype="float32",
                                          implementation=impl)
        model = build_gpt_model(geometry, config, seed=0, implementation=impl)
        model.train()
        with MemoryMeter(device="cpu") as meter:
            logits = model(tokens, torch.arange(48)[None], attention_mask=None)
            kept = meter.live_bytes  # what the forward keeps for backward (and the logits)
            logits.float().pow(2).mean().backward()
        results[name] = (logits.detach(), kept, model)
    (local_logits, local_kept, _), (logits, kept, model) = results["local"], results[
        "gpu-shaped"]
    layer = model.decoder.layers[0]
    assert isinstance(layer.input_layernorm, cpu_fused.FusedRMSNorm)
    assert isinstance(model.decoder.final_layernorm, cpu_fused.FusedRMSNorm)
    torch.testing.assert_close(logits, local_logits)
    grads = {n: p.grad for n, p in results["local"][2].named_parameters()}
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], atol=1e-6, rtol=1e-5)
    assert kept < local_kept  # fp32 norm rows, silu halves and cos/sin copies are not kept


def test_gpu_shaped_hybrid_build_takes_the_stand_ins_and_equals_the_local_build(
        megatron_process, monkeypatch):
    """A hybrid (Gated DeltaNet + gated attention) built GPU-shaped takes the fused norms'
    stand-ins, the fused RoPE's (its attention rotates a quarter of each head, as the fused
    kernel does for frequencies narrower than the head) and the segmented flash attention, as
    the dense local spec does, runs a packed row of several sequences forward and backward,
    and gives the local build's output."""
    from _calibration.harness import POLICY_BY_NAME, calibration_geometries, calibration_provider

    from art.megatron import cpu_fused
    from art.megatron.implementation import Implementation
    from art.megatron.packed_attention import SegmentedFlashAttention
    from art.trainer_rank.compute.forward import decoder_hidden_states, unwrap_model
    from art.trainer_rank.compute.packing import pack_sequences, unpack

    geometry = calibration_geometries()["hybrid-128"]
    assert geometry.rotary_fraction < 1.0
    rotated: list[tuple[int, int]] = []
    stand_in = cpu_fused.fused_rope

    def counted(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        rotated.append((freqs.shape[-1], t.shape[-1]))
        return stand_in(t, freqs)

    monkeypatch.setattr(cpu_fused, "fused_rope", counted)
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 1024, (n,), generator=generator) for n in (37, 70, 21)]
    hidden = {}
    for name, impl in (("local", Implementation.cpu_local()),
                       ("gpu-shaped", Implementation.cpu_gpu_shaped())):
        provider = calibration_provider(geometry, POLICY_BY_NAME["none"], lora_rank=0,
                                        tensor_parallel=1, dtype="float32", implementation=impl)
        model = provider.build_model(seed=0)
        batch = pack_sequences(sequences, implementation=impl, layout=provider.layout,
                               device=torch.device("cpu"))
        out = decoder_hidden_states(model, batch)
        out.pow(2).mean().backward()
        # In item order: a flash row lays its sequences out by length, the unfused one not.
        hidden[name] = torch.cat(unpack(out.detach(), batch))
    decoder = unwrap_model(model).decoder
    attention = decoder.layers[3].self_attention
    assert isinstance(attention.core_attention, SegmentedFlashAttention)
    assert isinstance(attention.q_layernorm, cpu_fused.FusedRMSNorm)
    assert isinstance(decoder.layers[0].pre_mlp_layernorm, cpu_fused.FusedRMSNorm)
    assert isinstance(decoder.final_layernorm, cpu_fused.FusedRMSNorm)
    assert rotated and all(rotary < head for rotary, head in rotated), rotated
    torch.testing.assert_close(hidden["gpu-shaped"], hidden["local"], atol=1e-5, rtol=1e-4)
