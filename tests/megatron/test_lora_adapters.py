"""Several resident LoRA adapters per linear on a real Megatron-Core model (TP=1): selection,
none = base model, per-adapter peft files, and recompute keeping the forward's adapter."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from art.megatron.lora import lora_modules, lora_parameters
from art.megatron.lora_peft import export_adapter, load_adapter
from art.megatron.lora_selection import active_adapter, use_adapter
from art.megatron.model_builder import build_gpt_model
from art.megatron.provider import Provider
from art.megatron.settings import load_settings

TOKENS = 16


def _provider(granularity: str = "none", r: int = 4, target="all-linear") -> Provider:
    settings = load_settings({"ART_MEGATRON_RECOMPUTE_GRANULARITY": granularity})
    return Provider("tiny-qwen3", settings=settings, dtype="float32",
                    lora=LoraConfig(r=r, lora_alpha=2 * r, target_modules=target))


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 256, (1, TOKENS), generator=g), torch.arange(TOKENS)[None]


def _randomise(model, adapter="default", seed=5):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in lora_modules(model):
            if adapter in module.adapters:
                for b in module.adapters[adapter].lora_B.values():
                    b.copy_(torch.randn(b.shape, generator=g) * 0.2)


def _adapter_dir(tmp_path, name, r, seed, target="all-linear"):
    """A non-trivial adapter exported from its own model."""
    p = _provider(r=r, target=target)
    model = p.build_model(seed=seed)
    _randomise(model, seed=seed)
    export_adapter(model, tmp_path / name, base_model_name_or_path="tiny-qwen3")
    return tmp_path / name


def test_no_adapter_is_the_base_model_and_adapters_match_separate_models(
        megatron_process, tmp_path):
    p = _provider()
    tokens, positions = _batch()
    base = build_gpt_model(p.geometry, p.transformer_config(), implementation=p.implementation,
                           seed=0)
    model = p.build_model(seed=0)
    _randomise(model)
    a_dir = _adapter_dir(tmp_path, "a", r=2, seed=1, target=["q_proj", "v_proj", "down_proj"])
    b_dir = _adapter_dir(tmp_path, "b", r=8, seed=2)
    load_adapter(model, a_dir, adapter="a")
    load_adapter(model, b_dir, adapter="b", trainable=False)
    with torch.no_grad():
        expected_base = base(tokens, positions, attention_mask=None)
        separate = {}
        for name, directory in (("a", a_dir), ("b", b_dir)):
            alone = build_gpt_model(p.geometry, p.transformer_config(),
                                    implementation=p.implementation, seed=0)
            load_adapter(alone, directory)
            separate[name] = alone(tokens, positions, attention_mask=None)
        with use_adapter(None):
            got_base = model(tokens, positions, attention_mask=None)
        got = {}
        for name in ("a", "b"):
            with use_adapter(name):
                got[name] = model(tokens, positions, attention_mask=None)
        default = model(tokens, positions, attention_mask=None)
    assert active_adapter() == "default"
    assert torch.equal(got_base, expected_base)
    for name in ("a", "b"):
        assert torch.equal(got[name], separate[name]), name
        assert not torch.equal(got[name], expected_base)
    assert not torch.equal(default, got["a"]) and not torch.equal(default, expected_base)
    # Only the selected adapter's parameters receive gradients; the frozen one none.
    assert all(not q.requires_grad for q in lora_parameters(model, "b") + [
        q for m in lora_modules(model) for q in m.adapters["b"].parameters()])
    with use_adapter("a"):
        model(tokens, positions, attention_mask=None).float().pow(2).mean().backward()
    assert all(q.grad is not None for q in lora_parameters(model, "a"))
    assert all(q.grad is None for q in lora_parameters(model, "default"))
    # Per-adapter export reproduces the loaded files' tensors and shapes.
    export_adapter(model, tmp_path / "a-again", adapter="a")
    from safetensors.torch import load_file
    again = load_file(tmp_path / "a-again" / "adapter_model.safetensors")
    original = load_file(a_dir / "adapter_model.safetensors")
    assert again.keys() == original.keys()
    assert all(torch.equal(again[k], original[k]) for k in original)


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recompute_reruns_with_the_adapter_of_the_forward(megatron_process, tmp_path,
                                                          granularity):
    """The backward runs after use_adapter() has exited; recompute must still apply the
    forward's adapter (else the gradients would belong to another adapter's forward)."""
    a_dir = _adapter_dir(tmp_path, "a", r=4, seed=1)
    tokens, positions = _batch()

    def grads(granularity_: str) -> dict[str, torch.Tensor]:
        p = _provider(granularity_)
        env_settings = {"ART_MEGATRON_RECOMPUTE_MODULES": "core_attn,mlp"}
        if granularity_ == "selective":
            p = Provider("tiny-qwen3", settings=load_settings(
                {"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective", **env_settings}),
                dtype="float32", lora=p.lora_config)
        model = p.build_model(seed=0)
        _randomise(model)  # the default adapter differs from "a"
        load_adapter(model, a_dir, adapter="a")
        with use_adapter("a"):
            loss = model(tokens, positions, attention_mask=None).float().pow(2).mean()
        loss.backward()  # outside the selection, as a caller's loss.backward() is
        return {n: q.grad.clone() for n, q in model.named_parameters()
                if q.requires_grad and q.grad is not None}

    reference = grads("none")
    got = grads(granularity)
    assert got.keys() == reference.keys() and any(".adapters.a." in k for k in got)
    for name, grad in got.items():
        torch.testing.assert_close(grad, reference[name], rtol=1e-5, atol=1e-7, msg=name)
