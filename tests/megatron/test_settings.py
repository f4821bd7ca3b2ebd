"""ART_MEGATRON_* parsing: defaults, "explicitly unset" words, and errors that name the variable."""

from __future__ import annotations

import pytest

from art.megatron.settings import ENV_PREFIX, MEGATRON_ENV, Settings, load_settings

SEED_ENV = {
    "ART_MEGATRON_CONTEXT_PARALLEL_SIZE": "1",
    "ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "2",
    "ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective",
    "ART_MEGATRON_RECOMPUTE_METHOD": "none",
    "ART_MEGATRON_RECOMPUTE_NUM_LAYERS": "none",
}


def test_defaults_when_nothing_is_set():
    s = load_settings({"PATH": "/bin", "ART_OTHER": "x"})
    assert s == Settings()
    assert (s.recompute_granularity, s.recompute_method, s.recompute_num_layers) == (
        "full", "uniform", 1)
    assert s.sequence_parallel is False
    layout = s.layout()
    assert (layout.tensor_parallel, layout.context_parallel, layout.pipeline_parallel,
            layout.expert_parallel, layout.virtual_pipeline_parallel) == (1, 1, 1, 1, 1)


def test_the_seed_environment_parses():
    s = load_settings(SEED_ENV)
    assert s.tensor_model_parallel_size == 2
    assert s.sequence_parallel is True  # default on when TP > 1
    assert s.recompute_granularity == "selective"
    assert s.recompute_method is None and s.recompute_num_layers is None
    assert s.recompute_config().modules is None
    text = str(s)
    assert "ART_MEGATRON_RECOMPUTE_METHOD=none" in text
    assert "Megatron default: core_attn" in text


@pytest.mark.parametrize("word", ["none", "NULL", "off", "Disabled", "empty", ""])
def test_unset_words_mean_megatron_none(word):
    s = load_settings({"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective",
                       "ART_MEGATRON_RECOMPUTE_NUM_LAYERS": word})
    assert s.recompute_num_layers is None
    # Granularity explicitly unset is "no recompute", not the default (full).
    assert load_settings({"ART_MEGATRON_RECOMPUTE_GRANULARITY": word}).recompute_granularity \
        is None


def test_selective_leaves_method_and_num_layers_unset_by_default():
    s = load_settings({"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective",
                       "ART_MEGATRON_RECOMPUTE_MODULES": "core_attn, mlp"})
    assert s.recompute_method is None and s.recompute_num_layers is None
    assert s.recompute_modules == ("core_attn", "mlp")


def test_settings_built_directly_for_selective_need_no_method_or_layer_count():
    s = Settings(recompute_granularity="selective")
    assert s.recompute_method is None and s.recompute_num_layers is None
    assert Settings(recompute_granularity=None).recompute_method is None
    # Named by a variable, a method is kept as given (what Megatron is handed).
    named = load_settings({"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective",
                           "ART_MEGATRON_RECOMPUTE_METHOD": "uniform"})
    assert named.recompute_method == "uniform"


def test_sequence_parallel_words():
    tp2 = {"ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "2"}
    assert load_settings({**tp2, "ART_MEGATRON_SEQUENCE_PARALLEL": "off"}).sequence_parallel \
        is False
    assert load_settings({**tp2, "ART_MEGATRON_SEQUENCE_PARALLEL": "none"}).sequence_parallel \
        is True
    assert load_settings({**tp2, "ART_MEGATRON_SEQUENCE_PARALLEL": "0"}).sequence_parallel \
        is False


def test_expert_tensor_parallel_defaults_to_tensor_parallel():
    s = load_settings({"ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "4"})
    assert s.expert_tensor_parallel_size is None
    assert s.layout().expert_tensor_parallel == 4
    assert s.layout(world_size=8).data_parallel == 2
    with pytest.raises(ValueError, match="world size 6 is not a multiple of TP x CP x PP = 4"):
        s.layout(world_size=6)


@pytest.mark.parametrize(
    "env,fragment",
    [
        ({"ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "two"},
         "ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE='two' is not an integer"),
        ({"ART_MEGATRON_CONTEXT_PARALLEL_SIZE": "0"},
         "ART_MEGATRON_CONTEXT_PARALLEL_SIZE='0' must be >= 1"),
        ({"ART_MEGATRON_RECOMPUTE_GRANULARITY": "partial"},
         "ART_MEGATRON_RECOMPUTE_GRANULARITY='partial' is not one of full, selective, none"),
        ({"ART_MEGATRON_RECOMPUTE_METHOD": "chunked"},
         "ART_MEGATRON_RECOMPUTE_METHOD='chunked' is not one of uniform, block, none"),
        ({"ART_MEGATRON_SEQUENCE_PARALLEL": "maybe"},
         "ART_MEGATRON_SEQUENCE_PARALLEL='maybe' is not a boolean"),
        ({"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective",
          "ART_MEGATRON_RECOMPUTE_MODULES": "core_atn"},
         "unknown module.*'core_atn' \\(did you mean 'core_attn'\\?\\)"),
        ({"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective",
          "ART_MEGATRON_RECOMPUTE_MODULES": "mlp,,core_attn"}, "has an empty item"),
        ({"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective",
          "ART_MEGATRON_RECOMPUTE_NUM_LAYERS": "2"},
         "ART_MEGATRON_RECOMPUTE_NUM_LAYERS=2: selective recompute does not take"),
        ({"ART_MEGATRON_RECOMPUTE_METHOD": "none"},
         "ART_MEGATRON_RECOMPUTE_METHOD=none: full recompute needs a method"),
        ({"ART_MEGATRON_RECOMPUTE_NUM_LAYERS": "off"},
         "ART_MEGATRON_RECOMPUTE_NUM_LAYERS=off: full recompute needs a number of layers"),
        ({"ART_MEGATRON_RECOMPUTE_MODULES": "mlp"},
         "recompute modules only apply to selective"),
        ({"ART_MEGATRON_RECOMPUTE_GRANULARITY": "none", "ART_MEGATRON_RECOMPUTE_METHOD": "block"},
         "ART_MEGATRON_RECOMPUTE_METHOD=block: set while recompute granularity is none"),
        ({"ART_MEGATRON_SEQUENCE_PARALLEL": "true"},
         "sequence parallel needs TENSOR_MODEL_PARALLEL_SIZE > 1"),
        ({"ART_MEGATRON_VIRTUAL_PIPELINE_MODEL_PARALLEL_SIZE": "2"},
         "2 virtual chunks need PIPELINE_MODEL_PARALLEL_SIZE > 1"),
    ],
)
def test_bad_values_name_the_variable_and_value(env, fragment):
    with pytest.raises(ValueError, match=fragment):
        load_settings(env)


def test_unknown_variable_is_an_error_with_the_closest_name():
    with pytest.raises(ValueError, match="did you mean ART_MEGATRON_RECOMPUTE_GRANULARITY"):
        load_settings({"ART_MEGATRON_RECOMPUTE_GRANULARTY": "selective"})
    with pytest.raises(ValueError, match="did you mean ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE"):
        load_settings({"ART_MEGATRON_TENSOR_PARALLEL_SIZE": "2"})
    # A name close to no known one is a warning, not a crash (upstream ignores it).
    with pytest.warns(UserWarning, match="ART_MEGATRON_BANANA='1' is not a variable"):
        load_settings({"ART_MEGATRON_BANANA": "1"})


def test_every_upstream_variable_is_accepted_and_listed():
    import warnings

    from _upstream_env import UPSTREAM_ENV

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = load_settings(UPSTREAM_ENV)
    assert s.expert_tensor_parallel_size == 1 and s.recompute_modules is None
    text = str(s)
    assert "ART_MEGATRON_MOE_HYBRIDEP_NUM_SMS='default': no effect on this build" in text
    with pytest.raises(ValueError, match="positive even integer"):
        load_settings({"ART_MEGATRON_MOE_HYBRIDEP_NUM_SMS": "3"})
    with pytest.raises(ValueError, match="retired"):
        load_settings({"ART_MEGATRON_MOE_DEEPEP_NUM_SMS": "8"})
    two = load_settings({"ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "2"})
    assert two.sequence_parallel is True  # on exactly when TP > 1, unless set


def text_fields(s: Settings) -> set[str]:
    return {line.split()[0] for line in str(s).splitlines()[1:]}


def test_known_variables_are_documented_and_printed():
    s = load_settings(SEED_ENV)
    applied = MEGATRON_ENV.applied_variables()
    for variable in applied:
        assert variable.meaning and variable.default_text, variable.name
        assert variable.field in text_fields(s), variable.name
    assert str(s).count("\n") == len(applied)
    assert all(not v.name.startswith(ENV_PREFIX) for v in MEGATRON_ENV.variables)


def test_settings_object_validates_direct_construction():
    with pytest.raises(ValueError, match="tensor_model_parallel_size|TENSOR_MODEL"):
        Settings(tensor_model_parallel_size=0)
    with pytest.raises(ValueError, match="full recompute needs a method"):
        Settings(recompute_method=None)
