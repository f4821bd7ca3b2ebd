"""TrainerRank prices with coefficients its own start-up probe measured (not the default
formulas): layers for the configured policy at start-up and for the other rungs on first
use, head tails per output mix on first use; the
probe leaves the caller's gradients and RNG alone; it can be turned off; it is cached on disk."""

from __future__ import annotations

import pytest
import torch
from _trainer_helpers import grads, make_inputs

from art.megatron.train import TrainingRuntime
from art.trainer_rank import TrainerRank, TrainerRankOptions
from art.trainer_rank._request import MicroBatchShape, OutputRequest
from art.trainer_rank.measuring.probing import (
    LOGPROBS,
    MIN_PROBE_POINTS,
    _model_state_kept,
    probe_tokens_for_limit,
)
from art.trainer_rank.pricing.model import MemoryModel

LIMIT = 16 * 2**20  # small: the probe stops at a few hundred tokens


def test_trainer_prices_with_probe_coefficients_and_probes_new_output_mixes_on_first_use(built):
    p, model = built
    trainer = TrainerRank(TrainingRuntime.for_model(model, p,
                          trainer_options=TrainerRankOptions(test_memory_limit_bytes=LIMIT)))
    assert trainer.probe is not None and trainer.probe.probed_tails == []
    # Nothing is probed when the trainer is built: the configured policy's grad modes, its
    # no-grad modes and the full-recompute escalation policy's modes each wait for the first
    # estimate that asks for one.
    assert trainer.probe.layers.layers == () and trainer.probe.modes == []
    groups = [{(m.mode.grad, m.mode.full_layers) for m in group}
              for group in trainer.probe.pending_groups]
    assert groups[:2] == [{(True, 0)}, {(False, 0)}]
    assert any({(True, 1)} <= group for group in groups[2:])
    grad_group = trainer.probe.pending_groups[0]
    mbs = list(trainer.forward_micro_batches(make_inputs([6, 9], top_k=2, logits=False,
                                                         hidden_states=False), no_grad=True))
    assert trainer.probe.probed_tails == ["logprobs,top_k=2:no-grad"]
    assert all("coefficients: probe:" in mb.stats.term_table for mb in mbs)
    # A scoring call probed the no-grad modes only.
    assert {m.split(":", 1)[1] for m in trainer.probe.probed_on_first_use} == {"nograd"}
    shape = MicroBatchShape((64,), outputs=OutputRequest(logits=True), grad_enabled=True)
    configured = trainer.admission.memory_model.estimate(shape)
    assert {m.split(":", 1)[1] for m in trainer.probe.probed_on_first_use} == {
        "nograd", "sel:core_attn"}
    # The key TP ranks agree on before probing a group is the probe's own.
    assert trainer.probe._key(grad_group, (), trainer.probe._points(LOGPROBS, False),
                              trainer.probe._points(LOGPROBS, True)
                              ) in trainer.probe.key.split("+")
    escalated = trainer.admission.memory_model.with_recompute(trainer.admission.full_recompute)
    assert escalated.estimate(shape).coefficients_source.startswith("probe:")
    assert trainer.probe.probed_tails[-1] == "logits:grad"
    assert trainer.probe.pending_modes == []
    assert any(m.endswith(":full:1") for m in trainer.probe.probed_on_first_use)
    full_probed = {mode for kind, mode, _ in trainer.probe.layers.layers}
    assert "full:1" in full_probed and "none" in full_probed
    # Probing them later changes no price the configured policy had.
    assert trainer.admission.memory_model.estimate(shape).peak_bytes == configured.peak_bytes


def test_an_oom_in_a_probe_on_first_use_is_a_memory_error_that_names_the_probe(built,
                                                                               monkeypatch):
    """On a replica of one rank an OOM while a call probes a layer on first use ends the
    call with a TrainerRankMemoryError naming the probe and its remedies; the layer mode
    stays pending, and a later call probes it and runs."""
    from art.trainer_rank import TrainerRankMemoryError
    from art.trainer_rank.measuring import probe as probe_module
    from art.trainer_rank.measuring import probe_runs

    p, model = built
    # Nothing this process measured before is reused: the probe runs its points.
    monkeypatch.setattr(probe_module, "_CACHE", {})
    monkeypatch.setattr(probe_module, "_PARTS", {})
    trainer = TrainerRank(TrainingRuntime.for_model(model, p, trainer_options=TrainerRankOptions(
        test_memory_limit_bytes=LIMIT, probe_cache=False)))
    real = probe_runs._metered_run

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("injected: out of memory in a probe point")

    monkeypatch.setattr(probe_runs, "_metered_run", out_of_memory)
    with pytest.raises(TrainerRankMemoryError) as caught:
        list(trainer.forward_micro_batches(make_inputs([6, 9]), no_grad=True))
    message = str(caught.value)
    assert "ran out of memory while probing the model on first use" in message
    assert "ART_TRAINER_RANK_PROBE_LAYERS=false" in message
    assert "process groups are closed" not in message
    assert trainer.probe.pending_groups[1][0].mode.key == "nograd"
    monkeypatch.setattr(probe_runs, "_metered_run", real)
    mbs = list(trainer.forward_micro_batches(make_inputs([6, 9]), no_grad=True))
    assert sum(len(mb.outputs) for mb in mbs) == 2
    assert any(m.endswith(":nograd") for m in trainer.probe.probed_on_first_use)


def test_probe_off_prices_with_the_default_formulas(built, monkeypatch):
    p, model = built
    monkeypatch.setenv("ART_TRAINER_RANK_PROBE_LAYERS", "false")
    monkeypatch.setenv("ART_TRAINER_RANK_TEST_MEMORY_LIMIT_BYTES", str(LIMIT))
    trainer = TrainerRank(TrainingRuntime.for_model(model, p))
    assert trainer.options.probe_layers is False and trainer.probe is None
    shape = MicroBatchShape((64,), outputs=OutputRequest(target_logprobs=True),
                            grad_enabled=True)
    assert trainer.memory_model.estimate(shape).coefficients_source == "defaults"
    monkeypatch.setenv("ART_TRAINER_RANK_PROBE_LAYERS", "sometimes")
    with pytest.raises(ValueError, match="ART_TRAINER_RANK_PROBE_LAYERS"):
        TrainerRankOptions.from_env()


def test_probe_keeps_the_callers_gradients_and_random_stream(built):
    p, model = built
    for i, param in enumerate(q for q in model.parameters() if q.requires_grad):
        param.grad = torch.full_like(param, float(i))
    before = grads(model)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    with _model_state_kept(model):
        out = model(torch.randint(0, 256, (1, 8)), torch.arange(8).view(1, 8),
                    attention_mask=None)
        out.float().mean().backward()  # the probe's backward accumulates into the adapters
        torch.rand(100)
    assert torch.equal(torch.rand(3), expected)
    after = grads(model)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    for param in model.parameters():
        param.grad = None


def test_probe_points_follow_the_limit_and_are_cached_on_disk(built, tmp_path):
    p, model = built
    defaults = MemoryModel.for_provider(p)
    small = probe_tokens_for_limit(model, p.implementation, defaults, 1)
    assert len(small) == MIN_PROBE_POINTS
    roomy = probe_tokens_for_limit(model, p.implementation, defaults, 2**40)
    assert len(roomy) > len(small) and roomy[:MIN_PROBE_POINTS] == small
    options = TrainerRankOptions(test_memory_limit_bytes=LIMIT,
                                 profile_path=str(tmp_path / "profiles.json"))
    trainer = TrainerRank(TrainingRuntime.for_model(model, p, trainer_options=options))
    trainer.memory_model.estimate(MicroBatchShape(
        (32,), outputs=OutputRequest(target_logprobs=True), grad_enabled=True))
    # Next to the profile file: the layers' coefficients and the tail probed on first use.
    assert len(list(tmp_path.glob("probe-*.json"))) == 2


def test_a_tail_is_measured_out_to_the_rows_priced_and_further_only_for_a_longer_one(
        built, monkeypatch):
    """The tail is measured past the layers' points at the head chunk's multiples, but only
    out to the first multiple the rows priced so far reach: the cold cap's search, which
    prices rows up to the limit, prices them by the formulas and measures nothing. A longer
    row priced later measures the tail further out, and only at its new rows."""
    from art.trainer_rank.measuring import probe as probe_module

    chunk = 4096
    p, model = built
    probe_module.forget_in_process_probes()
    measured: list[int] = []
    real = probe_module.measure_tail

    def counted(model, inputs, *args, **kwargs):
        measured.append(int(inputs.rows))
        return real(model, inputs, *args, **kwargs)

    monkeypatch.setattr(probe_module, "measure_tail", counted)
    trainer = TrainerRank(TrainingRuntime.for_model(model, p, trainer_options=TrainerRankOptions(
        test_memory_limit_bytes=LIMIT, head_chunk_tokens=chunk)))
    probe = trainer.probe
    # The limit admits tails far longer than the layers' points reach.
    assert max(probe._points(LOGPROBS, False)) < chunk
    assert probe._tail_max_tokens(LOGPROBS, False) >= 3 * chunk
    list(trainer.forward_micro_batches(make_inputs([6, 9], top_k=None, logits=False,
                                                   hidden_states=False), no_grad=True))
    (tail, extent), = probe.tails.values()
    assert extent == chunk and max(measured) == chunk
    first = len(measured)
    shape = MicroBatchShape((int(2.5 * chunk),), outputs=LOGPROBS, grad_enabled=False)
    trainer.admission.memory_model.estimate(shape)
    (tail, extent), = probe.tails.values()
    assert extent == 3 * chunk
    assert sorted(measured[first:]) == [int(1.5 * chunk), 2 * chunk, 3 * chunk]
    assert probe.probed_tails == ["logprobs:no-grad"] * 2
    # A row no longer than the extent measures nothing more.
    trainer.admission.memory_model.estimate(
        MicroBatchShape((3 * chunk - 5,), outputs=LOGPROBS, grad_enabled=False))
    assert len(probe.probed_tails) == 2
