"""One vocabulary for every environment variable: the same word means the same thing under
ART_MEGATRON_* and ART_TRAINER_RANK_*, and the recompute rules are checked in one place, so the
settings loader and resolve_recompute refuse the same configurations for the same reason."""

from __future__ import annotations

import pytest

from art.env_vars import FALSE_WORDS, TRUE_WORDS, UNSET_WORDS
from art.megatron.geometry import LayerKind
from art.megatron.recompute import recompute_rule_break, resolve_recompute
from art.megatron.settings import Settings, load_settings
from art.trainer_rank._options import TrainerRankOptions

TP2 = {"ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "2"}


@pytest.mark.parametrize("word", sorted(TRUE_WORDS) + ["ENABLED", " On "])
def test_a_true_word_is_true_under_both_prefixes(word: str) -> None:
    assert load_settings({**TP2, "ART_MEGATRON_SEQUENCE_PARALLEL": word}).sequence_parallel
    options = TrainerRankOptions.from_env({"ART_TRAINER_RANK_PROBE_CACHE": word,
                                           "ART_TRAINER_RANK_ESCALATE_TO_FULL_RECOMPUTE": word})
    assert options.probe_cache is True and options.escalate_to_full_recompute is True


@pytest.mark.parametrize("word", sorted(FALSE_WORDS) + ["Disabled", " OFF"])
def test_a_false_word_is_false_under_both_prefixes(word: str) -> None:
    assert not load_settings({**TP2, "ART_MEGATRON_SEQUENCE_PARALLEL": word}).sequence_parallel
    options = TrainerRankOptions.from_env({"ART_TRAINER_RANK_PROBE_LAYERS": word,
                                           "ART_TRAINER_RANK_PROBE_CACHE": word})
    assert options.probe_layers is False and options.probe_cache is False


@pytest.mark.parametrize("word", sorted(UNSET_WORDS - FALSE_WORDS) + ["NULL", " none "])
def test_a_none_word_is_the_default_or_none_under_both_prefixes(word: str) -> None:
    # A boolean keeps its default; a field that takes None gets None.
    assert load_settings({**TP2, "ART_MEGATRON_SEQUENCE_PARALLEL": word}).sequence_parallel
    assert load_settings({"ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": word}
                         ).tensor_model_parallel_size == 1
    options = TrainerRankOptions.from_env({
        "ART_TRAINER_RANK_PROBE_LAYERS": word, "ART_TRAINER_RANK_PROFILE_PATH": word,
        "ART_TRAINER_RANK_TEST_MEMORY_LIMIT_BYTES": word,
        "ART_TRAINER_RANK_COLD_START_FRACTION": word, "ART_TRAINER_RANK_RECOMPUTE": word})
    assert options == TrainerRankOptions()


@pytest.mark.parametrize("word", ["maybe", "2", "enabledd", "truee"])
def test_a_word_that_is_no_boolean_fails_under_both_prefixes(word: str) -> None:
    with pytest.raises(ValueError, match=f"ART_MEGATRON_SEQUENCE_PARALLEL='{word}' is not a "
                                         "boolean"):
        load_settings({**TP2, "ART_MEGATRON_SEQUENCE_PARALLEL": word})
    with pytest.raises(ValueError, match=f"ART_TRAINER_RANK_PROBE_LAYERS='{word}' is not a "
                                         "boolean"):
        TrainerRankOptions.from_env({"ART_TRAINER_RANK_PROBE_LAYERS": word})


# (granularity, method, num_layers, modules) Megatron rejects or would ignore.
BROKEN = [
    ("full", None, 1, None),
    ("full", "uniform", None, None),
    ("full", "uniform", 1, ("mlp",)),
    ("selective", None, 2, None),
    ("selective", None, None, ("core_atn",)),
    (None, "block", None, None),
    (None, None, 1, None),
    ("partial", None, None, None),
    ("full", "chunked", 1, None),
    ("full", "uniform", 0, None),
]


@pytest.mark.parametrize("granularity,method,num_layers,modules", BROKEN)
def test_the_loader_and_resolve_recompute_refuse_alike(granularity, method, num_layers,
                                                        modules) -> None:
    rule_break = recompute_rule_break(granularity, method, num_layers, modules)
    assert rule_break is not None
    with pytest.raises(ValueError) as from_settings:
        Settings(recompute_granularity=granularity, recompute_method=method,
                 recompute_num_layers=num_layers, recompute_modules=modules,
                 sources=(("recompute_method", "set"), ("recompute_num_layers", "set")))
    with pytest.raises(ValueError) as from_resolve:
        resolve_recompute(granularity=granularity, method=method, num_layers=num_layers,
                          modules=modules, moe_layers=(False,) * 4,
                          layer_types=(LayerKind.ATTENTION,) * 4)
    assert rule_break.reason in str(from_settings.value)
    assert rule_break.reason in str(from_resolve.value)


def test_what_the_rules_accept_both_accept() -> None:
    for config in [("full", "uniform", 2, None), ("full", "block", 3, None),
                   ("selective", None, None, None), ("selective", None, None, ("mlp",)),
                   (None, None, None, None)]:
        assert recompute_rule_break(*config) is None
        granularity, method, num_layers, modules = config
        Settings(recompute_granularity=granularity, recompute_method=method,
                 recompute_num_layers=num_layers, recompute_modules=modules,
                 sources=(("recompute_method", "set"), ("recompute_num_layers", "set")))
        resolve_recompute(granularity=granularity, method=method, num_layers=num_layers,
                          modules=modules, moe_layers=(False,) * 4)
