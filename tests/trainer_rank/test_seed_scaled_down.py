"""The seed, scaled down to CPU: selective recompute (method and num_layers none), rank-1 LoRA,
one group of two sequences with hidden states requested, no profile, and a virtual memory
limit that the seed's constant-factor formula would have admitted many times over.

Ours prices selective recompute above the limit before running anything, and either escalates
to full recompute (which then really runs inside the limit) or, with escalation off, declines
with 'selective' and the remedy in the message. The decline is checked against reality: the
same micro-batch run directly under selective recompute does run out of the virtual limit.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from art.megatron.geometry import geometry_from_hf_dict
from art.megatron.implementation import Implementation
from art.megatron.provider import Provider
from art.megatron.settings import load_settings
from art.megatron.train import TrainingRuntime
from art.trainer_rank import (
    ForwardInput,
    TrainerRank,
    TrainerRankMemoryError,
    TrainerRankOptions,
    format_stats_table,
)
from art.trainer_rank.compute.execute import run_sub_forward
from art.trainer_rank.measuring.meter import MemoryMeter

LIMIT_BYTES = 16 * 2**20
LENGTHS = (140, 116)  # one group, like the seed's two ~16-20k-token sequences
SEED_ENV = {
    "ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "1",
    "ART_MEGATRON_CONTEXT_PARALLEL_SIZE": "1",
    "ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective",
    "ART_MEGATRON_RECOMPUTE_METHOD": "none",
    "ART_MEGATRON_RECOMPUTE_NUM_LAYERS": "none",
}
GEOMETRY = geometry_from_hf_dict(
    dict(
        model_type="qwen3", num_hidden_layers=8, hidden_size=256, intermediate_size=768,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=256,
        max_position_embeddings=4096,
    ),
    name="seed-scaled-8x256",
)


def seed_formula_bytes(packed_tokens: int, output_bytes: int) -> float:
    """The old planner's estimate (quoted in the seed), blind to the recompute mode."""
    factor = max(4, min(16, GEOMETRY.num_layers // 4 + 4))
    static = packed_tokens * GEOMETRY.hidden_size * 2 * factor
    return (output_bytes + static) * 1.10


@pytest.fixture(scope="module")
def seed_runtime(megatron_process):
    provider = Provider(
        GEOMETRY,
        settings=load_settings(SEED_ENV),
        lora=LoraConfig(r=1, lora_alpha=2, target_modules=["q_proj", "k_proj", "v_proj",
                                                           "o_proj", "gate_proj", "up_proj",
                                                           "down_proj"]),
        dtype="bfloat16",
        implementation=Implementation.cpu_local(),
    )
    return provider, provider.build_model(seed=0)


def _group():
    g = torch.Generator().manual_seed(7)
    return [[ForwardInput(input_tokens=torch.randint(0, 256, (n,), generator=g), hidden_states=True)
             for n in LENGTHS]]


def _trainer(seed_runtime, **options):
    provider, model = seed_runtime
    return TrainerRank(TrainingRuntime.for_model(
        model, provider, trainer_options=TrainerRankOptions(
        test_memory_limit_bytes=LIMIT_BYTES, **options)))


def test_the_seed_formula_would_admit_this_group():
    packed = sum(LENGTHS)
    old = seed_formula_bytes(packed, output_bytes=packed * GEOMETRY.hidden_size * 2)
    assert old < LIMIT_BYTES / 10


def test_selective_really_exceeds_the_limit(seed_runtime):
    provider, model = seed_runtime
    leaves = _group()[0]
    with pytest.raises(torch.OutOfMemoryError), MemoryMeter(limit_bytes=LIMIT_BYTES):
        outs = run_sub_forward(model, leaves, implementation=provider.implementation,
                               layout=provider.layout, device=torch.device("cpu"),
                               head_chunk_tokens=2048)
        sum(o.hidden_states.float().sum() for o in outs).backward()


def test_declined_before_running_with_selective_and_the_remedy(seed_runtime):
    provider, model = seed_runtime
    trainer = _trainer(seed_runtime, escalate_to_full_recompute=False)
    forwards = []
    hook = model.decoder.register_forward_pre_hook(lambda m, a: forwards.append(1))
    try:
        with pytest.raises(TrainerRankMemoryError) as info:
            for _ in trainer.forward_micro_batches(_group()):
                pytest.fail("the group must not be yielded")
    finally:
        hook.remove()
    err = info.value
    assert forwards == []  # declined before running: no forward started
    msg = str(err)
    assert "selective recompute (core_attn)" in msg
    assert err.recompute_summary.startswith("selective")
    assert "ART_MEGATRON_RECOMPUTE_GRANULARITY=full" in err.suggestion
    assert "Under full recompute" in msg and ": fits." in msg
    assert err.predicted_peak_bytes > LIMIT_BYTES == err.usable_limit_bytes
    assert err.indices_not_run == (0,)


def test_escalates_and_then_runs_inside_the_limit(seed_runtime):
    provider, model = seed_runtime
    trainer = _trainer(seed_runtime)
    for mb in trainer.forward_micro_batches(_group()):
        assert model.config.recompute_granularity == "full"
        sum(o.hidden_states.float().pow(2).mean() for o in mb.outputs[0]).backward()
    assert model.config.recompute_granularity == "selective"
    (stats,) = trainer.stats_history
    assert stats.decision == "escalated" and stats.recompute_summary.startswith("full")
    assert stats.predicted_dynamic_bytes <= LIMIT_BYTES
    assert stats.measured_peak_bytes <= stats.predicted_dynamic_bytes
    # Priced from the trainer's own probe (layers under full recompute, this output mix's tail),
    # not from the default formulas.
    assert trainer.probe is not None and "coefficients: probe:" in stats.term_table
    assert trainer.probe.probed_tails == ["hidden_states:grad"]
    print("\n" + format_stats_table(trainer.stats_history))
    print(stats.term_table)
