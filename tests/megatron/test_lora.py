"""LoRA on real Megatron-Core models (TP=1 here; TP=2 in tests/distributed/test_lora_tp2.py)."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file

from art.megatron.lora import LoraLinear, apply_lora, lora_modules, lora_parameters
from art.megatron.lora_peft import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    export_adapter,
    load_adapter,
)
from art.megatron.model_builder import build_gpt_model
from art.megatron.provider import Provider
from art.megatron.settings import load_settings

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENS = 16


def _provider(model="tiny-qwen3", granularity="none", target=ALL, r=4, **env) -> Provider:
    settings = load_settings({"ART_MEGATRON_RECOMPUTE_GRANULARITY": granularity, **env})
    return Provider(model, settings=settings, dtype="float32",
                    lora=LoraConfig(r=r, lora_alpha=2 * r, target_modules=target))


def _batch(vocab=256):
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, vocab, (1, TOKENS), generator=g)
    return tokens, torch.arange(TOKENS)[None]


def _randomise_b(model, seed=5):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in lora_modules(model):
            for b in module.lora_B.values():
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)


@pytest.mark.parametrize("model_name", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_zero_b_leaves_outputs_unchanged_and_only_lora_trains(megatron_process, model_name):
    p = _provider(model_name)
    base = build_gpt_model(p.geometry, p.transformer_config(), implementation=p.implementation,
                           seed=0)
    model = p.build_model(seed=0)
    tokens, positions = _batch()
    with torch.no_grad():
        expected = base(tokens, positions, attention_mask=None)
        got = model(tokens, positions, attention_mask=None)
    assert torch.equal(got, expected)
    trainable = [n for n, q in model.named_parameters() if q.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {id(q) for q in lora_parameters(model)} == {
        id(q) for q in model.parameters() if q.requires_grad}
    wrapped = {type(m.base).__name__ for m in lora_modules(model)}
    assert wrapped == {"ColumnParallelLinear", "RowParallelLinear"}
    if model_name.endswith("moe"):
        assert any(".experts." in m.hf_path for m in lora_modules(model))
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(model, p.lora_config)


def _lora_grads(granularity: str, model_name: str) -> dict[str, torch.Tensor]:
    p = _provider(model_name, granularity)
    model = p.build_model(seed=0)
    _randomise_b(model)
    tokens, positions = _batch()
    logits = model(tokens, positions, attention_mask=None)
    logits.float().pow(2).mean().backward()
    return {n: q.grad.clone() for n, q in model.named_parameters()
            if q.requires_grad and q.grad is not None}


@pytest.mark.parametrize("model_name", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_lora_grads_are_the_same_in_every_recompute_mode(megatron_process, model_name):
    """Megatron's checkpoints are reentrant: without the embedding-output hook, full recompute
    would give the first layers' LoRA no gradient at all."""
    reference = _lora_grads("none", model_name)
    n_trainable = sum(
        1 for _ in _provider(model_name).build_model().parameters() if _.requires_grad)
    # Every adapter gets a gradient (experts that received no token excepted on MoE).
    assert len(reference) >= (n_trainable if "moe" not in model_name else n_trainable // 2)
    for granularity in ("full", "selective"):
        grads = _lora_grads(granularity, model_name)
        assert grads.keys() == reference.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference[name], rtol=1e-5, atol=1e-7,
                                       msg=f"{granularity}: {name}")


def test_fused_qkv_and_fc1_layout_matches_the_hf_projections(megatron_process):
    """Each HF projection's LoRA term lands where Megatron puts that projection in its fused
    output: QKV interleaved per query group, fc1 as [gate, up]."""
    p = _provider()
    model = p.build_model(seed=0)
    _randomise_b(model)
    layer = model.decoder.layers[0]
    qkv: LoraLinear = layer.self_attention.linear_qkv
    x = torch.randn(5, 1, p.geometry.hidden_size)
    fused = qkv.delta(x)
    groups, heads, d = (p.geometry.num_query_groups, p.geometry.num_attention_heads,
                        p.geometry.head_dim)
    per_group = fused.view(5, 1, groups, (heads // groups + 2) * d)
    q, k, v = torch.split(per_group, [heads // groups * d, d, d], dim=-1)

    def hf(name):
        return (x @ qkv.lora_A[name].t() @ qkv.lora_B[name].t()) * qkv.scaling

    torch.testing.assert_close(q.reshape(5, 1, -1), hf("q_proj"))
    torch.testing.assert_close(k.reshape(5, 1, -1), hf("k_proj"))
    torch.testing.assert_close(v.reshape(5, 1, -1), hf("v_proj"))
    fc1: LoraLinear = layer.mlp.linear_fc1
    gate, up = torch.chunk(fc1.delta(x), 2, dim=-1)
    torch.testing.assert_close(gate, (x @ fc1.lora_A["gate_proj"].t()
                                      @ fc1.lora_B["gate_proj"].t()) * fc1.scaling)
    torch.testing.assert_close(up, (x @ fc1.lora_A["up_proj"].t()
                                    @ fc1.lora_B["up_proj"].t()) * fc1.scaling)


def test_partial_targets(megatron_process):
    model = _provider(target=["q_proj", "v_proj", "linear_fc2"]).build_model(seed=0)
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    assert set(qkv.lora_A) == {"q_proj", "v_proj"}
    assert isinstance(model.decoder.layers[0].mlp.linear_fc2, LoraLinear)
    assert not isinstance(model.decoder.layers[0].mlp.linear_fc1, LoraLinear)
    assert not isinstance(model.decoder.layers[0].self_attention.linear_proj, LoraLinear)
    tokens, positions = _batch()
    model(tokens, positions, attention_mask=None).float().mean().backward()
    assert all(q.grad is not None for q in lora_parameters(model))


@pytest.mark.parametrize("model_name", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_export_round_trips(megatron_process, tmp_path, model_name):
    p = _provider(model_name, r=3)
    model = p.build_model(seed=0)
    _randomise_b(model)
    tokens, positions = _batch()
    with torch.no_grad():
        expected = model(tokens, positions, attention_mask=None)
    export_adapter(model, tmp_path, base_model_name_or_path=model_name)
    config = json.loads((tmp_path / ADAPTER_CONFIG_FILE).read_text())
    assert config["r"] == 3 and config["lora_alpha"] == 6 and config["peft_type"] == "LORA"
    assert sorted(config["target_modules"]) == sorted(ALL)
    # A fresh base model (same base seed) with no LoRA: load_adapter applies and fills it.
    fresh = build_gpt_model(p.geometry, p.transformer_config(),
                            implementation=p.implementation, seed=0)
    loaded = load_adapter(fresh, tmp_path)
    assert loaded.r == 3
    with torch.no_grad():
        got = fresh(tokens, positions, attention_mask=None)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert not torch.equal(got, build_gpt_model(
        p.geometry, p.transformer_config(), implementation=p.implementation, seed=0)(
        tokens, positions, attention_mask=None))


def test_export_has_peft_keys_and_shapes_of_the_hf_model(megatron_process, tmp_path):
    """The same LoraConfig on the HF model (transformers + peft) has exactly our keys/shapes."""
    from peft import get_peft_model, get_peft_model_state_dict
    from transformers import Qwen3Config, Qwen3ForCausalLM

    p = _provider(r=4)
    model = p.build_model(seed=0)
    export_adapter(model, tmp_path)
    ours = {k: tuple(v.shape) for k, v in load_file(tmp_path / ADAPTER_WEIGHTS_FILE).items()}
    with open(p.geometry.source) as f:
        hf = Qwen3ForCausalLM(Qwen3Config(**json.load(f)))
    peft_model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=ALL))
    theirs = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(peft_model).items()}
    assert ours == theirs


def test_load_rejects_mismatched_adapters(megatron_process, tmp_path):
    model = _provider(r=2).build_model(seed=0)
    export_adapter(model, tmp_path)
    other = _provider(r=4).build_model(seed=0)
    with pytest.raises(ValueError, match="differs from the model's LoRA"):
        load_adapter(other, tmp_path)
    fewer = _provider(r=2, target=["q_proj"]).build_model(seed=0)
    with pytest.raises(ValueError, match="match no LoRA module"):
        load_adapter(fewer, tmp_path)


class _NormThenColumnLinear(torch.nn.Module):
    """Stand-in for Transformer Engine's LayerNormColumnParallelLinear (TE cannot be installed
    on this CPU machine): RMSNorm fused in front of a real Megatron column-parallel linear,
    exposing `layer_norm_weight`, `weight`, `tp_group` and `config` like the TE wrapper."""

    def __init__(self, linear, norm):
        super().__init__()
        self.linear, self.norm = linear, norm
        self.layer_norm_weight = norm.weight
        self.weight, self.tp_group, self.config = linear.weight, linear.tp_group, linear.config

    def forward(self, x):
        return self.linear(self.norm(x))


def test_lora_on_a_fused_norm_linear_sees_the_normalised_input(megatron_process):
    from art.megatron.lora import LoraLinear, _Part

    p = _provider()
    model = build_gpt_model(p.geometry, p.transformer_config(), implementation=p.implementation,
                            seed=0)
    layer = model.decoder.layers[1]
    with torch.no_grad():
        layer.input_layernorm.weight.uniform_(0.5, 1.5)
    g = p.geometry
    parts = (_Part("q_proj", g.num_attention_heads * g.head_dim),
             _Part("k_proj", g.num_query_groups * g.head_dim),
             _Part("v_proj", g.num_query_groups * g.head_dim))
    kwargs = dict(kind="column", parts=parts, r=4, scaling=2.0, hf_path="self_attn",
                  layer_index=1, query_groups_local=g.num_query_groups, seed=0)
    fused = LoraLinear(_NormThenColumnLinear(layer.self_attention.linear_qkv,
                                             layer.input_layernorm), **kwargs)
    plain = LoraLinear(layer.self_attention.linear_qkv, **kwargs)
    assert fused.fused_norm and not plain.fused_norm
    _randomise_b(torch.nn.ModuleList([fused]), seed=1)
    _randomise_b(torch.nn.ModuleList([plain]), seed=1)
    x = torch.randn(6, 1, g.hidden_size) * 3
    out_fused, _ = fused(x)
    out_plain, _ = plain(layer.input_layernorm(x))
    torch.testing.assert_close(out_fused, out_plain)


def test_gated_attention_lora_takes_the_fused_qkv_targets():
    """q/k/v LoRA on a gated attention output (q and gate fused in linear_qkv) is accepted;
    its parity with peft is tests/megatron/test_weights_qwen3_5.py."""
    from art.megatron.geometry import load_geometry
    from art.megatron.lora import validate_lora_config

    hybrid = load_geometry("tiny-qwen3_5")
    validate_lora_config(LoraConfig(r=2, target_modules=["q_proj", "k_proj", "v_proj"]), hybrid)
