"""Where fla refuses its gated delta rule's backward, the CUDA build runs the torch rule.

fla-core 0.6 raises at the first backward of a gated chunk kernel on Hopper GPUs under Triton
>= 3.4.0 and < 3.7.1 unless tilelang is installed (`fla/ops/common/chunk_o.py`); the GPU check
met it on an H200 with torch 2.11's Triton 3.6 (bench/gpu). No GPU and no fla here: the
tests put a stand-in of `fla.ops.common.chunk_o` carrying fla's own flag names in
`sys.modules`, and stand in for CUDA being available where `detect` asks. The torch rule's
device handling runs for real on the meta device, which (like CUDA) refuses tensors left on
the CPU.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
import warnings

import pytest
import torch

from art.megatron import cpu_gated_delta, cpu_runtime, fla_support, implementation
from art.megatron.geometry import load_geometry
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.megatron.model_builder import RecomputeConfig, build_transformer_config
from art.megatron.provider import Provider
from art.megatron.specs.gated_delta_net import TORCH_DELTA_RULE_CONFIG_FLAG
from art.trainer_rank.pricing.layer_terms import Dims
from art.trainer_rank.pricing.layers_gdn import rule_work


def _module(name: str, **attributes: object) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for key, value in attributes.items():
        setattr(module, key, value)
    return module


def _stand_in_fla(monkeypatch: pytest.MonkeyPatch, *, hopper: bool = True,
                  above_3_4_0: bool = True, above_3_7_1: bool = False) -> None:
    """fla's package tree down to chunk_o, with the flags fla's guard reads."""
    chunk_o = _module("fla.ops.common.chunk_o", IS_NVIDIA_HOPPER=hopper,
                      TRITON_ABOVE_3_4_0=above_3_4_0, TRITON_ABOVE_3_7_1=above_3_7_1)
    for name in ("fla", "fla.ops", "fla.ops.common"):
        monkeypatch.setitem(sys.modules, name, _module(name))
    monkeypatch.setitem(sys.modules, "fla.ops.common.chunk_o", chunk_o)
    monkeypatch.delitem(sys.modules, "tilelang", raising=False)


def test_fla_s_refusal_is_read_from_its_own_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    _stand_in_fla(monkeypatch)
    refusal = fla_support.fla_delta_rule_refusal()
    assert refusal is not None and "Triton" in refusal and "tilelang" in refusal
    _stand_in_fla(monkeypatch, above_3_7_1=True)
    assert fla_support.fla_delta_rule_refusal() is None
    _stand_in_fla(monkeypatch, hopper=False)
    assert fla_support.fla_delta_rule_refusal() is None
    _stand_in_fla(monkeypatch)
    monkeypatch.setitem(sys.modules, "tilelang", _module("tilelang"))
    assert fla_support.fla_delta_rule_refusal() is None


def test_without_fla_nothing_is_refused_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fla", None)  # an import of fla fails
    assert fla_support.fla_delta_rule_refusal() is None


def test_detect_picks_the_torch_rule_where_fla_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    # CUDA without Transformer Engine, as the GPU check's machine is (a stand-in here).
    monkeypatch.setattr(cpu_runtime, "cuda_available", lambda: True)
    monkeypatch.setattr(cpu_runtime, "transformer_engine_available", lambda: False)
    monkeypatch.setattr(implementation, "torch_cuda_rms_norm_fused", lambda: True)
    _stand_in_fla(monkeypatch)
    found = Implementation.detect()
    assert found == Implementation.cuda_local("fused", "torch")
    assert found.key == "local/flash/fused-norm/swiglu-unfused/cuda/torch-delta-rule"
    _stand_in_fla(monkeypatch, above_3_7_1=True)
    assert Implementation.detect() == Implementation.cuda_local("fused", "fla")
    assert Implementation.detect().key == "local/flash/fused-norm/swiglu-unfused/cuda"


def test_cpu_builds_always_run_the_torch_rule() -> None:
    # Both CPU attentions (the default segmented flash attention and Megatron's unfused
    # DotProductAttention) run the torch rule, and the key does not name it on CPU.
    assert Implementation.cpu_local().delta_rule == "torch"
    assert Implementation.cpu_local("unfused").delta_rule == "torch"
    assert Implementation(spec="local", device="cpu", delta_rule="fla").delta_rule == "torch"
    assert Implementation.cpu_local().key == "local/flash/torch-norm/swiglu-unfused/cpu"
    assert Implementation.cpu_local("unfused").key == "local/unfused/torch-norm/swiglu-unfused/cpu"
    with pytest.raises(ValueError, match="delta_rule"):
        Implementation(delta_rule="triton")


def test_an_explicit_fla_build_is_refused_before_the_model_is_built(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _stand_in_fla(monkeypatch)
    geometry = load_geometry("tiny-qwen3_5")
    refused = Provider(geometry, dtype="bfloat16", implementation=Implementation.cuda_local())
    with pytest.raises(ValueError, match="asks for fla's delta rule.*Triton"):
        refused.transformer_config()
    torch_rule = Provider(geometry, dtype="bfloat16",
                          implementation=Implementation.cuda_local(delta_rule="torch"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        config = torch_rule.transformer_config()
        torch_rule.transformer_config()
    said = [str(w.message) for w in seen if "pure-torch delta rule" in str(w.message)]
    assert len(said) == 1 and "Triton" in said[0]  # once per provider
    assert getattr(config, TORCH_DELTA_RULE_CONFIG_FLAG) is True


def test_only_a_cuda_torch_rule_hybrid_config_carries_the_flag() -> None:
    hybrid, dense = load_geometry("tiny-qwen3_5"), load_geometry("tiny-qwen3")

    def flagged(geometry, impl: Implementation) -> bool:
        config = build_transformer_config(geometry, layout=ParallelLayout(),
                                          recompute=RecomputeConfig(), dtype="float32",
                                          implementation=impl)
        return bool(getattr(config, TORCH_DELTA_RULE_CONFIG_FLAG, False))

    assert flagged(hybrid, Implementation.cuda_local(delta_rule="torch"))
    assert not flagged(hybrid, Implementation.cuda_local())
    assert not flagged(hybrid, Implementation.cpu_local("flash"))  # the runtime redirects
    assert not flagged(dense, Implementation.cuda_local(delta_rule="torch"))


def test_the_torch_rule_is_priced_as_on_cpu_and_fla_s_as_fla_s() -> None:
    geometry = load_geometry("tiny-qwen3_5")

    def work(impl: Implementation) -> tuple[float, float]:
        d = Dims(geometry, ParallelLayout(), impl, 2, 0, frozenset())
        return rule_work(d, 1000.0, 1024.0)

    cpu = work(Implementation.cpu_local("flash"))
    assert work(Implementation.cuda_local(delta_rule="torch")) == cpu
    assert work(Implementation.cuda_local()) != cpu


def test_the_torch_rule_keeps_every_tensor_on_its_inputs_device() -> None:
    """Forward and backward on the meta device: a tensor made on the CPU inside the rule
    (an identity, a causal mask) fails there as it would on CUDA."""
    b, t, h, dk, dv = 1, 100, 2, 16, 16
    inputs = [torch.randn(b, t, h, n, device="meta", requires_grad=True)
              for n in (dk, dk, dv)]
    g = torch.randn(b, t, h, device="meta", requires_grad=True)
    beta = torch.rand(b, t, h, device="meta", requires_grad=True)
    out, final = cpu_gated_delta.chunk_gated_delta_rule(
        *inputs, g, beta, output_final_state=True, cu_seqlens=torch.tensor([0, 40, 100]))
    assert out.device.type == "meta" and final is not None and final.device.type == "meta"
    (out.sum() + final.sum()).backward()
    assert all(x.grad is not None and x.grad.device.type == "meta" for x in [*inputs, g, beta])
