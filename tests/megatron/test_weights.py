"""Hugging Face checkpoints into Megatron-Core and back, TP=1 (TP=2 and expert-TP in
tests/distributed/test_weights_tp2.py): logprob parity with transformers, bit-identical
export, merged and peft exports that transformers / peft load, and bad input refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _hf_models import (
    hf_logprobs,
    our_logprobs,
    pretrained_runtime,
    runtime_logprobs,
    save_hf_model,
    token_sequences,
)
from peft import LoraConfig
from safetensors.torch import load_file, save_file

from art.megatron.provider import Provider
from art.megatron.settings import load_settings
from art.megatron.weights import (
    CheckpointError,
    UnsupportedCheckpointError,
    load_into,
    prepare_checkpoint,
)
from art.megatron.weights.export import hf_state_dict, save_hf_checkpoint

TOLERANCE = 1e-4
CASES = {"qwen3": {}, "llama": {"tied": True}, "qwen3_moe": {}}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {f: save_hf_model(f, root / f, **kw) for f, kw in CASES.items()}


def _provider(folder: Path, lora: LoraConfig | None = None) -> Provider:
    settings = load_settings({"ART_MEGATRON_RECOMPUTE_GRANULARITY": "none"})
    return Provider(folder, settings=settings, dtype="float32", lora=lora)


def _loaded(folder: Path, lora: LoraConfig | None = None):
    provider = _provider(folder, lora)
    prepared = prepare_checkpoint(folder, provider.geometry)
    model = provider.build_model(seed=1)
    load_into(model, prepared)
    return provider, prepared, model.eval()


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("family", list(CASES))
def test_logprobs_match_transformers_and_export_is_bit_identical(megatron_process, folders,
                                                                  family, monkeypatch):
    monkeypatch.setenv("ART_TRAINER_RANK_PROBE_LAYERS", "false")
    monkeypatch.setenv("ART_MEGATRON_RECOMPUTE_GRANULARITY", "none")
    folder = folders[family]
    runtime = pretrained_runtime(folder)
    sequences = token_sequences(runtime.provider.geometry.vocab_size)
    ours = runtime_logprobs(runtime, sequences)
    theirs = hf_logprobs(folder, sequences)
    assert _max_diff(ours, theirs) < TOLERANCE
    # Not a trivial pass: the logprobs are far from uniform.
    assert float(torch.cat(theirs).std()) > 0.5
    prepared = prepare_checkpoint(folder, runtime.provider.geometry)
    exported = hf_state_dict(runtime.model[0], prepared)
    original = load_file(str(folder / "model.safetensors"))
    assert exported is not None and set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    # What the planner prices as resident weights is what the load left live.
    from art.megatron.lora import lora_parameters
    from art.trainer_rank.pricing.model import MemoryModel

    model = runtime.model[0]
    priced = next(t.bytes for t in MemoryModel.for_provider(runtime.provider).resident_terms()
                  if t.name == "weights")
    lora = {id(p) for p in lora_parameters(model)}
    assert priced == sum(p.numel() * p.element_size() for p in model.parameters()
                         if id(p) not in lora)


def test_pretrained_with_a_shipped_config_name_is_an_error_before_building():
    from art.megatron.train import build_training_runtime

    with pytest.raises(CheckpointError, match="shipped config, which has no weights"):
        build_training_runtime(model_identifier="tiny-qwen3", print_env=False)
    with pytest.raises(ValueError, match="no-such-folder"):
        build_training_runtime(model_identifier="/tmp/no-such-folder", print_env=False)


def test_adapter_loads_in_peft_and_merged_export_loads_in_transformers(megatron_process,
                                                                      folders, tmp_path):
    from art.megatron.lora import lora_modules
    from art.megatron.lora_peft import export_adapter

    folder = folders["qwen3"]
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    provider, prepared, model = _loaded(folder, lora)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a "trained" adapter: B away from its zero init
        for module in lora_modules(model):
            for b in module.lora_B.values():
                b.copy_(torch.randn(b.shape, generator=generator) * 0.2)
    sequences = token_sequences(provider.geometry.vocab_size)
    ours = our_logprobs(model, sequences, implementation=provider.implementation,
                        layout=provider.layout)
    base = hf_logprobs(folder, sequences)
    assert _max_diff(ours, base) > 1e-2  # the adapter changes the outputs
    adapter = export_adapter(model, tmp_path / "adapter", lora)
    assert _max_diff(ours, hf_logprobs(folder, sequences, adapter=adapter)) < TOLERANCE
    merged = save_hf_checkpoint(model, tmp_path / "merged", prepared, merge_lora=True)
    assert merged is not None
    assert _max_diff(ours, hf_logprobs(merged, sequences)) < TOLERANCE


# ---------------------------------------------------------------------- bad input
def _copy(folder: Path, to: Path) -> Path:
    to.mkdir()
    for item in folder.iterdir():
        (to / item.name).write_bytes(item.read_bytes())
    return to


def _geometry(folder: Path):
    return _provider(folder).geometry


def test_missing_folder_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(CheckpointError, match=str(missing)):
        prepare_checkpoint(missing, _geometry_of_any())


def _geometry_of_any():
    from _tiny import tiny_dense

    return tiny_dense()


def test_truncated_file_is_named(folders, tmp_path):
    folder = _copy(folders["qwen3"], tmp_path / "cut")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        prepare_checkpoint(folder, _geometry(folders["qwen3"]))


def _rewrite(folder: Path, edit) -> None:
    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    edit(tensors)
    save_file(tensors, str(weights), metadata={"format": "pt"})


def test_missing_extra_and_misshapen_tensors_are_named_with_shapes(folders, tmp_path):
    geometry = _geometry(folders["qwen3"])
    missing = _copy(folders["qwen3"], tmp_path / "missing")
    _rewrite(missing, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight "
                                              r"\[128, 64\]"):
        prepare_checkpoint(missing, geometry)
    extra = _copy(folders["qwen3"], tmp_path / "extra")
    _rewrite(extra, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"does not account for.*layers\.2\.mlp\.up_proj"):
        prepare_checkpoint(extra, geometry)
    shape = _copy(folders["qwen3"], tmp_path / "shape")
    _rewrite(shape, lambda t: t.update(
        {"model.layers.0.self_attn.k_proj.weight": torch.zeros(48, 64)}))
    with pytest.raises(CheckpointError, match=r"k_proj\.weight' has shape \[48, 64\].*implies "
                                              r"\[64, 64\]"):
        prepare_checkpoint(shape, geometry)


def test_a_provider_shrunk_to_fewer_layers_loads_the_first_ones(megatron_process, folders):
    import dataclasses

    folder = folders["qwen3"]
    geometry = dataclasses.replace(_geometry(folder), num_layers=1,
                                   layer_types=("attention",), moe_layers=(False,))
    provider = Provider(geometry, settings=load_settings({}), dtype="float32")
    model = provider.build_model(seed=1)
    load_into(model, prepare_checkpoint(folder, geometry))
    stored = load_file(str(folder / "model.safetensors"))
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    assert torch.equal(qkv[:32], stored["model.layers.0.self_attn.q_proj.weight"][:32])


def test_config_disagreeing_with_tensors_fails_before_building(folders, tmp_path):
    folder = _copy(folders["qwen3"], tmp_path / "wider")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 192
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight' has shape \[128, 64\].*"
                                              r"\[192, 64\]"):
        prepare_checkpoint(folder, _geometry(folder))


def test_unsupported_architecture_and_settings_are_named(folders, tmp_path):
    folder = _copy(folders["qwen3"], tmp_path / "other")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedCheckpointError, match="GPT2LMHeadModel"):
        prepare_checkpoint(folder, _geometry(folders["qwen3"]))
    moe = _copy(folders["qwen3_moe"], tmp_path / "moe")
    config = json.loads((moe / "config.json").read_text())
    (moe / "config.json").write_text(json.dumps({**config, "norm_topk_prob": False}))
    with pytest.raises(UnsupportedCheckpointError, match="norm_topk_prob"):
        prepare_checkpoint(moe, _geometry(folders["qwen3_moe"]))


def test_layout_pieces_interleave_qkv_groups_and_pad_the_vocabulary():
    from art.megatron.weights.layouts import QKV, VOCAB, HFTensor, Piece, TensorMap, pieces

    qkv = TensorMap("qkv", (HFTensor("q", (8, 4)), HFTensor("k", (4, 4)), HFTensor("v", (4, 4))),
                    QKV, head_dim=2)  # 2 KV groups of 2 query heads, head_dim 2
    assert pieces(qkv, rank=1, size=2, local_shape=(8, 4)) == [
        Piece("q", 0, 4, 0, 4), Piece("k", 0, 2, 4, 2), Piece("v", 0, 2, 6, 2)]
    with pytest.raises(ValueError, match=r"shard has shape \[6, 4\].*give \[8, 4\]"):
        pieces(qkv, rank=0, size=2, local_shape=(6, 4))
    vocab = TensorMap("embedding", (HFTensor("embed", (250, 4)),), VOCAB)
    # 2 ranks of 128 rows: rank 1 holds real rows 128..249 and 6 padding rows.
    assert pieces(vocab, rank=1, size=2, local_shape=(128, 4)) == [Piece("embed", 0, 128, 0, 122)]
