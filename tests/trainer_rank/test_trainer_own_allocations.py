"""What TrainerRank allocates for itself stays inside the limit it plans with: the layers and
head tails probed on first use (measured by an outer meter, which counts everything the
trainer allocates), and the gradient snapshot kept for a caller-backward OOM
(taken before the limit is read, and subtracted from a fixed limit)."""

from __future__ import annotations

import pytest
from _trainer_helpers import loss_of, make_inputs

from art.megatron.train import TrainingRuntime
from art.trainer_rank import TrainerRank, TrainerRankMemoryError, TrainerRankOptions
from art.trainer_rank.measuring.meter import MemoryMeter

LIMIT = 6 * 2**20


def _run(trainer: TrainerRank, lengths: list[int], *, grad: bool, **outputs) -> list:
    stats = []
    for mb in trainer.forward_micro_batches(make_inputs(lengths, **outputs), no_grad=not grad):
        if grad:
            sum(loss_of(out, 1.0) for out in mb.outputs).backward()
        stats.append(mb.stats)
    return stats


def test_probe_and_first_use_head_tails_stay_under_the_limit(built):
    p, model = built
    options = TrainerRankOptions(test_memory_limit_bytes=LIMIT)
    with MemoryMeter(device="cpu") as start:
        trainer = TrainerRank(TrainingRuntime.for_model(model, p, trainer_options=options))
    assert start.peak_bytes <= LIMIT
    # Each call asks for a new grad mode and a new output mix, so the layers of its grad mode
    # and the head tail are probed inside it.
    for grad, outputs in ((True, dict(top_k=4, logits=True, hidden_states=True)),
                          (False, dict(top_k=2, logits=True, hidden_states=False))):
        before = (len(trainer.probe.probed_tails), len(trainer.probe.probed_on_first_use))
        with MemoryMeter(device="cpu") as call:
            _run(trainer, [16], grad=grad, **outputs)
        assert len(trainer.probe.probed_tails) > before[0]
        assert len(trainer.probe.probed_on_first_use) > before[1]
        assert 0 < call.peak_bytes <= LIMIT, (grad, call.peak_bytes, LIMIT)
    trainer.zero_grad()


def test_gradient_snapshot_is_taken_before_the_limit_is_read(built):
    p, model = built
    options = TrainerRankOptions(test_memory_limit_bytes=LIMIT)
    trainer = TrainerRank(TrainingRuntime.for_model(model, p, trainer_options=options))
    (first,) = _run(trainer, [24], grad=True)
    assert first.available_bytes == LIMIT  # no gradients yet: the snapshot holds nothing
    held = sum(q.grad.untyped_storage().nbytes() for q in model.parameters()
               if q.requires_grad and q.grad is not None)
    assert held > 0
    (second,) = _run(trainer, [24], grad=True)
    # The copies of the accumulated gradients are live while the micro-batch runs.
    assert second.available_bytes == LIMIT - held
    trainer.zero_grad()


def test_decline_prices_the_next_tp_size_like_the_decision(built):
    p, model = built
    options = TrainerRankOptions(test_memory_limit_bytes=LIMIT, escalate_to_full_recompute=False)
    trainer = TrainerRank(TrainingRuntime.for_model(model, p, trainer_options=options))
    assert trainer.admission.default_memory_model is not None
    with pytest.raises(TrainerRankMemoryError) as caught:
        _run(trainer, [6000], grad=True)
    msg = str(caught.value)
    assert "At TP=2 (same recompute)" in msg and "the probe's ratio to them here" in msg
