"""The escalation switch on a real MoE model (selective core_attn + moe): inside it every layer
is one full checkpoint (its forward re-runs in backward), the flags selective recompute set
at construction are off, results are unchanged, and everything is restored afterwards."""

from __future__ import annotations

import torch

from art.megatron.implementation import Implementation
from art.megatron.provider import Provider
from art.megatron.settings import load_settings
from art.trainer_rank.decide.escalation import SELECTIVE_FLAGS, full_recompute

from _tiny import tiny_moe


def _flags(model) -> set[tuple[str, str]]:
    return {(type(m).__name__, n) for m in model.modules() for n in SELECTIVE_FLAGS
            if m.__dict__.get(n) is True}


def test_full_recompute_switch_on_moe(megatron_process):
    provider = Provider(
        tiny_moe(),
        settings=load_settings({"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective",
                                "ART_MEGATRON_RECOMPUTE_MODULES": "core_attn,moe"}),
        dtype="float32", implementation=Implementation.cpu_local(),
    )
    model = provider.build_model(seed=0)
    before = _flags(model)
    assert ("MoELayer", "moe_layer_recompute") in before
    assert ("SelfAttention", "checkpoint_core_attention") in before
    tokens = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12)[None]
    calls: list[int] = []
    hook = model.decoder.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        ref = model(tokens, positions, attention_mask=None)
        ref.float().pow(2).mean().backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        assert len(calls) == 1
        for p in model.parameters():
            p.grad = None
        calls.clear()
        with full_recompute(model):
            assert _flags(model) == set() and model.config.recompute_granularity == "full"
            out = model(tokens, positions, attention_mask=None)
            out.float().pow(2).mean().backward()
        assert len(calls) == 2
    finally:
        hook.remove()
    assert _flags(model) == before and model.config.recompute_granularity == "selective"
    assert model.config.recompute_method is None and model.config.recompute_num_layers is None
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    for name, grad in want.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad,
                                   atol=1e-6, rtol=1e-5, msg=name)
