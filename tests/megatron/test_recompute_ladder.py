"""Every rung of the recompute ladder switched on a built model, for one forward and backward:
Megatron re-runs exactly what the rung says (nothing twice), outputs and gradients equal the
configured policy's, and the model is back to its configured policy afterwards."""

from __future__ import annotations

import pytest
import torch

from art.megatron.provider import Provider
from art.megatron.recompute_ladder import build_ladder, layer_flops, recomputed_flops
from art.megatron.settings import load_settings
from art.trainer_rank.decide.escalation import running_recompute

from _recompute_observer import expected_reruns, observe_backward_rerun_counts

SEQ_TOKENS = 8

CASES = [
    ("tiny-qwen3", {"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective"}),
    ("tiny-qwen3", {"ART_MEGATRON_RECOMPUTE_GRANULARITY": "full",
                    "ART_MEGATRON_RECOMPUTE_METHOD": "uniform",
                    "ART_MEGATRON_RECOMPUTE_NUM_LAYERS": "1"}),
    ("tiny-qwen3", {"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective",
                    "ART_MEGATRON_RECOMPUTE_MODULES": "layernorm"}),
    ("tiny-qwen3-moe", {"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective",
                        "ART_MEGATRON_RECOMPUTE_MODULES": "core_attn,moe"}),
    # Built selective core_attn: the MoE rung is switched on at run time.
    ("tiny-qwen3_5-moe", {"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective"}),
    ("tiny-qwen3_5", {"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective"}),
    ("tiny-qwen3_5", {}),
]


def _run(model, tokens) -> tuple[dict[int, frozenset[str]], dict[str, torch.Tensor]]:
    for p in model.parameters():
        p.grad = None
    counts, _ = observe_backward_rerun_counts(model, tokens)
    twice = {part: n for part, n in counts.items() if n != 1}
    assert not twice, f"recomputed more than once: {twice}"
    rerun: dict[int, frozenset[str]] = {}
    for layer_number, label in counts:
        rerun[layer_number] = rerun.get(layer_number, frozenset()) | {label}
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return rerun, grads


@pytest.mark.parametrize("model_name,env", CASES,
                         ids=[f"{m}-{e.get('ART_MEGATRON_RECOMPUTE_GRANULARITY', 'default')}"
                              f"-{e.get('ART_MEGATRON_RECOMPUTE_MODULES', '')}"
                              for m, e in CASES])
def test_every_rung_runs_what_it_says(megatron_process, model_name, env):
    provider = Provider(model_name, settings=load_settings(env), dtype="float32")
    configured = provider.effective_recompute
    ladder = build_ladder(configured, provider.recompute_as)
    assert ladder[0].recompute is configured
    model = provider.build_model(seed=0)
    model.train()
    torch.manual_seed(3)
    tokens = torch.randint(0, provider.geometry.vocab_size, (1, SEQ_TOKENS))
    moe = provider.geometry.moe_layers
    rerun, want = _run(model, tokens)
    assert rerun == expected_reruns(configured, moe)
    names = [rung.name for rung in ladder]
    assert len(set(names)) == len(names), names
    for rung in ladder[1:]:
        with running_recompute(model, rung.recompute):
            rerun, grads = _run(model, tokens)
        assert rerun == expected_reruns(rung.recompute, moe), (
            f"{rung.name}: Megatron re-ran {rerun}, the rung says "
            f"{rung.recompute.describe_layers()}")
        assert grads.keys() == want.keys()
        for name, grad in want.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5,
                                       msg=f"{rung.name}: {name}")
    # Back to the configured policy: the flags and the config are restored.
    rerun, grads = _run(model, tokens)
    assert rerun == expected_reruns(configured, moe)
    assert model.config.recompute_granularity == configured.granularity


def test_the_ladder_is_ordered_by_recomputed_work(megatron_process):
    provider = Provider("tiny-qwen3", settings=load_settings(
        {"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective"}), dtype="float32")
    ladder = build_ladder(provider.effective_recompute, provider.recompute_as)
    geometry = provider.geometry
    lengths = (300, 120, 40)
    flops = {rung.name: rung.recomputed_flops(geometry, lengths) for rung in ladder}
    assert flops["none"] == 0
    blocks = [flops[f"full block {n} (selective core_attn on the rest)"] for n in (1, 2, 3)]
    assert blocks == sorted(blocks) and len(set(blocks)) == 3
    assert blocks[-1] < flops["full uniform 1"]
    assert flops["selective core_attn"] < flops["selective core_attn+mlp"]
    per_layer = layer_flops(geometry, 0, lengths)
    assert flops["full uniform 1"] == pytest.approx(geometry.num_layers * per_layer.layer)
    # Attention grows with each sequence squared, the rest with its tokens.
    one_row = recomputed_flops(geometry, provider.effective_recompute, (460,))
    assert one_row > flops["selective core_attn"]


@pytest.mark.parametrize("model_name,has_moe_rung", [("tiny-qwen3", False),
                                                     ("tiny-qwen3-moe", True),
                                                     ("tiny-qwen3_5-moe", True)])
def test_models_with_moe_layers_get_the_moe_rung(megatron_process, model_name, has_moe_rung):
    """Selective `core_attn,moe` is a rung where the layers are MoE, between `core_attn` and
    the block rungs in work at these lengths; `moe_act` is not (Megatron needs grouped GEMM
    experts for it, which this build does not make), and a dense model has neither."""
    provider = Provider(model_name, settings=load_settings(
        {"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective"}), dtype="float32")
    ladder = build_ladder(provider.effective_recompute, provider.recompute_as)
    names = [rung.name for rung in ladder]
    assert ("selective core_attn+moe" in names) is has_moe_rung, names
    assert not any("moe_act" in name for name in names)
    if has_moe_rung:
        lengths = (300, 120, 40)
        flops = {rung.name: rung.recomputed_flops(provider.geometry, lengths)
                 for rung in ladder}
        assert flops["selective core_attn"] < flops["selective core_attn+moe"] \
            < flops["full uniform 1"]
        assert "selective core_attn+mlp" not in names  # mlp does nothing on MoE layers
