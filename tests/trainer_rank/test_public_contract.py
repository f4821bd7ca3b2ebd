"""Upstream's public contract for TrainerRank, as ART's acceptance tests state it (seed era),
checked against ours: the planner's policy is not a knob of the public surface.

- The constructor takes the training runtime and nothing else (no **kwargs either).
- `forward_micro_batches` and `dp_rank_forward` take `inputs`, and keyword-only `checkpoint`
  and `no_grad`; nothing else.
- `TrainerRankMemoryError` reports the predicted peak, the usable limit and a suggestion, and
  no infeasibility proof or per-component attribution.
- No prefix-sharing depth, head-chunk, safety-factor or reserve knob, nor a test-only layout
  anchor, reaches the public API.
"""

from __future__ import annotations

import inspect

import pytest

import art.trainer_rank as public

POLICY_KNOBS = ("shared_prefix_max_depth", "head_chunk_tokens", "memory_safety_factor",
                "memory_reserve_fraction")
PROOF_FIELDS = ("feasibility_proof", "proven_minimum_bytes", "proven_minimum_peak_bytes",
                "limiting_atomic_input", "component_breakdown", "retained_graph_bytes",
                "ephemeral_bytes", "output_head_bytes", "gradient_bytes",
                "persistent_capacity_bytes")


def _parameters(function) -> dict[str, inspect.Parameter]:
    return {name: p for name, p in inspect.signature(function).parameters.items()
            if name not in ("self", "cls")}


def test_the_constructor_takes_the_runtime_only():
    parameters = _parameters(public.TrainerRank.__init__)
    assert list(parameters) == ["runtime"]
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    assert not set(POLICY_KNOBS) & set(parameters)


@pytest.mark.parametrize("method", ["forward_micro_batches", "dp_rank_forward"])
def test_forward_methods_take_inputs_checkpoint_and_no_grad(method):
    parameters = _parameters(getattr(public.TrainerRank, method))
    assert set(parameters) == {"inputs", "checkpoint", "no_grad"}
    assert list(parameters)[0] == "inputs"
    for name in ("checkpoint", "no_grad"):
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert parameters["no_grad"].default is None


def test_the_memory_error_reports_what_a_caller_can_act_on_and_no_proof():
    error = public.TrainerRankMemoryError("m", predicted_peak_bytes=3, usable_limit_bytes=2,
                                          suggestion="shorten")
    assert (error.predicted_peak_bytes, error.usable_limit_bytes, error.suggestion) == (
        3, 2, "shorten")
    declared = (set(_parameters(public.TrainerRankMemoryError.__init__))
                | set(getattr(public.TrainerRankMemoryError, "__annotations__", {}))
                | set(vars(public.TrainerRankMemoryError)) | set(vars(error)))
    assert not set(PROOF_FIELDS) & declared
    assert issubclass(public.TrainerRankPartialExecutionError, public.TrainerRankMemoryError)


def test_no_policy_knob_or_test_anchor_is_public():
    for method in ("__init__", "forward_micro_batches", "dp_rank_forward"):
        leaked = [name for name in _parameters(getattr(public.TrainerRank, method))
                  if "anchor" in name or "policy" in name or "forced" in name]
        assert not leaked, (method, leaked)
    assert not set(POLICY_KNOBS) & set(dir(public))
