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


def test_the_rung_choice_is_validated():
    with pytest.raises(ValueError, match="must be one of configured, escalate, adaptive"):
        TrainerRankOptions.from_env({"ART_TRAINER_RANK_RECOMPUTE": "sometimes"})
    with pytest.raises(ValueError, match="escalate_to_full_recompute=False forbids"):
        TrainerRankOptions(recompute="adaptive", escalate_to_full_recompute=False)
    assert replace(TrainerRankOptions(), escalate_to_full_recompute=False
                   ).recompute_choice == "configured"
