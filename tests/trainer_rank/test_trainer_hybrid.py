"""TrainerRank runs the tiny hybrid (Gated DeltaNet + attention, LoRA on o_proj and the MLP)
through forward_micro_batches under each recompute policy kind, within an OOM-free virtual
limit, priced by its start-up probe and measured per micro-batch (seeded random lengths):
predicted/measured within [1.00, 1.05] for every micro-batch, the cold-capped first one and
the profile-corrected later ones included. The Gated DeltaNet kernels pad each sequence to
whole 64-token chunks, so these small rows sit on the steps the chunked fit prices
(pricing/chunked.py)."""

from __future__ import annotations

import random

import pytest
import torch
from peft import LoraConfig

from art.megatron.implementation import Implementation
from art.megatron.provider import Provider
from art.megatron.settings import load_settings
from art.megatron.train import TrainingRuntime
from art.trainer_rank import ForwardInput, TrainerRank, TrainerRankOptions

LIMIT = 48 * 2**20  # far above these micro-batches: nothing is split or escalated
# Each recompute policy kind; the recompute reality test covers which modules re-run. The
# first grad micro-batch also allocates the LoRA gradients (None before the first backward):
# its estimate carries them as first_gradient_allocation_bytes.
POLICIES = [
    ("none", None, None, None),
    ("selective", None, None, None),  # Megatron's default: core_attn
    ("selective", None, None, "mlp"),
    ("selective", None, None, "core_attn,mlp,layernorm"),
    # Units of two layers: the second holds a Gated DeltaNet and the attention layer.
    ("full", "uniform", "2", None),
    ("full", "block", "2", None),
]


def _provider(granularity, method, num_layers, modules) -> Provider:
    env = {"ART_MEGATRON_RECOMPUTE_GRANULARITY": granularity,
           "ART_MEGATRON_RECOMPUTE_METHOD": method or "none",
           "ART_MEGATRON_RECOMPUTE_NUM_LAYERS": num_layers or "none"}
    if modules:
        env["ART_MEGATRON_RECOMPUTE_MODULES"] = modules
    return Provider("tiny-qwen3_5", settings=load_settings(env), dtype="float32",
                    implementation=Implementation.cpu_local(),
                    lora=LoraConfig(r=4, lora_alpha=4, lora_dropout=0.0,
                                    target_modules=["o_proj", "gate_proj", "up_proj",
                                                    "down_proj"]))


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: "-".join(x for x in p if x))
def test_hybrid_runs_every_policy_within_an_oom_free_limit(megatron_process, policy):
    p = _provider(*policy)
    model = p.build_model(seed=0)
    trainer = TrainerRank(TrainingRuntime.for_model(
        model, p, trainer_options=TrainerRankOptions(test_memory_limit_bytes=LIMIT)))
    rng = random.Random(f"hybrid {policy}")
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    batches = []
    for _ in range(2):  # the second call plans with the profile the first one recorded
        inputs = [ForwardInput(input_tokens=torch.randint(0, 256, (n,), generator=g),
                               target_tokens=torch.randint(0, 256, (n,), generator=g))
                  for n in (rng.randint(40, 300) for _ in range(4))]
        for mb in trainer.forward_micro_batches(inputs):
            loss = sum(-(out.target_logprobs.sum()) for out in mb.outputs)
            loss.backward()
            del loss
            batches.append(mb)
    # The measured peak (through the caller's backward) is filled in, when the loop resumes,
    # in the trainer's records of the yielded stats.
    records = trainer.stats_history
    assert len(records) == len(batches)
    ratios = []
    for stats in records:
        assert stats.measured_peak_bytes, stats
        assert "coefficients: probe:" in stats.term_table
        assert stats.measured_peak_bytes <= stats.usable_limit_bytes
        assert stats.retries == 0 and stats.decision != "escalated", stats
        ratios.append(stats.predicted_dynamic_bytes / stats.measured_peak_bytes)
    # `pytest -s` prints the figures the closing notes quote.
    print("predicted/measured", "-".join(x for x in policy if x),
          [(stats.packed_tokens, stats.decision, round(r, 3))
           for stats, r in zip(records, ratios)])
    assert sum(len(mb.indices) for mb in batches) == 2 * len(inputs)
    assert any(mb.stats.local_count > 1 for mb in batches)  # packed rows are priced too
    assert all(1.0 <= ratio <= 1.05 for ratio in ratios), [
        (mb.stats.packed_tokens, mb.stats.decision, round(r, 3)) for mb, r in zip(batches, ratios)]
    lora_grads = [q.grad for n, q in model.named_parameters() if "lora" in n]
    assert lora_grads and all(gr is not None and torch.isfinite(gr).all() for gr in lora_grads)


def test_packed_sequences_do_not_see_each_other_through_gated_delta_net_layers(megatron_process):
    """Two sequences in one packed micro-batch: each one's log-probs equal running it alone
    (Megatron's GatedDeltaNet runs a row as one sequence; the layer hands the row's sequences
    to the conv and the delta rule)."""
    p = _provider("none", None, None, None)
    trainer = TrainerRank(TrainingRuntime.for_model(
        p.build_model(seed=0), p,
        trainer_options=TrainerRankOptions(test_memory_limit_bytes=LIMIT, probe_layers=False)))
    g = torch.Generator().manual_seed(1)
    a, b = (ForwardInput(input_tokens=torch.randint(0, 256, (n,), generator=g),
                         target_tokens=torch.randint(0, 256, (n,), generator=g)) for n in (70, 45))
    with torch.no_grad():
        together = [mb for mb in trainer.forward_micro_batches([a, b])]
        alone = [mb for mb in trainer.forward_micro_batches([b])]
    assert len(together) == 1 and together[0].stats.local_count == 2
    torch.testing.assert_close(together[0].outputs[1].target_logprobs,
                               alone[0].outputs[0].target_logprobs, rtol=1e-5, atol=1e-5)


def test_a_hybrid_probe_cut_short_by_the_limit_keeps_what_its_fit_needs(megatron_process):
    """Under a limit that admits no probe point the probe still measures its fewest points;
    for a hybrid those include three whole-chunk points and one inside a chunk, which its
    Gated DeltaNet fit needs (with one whole point every larger row would be priced at it)."""
    from art.trainer_rank.measuring.probing import probe_tokens_for_limit
    from art.trainer_rank.pricing.model import MemoryModel

    p = _provider("none", None, None, None)
    model = p.build_model(seed=0)
    points = probe_tokens_for_limit(model, p.implementation, MemoryModel.for_provider(p), 1)
    assert sum(1 for t in points if t % 64 == 0) == 3 and any(t % 64 for t in points), points
