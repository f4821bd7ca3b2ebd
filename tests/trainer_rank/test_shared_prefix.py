"""Shared-prefix packing on a real Megatron-Core model (CPU, fp32, TP=1): a group laid out as
a prefix tree gives every sequence the outputs and the weight gradients of running it alone,
with segmented flash attention and with Megatron's unfused attention on the dense tree mask."""

from __future__ import annotations

import pytest

from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.megatron.model_builder import RecomputeConfig, build_gpt_model, build_transformer_config

from _shared_prefix import CASES, compare, group
from _tiny import tiny_dense


def _model(attention: str, recompute: RecomputeConfig):
    geometry = tiny_dense(num_layers=2)
    implementation = Implementation.cpu_local(attention)
    config = build_transformer_config(geometry, layout=ParallelLayout(), recompute=recompute,
                                      dtype="float32", implementation=implementation)
    return geometry, implementation, build_gpt_model(geometry, config,
                                                     implementation=implementation, seed=0)


def _check(diffs: dict) -> None:
    assert diffs["present"] and diffs["top_k_tokens_equal"], diffs
    for key in ("logprobs", "top_k", "logits", "hidden"):
        assert diffs[key] < 1e-5, (key, diffs)
    assert diffs["grad"] < 1e-5, diffs


@pytest.mark.parametrize(
    ("attention", "recompute", "cases"),
    [
        ("flash", RecomputeConfig("selective"), CASES),
        ("flash", RecomputeConfig("full", "uniform", 1), CASES[3:4]),
        ("unfused", RecomputeConfig("selective"), CASES[1:4]),
    ],
    ids=["flash-selective", "flash-full", "unfused-selective"],
)
def test_shared_prefix_equals_unshared(megatron_process, attention, recompute, cases):
    geometry, implementation, model = _model(attention, recompute)
    for case in cases:
        diffs = compare(model, group(case, geometry.vocab_size), implementation, ParallelLayout())
        _check(diffs)
        if case.rollouts > 1:
            assert diffs["shared_tokens"] >= case.prompt_tokens * (case.rollouts - 1)
            assert diffs["packed_tokens"] == diffs["logical_tokens"] - diffs["shared_tokens"]
