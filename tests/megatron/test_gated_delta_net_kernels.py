"""The packed Gated DeltaNet layer against the GPU kernels' contracts, without a GPU.

fla's `chunk_gated_delta_rule` and causal-conv1d's `causal_conv1d_fn` do not run here (Triton
and CUDA kernels). These tests replace them, where Megatron-Core's module holds them, by
stand-ins with the real functions' exact signatures that record every call and compute with
the CPU kernels (the delta rule) or a torch conv (the causal conv): they fail if the layer
drops cu_seqlens, the per-sequence initial states or the final-state request, passes them in
the wrong layout, or hands the conv a row without its sequence index.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from art.megatron import cpu_gated_delta
from art.megatron.geometry import load_geometry
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.megatron.model_builder import RecomputeConfig, build_gpt_model, build_transformer_config
from art.trainer_rank._types import ForwardInput
from art.trainer_rank.compute.execute import run_sub_forward

# fla-core's chunk_gated_delta_rule (fla/ops/gated_delta_rule/chunk.py) and causal-conv1d's
# causal_conv1d_fn (causal_conv1d/causal_conv1d_interface.py), parameter for parameter.
FLA_PARAMETERS = ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
                  "use_qk_l2norm_in_kernel", "cu_seqlens", "head_first")
CONV_PARAMETERS = ("x", "weight", "bias", "seq_idx", "initial_states", "return_final_states",
                   "final_states_out", "activation")


@dataclass
class Recorder:
    calls: list[dict[str, Any]] = field(default_factory=list)


def fla_stand_in(recorder: Recorder):
    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                               output_final_state=False, use_qk_l2norm_in_kernel=False,
                               cu_seqlens=None, head_first=False):
        recorder.calls.append(dict(
            tokens=q.shape[1], batch=q.shape[0],
            cu_seqlens=None if cu_seqlens is None else cu_seqlens.tolist(),
            initial_state=None if initial_state is None else (
                tuple(initial_state.shape), initial_state.dtype,
                bool(initial_state.requires_grad)),
            output_final_state=output_final_state, l2norm_in_kernel=use_qk_l2norm_in_kernel,
            head_first=head_first, contiguous=all(t.is_contiguous() for t in (q, k, v))))
        return cpu_gated_delta.chunk_gated_delta_rule(
            q, k, v, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    return chunk_gated_delta_rule


def conv_stand_in(recorder: Recorder):
    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None,
                         return_final_states=False, final_states_out=None, activation=None):
        recorder.calls.append(dict(
            seq_idx=None if seq_idx is None else (seq_idx.dtype, seq_idx[0].tolist()),
            channel_last=x.stride(1) == 1, activation=activation))
        width = weight.shape[-1]
        # A reference that honours seq_idx: each sequence padded on its own.
        ids = (torch.zeros(x.shape[-1], dtype=torch.int32) if seq_idx is None
               else seq_idx[0])
        out = []
        for n in torch.unique_consecutive(ids).tolist():
            part = x[..., ids == n]
            y = torch.nn.functional.conv1d(part, weight.unsqueeze(1), bias, padding=width - 1,
                                           groups=x.shape[1])[..., :part.shape[-1]]
            out.append(y)
        y = torch.cat(out, dim=-1)
        return torch.nn.functional.silu(y) if activation in ("silu", "swish") else y
    return causal_conv1d_fn


def test_stand_ins_have_the_real_signatures():
    assert tuple(inspect.signature(fla_stand_in(Recorder())).parameters) == FLA_PARAMETERS
    assert tuple(inspect.signature(conv_stand_in(Recorder())).parameters) == CONV_PARAMETERS
    # The CPU kernel the layer calls where fla is missing takes fla's parameters in fla's order.
    assert tuple(inspect.signature(cpu_gated_delta.chunk_gated_delta_rule).parameters) == \
        FLA_PARAMETERS


@pytest.fixture(scope="module")
def hybrid(megatron_process):
    geometry = load_geometry("tiny-qwen3_5")
    implementation = Implementation.cpu_local("flash")
    config = build_transformer_config(geometry, layout=ParallelLayout(),
                                      recompute=RecomputeConfig("selective"), dtype="float32",
                                      implementation=implementation)
    return geometry, implementation, build_gpt_model(geometry, config,
                                                     implementation=implementation, seed=0)


def _leaves(vocab: int) -> list[ForwardInput]:
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(1, vocab, (70,), generator=g)
    group = [torch.cat([prompt, torch.randint(1, vocab, (n,), generator=g)]) for n in (80, 30)]
    group[1][70] = (group[0][70] % (vocab - 1)) + 1  # they part right after the prompt
    alone = torch.randint(1, vocab, (50,), generator=g)
    return [ForwardInput(input_tokens=t, target_tokens=torch.roll(t, -1))
            for t in (*group, alone)]


def _run(model, implementation, leaves, groups, monkeypatch, rule=None, conv=None):
    from megatron.core.ssm import gated_delta_net

    if rule is not None:
        monkeypatch.setattr(gated_delta_net, "chunk_gated_delta_rule", rule)
    if conv is not None:
        monkeypatch.setattr(gated_delta_net, "causal_conv1d_fn", conv)
    return run_sub_forward(model, leaves, implementation=implementation,
                           layout=ParallelLayout(), device=torch.device("cpu"),
                           head_chunk_tokens=64, groups=groups)


def test_a_prefix_tree_runs_depth_by_depth_with_fla_states(hybrid, monkeypatch):
    """A group of two sharing a 70-token prompt and a sequence alone, laid out depth by depth
    (alone, prompt | child 1, child 2: the roots of a flash row by length): per Gated DeltaNet
    layer one varlen call per depth;
    the second starts both children from the prompt's final state ([2, heads, dk, dv], fp32,
    carrying gradient) and the first asks for final states."""
    geometry, implementation, model = hybrid
    recorder = Recorder()
    outputs = _run(model, implementation, _leaves(geometry.vocab_size), [2, 1], monkeypatch,
                   rule=fla_stand_in(recorder))
    layers = sum(1 for t in geometry.layer_types if t == "linear_attention")
    assert len(recorder.calls) == 2 * layers
    heads = geometry.linear_attention.num_value_heads
    dims = (geometry.linear_attention.key_head_dim, geometry.linear_attention.value_head_dim)
    for first, second in zip(recorder.calls[::2], recorder.calls[1::2]):
        assert first["cu_seqlens"] == [0, 50, 120] and first["initial_state"] is None
        assert first["output_final_state"] is True
        assert second["cu_seqlens"] == [0, 80, 110] and second["output_final_state"] is False
        assert second["initial_state"] == ((2, heads, *dims), torch.float32, True)
        for call in (first, second):
            assert call["batch"] == 1 and not call["l2norm_in_kernel"]
            assert not call["head_first"] and call["contiguous"]
    # The stand-in computes with the CPU kernel: the same outputs as without it.
    monkeypatch.undo()
    again = _run(model, implementation, _leaves(geometry.vocab_size), [2, 1], monkeypatch)
    for a, b in zip(outputs, again):
        torch.testing.assert_close(a.target_logprobs, b.target_logprobs)


def test_plain_sequences_are_one_varlen_call_and_causal_conv1d_gets_seq_idx(hybrid,
                                                                           monkeypatch):
    geometry, implementation, model = hybrid
    rules, convs = Recorder(), Recorder()
    leaves = _leaves(geometry.vocab_size)
    with torch.no_grad():
        outputs = _run(model, implementation, leaves, None, monkeypatch,
                       rule=fla_stand_in(rules), conv=conv_stand_in(convs))
    # The row's sequences by length (50, 100, 150), as the flash build lays them out.
    assert {tuple(c["cu_seqlens"]) for c in rules.calls} == {(0, 50, 150, 300)}
    assert all(c["initial_state"] is None and not c["output_final_state"] for c in rules.calls)
    expected = [0] * 50 + [1] * 100 + [2] * 150
    assert convs.calls and all(c["seq_idx"] == (torch.int32, expected) and c["channel_last"]
                               and c["activation"] == "silu" for c in convs.calls)
    monkeypatch.undo()
    with torch.no_grad():
        reference = _run(model, implementation, leaves, None, monkeypatch)
    for a, b in zip(outputs, reference):
        torch.testing.assert_close(a.target_logprobs, b.target_logprobs, rtol=1e-5, atol=1e-5)


def test_the_transformer_engine_hybrid_spec_builds_the_packed_mixer():
    """Megatron's TE hybrid spec needs Transformer Engine, which this machine lacks: the swap
    is checked on a spec of the same shape (layer specs whose self_attention is a ModuleSpec
    of Megatron's GatedDeltaNet, beside an attention layer), which is all it reads."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    from art.megatron.specs.gated_delta_net import GatedDeltaNetTP, with_packed_gated_delta_net

    gdn = ModuleSpec(module=GatedDeltaNet, submodules="te submodules")
    attention = ModuleSpec(module=torch.nn.Identity)
    block = TransformerBlockSubmodules(layer_specs=[
        ModuleSpec(module=torch.nn.Module,
                   submodules=TransformerLayerSubmodules(self_attention=mixer))
        for mixer in (gdn, attention)])
    swapped = with_packed_gated_delta_net(block)
    mixers = [layer.submodules.self_attention for layer in swapped.layer_specs]
    assert mixers[0].module is GatedDeltaNetTP and mixers[0].submodules == "te submodules"
    assert mixers[1].module is torch.nn.Identity
    assert block.layer_specs[0].submodules.self_attention.module is GatedDeltaNet  # a copy


def test_a_torch_rule_build_never_calls_fla_s_rule(hybrid, monkeypatch):
    """A CUDA build where fla refuses its backward (fla_support.py) carries the torch-rule
    flag on its config: its layers call `cpu_gated_delta` directly, and fla's rule (here the
    recording stand-in where Megatron holds it) is never reached, also in backward."""
    from art.megatron.specs.gated_delta_net import TORCH_DELTA_RULE_CONFIG_FLAG

    geometry, implementation, model = hybrid
    fla_calls, torch_calls = Recorder(), Recorder()
    real = cpu_gated_delta.chunk_gated_delta_rule

    def torch_rule(*args, **kwargs):
        torch_calls.calls.append({})
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_gated_delta, "chunk_gated_delta_rule", torch_rule)
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    for config in configs.values():
        monkeypatch.setattr(config, TORCH_DELTA_RULE_CONFIG_FLAG, True, raising=False)
    outputs = _run(model, implementation, _leaves(geometry.vocab_size), [2, 1], monkeypatch,
                   rule=fla_stand_in(fla_calls))
    sum(o.target_logprobs.sum() for o in outputs).backward()
    layers = sum(1 for t in geometry.layer_types if t == "linear_attention")
    assert not fla_calls.calls and len(torch_calls.calls) == 2 * layers
    model.zero_grad(set_to_none=True)
