"""Provider: shipped configs, validation before building, effective_recompute, building."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig

from art.megatron import cpu_runtime
from art.megatron.geometry import ATTENTION, LINEAR_ATTENTION, load_geometry, shipped_model_names
from art.megatron.implementation import Implementation
from art.megatron.provider import Provider
from art.megatron.settings import load_settings

SEED_ENV = {
    "ART_MEGATRON_CONTEXT_PARALLEL_SIZE": "1",
    "ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "2",
    "ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective",
    "ART_MEGATRON_RECOMPUTE_METHOD": "none",
    "ART_MEGATRON_RECOMPUTE_NUM_LAYERS": "none",
}
GPU = Implementation.gpu_te()
CPU = Implementation.cpu_local()
# Megatron's unfused DotProductAttention on CPU: the build that refuses context parallel.
CPU_UNFUSED = Implementation.cpu_local("unfused")

REQUIRED = {
    "Qwen3-0.6B", "Qwen3-1.7B", "Qwen3-4B", "Qwen3-8B", "Qwen3-14B", "Qwen3-32B",
    "Qwen3-30B-A3B", "Qwen3-235B-A22B", "Llama-3.1-8B", "Llama-3.1-70B", "Qwen3.5-27B",
    "Qwen3.5-35B-A3B", "tiny-qwen3", "tiny-llama", "tiny-qwen3-moe", "tiny-qwen3_5",
    "tiny-qwen3_5-moe",
}


def test_every_required_config_is_shipped_and_loads():
    assert REQUIRED <= set(shipped_model_names())
    for name in shipped_model_names():
        g = load_geometry(name)
        assert g.num_layers == len(g.layer_types) and g.hidden_size > 0, name
        # Pricing works for every shipped model at TP 1 with the GPU implementation.
        Provider(g, settings=load_settings({}), implementation=GPU)


@pytest.mark.parametrize(
    "name,layers,hidden,ffn,heads,groups,head_dim,vocab,tied",
    [
        ("Qwen3-8B", 36, 4096, 12288, 32, 8, 128, 151936, False),
        ("Qwen3-0.6B", 28, 1024, 3072, 16, 8, 128, 151936, True),
        ("Llama-3.1-70B", 80, 8192, 28672, 64, 8, 128, 128256, False),
        ("Qwen3.5-27B", 64, 5120, 17408, 24, 4, 256, 248320, False),
    ],
)
def test_public_config_values(name, layers, hidden, ffn, heads, groups, head_dim, vocab, tied):
    g = load_geometry(name)
    assert (g.num_layers, g.hidden_size, g.ffn_hidden_size, g.num_attention_heads,
            g.num_query_groups, g.head_dim, g.vocab_size, g.tied_embeddings) == (
        layers, hidden, ffn, heads, groups, head_dim, vocab, tied)


def test_seed_model_is_hybrid_with_full_attention_every_fourth_layer():
    g = load_geometry("Qwen3.5-27B")
    assert g.gated_attention_output and g.is_hybrid and not g.is_moe
    assert [i + 1 for i, t in enumerate(g.layer_types) if t == ATTENTION] == list(range(4, 65, 4))
    assert g.layer_types.count(LINEAR_ATTENTION) == 48
    moe = load_geometry("Qwen3.5-35B-A3B")
    assert moe.is_moe and moe.is_hybrid and moe.num_experts == 256
    assert moe.moe_router_topk == 8 and moe.shared_expert_ffn_hidden_size > 0
    qwen_moe = load_geometry("Qwen3-30B-A3B")
    assert (qwen_moe.num_experts, qwen_moe.moe_router_topk, qwen_moe.moe_ffn_hidden_size) == (
        128, 8, 768)


def test_seed_setting_effective_recompute():
    # The GPU implementation pinned, for a machine-independent answer.
    p = Provider.from_env("Qwen3.5-27B", env=SEED_ENV, implementation=GPU)
    er = p.effective_recompute
    assert er.granularity == "selective" and er.modules == ("core_attn",)
    assert len(er.layers) == 64
    # core_attn recompute exists only in the 16 full-attention layers; Gated DeltaNet layers
    # have no core-attention checkpoint and keep everything.
    selective = [lr.layer_number for lr in er.layers if lr.mode == "selective"]
    assert selective == list(range(4, 65, 4))
    assert all(lr.mode == "none" for lr in er.layers if lr.layer_type == LINEAR_ATTENTION)
    assert er.describe_layers().startswith(
        "layers 1-3: keeps everything; layers 4: selective core_attn")
    assert p.layout.tensor_parallel == 2 and p.layout.sequence_parallel


def test_block_and_uniform_examples_per_chunk():
    env = {"ART_MEGATRON_PIPELINE_MODEL_PARALLEL_SIZE": "2",
           "ART_MEGATRON_RECOMPUTE_METHOD": "block", "ART_MEGATRON_RECOMPUTE_NUM_LAYERS": "3"}
    er = Provider("Qwen3-8B", settings=load_settings(env), implementation=GPU).effective_recompute
    full = [lr.layer_number for lr in er.layers if lr.mode == "full"]
    assert full == [1, 2, 3, 19, 20, 21]  # first 3 layers of each 18-layer stage
    env = {"ART_MEGATRON_RECOMPUTE_NUM_LAYERS": "4"}
    er = Provider("Qwen3-8B", settings=load_settings(env), implementation=GPU).effective_recompute
    assert {lr.full_checkpoint_unit for lr in er.layers} == set(range(9))
    assert all(lr.full_unit_layers == 4 for lr in er.layers)


def test_virtual_pipeline_chunks_follow_megatrons_round_robin():
    env = {"ART_MEGATRON_PIPELINE_MODEL_PARALLEL_SIZE": "2",
           "ART_MEGATRON_VIRTUAL_PIPELINE_MODEL_PARALLEL_SIZE": "2",
           "ART_MEGATRON_RECOMPUTE_METHOD": "block", "ART_MEGATRON_RECOMPUTE_NUM_LAYERS": "2"}
    er = Provider("Qwen3-8B", settings=load_settings(env), implementation=GPU).effective_recompute
    # 36 layers in 4 chunks of 9: chunk v of stage p is block v * 2 + p.
    assert [lr.layer_number for lr in er.layers if lr.mode == "full"] == [
        1, 2, 10, 11, 19, 20, 28, 29]
    assert [lr.pipeline_stage for lr in er.layers if lr.mode == "full"] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert er.chunk_layers(1, 1)[0].layer_number == 28
    env["ART_MEGATRON_RECOMPUTE_METHOD"] = "uniform"
    with pytest.raises(ValueError, match="num_layers=2 does not divide the 9 layers"):
        Provider("Qwen3-8B", settings=load_settings(env), implementation=GPU)


def test_recompute_as_is_a_validated_what_if():
    p = Provider("tiny-qwen3", settings=load_settings(SEED_ENV | {
        "ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "1"}), implementation=CPU)
    full = p.recompute_as("full", "uniform", 1)
    assert full.granularity == "full" and all(lr.mode == "full" for lr in full.layers)
    assert p.effective_recompute.granularity == "selective"  # unchanged
    assert full.key != p.effective_recompute.key
    with pytest.raises(ValueError, match="does not divide the 4 layers"):
        p.recompute_as("full", "uniform", 3)


def test_layernorm_recompute_with_transformer_engine_spec():
    """TE fuses both norms into the next linear on dense layers; an MoE layer keeps a real
    pre-MLP norm, so only that one is recomputed."""
    env = {"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective",
           "ART_MEGATRON_RECOMPUTE_MODULES": "layernorm"}
    dense = Provider("Qwen3-8B", settings=load_settings(env), implementation=GPU)
    assert all(lr.mode == "none" for lr in dense.effective_recompute.layers)
    moe = Provider("Qwen3-30B-A3B", settings=load_settings(env), implementation=GPU)
    assert all(lr.recomputed_norms == {"pre_mlp"} for lr in moe.effective_recompute.layers)
    local = Provider("tiny-qwen3", settings=load_settings(env), implementation=CPU)
    assert all(lr.recomputed_norms == {"input", "pre_mlp"}
               for lr in local.effective_recompute.layers)


@pytest.mark.parametrize(
    "model,env,impl,fragment",
    [
        ("tiny-qwen3", {"ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "3"}, CPU,
         "num_attention_heads=8 is not divisible by TENSOR_MODEL_PARALLEL_SIZE=3"),
        ("tiny-qwen3", {"ART_MEGATRON_RECOMPUTE_NUM_LAYERS": "3"}, CPU,
         "num_layers=3 does not divide the 4 layers of model chunk 0.*IndexError"),
        ("Qwen3-8B", {"ART_MEGATRON_PIPELINE_MODEL_PARALLEL_SIZE": "5"}, GPU,
         "36 layers cannot be split evenly"),
        ("tiny-qwen3", {"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective",
                        "ART_MEGATRON_RECOMPUTE_MODULES": "moe"}, CPU, "'moe' needs MoE layers"),
        ("tiny-qwen3-moe", {"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective",
                            "ART_MEGATRON_RECOMPUTE_MODULES": "moe_act"}, CPU,
         "'moe_act' needs MoE layers with grouped GEMM"),
        ("tiny-qwen3-moe", {"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective",
                            "ART_MEGATRON_RECOMPUTE_MODULES": "shared_experts"}, CPU,
         "'shared_experts' needs MoE layers with shared experts"),
        ("Qwen3-8B", {"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective",
                      "ART_MEGATRON_RECOMPUTE_MODULES": "mla_up_proj"}, GPU,
         "needs multi-latent attention"),
        ("tiny-qwen3", {"ART_MEGATRON_CONTEXT_PARALLEL_SIZE": "2"}, CPU_UNFUSED,
         "CONTEXT_PARALLEL_SIZE=2 runs in the segmented flash attention .* unfused "
         "DotProductAttention"),
        ("tiny-qwen3", {"ART_MEGATRON_EXPERT_MODEL_PARALLEL_SIZE": "2"}, CPU,
         "has no MoE layers"),
    ],
)
def test_configurations_megatron_would_mishandle_are_rejected(model, env, impl, fragment):
    with pytest.raises(ValueError, match=fragment):
        Provider(model, settings=load_settings(env), implementation=impl)


def test_context_parallel_builds_the_segmented_flash_attention_and_refuses_what_it_cannot_split(
        monkeypatch):
    env = {"ART_MEGATRON_CONTEXT_PARALLEL_SIZE": "2"}
    dense = Provider("tiny-qwen3", settings=load_settings(env))
    assert (dense.implementation.spec, dense.implementation.attention) == ("local", "flash")
    # On CPU the runtime builds the segmented flash attention at every layout, CP 1 included.
    assert Provider("tiny-qwen3", settings=load_settings({})).implementation == dense.implementation
    # Megatron's unfused attention, asked for by name, still refuses CP.
    with pytest.raises(ValueError, match="unfused DotProductAttention"):
        Provider("tiny-qwen3", settings=load_settings(env), implementation=CPU_UNFUSED)
    # CUDA with Transformer Engine installed still builds the local spec for CP (TE's THD CP
    # would need a per-sequence split).
    monkeypatch.setattr(cpu_runtime, "cuda_available", lambda: True)
    monkeypatch.setattr(cpu_runtime, "transformer_engine_available", lambda: True)
    assert Implementation.detect(2).spec == "local" and Implementation.detect(1).spec == "te"
    monkeypatch.undo()
    # Hybrids run under CP (their Gated DeltaNet layers over the gathered whole row), and so do
    # MoE models and hybrid MoE models, their experts spread over the CP ranks or not.
    hybrid = Provider("tiny-qwen3_5", settings=load_settings(env))
    assert hybrid.implementation.attention == "flash" and hybrid.layout.context_parallel == 2
    for moe in ("tiny-qwen3-moe", "tiny-qwen3_5-moe"):
        for ep in ("1", "2"):
            built = Provider(moe, settings=load_settings(
                {**env, "ART_MEGATRON_EXPERT_MODEL_PARALLEL_SIZE": ep}))
            assert built.implementation.attention == "flash", moe
            assert (built.layout.context_parallel, built.layout.expert_parallel) == (2, int(ep))
    # Expert parallel builds on CPU too (gloo's all-to-all takes the split sizes as lists).
    ep = Provider("tiny-qwen3-moe",
                  settings=load_settings({"ART_MEGATRON_EXPERT_MODEL_PARALLEL_SIZE": "2"}))
    assert ep.layout.expert_parallel == 2


def test_hybrid_models_build_on_cpu(megatron_process):
    p = Provider("tiny-qwen3_5", settings=load_settings({}), implementation=CPU,
                 dtype="float32")
    assert [lr.layer_type for lr in p.effective_recompute.layers] == [
        LINEAR_ATTENTION, LINEAR_ATTENTION, LINEAR_ATTENTION, ATTENTION]
    model = p.build_model()
    kinds = [type(layer.self_attention).__name__ for layer in model.decoder.layers]
    assert kinds == ["GatedDeltaNetTP"] * 3 + ["SelfAttention"]
    logits = model(torch.randint(0, 256, (1, 8)), torch.arange(8)[None], attention_mask=None)
    assert logits.shape == (1, 8, 256) and torch.isfinite(logits).all()


def test_hybrid_on_cuda_needs_fla():
    import importlib.util

    if importlib.util.find_spec("fla") is not None:
        pytest.skip("fla is installed here")
    p = Provider("tiny-qwen3_5", settings=load_settings({}), implementation=GPU)
    with pytest.raises(ValueError, match="needs the `fla` package"):
        p.transformer_config()


def test_bad_lora_config_is_rejected_before_building():
    with pytest.raises(ValueError, match="LoRA target module 'qproj' is not known"):
        Provider("tiny-qwen3", settings=load_settings({}), implementation=CPU,
                 lora=LoraConfig(r=2, target_modules=["qproj"]))
    with pytest.raises(ValueError, match="lora_dropout"):
        Provider("tiny-qwen3", settings=load_settings({}), implementation=CPU,
                 lora=LoraConfig(r=2, target_modules=["q_proj"], lora_dropout=0.1))


def test_local_config_path(tmp_path):
    with open(load_geometry("tiny-llama").source) as f:
        raw = json.load(f)
    raw["num_hidden_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(raw))
    p = Provider(tmp_path, settings=load_settings({}), implementation=CPU)
    assert p.geometry.num_layers == 2 and not p.geometry.qk_layernorm
    with pytest.raises(ValueError, match="neither a config.json path nor a shipped model"):
        Provider(tmp_path / "missing", settings=load_settings({}), implementation=CPU)


def test_transformer_config_agrees_and_model_builds(megatron_process):
    env = {"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective"}
    p = Provider("tiny-llama", settings=load_settings(env), dtype="float32")
    config = p.transformer_config()
    assert config.recompute_granularity == "selective"
    assert config.recompute_modules == ["core_attn"]
    model = p.build_model(seed=0)
    assert model.training
    assert sum(p_.numel() for p_ in model.parameters()) > 0
    tokens = torch.randint(0, 256, (1, 8))
    logits = model(tokens, torch.arange(8)[None], attention_mask=None)
    assert logits.shape == (1, 8, 256)
    assert "selective recompute (core_attn)" in p.describe()


def test_build_refuses_a_process_initialised_for_another_layout(megatron_process):
    p = Provider("tiny-qwen3", settings=load_settings(
        {"ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "2",
         "ART_MEGATRON_SEQUENCE_PARALLEL": "false"}), dtype="float32")
    with pytest.raises(RuntimeError, match="TENSOR_MODEL_PARALLEL_SIZE=1 but the settings say 2"):
        p.build_model()


def test_cli_prints_settings_and_policy(monkeypatch, capsys):
    from art.megatron.provider import main

    for name, value in SEED_ENV.items():
        monkeypatch.setenv(name, value)
    assert main(["Qwen3.5-27B", "--implementation", "te"]) == 0
    out = capsys.readouterr().out
    assert "ART_MEGATRON_RECOMPUTE_METHOD=none" in out
    assert "48 layer(s) keep everything (Gated DeltaNet); 16 layer(s) selective core_attn" in out
    monkeypatch.setenv("ART_MEGATRON_RECOMPUTE_NUM_LAYERS", "3")
    assert main(["Qwen3.5-27B", "--implementation", "te"]) == 2
    assert "selective recompute does not take" in capsys.readouterr().out


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama"])
def test_cuda_without_transformer_engine_builds_a_valid_config(monkeypatch, model):
    # What a CUDA machine without TE detects: the local spec on cuda. Megatron-Core 0.16.1
    # refuses apply_rope_fusion without TE, and the local spec's fused softmax needs a
    # compiled extension TE-less machines lack: the config must leave both off.
    from art.megatron import cpu_runtime

    monkeypatch.setattr(cpu_runtime, "cuda_available", lambda: True)
    monkeypatch.setattr(cpu_runtime, "transformer_engine_available", lambda: False)
    impl = Implementation.detect()
    assert (impl.spec, impl.device) == ("local", "cuda")
    env = {"ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "2",
           "ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective"}
    config = Provider(model, settings=load_settings(env), implementation=impl).transformer_config()
    assert not config.apply_rope_fusion and not config.masked_softmax_fusion
    assert config.bias_dropout_fusion and not config.use_cpu_initialization
    assert config.tensor_model_parallel_size == 2 and config.sequence_parallel
    assert config.recompute_granularity == "selective"
