"""ART's public interface, as a driver written against upstream uses it: names, signatures,
error constructors, checkpoint helpers, and one real training run through
build_training_runtime -> TrainerRank(runtime) -> forward_micro_batches -> optim_step."""

from __future__ import annotations

import importlib
import inspect
import json
from dataclasses import MISSING

import pytest
import torch

UPSTREAM_ALL = (
    "TrainerRank", "ForwardInput", "ForwardOutput", "TopK", "MicroBatch", "MicroBatchStats",
    "AdamParams", "Unset", "AdapterSelection", "TrainerRankMemoryError",
    "TrainerRankRuntimeSupportError", "TrainerRankSlotStateError", "MaterializedCheckpoint",
    "PushedCheckpoint", "CheckpointManifest", "materialize_lora", "validate_checkpoint",
)
UPSTREAM_STATS_FIELDS = (
    "global_start", "global_stop", "global_count", "local_count", "packed_tokens",
    "logical_tokens", "estimated_required_bytes", "available_bytes", "rejected_candidates",
    "cold_start", "subforward_count",
)


def test_every_upstream_name_imports():
    module = importlib.import_module("art.trainer_rank")
    missing = [name for name in UPSTREAM_ALL if not hasattr(module, name)]
    assert missing == []
    from art.megatron.provider import get_provider  # noqa: F401
    from art.megatron.train import TrainingRuntime, build_training_runtime  # noqa: F401
    from art.trainer_rank._impl import TrainerRankPartialExecutionError
    from art.trainer_rank._types import TrainerRankMemoryError

    assert issubclass(TrainerRankPartialExecutionError, TrainerRankMemoryError)


def test_signatures_match_upstream():
    from dataclasses import fields

    from art.megatron.train import build_training_runtime
    from art.trainer_rank import MicroBatchStats, TrainerRank

    assert list(inspect.signature(TrainerRank.__init__).parameters) == ["self", "runtime"]
    params = inspect.signature(build_training_runtime).parameters
    for name in ("model_identifier", "provider_configure", "optimizer_config", "print_env",
                 "build_optimizer", "trainable_parameter_mode", "model_initialization",
                 "provider_torch_dtype"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert params["model_initialization"].default == "pretrained"
    assert params["provider_torch_dtype"].default is torch.bfloat16
    step = inspect.signature(TrainerRank.optim_step).parameters
    assert all(step[n].kind is inspect.Parameter.KEYWORD_ONLY
               for n in ("params", "scale_grads", "checkpoints", "on_live_graphs"))
    forward = inspect.signature(TrainerRank.forward_micro_batches).parameters
    assert list(forward)[:2] == ["self", "inputs"]
    assert forward["checkpoint"].kind is inspect.Parameter.KEYWORD_ONLY
    assert forward["no_grad"].default is None
    names = [f.name for f in fields(MicroBatchStats)]
    assert tuple(names[: len(UPSTREAM_STATS_FIELDS)]) == UPSTREAM_STATS_FIELDS
    # As upstream: every field but subforward_count is required; ours come after, defaulted.
    required = [f.name for f in fields(MicroBatchStats) if f.default is MISSING
                and f.default_factory is MISSING]
    assert tuple(required) == UPSTREAM_STATS_FIELDS[:-1]
    assert fields(MicroBatchStats)[len(UPSTREAM_STATS_FIELDS) - 1].default == 1


def test_micro_batch_stats_are_frozen_and_micro_batch_needs_them():
    from dataclasses import FrozenInstanceError

    from art.trainer_rank import MicroBatch, MicroBatchStats

    stats = MicroBatchStats(global_start=0, global_stop=2, global_count=2, local_count=1,
                            packed_tokens=5, logical_tokens=5, estimated_required_bytes=1,
                            available_bytes=2, rejected_candidates=0, cold_start=True)
    assert stats.subforward_count == 1
    with pytest.raises(FrozenInstanceError):
        stats.global_start = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        MicroBatchStats(global_start=0)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        MicroBatch(inputs=[], outputs=[], indices=[])  # type: ignore[call-arg]


def test_train_and_provider_modules_have_the_names_upstream_drivers_reach():
    """ART's dev driver prints `megatron_train.ps.get_data_parallel_world_size()`; its train
    module also offers print0 and freeze_model, and the provider module get_provider."""
    from megatron.core import parallel_state

    from art.megatron import provider, train

    assert train.ps is parallel_state
    for name in ("build_training_runtime", "TrainingRuntime", "DEFAULT_MODEL_IDENTIFIER",
                 "print0", "freeze_model", "get_provider", "ps"):
        assert hasattr(train, name), name
    assert callable(provider.get_provider)
    layer = torch.nn.Linear(2, 2)
    assert train.freeze_model([layer]) == [layer]
    assert not any(p.requires_grad for p in layer.parameters())


def test_value_types_behave_like_upstream():
    from dataclasses import FrozenInstanceError

    from art.trainer_rank import (
        AdamParams,
        ForwardOutput,
        MicroBatch,
        TopK,
        TrainerRankMemoryError,
        Unset,
    )

    err = TrainerRankMemoryError("too big")
    assert (err.predicted_peak_bytes, err.usable_limit_bytes, err.suggestion) == (0, 0, "")
    out = ForwardOutput(target_logprobs=torch.zeros(2))
    with pytest.raises(FrozenInstanceError):
        out.logits = torch.zeros(1)  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        TopK(torch.zeros(1), torch.zeros(1)).tokens = None  # type: ignore[misc]
    assert out.checkpoint is None and out.no_grad is False
    mb = MicroBatch(inputs=["b", "d"], outputs=[], indices=[1, 3], stats=None)  # type: ignore
    assert mb.select(["a", "b", "c", "d"]) == ["b", "d"]
    assert repr(Unset) == "Unset" and Unset is type(Unset)()
    assert AdamParams(learning_rate=1e-5).beta2 == 0.99
    with pytest.raises(ValueError, match="beta1"):
        AdamParams(learning_rate=1e-5, beta1=1.0)


def test_checkpoint_folder_is_validated_and_materialised(tmp_path):
    from safetensors.torch import save_file

    from art.trainer_rank import materialize_lora, validate_checkpoint

    source = tmp_path / "ckpt"
    source.mkdir()
    with pytest.raises(ValueError, match="no adapter_config.json"):
        validate_checkpoint(source)
    (source / "adapter_config.json").write_text(json.dumps(
        {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    save_file({key.format("A"): torch.zeros(2, 8), key.format("B"): torch.zeros(8, 2)},
              str(source / "adapter_model.safetensors"))
    # A plain peft folder has no checkpoint.json manifest: upstream returns None for it.
    assert validate_checkpoint(source) is None
    local = materialize_lora(source, tmp_path / "local")
    assert local.path == str(source) and (tmp_path / "local" / "adapter_config.json").is_file()


def test_pretrained_without_weights_fails_before_building():
    from art.megatron.train import build_training_runtime

    with pytest.raises(ValueError, match="model_initialization='random'"):
        build_training_runtime(model_identifier="Qwen/Qwen3-0.6B", print_env=False)


def test_get_provider_and_provider_configure_fields():
    from art.megatron.provider import get_provider

    provider = get_provider("Qwen/Qwen3-8B", env={})
    assert provider.geometry.name == "Qwen3-8B" and provider.dtype == "bfloat16"
    provider.num_layers = 3
    assert provider.geometry.num_layers == 3 and len(provider.effective_recompute.layers) == 3
    provider.tensor_model_parallel_size = 2
    assert provider.sequence_parallel is True  # follows TP unless set explicitly
    with pytest.raises(ValueError, match="not divisible"):
        provider.tensor_model_parallel_size = 3


def test_build_training_runtime_trains_the_adapter_only(monkeypatch):
    from art.megatron.train import build_training_runtime
    from art.trainer_rank import (
        AdamParams,
        ForwardInput,
        TrainerRank,
        TrainerRankSlotStateError,
    )

    from _upstream_env import UPSTREAM_ENV

    # Every variable upstream reads, at a valid value: the runtime builds with all of them.
    for name, value in {**UPSTREAM_ENV, "ART_MEGATRON_RANDOM_STATE": "7"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ART_TRAINER_RANK_PROBE_LAYERS", "false")

    def configure(provider) -> None:
        provider.num_layers = 2

    runtime = build_training_runtime(
        model_identifier="tiny-qwen3", provider_configure=configure, print_env=False,
        model_initialization="random", provider_torch_dtype=torch.float32)
    assert len(runtime.model) == 1 and runtime.optimizer is not None
    assert runtime.optimizer_config.lr == 5e-6 and runtime.optimizer_config.clip_grad == 0.1
    rank = TrainerRank(runtime)
    g = torch.Generator().manual_seed(0)
    inputs = [ForwardInput(input_tokens=torch.randint(0, 256, (n,), generator=g),
                           target_tokens=torch.randint(0, 256, (n,), generator=g))
              for n in (12, 20, 9)]
    frozen = {n: p.detach().clone() for n, p in rank.model.named_parameters()
              if not p.requires_grad}
    adapter = {n: p.detach().clone() for n, p in rank.model.named_parameters()
               if p.requires_grad}
    assert frozen and adapter and all(".lora_" in n for n in adapter)

    held = rank.dp_rank_forward(inputs[:1])
    with pytest.raises(TrainerRankSlotStateError, match="still holds"):
        rank.optim_step(params=AdamParams(learning_rate=1e-2), on_live_graphs="error")
    del held
    with pytest.raises(TrainerRankSlotStateError, match="checkpoint='other'"):
        list(rank.forward_micro_batches(inputs, checkpoint="other"))

    losses = []
    for _ in range(3):
        rank.zero_grad()
        total, tokens = torch.zeros(()), torch.zeros(())
        for micro in rank.forward_micro_batches(inputs):
            loss = sum(-out.target_logprobs.sum() for out in micro.outputs)
            loss.backward()
            total += loss.detach()
            tokens += sum(out.target_logprobs.numel() for out in micro.outputs)
        rank.dp_reduce(total)
        rank.dp_reduce(tokens)
        metrics = rank.optim_step(params=AdamParams(learning_rate=1e-2),
                                  scale_grads=1 / float(tokens), on_live_graphs="error")
        assert metrics["update_successful"] == 1.0 and metrics["grad_norm"] > 0
        losses.append(float(total / tokens))
    assert losses[2] < losses[1] < losses[0]
    params = dict(rank.model.named_parameters())
    assert all(torch.equal(params[n], v) for n, v in frozen.items())
    assert all(not torch.equal(params[n], v) for n, v in adapter.items())


def test_forward_semantics_follow_upstream(megatron_process):
    """Multi-target labels, [1, T] inputs, per-input no_grad inside a grad call, no_grad=None
    inheriting torch.is_grad_enabled(), generator inputs with nested groups; the caller's
    tensors are never changed."""
    from _trainer_helpers import provider

    from art.megatron.train import TrainingRuntime
    from art.trainer_rank import ForwardInput, TrainerRank, TrainerRankOptions

    p = provider("selective")
    trainer = TrainerRank(TrainingRuntime.for_model(p.build_model(seed=0), p,
                          trainer_options=TrainerRankOptions(probe_layers=False)))
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (1, 9), generator=g)
    two = torch.randint(0, 256, (9, 2), generator=g)
    two[0, 1] = -100
    kept = (tokens.clone(), two.clone())
    multi = ForwardInput(input_tokens=tokens, target_tokens=two)
    cols = [ForwardInput(input_tokens=tokens, target_tokens=two[:, k].contiguous())
            for k in range(2)]
    scored = ForwardInput(input_tokens=tokens[0, :5], target_tokens=two[:5, 0], no_grad=True)
    outs = trainer.dp_rank_forward(
        x for x in [multi, [cols[0], [cols[1]]], scored])  # any iterable, nested groups
    assert outs[0].target_logprobs.shape == (9, 2)
    assert torch.allclose(outs[0].target_logprobs[:, 0], outs[1][0].target_logprobs, atol=1e-5)
    assert torch.allclose(outs[0].target_logprobs[:, 1], outs[1][1][0].target_logprobs,
                          atol=1e-5)
    assert float(outs[0].target_logprobs[0, 1]) == 0.0  # ignored
    assert outs[0].target_logprobs.requires_grad and not outs[0].no_grad
    assert outs[2].no_grad and not outs[2].target_logprobs.requires_grad
    assert outs[0].checkpoint is None  # a runtime without adapter runs the base model
    assert torch.equal(tokens, kept[0]) and torch.equal(two, kept[1]) and tokens.shape == (1, 9)
    with torch.no_grad():
        (inherited,) = trainer.dp_rank_forward([cols[0]])
    assert inherited.no_grad and not inherited.target_logprobs.requires_grad
