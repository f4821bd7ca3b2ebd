"""Hypothesis-generated ART_MEGATRON_* environments against the settings parser and Megatron.

Two oracles, both independent of art/megatron/settings.py:
- a per-value table (below) of what each variable accepts on its own. Any environment holding
  an unknown ART_MEGATRON_* name or a value the table calls invalid must raise ValueError
  naming one of the offending variables, and it must do so before any model is built (the
  builders are patched to fail the test if reached);
- Megatron-Core itself, for recompute combinations of individually valid values. When ART
  accepts one, the Provider's `effective_recompute` must equal what the built model really
  re-runs in backward. When ART rejects one, Megatron must reject it too (TransformerConfig
  or a crash in forward/backward), or the rejected setting must be one Megatron would silently
  ignore: the model built with it re-runs exactly what the model built without it does.
"""

from __future__ import annotations

import pytest
import torch
from _reliability import write_counts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from art.megatron import model_builder
from art.megatron.geometry import ModelGeometry, geometry_from_hf_dict
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.megatron.provider import Provider
from art.megatron.settings import load_settings

from _recompute_observer import expected_reruns, observe_backward_reruns

PREFIX = "ART_MEGATRON_"
UNSET = ("none", "None", "NULL", " null ", "off", "DISABLED", "empty", "")
INTS_VALID = ("1", "2", "4", " 2 ", "+1", *UNSET)
INTS_INVALID = ("0", "-1", "-4", "abc", "1.5", "2.0", "1e3", "two", "0x2", "true", "1 2")
INT_VARIABLES = (
    "TENSOR_MODEL_PARALLEL_SIZE", "CONTEXT_PARALLEL_SIZE", "PIPELINE_MODEL_PARALLEL_SIZE",
    "VIRTUAL_PIPELINE_MODEL_PARALLEL_SIZE", "EXPERT_MODEL_PARALLEL_SIZE",
    "EXPERT_TENSOR_PARALLEL_SIZE", "RECOMPUTE_NUM_LAYERS",
)
GRANULARITY_VALID = ("full", "FULL", "selective", " Selective", "none", "None", "")
GRANULARITY_INVALID = ("partial", "fulll", "true", "1", "selective,full", "recompute")
METHOD_VALID = ("uniform", "UNIFORM", "block", "Block ", "none", "null", "")
METHOD_INVALID = ("chunked", "uniformly", "blocks", "2", "full")
BOOL_VALID = ("true", "False", "1", "0", "yes", "NO", "on", "off", "none", "")
BOOL_INVALID = ("maybe", "2", "-1", "truee", "enabledd")
MODULES_VALID = ("core_attn", "mlp", "core_attn,mlp", "layernorm", "core_attn, layernorm",
                 "MLP,Core_Attn", "moe", "core_attn,moe", "none", "")
MODULES_INVALID = ("attn", "core_atn", "core_attn,,mlp", "mlp,mlp", "mlp;core_attn", "all",
                   "core_attn,")
# Misspellings of known names: errors. (A name close to none, e.g. ART_MEGATRON_TP, is only
# warned about, as upstream ignores unknown names: see test_settings.)
UNKNOWN_NAMES = (
    "ART_MEGATRON_TENSOR_PARALLEL_SIZE", "ART_MEGATRON_RECOMPUTE_GRANULARTY",
    "ART_MEGATRON_recompute_method", "ART_MEGATRON_RECOMPUTE_LAYERS",
    "ART_MEGATRON_SEQUENCE_PARALLELISM", "ART_MEGATRON_RECOMPUTE_GRANULARITY ",
)
# Environment entries that are not ART_MEGATRON_* and must be ignored.
BYSTANDERS = {"PATH": "/usr/bin", "ART_TRAINER_RANK_TRUST_WINDOW": "x", "ART_MEGATRONX": "1",
              "art_megatron_tensor_model_parallel_size": "banana"}


def _table(short: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if short in INT_VARIABLES:
        return INTS_VALID, INTS_INVALID
    return {
        "RECOMPUTE_GRANULARITY": (GRANULARITY_VALID, GRANULARITY_INVALID),
        "RECOMPUTE_METHOD": (METHOD_VALID, METHOD_INVALID),
        "SEQUENCE_PARALLEL": (BOOL_VALID, BOOL_INVALID),
        "RECOMPUTE_MODULES": (MODULES_VALID, MODULES_INVALID),
    }[short]


ALL_VARIABLES = (*INT_VARIABLES, "RECOMPUTE_GRANULARITY", "RECOMPUTE_METHOD",
                 "SEQUENCE_PARALLEL", "RECOMPUTE_MODULES")


@st.composite
def environments(draw: st.DrawFn) -> tuple[dict[str, str], set[str]]:
    """An environment and the set of variables the table says are wrong on their own."""
    env: dict[str, str] = {}
    bad: set[str] = set()
    for short in draw(st.lists(st.sampled_from(ALL_VARIABLES), unique=True, max_size=6)):
        valid, invalid = _table(short)
        if draw(st.booleans()) and draw(st.booleans()):  # ~1 in 4 values is invalid
            env[PREFIX + short] = draw(st.sampled_from(invalid))
            bad.add(PREFIX + short)
        else:
            env[PREFIX + short] = draw(st.sampled_from(valid))
    unknown = draw(st.lists(st.sampled_from(UNKNOWN_NAMES), unique=True, max_size=1))
    for name in unknown:
        env[name] = draw(st.sampled_from(("1", "full", "")))
    if draw(st.booleans()):
        env.update(BYSTANDERS)
    return env, set(unknown) or bad


def _tiny(moe: bool) -> ModelGeometry:
    base = dict(num_hidden_layers=2 if moe else 4, hidden_size=32, intermediate_size=64,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
                max_position_embeddings=256)
    if moe:
        base.update(model_type="qwen3_moe", moe_intermediate_size=16, num_experts=4,
                    num_experts_per_tok=2)
    else:
        base.update(model_type="qwen3")
    return geometry_from_hf_dict(base, name="fuzz-moe" if moe else "fuzz-dense")


DENSE, MOE = _tiny(False), _tiny(True)
IMPL = Implementation.cpu_local()
# Tallies for the closing report; written as JSON when ART_RELIABILITY_COUNTS_DIR is set.
COUNTS = {"environments": 0, "invalid": 0, "accepted": 0, "built": 0,
          "rejected_megatron_rejects": 0, "rejected_megatron_crashes": 0,
          "rejected_setting_ignored": 0}


@pytest.fixture
def no_model_building(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("a model was built while validating settings")

    monkeypatch.setattr(model_builder, "build_gpt_model", refuse)
    monkeypatch.setattr(model_builder, "build_transformer_config", refuse)


@settings(max_examples=400, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=environments(), moe=st.booleans())
def test_invalid_environments_name_the_variable_before_any_build(no_model_building, case, moe):
    env, bad = case
    COUNTS["environments"] += 1
    geometry = MOE if moe else DENSE
    if bad:
        COUNTS["invalid"] += 1
        with pytest.raises(ValueError) as info:
            Provider.from_env(geometry, env=env, dtype="float32")
        message = str(info.value)
        assert any(name in message for name in bad), (env, message)
        return
    try:
        provider = Provider(geometry, settings=load_settings(env), dtype="float32",
                            implementation=IMPL)
    except ValueError as exc:
        # A contradiction between individually valid values: it must say which variable.
        assert PREFIX in str(exc) or "_SIZE" in str(exc), (env, str(exc))
        return
    COUNTS["accepted"] += 1
    s = provider.settings
    tp = env.get(PREFIX + "TENSOR_MODEL_PARALLEL_SIZE", "").strip()
    assert s.tensor_model_parallel_size == (int(tp) if tp.lstrip("+").isdigit() else 1)
    granularity = env.get(PREFIX + "RECOMPUTE_GRANULARITY")
    expected = "full" if granularity is None else (
        None if granularity.strip().lower() in ("none", "") else granularity.strip().lower())
    assert provider.effective_recompute.granularity == expected


# ---------------------------------------------------------------- against Megatron itself

RECOMPUTE_VARIABLES = ("RECOMPUTE_GRANULARITY", "RECOMPUTE_METHOD", "RECOMPUTE_NUM_LAYERS",
                       "RECOMPUTE_MODULES")


@st.composite
def recompute_environments(draw: st.DrawFn) -> dict[str, str]:
    env = {}
    for short in RECOMPUTE_VARIABLES:
        if draw(st.integers(0, 3)) == 0:
            continue  # absent: ART's default applies
        if short == "RECOMPUTE_NUM_LAYERS":
            env[PREFIX + short] = draw(st.sampled_from(("1", "2", "3", "4", "5", "none")))
        else:
            env[PREFIX + short] = draw(st.sampled_from(_table(short)[0]))
    return env


def _raw(env: dict[str, str]) -> model_builder.RecomputeConfig:
    """The env as Megatron would receive it without ART's checks (ART's documented defaults:
    granularity absent = full; method / num_layers absent under full = uniform / 1)."""

    def word(short: str) -> str | None:
        text = env[PREFIX + short].strip().lower()
        return None if text in {"none", "null", "off", "disabled", "empty", ""} else text

    granularity = word("RECOMPUTE_GRANULARITY") if PREFIX + "RECOMPUTE_GRANULARITY" in env \
        else "full"
    full = granularity == "full"
    method = word("RECOMPUTE_METHOD") if PREFIX + "RECOMPUTE_METHOD" in env else (
        "uniform" if full else None)
    layers = word("RECOMPUTE_NUM_LAYERS") if PREFIX + "RECOMPUTE_NUM_LAYERS" in env else (
        "1" if full else None)
    modules = word("RECOMPUTE_MODULES") if PREFIX + "RECOMPUTE_MODULES" in env else None
    return model_builder.RecomputeConfig(
        granularity=granularity, method=method,
        num_layers=None if layers is None else int(layers),
        modules=None if modules is None else tuple(m.strip() for m in modules.split(",")),
    )


def _observe(model: torch.nn.Module) -> dict[int, frozenset[str]]:
    """Per layer: which of its parts ran forward again during backward."""
    return observe_backward_reruns(model, torch.arange(6).view(1, 6) % 64)[0]


def _build_raw(geometry: ModelGeometry, recompute: model_builder.RecomputeConfig):
    config = model_builder.build_transformer_config(
        geometry, layout=ParallelLayout(), recompute=recompute, dtype="float32",
        implementation=IMPL)
    return model_builder.build_gpt_model(geometry, config, implementation=IMPL, seed=0)


def _observe_raw(geometry: ModelGeometry, env: dict[str, str]):
    """('config', exc) / ('crash', exc) / ('ran', observation) for Megatron given raw values."""
    try:
        model = _build_raw(geometry, _raw(env))
    except Exception as exc:  # Megatron's own validation
        return "config", exc
    try:
        return "ran", _observe(model)
    except Exception as exc:
        return "crash", exc


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(env=recompute_environments(), moe=st.booleans())
def test_recompute_settings_agree_with_megatron(megatron_process, env, moe):
    geometry = MOE if moe else DENSE
    try:
        provider = Provider(geometry, settings=load_settings(env), dtype="float32",
                            implementation=IMPL)
    except ValueError as exc:
        message = str(exc)
        mentioned = [short for short in RECOMPUTE_VARIABLES if short in message]
        assert mentioned, f"{env}: the error names no variable: {message}"
        # The variables the message blames with their value ("NAME=value"), else all named.
        named = [s for s in mentioned if f"{PREFIX}{s}=" in message] or mentioned
        outcome, detail = _observe_raw(geometry, env)
        if outcome == "config":
            COUNTS["rejected_megatron_rejects"] += 1
            return
        if outcome == "crash":
            COUNTS["rejected_megatron_crashes"] += 1
            return
        # Megatron ran it: ART may reject only a setting Megatron would silently ignore.
        reduced = {k: v for k, v in env.items() if not any(k.endswith(n) for n in named)}
        try:
            load_settings(reduced)
        except ValueError:
            # Without the named setting the rest is still contradictory; the named setting
            # is then a consequence of another choice, which Megatron ignored as well.
            reduced = {k: v for k, v in env.items() if k.endswith("GRANULARITY")}
        again, baseline = _observe_raw(geometry, reduced)
        assert again == "ran" and baseline == detail, (
            f"ART rejected {env} ({message}) but Megatron ran it and did something else than "
            f"without {named}: {detail} vs {baseline}")
        COUNTS["rejected_setting_ignored"] += 1
        return
    model = provider.build_model(seed=0)
    COUNTS["built"] += 1
    observed = _observe(model)
    assert observed == expected_reruns(provider.effective_recompute, geometry.moe_layers), (
        f"{env}: provider says {provider.effective_recompute.describe_layers()}, Megatron "
        f"re-ran {observed}")


@pytest.fixture(scope="module", autouse=True)
def _report_counts():
    yield
    write_counts("config_fuzz", COUNTS)
