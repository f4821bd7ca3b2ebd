"""An adapter exported from our Megatron-Core model loads with peft onto the transformers model
holding the same base weights, and scores the same logprobs.

The transformers model is built from tiny-qwen3's config.json and given our model's base
weights by the name/layout mapping below (fused QKV de-interleaved per query group, fc1 split
into gate and up); the norms are randomised first so a wrong norm mapping would show.
"""

from __future__ import annotations

import json

import torch
from peft import LoraConfig, PeftModel

from art.megatron.lora import lora_modules
from art.megatron.lora_peft import export_adapter
from art.megatron.provider import Provider
from art.megatron.settings import load_settings

TOKENS = 24


def _hf_state_from_megatron(model, geometry) -> dict[str, torch.Tensor]:
    heads, groups, d = geometry.num_attention_heads, geometry.num_query_groups, geometry.head_dim
    per_group = heads // groups
    base = {name.replace(".base.", "."): p.detach() for name, p in model.named_parameters()
            if ".adapters." not in name}
    state = {"model.embed_tokens.weight": base["embedding.word_embeddings.weight"],
             "model.norm.weight": base["decoder.final_layernorm.weight"],
             "lm_head.weight": base["output_layer.weight"]}
    for i in range(geometry.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = base[src + "self_attention.linear_qkv.weight"].reshape(
            groups, (per_group + 2) * d, -1)
        state[dst + "self_attn.q_proj.weight"] = qkv[:, : per_group * d].reshape(heads * d, -1)
        state[dst + "self_attn.k_proj.weight"] = qkv[:, per_group * d: (per_group + 1) * d
                                                     ].reshape(groups * d, -1)
        state[dst + "self_attn.v_proj.weight"] = qkv[:, (per_group + 1) * d:].reshape(
            groups * d, -1)
        state[dst + "self_attn.o_proj.weight"] = base[src + "self_attention.linear_proj.weight"]
        state[dst + "self_attn.q_norm.weight"] = base[src + "self_attention.q_layernorm.weight"]
        state[dst + "self_attn.k_norm.weight"] = base[src + "self_attention.k_layernorm.weight"]
        gate, up = torch.chunk(base[src + "mlp.linear_fc1.weight"], 2, dim=0)
        state[dst + "mlp.gate_proj.weight"], state[dst + "mlp.up_proj.weight"] = gate, up
        state[dst + "mlp.down_proj.weight"] = base[src + "mlp.linear_fc2.weight"]
        state[dst + "input_layernorm.weight"] = base[src + "input_layernorm.weight"]
        state[dst + "post_attention_layernorm.weight"] = base[src + "pre_mlp_layernorm.weight"]
    return {k: v.clone() for k, v in state.items()}


def test_peft_loads_our_export_on_the_transformers_model_with_equal_logprobs(
        megatron_process, tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    provider = Provider("tiny-qwen3", settings=load_settings({}), dtype="float32",
                        lora=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model = provider.build_model(seed=0)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.uniform_(0.5, 1.5, generator=g)
        for module in lora_modules(model):
            for b in module.lora_B.values():
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    export_adapter(model, tmp_path / "adapter", base_model_name_or_path="tiny-qwen3")

    with open(provider.geometry.source) as f:
        hf_config = Qwen3Config(**json.load(f))
    hf_config._attn_implementation = "eager"
    hf = Qwen3ForCausalLM(hf_config).float().eval()
    missing, unexpected = hf.load_state_dict(_hf_state_from_megatron(model, provider.geometry),
                                             strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    tokens = torch.randint(0, provider.geometry.vocab_size, (1, TOKENS), generator=g)
    targets = torch.roll(tokens, -1, dims=1)

    def logprobs(logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]

    model.eval()
    with torch.no_grad():
        ours = logprobs(model(tokens, torch.arange(TOKENS)[None], attention_mask=None))
        base_hf = logprobs(hf(tokens).logits)
        peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
        theirs = logprobs(peft_model(tokens).logits)
    assert (ours - base_hf).abs().max() > 1e-3  # the adapter changes the scores
    torch.testing.assert_close(theirs, ours, rtol=0, atol=2e-5)
