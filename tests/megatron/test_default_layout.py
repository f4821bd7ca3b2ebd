"""Upstream's default layout over the visible GPUs when no ART_MEGATRON_* layout size is set.
The GPU count is a stand-in (this machine has no CUDA): `visible_cuda_gpus` is replaced by a
function returning 8, as torch.cuda.device_count() would on an 8-GPU node."""

from __future__ import annotations

import pytest

from art.megatron import provider as provider_module
from art.megatron.default_layout import default_layout
from art.megatron.geometry import load_geometry
from art.megatron.settings import load_settings

DENSE = load_geometry("Qwen3-8B")
HYBRID = load_geometry("Qwen3.5-27B")
MOE = load_geometry("Qwen3.5-35B-A3B")


def test_dense_models_get_context_parallel_over_every_gpu():
    s = default_layout(load_settings({}), DENSE, visible_gpus=8, world_size=8)
    assert (s.tensor_model_parallel_size, s.context_parallel_size) == (1, 8)
    assert "8 visible GPUs" in s.source_of("context_parallel_size")
    # A torchrun world smaller than the node: the world's ranks.
    s = default_layout(load_settings({}), DENSE, visible_gpus=8, world_size=2)
    assert s.context_parallel_size == 2


def test_hybrids_and_moe_models_get_context_parallel_and_moe_models_expert_parallel():
    s = default_layout(load_settings({}), HYBRID, visible_gpus=8, world_size=8)
    assert (s.tensor_model_parallel_size, s.context_parallel_size) == (1, 8)
    assert s.expert_model_parallel_size == 1
    # As upstream for its MoE families (their handlers support CP): CP over the GPUs, TP 1,
    # and the experts spread over the same GPUs, each held whole (expert TP 1).
    for gpus in (2, 8):
        s = default_layout(load_settings({}), MOE, visible_gpus=gpus, world_size=gpus)
        assert (s.tensor_model_parallel_size, s.context_parallel_size) == (1, gpus)
        assert (s.expert_model_parallel_size, s.expert_tensor_parallel_size) == (gpus, 1)
        assert not s.sequence_parallel
        assert f"{gpus} visible GPUs" in s.source_of("expert_model_parallel_size")
    # Experts that do not divide over the GPUs stay whole on every rank (EP 1); CP still applies.
    s = default_layout(load_settings({}), MOE, visible_gpus=3, world_size=3)
    assert (s.context_parallel_size, s.expert_model_parallel_size) == (3, 1)


@pytest.mark.parametrize("env", [{"ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "2"},
                                 {"ART_MEGATRON_CONTEXT_PARALLEL_SIZE": "1"},
                                 {"ART_MEGATRON_PIPELINE_MODEL_PARALLEL_SIZE": "1"},
                                 {"ART_MEGATRON_EXPERT_TENSOR_PARALLEL_SIZE": "1"}])
def test_a_layout_set_explicitly_is_kept(env):
    s = default_layout(load_settings(env), DENSE, visible_gpus=8, world_size=8)
    assert s == load_settings(env)


def test_one_gpu_cpu_or_an_uneven_world_changes_nothing():
    for gpus, world in ((0, 1), (1, 1), (8, 1), (4, 6)):
        assert default_layout(load_settings({}), DENSE, visible_gpus=gpus,
                              world_size=world) == load_settings({})


def test_get_provider_applies_it(monkeypatch):
    monkeypatch.setattr(provider_module, "visible_cuda_gpus", lambda: 8)
    monkeypatch.setenv("WORLD_SIZE", "8")
    p = provider_module.get_provider("Qwen3-8B", env={})
    assert (p.settings.tensor_model_parallel_size, p.settings.context_parallel_size) == (1, 8)
    p = provider_module.get_provider("Qwen3-8B",
                                     env={"ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "8"})
    assert (p.settings.tensor_model_parallel_size, p.settings.context_parallel_size) == (8, 1)
    p = provider_module.get_provider("Qwen3.5-35B-A3B", env={})
    assert (p.settings.tensor_model_parallel_size, p.settings.context_parallel_size,
            p.settings.expert_model_parallel_size) == (1, 8, 8)
    monkeypatch.delenv("WORLD_SIZE")
    assert provider_module.get_provider("Qwen3-8B", env={}).settings.context_parallel_size == 1
