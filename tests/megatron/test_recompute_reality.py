"""`effective_recompute` against what Megatron-Core really does, on real CPU models.

For each policy we build the tiny model through the Provider, run forward and backward,
and record which modules' forwards run again *during backward* (forward hooks, with a phase
flag flipped before `backward()`). A full-recompute unit shows up as its layers re-running
in ascending order; selective modules as their own submodule re-running. The observation
must equal the per-layer policy the provider resolved before building anything.
"""

from __future__ import annotations

import pytest
import torch

from art.megatron.provider import Provider
from art.megatron.recompute import EffectiveRecompute
from art.megatron.settings import load_settings

from _recompute_observer import expected_reruns, observe_backward_reruns

SEQ_TOKENS = 8


def _env(granularity, method=None, num_layers=None, modules=None) -> dict[str, str]:
    env = {"ART_MEGATRON_RECOMPUTE_GRANULARITY": granularity or "none"}
    env["ART_MEGATRON_RECOMPUTE_METHOD"] = method or "none"
    env["ART_MEGATRON_RECOMPUTE_NUM_LAYERS"] = str(num_layers) if num_layers else "none"
    if modules is not None:
        env["ART_MEGATRON_RECOMPUTE_MODULES"] = modules
    return env


def _observe(provider: Provider) -> tuple[dict[int, frozenset[str]], list[int]]:
    model = provider.build_model(seed=0)
    torch.manual_seed(3)
    tokens = torch.randint(0, provider.geometry.vocab_size, (1, SEQ_TOKENS))
    return observe_backward_reruns(model, tokens)


def _units_from_order(order: list[int]) -> list[tuple[int, ...]]:
    """Backward replays units last-first, layers inside a unit first-last."""
    units: list[list[int]] = []
    for n in order:
        if units and n == units[-1][-1] + 1:
            units[-1].append(n)
        else:
            units.append([n])
    return sorted(tuple(u) for u in units)


def _expected_units(er: EffectiveRecompute) -> list[tuple[int, ...]]:
    units: dict[tuple[int, int, int], list[int]] = {}
    for lr in er.layers:
        if lr.full_checkpoint_unit is not None:
            key = (lr.pipeline_stage, lr.virtual_chunk, lr.full_checkpoint_unit)
            units.setdefault(key, []).append(lr.layer_number)
    return sorted(tuple(u) for u in units.values())


DENSE_POLICIES = [
    (None,),
    ("selective",),
    ("selective", None, None, "mlp"),
    ("selective", None, None, "layernorm"),
    ("selective", None, None, "core_attn,mlp,layernorm"),
    ("selective", None, None, "none"),
    ("full", "uniform", 1),
    ("full", "uniform", 2),
    ("full", "uniform", 4),
    ("full", "block", 1),
    ("full", "block", 3),
    ("full", "block", 6),
]
MOE_POLICIES = [
    ("selective", None, None, "moe"),
    ("selective", None, None, "mlp"),
    ("selective", None, None, "core_attn,moe,layernorm"),
    ("full", "uniform", 2),
]


# tiny-qwen3_5: layers 1-3 Gated DeltaNet, layer 4 attention. uniform 2 makes units of two
# Gated DeltaNet layers and of one of each kind; block 3 checkpoints only the DeltaNet layers.
HYBRID_POLICIES = [
    ("selective", None, None, "core_attn,mlp,layernorm"),
    ("selective", None, None, "layernorm"),
    ("full", "uniform", 2),
    ("full", "block", 3),
]
HYBRID_MOE_POLICIES = [
    ("selective", None, None, "core_attn,moe,layernorm"),
    ("full", "uniform", 4),
]


@pytest.mark.parametrize(
    "model_name,policy",
    [("tiny-qwen3", p) for p in DENSE_POLICIES] + [("tiny-qwen3-moe", p) for p in MOE_POLICIES]
    + [("tiny-qwen3_5", p) for p in HYBRID_POLICIES]
    + [("tiny-qwen3_5-moe", p) for p in HYBRID_MOE_POLICIES],
    ids=lambda v: "-".join(str(x) for x in v) if isinstance(v, tuple) else v,
)
def test_backward_reruns_match_effective_recompute(megatron_process, model_name, policy):
    provider = Provider(model_name, settings=load_settings(_env(*policy)), dtype="float32")
    er = provider.effective_recompute
    rerun, order = _observe(provider)
    assert rerun == expected_reruns(er, provider.geometry.moe_layers), (
        f"{er.summary}: Megatron re-ran {rerun}, provider said {er.describe_layers()}"
    )
    assert _units_from_order(order) == _expected_units(er)


def test_selective_mlp_is_ignored_on_moe_layers(megatron_process):
    provider = Provider(
        "tiny-qwen3-moe", settings=load_settings(_env("selective", modules="mlp")),
        dtype="float32",
    )
    assert all(lr.mode == "none" for lr in provider.effective_recompute.layers)
    rerun, _ = _observe(provider)
    assert rerun == {}


def test_full_recompute_is_off_in_eval_mode(megatron_process):
    """Megatron applies full recompute only in training mode; under no_grad the policy for
    pricing is 'nothing retained' (`for_grad(False)`), and nothing can run in backward."""
    provider = Provider("tiny-qwen3", settings=load_settings(_env("full", "uniform", 1)),
                        dtype="float32")
    assert all(lr.mode == "none" for lr in provider.effective_recompute.for_grad(False).layers)
    model = provider.build_model(seed=0)
    model.eval()
    calls = []
    handle = model.decoder.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
    tokens = torch.randint(0, 256, (1, SEQ_TOKENS))
    logits = model(tokens, torch.arange(SEQ_TOKENS)[None], attention_mask=None)
    n_forward = len(calls)
    logits.float().pow(2).mean().backward()
    handle.remove()
    assert n_forward == 1 and len(calls) == 1  # eval: no checkpoint, so no re-run
