"""Shared prefixes through Gated DeltaNet hybrids (CPU, fp32, TP=1): a group laid out as a
prefix tree, each child segment's recurrence starting from its parent's final state and its
conv from its path's last inputs, gives every sequence the outputs and the weight gradients
of running it alone; with segmented flash attention (the tree from the attention layout) and
with Megatron's unfused attention (the tree read from the dense mask), under selective and
full recompute."""

from __future__ import annotations

import pytest

from art.megatron.geometry import load_geometry
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.megatron.model_builder import RecomputeConfig, build_gpt_model, build_transformer_config

from _shared_prefix import HYBRID_CASES, compare, group


def _model(attention: str, recompute: RecomputeConfig):
    geometry = load_geometry("tiny-qwen3_5")
    implementation = Implementation.cpu_local(attention)
    config = build_transformer_config(geometry, layout=ParallelLayout(), recompute=recompute,
                                      dtype="float32", implementation=implementation)
    return geometry, implementation, build_gpt_model(geometry, config,
                                                     implementation=implementation, seed=0)


@pytest.mark.parametrize(
    ("attention", "recompute", "cases"),
    [
        ("flash", RecomputeConfig("selective"), HYBRID_CASES),
        ("flash", RecomputeConfig("full", "uniform", 1), HYBRID_CASES[2:3]),
        ("unfused", RecomputeConfig("selective"), HYBRID_CASES[:3]),
    ],
    ids=["flash-selective", "flash-full", "unfused-selective"],
)
def test_hybrid_shared_prefix_equals_unshared(megatron_process, attention, recompute, cases):
    geometry, implementation, model = _model(attention, recompute)
    for case in cases:
        diffs = compare(model, group(case, geometry.vocab_size), implementation, ParallelLayout())
        assert diffs["present"] and diffs["top_k_tokens_equal"], (case, diffs)
        for key in ("logprobs", "top_k", "logits", "hidden", "grad"):
            assert diffs[key] < 1e-5, (case, key, diffs)
        assert diffs["shared_tokens"] >= case.prompt_tokens * (case.rollouts - 1), diffs
