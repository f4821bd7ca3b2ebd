"""Public value types: validation, nesting helpers, DP dealing, picklable errors, stats table."""

from __future__ import annotations

import pickle

import pytest
import torch

from art.megatron.train import TrainingRuntime
from art.trainer_rank._types import (
    ADMITTED,
    ForwardInput,
    MicroBatchStats,
    TrainerRankMemoryError,
    format_stats_table,
)
from art.trainer_rank.compute.items import make_items, outputs_union, rebuild
from art.trainer_rank.ranks.lockstep import Wave, widest_wave


def fi(n: int, **kw) -> ForwardInput:
    return ForwardInput(input_tokens=torch.arange(n), **kw)


def test_forward_input_validation_names_the_problem():
    with pytest.raises(ValueError, match=r"\[T\] or \[1, T\], got \(2, 3\)"):
        ForwardInput(input_tokens=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(TypeError):
        ForwardInput(torch.arange(3))  # keyword-only, as upstream
    with pytest.raises(ValueError, match="empty"):
        ForwardInput(input_tokens=torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="integer token ids"):
        ForwardInput(input_tokens=torch.zeros(3))
    with pytest.raises(ValueError, match=r"\[T\] or \[T, k\] with T = 3"):
        ForwardInput(input_tokens=torch.arange(3), target_tokens=torch.arange(4))
    with pytest.raises(ValueError, match="top_k must be None or an integer >= 1, got 0"):
        ForwardInput(input_tokens=torch.arange(3), top_k=0)
    x = ForwardInput(input_tokens=torch.arange(3), target_tokens=torch.arange(3), top_k=4,
                     hidden_states=True)
    assert x.outputs.key == "logprobs,top_k=4,hidden_states"
    caller = torch.arange(5).view(1, 5)
    row = ForwardInput(input_tokens=caller, target_tokens=torch.zeros(5, 2, dtype=torch.long))
    assert row.input_tokens.shape == (5,) and caller.shape == (1, 5)
    assert row.targets_per_position == 2 and row.no_grad is None


def test_nesting_round_trips_and_outputs_union():
    inputs = [fi(3), [fi(2, top_k=2), [fi(4, logits=True), fi(1)]], [fi(5)]]
    items = make_items(inputs)
    assert [len(it.leaves) for it in items] == [1, 3, 1]
    assert items[1].num_tokens == 7 and items[1].is_group and not items[0].is_group
    out = rebuild(inputs[1], ["a", "b", "c"])
    assert out == ["a", ["b", "c"]]
    union = outputs_union(items[1].leaves)
    assert union.top_k == 2 and union.logits and not union.target_logprobs
    with pytest.raises(TypeError, match=r"inputs\[1\]\[0\] is a int"):
        make_items([fi(1), [3]])
    with pytest.raises(ValueError, match="empty group"):
        make_items([[]])
    with pytest.raises(TypeError, match="iterable of top-level items"):
        make_items(fi(2))


def test_per_input_no_grad_overrides_the_call_and_any_iterable_is_read_once():
    items = make_items(iter([fi(2), fi(3, no_grad=True), [fi(1), fi(2, no_grad=False)]]),
                       call_no_grad=True)
    assert [it.no_grad_leaves for it in items] == [(True,), (True,), (True, False)]
    assert [it.grad for it in items] == [False, False, True]
    deep = [[[[fi(1)]]]]  # four levels counting the top-level list: accepted
    assert len(make_items(deep)[0].leaves) == 1
    with pytest.raises(ValueError, match="deeper than 4 levels"):
        make_items([[[[[fi(1)]]]]])


def test_waves_deal_contiguous_items_round_robin_as_upstream():
    wave = Wave(start=4, stop=11)
    assert wave.width == 7
    assert [list(wave.share(r, 3)) for r in range(3)] == [[4, 7, 10], [5, 8], [6, 9]]
    assert sorted(i for r in range(3) for i in wave.share(r, 3)) == list(range(4, 11))
    # Rank 1 of 3 fits its first 2 items (5 and 8) of 4 from start 4: the wave may reach
    # item 10, not its third item, 11 (width 7).
    assert widest_wave(4, 20, 1, 3, fitting=2, share_size=4) == 7
    assert list(Wave(4, 4 + 7).share(1, 3)) == [5, 8]
    assert list(Wave(4, 4 + 8).share(1, 3)) == [5, 8, 11]
    assert widest_wave(4, 20, 1, 3, fitting=4, share_size=4) == 16  # all of it: to the end
    # A rank always takes at least its first item, and a wave never runs past the items.
    assert widest_wave(0, 2, 0, 4, fitting=0, share_size=1) == 2
    assert widest_wave(0, 9, 0, 4, fitting=0, share_size=3) == 4


def test_memory_error_pickles_with_its_fields():
    err = TrainerRankMemoryError(
        "too big", predicted_peak_bytes=10, usable_limit_bytes=5,
        recompute_summary="selective recompute (core_attn)", suggestion="use full",
        indices_not_run=(3,),
    )
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, TrainerRankMemoryError)
    assert (back.predicted_peak_bytes, back.usable_limit_bytes) == (10, 5)
    assert back.indices_not_run == (3,)
    assert back.recompute_summary.startswith("selective") and str(back) == "too big"


UPSTREAM_FIELDS = dict(global_start=0, global_stop=2, global_count=2, local_count=1,
                       packed_tokens=64, logical_tokens=60, estimated_required_bytes=2 << 20,
                       available_bytes=8 << 20, rejected_candidates=0, cold_start=False)


def test_stats_table_renders_rows():
    s = MicroBatchStats(**{
        **UPSTREAM_FIELDS,
        "decision": ADMITTED, "predicted_peak_bytes": 3 << 20, "recompute_summary": "no recompute",
        "grad_enabled": True, "measured_peak_bytes": 1 << 20,
    })
    assert (s.predicted_dynamic_bytes, s.usable_limit_bytes) == (2 << 20, 8 << 20)
    table = format_stats_table([s, s])
    lines = table.splitlines()
    assert len(lines) == 4 and "decision" in lines[0]
    assert "0.500" in lines[2] and "2.00" in lines[2]
    with pytest.raises(ValueError, match="decision must be one of"):
        MicroBatchStats(**UPSTREAM_FIELDS, decision="maybe")


def test_options_from_env_validate_and_suggest():
    from art.trainer_rank import TrainerRankOptions

    opts = TrainerRankOptions.from_env({
        "ART_TRAINER_RANK_PROFILE_PATH": "/tmp/p.json",
        "ART_TRAINER_RANK_TEST_MEMORY_LIMIT_BYTES": "1048576",
        "ART_TRAINER_RANK_ESCALATE_TO_FULL_RECOMPUTE": "false",
        "ART_TRAINER_RANK_TRUST_WINDOW": "3",
        "OTHER": "x",
    }, cold_start_fraction=0.5)
    assert (opts.profile_path, opts.test_memory_limit_bytes) == ("/tmp/p.json", 1 << 20)
    assert opts.escalate_to_full_recompute is False and opts.trust_window == 3.0
    assert opts.cold_start_fraction == 0.5
    with pytest.raises(ValueError, match="did you mean ART_TRAINER_RANK_PROFILE_PATH"):
        TrainerRankOptions.from_env({"ART_TRAINER_RANK_PROFILE_PATHS": "x"})
    with pytest.raises(ValueError, match="not a boolean"):
        TrainerRankOptions.from_env({"ART_TRAINER_RANK_ESCALATE_TO_FULL_RECOMPUTE": "maybe"})
    with pytest.raises(ValueError, match="positive byte count"):
        TrainerRankOptions.from_env({"ART_TRAINER_RANK_TEST_MEMORY_LIMIT_BYTES": "-5"})
    with pytest.raises(ValueError, match="cold_start_fraction"):
        TrainerRankOptions(cold_start_fraction=0.0)
    with pytest.raises(ValueError, match="trust_window"):
        TrainerRankOptions(trust_window=0.5)


def test_pipeline_parallel_is_refused_up_front():
    from _trainer_helpers import provider

    from art.trainer_rank import TrainerRank, TrainerRankRuntimeSupportError

    p = provider("full", ART_MEGATRON_PIPELINE_MODEL_PARALLEL_SIZE="2")
    with pytest.raises(TrainerRankRuntimeSupportError, match="PIPELINE_MODEL_PARALLEL_SIZE=1"):
        TrainerRank(TrainingRuntime.for_model(None, p))
