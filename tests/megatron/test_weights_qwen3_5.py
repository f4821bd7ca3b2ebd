"""A tiny random Qwen3.5 (Gated DeltaNet + gated full attention) saved by transformers loads
into the hybrid Megatron model with logprob parity, and exports back (TP=2 under torchrun in
tests/distributed/test_weights_tp2.py). transformers runs its pure-torch Gated DeltaNet path
on CPU (no fla), so it is the reference here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _hf_models import hf_logprobs, our_logprobs, save_qwen3_5, token_sequences
from safetensors.torch import load_file

from art.megatron.provider import Provider
from art.megatron.settings import load_settings
from art.megatron.weights import load_into, prepare_checkpoint
from art.megatron.weights.export import hf_state_dict
from art.megatron.weights.layouts import GATED_QKV, SECTIONS, HFTensor, TensorMap, pieces


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_qwen3_5(tmp_path_factory.mktemp("qwen3_5") / "tiny")


def test_qwen3_5_loads_with_logprob_parity_and_exports_back(megatron_process, folder):
    provider = Provider(folder, dtype="float32",
                        settings=load_settings({"ART_MEGATRON_RECOMPUTE_GRANULARITY": "none"}))
    assert provider.geometry.layer_types.count("linear_attention") == 3
    prepared = prepare_checkpoint(folder, provider.geometry)
    model = provider.build_model(seed=1)
    load_into(model, prepared)
    model.eval()
    # Three sequences packed in one row, one longer than a 64-token delta-rule chunk.
    sequences = token_sequences(256, lengths=(70, 13, 40))
    ours = our_logprobs(model, sequences, implementation=provider.implementation,
                        layout=provider.layout)
    theirs = hf_logprobs(folder, sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(ours, theirs)) < 1e-4
    assert float(torch.cat(theirs).std()) > 0.5  # far from uniform: not a trivial pass
    exported = hf_state_dict(model, prepared)
    original = load_file(str(folder / "model.safetensors"))
    assert exported is not None and set(exported) == set(original)
    for name, tensor in original.items():
        if name.endswith("norm.weight") and ".linear_attn." not in name:
            # Zero-centred: loaded as w + 1, exported as that - 1 (fp32 rounding).
            torch.testing.assert_close(exported[name], tensor, rtol=0, atol=1e-6)
        else:
            assert torch.equal(exported[name], tensor), name


def test_gated_qkv_and_in_proj_sections_at_tp2():
    """Rank 1 of 2: its KV group's query heads then their gate heads (HF interleaves them per
    head), and its half of every Gated DeltaNet in_proj section."""
    d = 2
    qkv = TensorMap("qkv", (HFTensor("q", (16, 4)), HFTensor("k", (4, 4)), HFTensor("v", (4, 4))),
                    GATED_QKV, head_dim=d)
    got = [(p.hf_name, p.hf_start, p.local_start, p.length)
           for p in pieces(qkv, rank=1, size=2, local_shape=(12, 4))]
    assert got == [("q", 8, 0, 2), ("q", 10, 4, 2), ("q", 12, 2, 2), ("q", 14, 6, 2),
                   ("k", 2, 8, 2), ("v", 2, 10, 2)]
    in_proj = TensorMap("in_proj", (HFTensor("qkv", (10, 4)), HFTensor("z", (4, 4)),
                                    HFTensor("b", (2, 4)), HFTensor("a", (2, 4))),
                        SECTIONS, sections=(2, 2, 6, 4, 2, 2))
    got = [(p.hf_name, p.hf_start, p.local_start, p.length)
           for p in pieces(in_proj, rank=1, size=2, local_shape=(9, 4))]
    assert got == [("qkv", 1, 0, 1), ("qkv", 3, 1, 1), ("qkv", 7, 2, 3), ("z", 2, 5, 2),
                   ("b", 1, 7, 1), ("a", 1, 8, 1)]


def test_lora_on_gated_qkv_matches_peft_and_merges(megatron_process, folder, tmp_path):
    """LoRA on q/k/v of the gated full attention (q_proj's B covers the query and gate heads,
    interleaved per head in HF, split per group in linear_qkv): our logprobs equal peft's on
    transformers' model with the exported adapter, and the merged export loads the same."""
    from peft import LoraConfig

    from art.megatron.lora import lora_modules
    from art.megatron.lora_peft import export_adapter
    from art.megatron.weights.export import save_hf_checkpoint

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    provider = Provider(folder, dtype="float32", lora=lora,
                        settings=load_settings({"ART_MEGATRON_RECOMPUTE_GRANULARITY": "none"}))
    prepared = prepare_checkpoint(folder, provider.geometry)
    model = provider.build_model(seed=1)
    load_into(model, prepared)
    model.eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a "trained" adapter: B away from its zero init
        for module in lora_modules(model):
            for b in module.lora_B.values():
                b.copy_(torch.randn(b.shape, generator=generator) * 0.3)
    sequences = token_sequences(256, lengths=(70, 13))
    ours = our_logprobs(model, sequences, implementation=provider.implementation,
                        layout=provider.layout)
    base = hf_logprobs(folder, sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(ours, base)) > 1e-2
    adapter = export_adapter(model, tmp_path / "adapter", lora)
    theirs = hf_logprobs(folder, sequences, adapter=adapter)
    assert max(float((a - b).abs().max()) for a, b in zip(ours, theirs)) < 1e-4
    merged = save_hf_checkpoint(model, tmp_path / "merged", prepared, merge_lora=True)
    assert merged is not None
    merged_lp = hf_logprobs(merged, sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(ours, merged_lp)) < 1e-4
