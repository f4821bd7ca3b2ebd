"""The rung a grad micro-batch runs, on a real Megatron-Core model under a virtual limit:
escalate takes the least-work rung above the configured policy that fits (block N before
uniform full), adaptive the least-work rung that fits below it too, configured declines and
names what would have fitted. Outputs and gradients equal the configured policy's; the
measured peak stays under the limit; profiles are keyed by the rung that ran."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from peft import LoraConfig

from art.megatron.geometry import geometry_from_hf_dict
from art.megatron.implementation import Implementation
from art.megatron.provider import Provider
from art.megatron.settings import load_settings
from art.megatron.train import TrainingRuntime
from art.trainer_rank import ForwardInput, TrainerRank, TrainerRankMemoryError, TrainerRankOptions
from art.trainer_rank.compute.items import make_items

ROOMY_BYTES = 2 * 2**30
GEOMETRY = geometry_from_hf_dict(
    dict(model_type="qwen3", num_hidden_layers=4, hidden_size=128, intermediate_size=384,
         num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256,
         max_position_embeddings=4096),
    name="adaptive-4x128",
)
LENGTHS = (523, 141)  # one group of two sequences


def _runtime(env: dict[str, str]) -> tuple[Provider, torch.nn.Module]:
    provider = Provider(
        GEOMETRY, settings=load_settings(env),
        lora=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj",
                                                           "down_proj"]),
        dtype="float32", implementation=Implementation.cpu_local())
    return provider, provider.build_model(seed=0)


@pytest.fixture(scope="module")
def selective(megatron_process):
    return _runtime({"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective"})


@pytest.fixture(scope="module")
def full(megatron_process):
    return _runtime({"ART_MEGATRON_RECOMPUTE_GRANULARITY": "full",
                     "ART_MEGATRON_RECOMPUTE_METHOD": "uniform",
                     "ART_MEGATRON_RECOMPUTE_NUM_LAYERS": "1"})


def _group() -> list[list[ForwardInput]]:
    g = torch.Generator().manual_seed(11)
    return [[ForwardInput(input_tokens=torch.randint(0, 256, (n,), generator=g),
                          hidden_states=True) for n in LENGTHS]]


def _trainer(runtime, limit: int, **options) -> TrainerRank:
    provider, model = runtime
    return TrainerRank(TrainingRuntime.for_model(model, provider, trainer_options=(
        TrainerRankOptions(test_memory_limit_bytes=limit, **options))))


def _run(trainer: TrainerRank) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    trainer.zero_grad()
    hidden = None
    for mb in trainer.forward_micro_batches(_group()):
        outs = mb.outputs[0]
        sum(o.hidden_states.float().pow(2).mean() for o in outs).backward()
        hidden = torch.cat([o.hidden_states.detach() for o in outs])
    assert hidden is not None
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()
             if p.grad is not None}
    trainer.zero_grad()
    return hidden, grads


def _same(a, b) -> None:
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)
    assert a[1].keys() == b[1].keys() and a[1]
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], atol=1e-5, rtol=1e-4, msg=name)


def _offset(trainer: TrainerRank) -> int:
    """The limit minus what the last micro-batch was offered (resident slots, snapshot)."""
    stats = trainer.stats_history[-1]
    return int(trainer.options.test_memory_limit_bytes) - stats.available_bytes


def _price(trainer: TrainerRank, recompute) -> int:
    (item,) = make_items(_group())
    return trainer.admission.price(item.leaves, True, recompute)[0].dynamic_bytes


def test_escalate_runs_the_least_work_rung_above_that_fits(selective):
    roomy = _trainer(selective, ROOMY_BYTES)
    reference = _run(roomy)
    assert roomy.stats_history[-1].decision in ("cold-capped", "admitted")
    offset = _offset(roomy)
    ladder = roomy.admission.ladder
    lengths = LENGTHS
    above = ladder.above(lengths)
    assert [r.name for r in above][-1] == "full uniform 1"
    configured = _price(roomy, ladder.configured.recompute)
    most_frugal = _price(roomy, above[-1].recompute)
    assert most_frugal < configured
    # A limit between the configured policy's price and full recompute's.
    usable = (configured + most_frugal) // 2
    trainer = _trainer(selective, usable + offset)
    got = _run(trainer)
    stats = trainer.stats_history[-1]
    assert stats.decision == "escalated"
    fitting = [r for r in above if _price(trainer, r.recompute) <= stats.available_bytes]
    assert fitting and stats.recompute_summary == fitting[0].recompute.summary
    assert fitting[0].name.startswith("full block"), fitting[0].name
    assert stats.measured_peak_bytes <= stats.available_bytes
    _same(got, reference)
    # The model is back to its configured policy.
    assert trainer.model.config.recompute_granularity == "selective"


def test_configured_declines_and_names_the_rung_that_would_fit(selective):
    roomy = _trainer(selective, ROOMY_BYTES)
    _run(roomy)
    offset = _offset(roomy)
    ladder = roomy.admission.ladder
    configured = _price(roomy, ladder.configured.recompute)
    block_1 = next(r for r in ladder.rungs if r.name.startswith("full block 1"))
    usable = (configured + _price(roomy, block_1.recompute)) // 2
    trainer = _trainer(selective, usable + offset, recompute="configured")
    with pytest.raises(TrainerRankMemoryError) as info:
        _run(trainer)
    assert "ART_TRAINER_RANK_RECOMPUTE=escalate" in info.value.suggestion
    assert "full recompute of the first" in str(info.value)


def test_adaptive_runs_less_than_the_configured_full_recompute(full):
    configured = _run(_trainer(full, ROOMY_BYTES, recompute="configured"))
    trainer = _trainer(full, ROOMY_BYTES, recompute="adaptive")
    got = _run(trainer)
    stats = trainer.stats_history[-1]
    assert stats.recompute_summary == "no recompute", stats.note
    assert "adaptive" in stats.note
    assert stats.measured_peak_bytes <= stats.available_bytes
    _same(got, configured)
    # Profiles are keyed by the rung that ran: the second call is warm under it.
    got_again = _run(trainer)
    assert trainer.stats_history[-1].decision == "admitted"
    assert trainer.stats_history[-1].recompute_summary == "no recompute"
    _same(got_again, configured)
    assert trainer.model.config.recompute_granularity == "full"


def test_adaptive_under_a_tight_limit_runs_a_rung_between(full):
    roomy = _trainer(full, ROOMY_BYTES, recompute="adaptive")
    reference = _run(roomy)
    offset = _offset(roomy)
    ladder = roomy.admission.ladder
    none_bytes = _price(roomy, ladder.by_key(ladder.below(LENGTHS)[0].recompute.key).recompute)
    full_bytes = _price(roomy, ladder.configured.recompute)
    assert full_bytes < none_bytes
    usable = (none_bytes + full_bytes) // 2
    trainer = _trainer(full, usable + offset, recompute="adaptive")
    got = _run(trainer)
    stats = trainer.stats_history[-1]
    fitting = [r for r in ladder.below(LENGTHS)
               if _price(trainer, r.recompute) <= stats.available_bytes]
    assert fitting, "some rung below full recompute fits this limit"
    assert stats.recompute_summary == fitting[0].recompute.summary, stats.note
    assert stats.recompute_summary not in ("no recompute", ladder.configured.recompute.summary)
    assert stats.measured_peak_bytes <= stats.available_bytes
    _same(got, reference)


def _three_groups() -> list[list[ForwardInput]]:
    g = torch.Generator().manual_seed(11)
    return [[ForwardInput(input_tokens=torch.randint(0, 256, (n,), generator=g),
                          hidden_states=True) for n in lengths]
            for lengths in ((523, 141), (480, 200), (300, 90))]


def test_adaptive_weighs_its_two_packings_by_the_step_time_line(full):
    """Adaptive packs the queue two ways: under the least-work rung the first group fits
    alone (here no recompute, one group; the cold cap starts with the smallest), and as the
    configured full recompute packs it (all three groups) with the rung then lowered as far
    as that micro-batch fits. Which
    runs is the one the step-time line predicts faster per token: a large fixed cost per
    micro-batch favours the packed one, none at all the least-work one; before there is a
    line, the packed one (never more micro-batches than the configured policy)."""
    from art.trainer_rank.decide.plan import PlanRequest
    from art.trainer_rank.decide.step_time import StepTimeFit

    trainer = _trainer(full, ROOMY_BYTES, recompute="adaptive", cold_start_fraction=1.0)
    admission = trainer.admission
    items = tuple(make_items(_three_groups()))
    ladder = admission.ladder
    none = ladder.below(LENGTHS)[0].recompute

    def price(chosen, recompute) -> int:
        return admission.price_items(list(chosen), True, recompute)[0].dynamic_bytes

    usable = max(price(items, ladder.configured.recompute), price(items[:1], none))
    assert usable < price(items[:2], none)

    def plan(fit):
        return admission.plan(PlanRequest(items, True, usable, step_time=fit))

    packed = plan(None)
    assert packed.indices == [0, 1, 2], packed.note
    assert packed.recompute is not None and packed.recompute != none
    assert price(items, packed.recompute) <= usable
    lower = [r.recompute for r in ladder.below([n for it in items
                                                 for n in it.sequence_lengths_tokens])]
    assert packed.recompute == next(r for r in lower if price(items, r) <= usable)
    assert "packed as configured" in packed.note

    least_work = plan(StepTimeFit(fixed_seconds=0.0, seconds_per_flop=1e-9, observations=8))
    assert len(least_work.items) == 1 and least_work.recompute == none, least_work.note
    assert "packed under its rung" in least_work.note

    fixed = plan(StepTimeFit(fixed_seconds=1.0, seconds_per_flop=1e-12, observations=8))
    assert fixed.indices == [0, 1, 2] and fixed.recompute == packed.recompute, fixed.note


def test_a_call_packs_its_waves_the_way_the_step_time_line_predicts_faster(full):
    """Through `forward_micro_batches` (waves): with no step times yet adaptive packs the three
    groups as the configured policy would (one micro-batch) and runs it under the least-work
    rung that micro-batch fits; once the line says a micro-batch costs nothing beside its
    FLOPs, the next call packs under the least-work rung of each wave's first group (more
    micro-batches, less recompute). Outputs and gradients equal the roomy run's."""
    from art.trainer_rank.decide.step_time import MicroBatchTime, StepTimes

    def run(trainer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        trainer.zero_grad()
        hidden = []
        for mb in trainer.forward_micro_batches(_three_groups()):
            outs = [o for group in mb.outputs for o in group]
            sum(o.hidden_states.float().pow(2).mean() for o in outs).backward()
            hidden += [((index, k), o.hidden_states.detach())
                       for index, group in zip(mb.indices, mb.outputs)
                       for k, o in enumerate(group)]
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()
                 if p.grad is not None}
        trainer.zero_grad()
        return torch.cat([h for _, h in sorted(hidden, key=lambda t: t[0])]), grads

    roomy = _trainer(full, ROOMY_BYTES, recompute="adaptive", cold_start_fraction=1.0)
    reference = run(roomy)
    offset = _offset(roomy)
    admission = roomy.admission
    items = make_items(_three_groups())
    ladder = admission.ladder
    none = ladder.below(LENGTHS)[0].recompute

    def price(chosen, recompute) -> int:
        return admission.price_items(list(chosen), True, recompute)[0].dynamic_bytes

    # A little above what the first group needs without recompute, far below two groups'.
    usable = int(max(price(items, ladder.configured.recompute), price(items[:1], none)) * 1.02)
    assert usable < price(items[:2], none)
    trainer = _trainer(full, usable + offset, recompute="adaptive", cold_start_fraction=1.0)
    packed = run(trainer)
    (stats,) = trainer.stats_history
    assert stats.local_count == 3 and "packed as configured" in stats.note, stats.note
    assert stats.recompute_summary not in ("no recompute", ladder.configured.recompute.summary)
    assert stats.measured_peak_bytes <= stats.available_bytes
    _same(packed, reference)

    trainer.step_times = StepTimes(tuple(MicroBatchTime(w, 0.0, 3e-9 * w)
                                         for w in (1e9, 2e9, 4e9)))
    least_work = run(trainer)
    first, *rest = trainer.stats_history[1:]
    assert rest and first.local_count == 1 and first.recompute_summary == "no recompute"
    assert all(s.measured_peak_bytes <= s.available_bytes for s in trainer.stats_history)
    _same(least_work, reference)


def test_grad_micro_batches_time_themselves_into_the_step_time_line(full):
    """Every grad micro-batch that runs adds its work and wall time (forward through the
    caller's backward) to the trainer's step times; no-grad ones do not, nor a
    dp_rank_forward call, whose caller's backward runs after it returns."""
    trainer = _trainer(full, ROOMY_BYTES, recompute="adaptive")
    assert trainer.step_times.fit() is None
    _run(trainer)
    _run(trainer)
    times = trainer.step_times.times
    assert len(times) == len(trainer.stats_history) == 2
    ladder = trainer.admission.ladder
    for time, stats in zip(times, trainer.stats_history):
        rung = next(r.recompute for r in ladder.rungs
                    if r.recompute.summary == stats.recompute_summary)
        assert time.forward_flops == ladder.forward_flops(LENGTHS)
        assert time.recomputed_flops == ladder.flops(rung, LENGTHS)
        assert time.seconds > 0
    with torch.no_grad():
        for _ in trainer.forward_micro_batches(_group()):
            pass
    assert len(trainer.step_times.times) == 2
    # dp_rank_forward returns before the caller's backward: its time would be the forward's.
    (group,) = trainer.dp_rank_forward(_group())
    sum(o.hidden_states.float().pow(2).mean() for o in group).backward()
    trainer.zero_grad()
    assert len(trainer.step_times.times) == 2


def test_the_rung_choice_is_validated():
    with pytest.raises(ValueError, match="must be one of configured, escalate, adaptive"):
        TrainerRankOptions.from_env({"ART_TRAINER_RANK_RECOMPUTE": "sometimes"})
    with pytest.raises(ValueError, match="escalate_to_full_recompute=False forbids"):
        TrainerRankOptions(recompute="adaptive", escalate_to_full_recompute=False)
    assert replace(TrainerRankOptions(), escalate_to_full_recompute=False
                   ).recompute_choice == "configured"
