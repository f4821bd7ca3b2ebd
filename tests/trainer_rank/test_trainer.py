"""TrainerRank on a real Megatron-Core model on CPU (tiny, fp32): packed micro-batches equal
an unpacked one-sequence-at-a-time reference (outputs and gradients); splitting, escalation
and run-time OOM retries do not change results, lose nothing and duplicate nothing."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _trainer_helpers import (
    StandInModel,
    grads,
    loss_of,
    make_inputs,
    provider,
    reference,
    zero_grads,
)

from art.megatron.train import TrainingRuntime
from art.trainer_rank import TrainerRank, TrainerRankMemoryError, TrainerRankOptions
from art.trainer_rank.compute.items import make_items

ATOL = 2e-5


@pytest.fixture(scope="module")
def built(megatron_process):
    p = provider("selective")
    return p, p.build_model(seed=0)


def _leaves(value):
    return [value] if not isinstance(value, list) else [x for v in value for x in _leaves(v)]


def _check_output(model, x, out, *, with_grad_outputs=True):
    with torch.no_grad():
        ref = reference(model, x)
    torch.testing.assert_close(out.target_logprobs, ref["target_logprobs"], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.top_k.logprobs, ref["top_k_logprobs"], atol=ATOL, rtol=0)
    assert torch.equal(out.top_k.tokens, ref["top_k_tokens"])
    torch.testing.assert_close(out.logits, ref["logits"], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.hidden_states, ref["hidden_states"], atol=ATOL, rtol=0)


def _reference_grads(model, leaves, weights):
    zero_grads(model)
    for x, w in zip(leaves, weights):
        loss_of(type("O", (), {"target_logprobs": reference(model, x)["target_logprobs"]}), w
                ).backward()
    out = grads(model)
    zero_grads(model)
    return out


def allocated_zero_grads(model) -> None:
    for q in model.parameters():
        if q.requires_grad:
            q.grad = torch.zeros_like(q)


def _run(trainer, inputs, weights, *, no_grad=None):
    """Drive forward_micro_batches like a training loop; returns outputs by index."""
    seen: dict[int, object] = {}
    leaf_weight = iter(weights)
    index_weights = {}
    for i, value in enumerate(inputs):
        index_weights[i] = [next(leaf_weight) for _ in _leaves(value)]
    for mb in trainer.forward_micro_batches(inputs, no_grad=no_grad):
        assert not set(mb.indices) & set(seen), "an item was yielded twice"
        if no_grad is not True:
            loss = sum(
                loss_of(o, w)
                for index, out in zip(mb.indices, mb.outputs)
                for o, w in zip(_leaves(out), index_weights[index])
            )
            loss.backward()
        seen.update(zip(mb.indices, mb.outputs))
    return seen


def test_packed_outputs_and_grads_equal_the_unpacked_reference(built):
    p, model = built
    trainer = TrainerRank(TrainingRuntime.for_model(model, p,
                          trainer_options=TrainerRankOptions(test_memory_limit_bytes=16 * 2**20)))
    xs = make_inputs([5, 9, 7, 12, 6])
    inputs = [xs[0], [xs[1], xs[2]], xs[3], [[xs[4]]]]
    weights = [1.0, 0.5, 2.0, -1.0, 0.25]
    zero_grads(model)
    seen = _run(trainer, inputs, weights)
    got = grads(model)
    assert sorted(seen) == [0, 1, 2, 3]
    assert isinstance(seen[1], list) and isinstance(seen[3][0], list)  # nesting mirrored
    for x, out in zip(xs, [o for i in range(4) for o in _leaves(seen[i])]):
        _check_output(model, x, out)
    want = _reference_grads(model, xs, weights)
    assert got.keys() == want.keys() and len(got) > 0
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)
    stats = trainer.stats_history
    assert stats[0].decision == "cold-capped"
    assert all(s.measured_peak_bytes and s.measured_peak_bytes > 0 for s in stats)
    assert sum(s.logical_tokens for s in stats) == sum(x.num_tokens for x in xs)


def test_no_grad_split_equals_the_whole_group(built):
    p, model = built
    xs = make_inputs([20, 24, 18, 22], seed=1, no_grad=True)
    roomy = TrainerRank(TrainingRuntime.for_model(model, p,
                        trainer_options=TrainerRankOptions(test_memory_limit_bytes=16 * 2**20)))
    group = make_items([xs])[0]
    pricing, _, _ = roomy.admission.price(group.leaves, False)  # nothing learned yet
    one, _, _ = roomy.admission.price(group.leaves[:1], False)
    whole = roomy.dp_rank_forward([xs])[0]
    limit = pricing.dynamic_bytes - 1
    assert one.dynamic_bytes < limit
    tight = TrainerRank(TrainingRuntime.for_model(model, p,
                        trainer_options=TrainerRankOptions(test_memory_limit_bytes=limit)))
    mbs = list(tight.forward_micro_batches([xs], no_grad=True))
    assert len(mbs) == 1 and mbs[0].stats.decision == "split" and mbs[0].stats.sub_forwards > 1
    split = mbs[0].outputs[0]
    for a, b, x in zip(whole, split, xs):
        torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(a.target_logprobs, b.target_logprobs, atol=1e-5, rtol=0)
        _check_output(model, x, b)


def test_escalation_runs_full_recompute_and_changes_nothing(built):
    p, model = built
    # Stand-in prices: selective needs far more than the limit, full recompute fits. The
    # decision is forced so the test can check what escalation does to a real model.
    priced = StandInModel({"selective": 10**9, "full": 1, "no-grad": 1}, "selective")
    trainer = TrainerRank(TrainingRuntime.for_model(model, p, memory_model=priced,
                          trainer_options=TrainerRankOptions(test_memory_limit_bytes=16 * 2**20)))
    xs = make_inputs([11, 13], seed=2)
    calls = []
    hook = model.decoder.layers[0].register_forward_pre_hook(lambda m, a: calls.append(1))
    zero_grads(model)
    try:
        mbs = []
        for mb in trainer.forward_micro_batches([[xs[0], xs[1]]]):
            assert model.config.recompute_granularity == "full"
            (loss_of(mb.outputs[0][0], 1.0) + loss_of(mb.outputs[0][1], 0.5)).backward()
            mbs.append(mb)
    finally:
        hook.remove()
    got = grads(model)
    assert [mb.stats.decision for mb in mbs] == ["escalated"]
    assert "full recompute" in mbs[0].stats.recompute_summary
    assert len(calls) == 2  # forward, then the recompute inside backward
    assert model.config.recompute_granularity == "selective"
    assert model.decoder.layers[0].self_attention.checkpoint_core_attention is True
    for x, out in zip(xs, mbs[0].outputs[0]):
        _check_output(model, x, out)
    want = _reference_grads(model, xs, [1.0, 0.5])
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)


def test_runtime_oom_is_retried_smaller_without_loss_or_duplication(built):
    p, model = built
    # Stand-in under-predicts (1 byte per token), so admission packs everything and the
    # virtual limit raises a real OutOfMemoryError inside the forward.
    priced = StandInModel({"selective": 1, "full": 1, "no-grad": 1}, "selective")
    xs = make_inputs([40, 36, 44, 38], seed=3, no_grad=True)
    peaks = {}
    for n in (1, 4):  # a fresh trainer each: nothing learned, so all n items run at once
        roomy = TrainerRank(TrainingRuntime.for_model(model, p, memory_model=priced,
                            trainer_options=TrainerRankOptions(test_memory_limit_bytes=16 * 2**20)))
        (mb,) = list(roomy.forward_micro_batches(xs[:n], no_grad=True))
        assert mb.stats.measured_peak_bytes is None  # measured after the caller's turn
        (record,) = roomy.stats_history
        assert record == replace(mb.stats, measured_peak_bytes=record.measured_peak_bytes)
        peaks[n] = record.measured_peak_bytes
    assert peaks[4] > peaks[1]
    limit = (peaks[1] + peaks[4]) // 2
    tight = TrainerRank(TrainingRuntime.for_model(model, p, memory_model=priced,
                        trainer_options=TrainerRankOptions(test_memory_limit_bytes=limit)))
    seen = _run(tight, xs, [1.0] * 4, no_grad=True)
    assert sorted(seen) == [0, 1, 2, 3]
    for x, i in zip(xs, range(4)):
        _check_output(model, x, seen[i])
    assert max(s.retries for s in tight.stats_history) >= 1
    assert all(s.measured_peak_bytes <= limit for s in tight.stats_history)


def test_caller_backward_oom_restores_grads_and_retries(built):
    p, model = built
    # Stand-in under-predicts so the forward is admitted whole; the virtual limit sits between
    # the forward's peak and the caller-backward's peak, so the OOM happens in the caller.
    priced = StandInModel({"selective": 1, "full": 1, "no-grad": 1}, "selective")
    xs = make_inputs([30, 34], seed=4, logits=False, hidden_states=False, top_k=None)
    roomy = TrainerRank(TrainingRuntime.for_model(model, p, memory_model=priced,
                        trainer_options=TrainerRankOptions(test_memory_limit_bytes=16 * 2**20)))
    # Gradients allocated (zero) beforehand: the under-prediction is the stand-in's alone, not
    # first_gradient_allocation_bytes, which prices gradients a backward allocates anew.
    allocated_zero_grads(model)
    roomy.dp_rank_forward([xs])  # grad: the measured peak is the forward's alone
    forward_peak = roomy.stats_history[-1].measured_peak_bytes
    allocated_zero_grads(model)
    _run(roomy, [xs], [1.0, 1.0])
    full_peak = roomy.stats_history[-1].measured_peak_bytes
    assert full_peak > forward_peak
    # The trainer lowers a fixed limit by its gradient snapshot (a copy of these gradients).
    snapshot = sum(q.numel() * q.element_size() for q in model.parameters() if q.requires_grad)
    limit = (forward_peak + full_peak) // 2 + snapshot
    tight = TrainerRank(TrainingRuntime.for_model(model, p, memory_model=priced,
                        trainer_options=TrainerRankOptions(test_memory_limit_bytes=limit)))
    allocated_zero_grads(model)
    yielded = []
    for mb in tight.forward_micro_batches([xs]):
        yielded.append(mb.stats.decision)
        try:
            sum(loss_of(o, 1.0) for o in mb.outputs[0]).backward()
        except torch.OutOfMemoryError:
            yielded.append("caller-oom")
            continue
    got = grads(model)
    assert yielded[:2] == ["cold-capped", "caller-oom"] and yielded[-1] == "escalated"
    want = _reference_grads(model, xs, [1.0, 1.0])
    for name in want:  # the partial gradients of the failed backward were undone
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)


def test_profiles_persist_and_a_second_run_starts_warm(built, tmp_path):
    p, model = built
    path = tmp_path / "profiles.json"
    options = TrainerRankOptions(test_memory_limit_bytes=16 * 2**20, profile_path=str(path))
    xs = make_inputs([8, 10, 9], seed=5, logits=False, hidden_states=False, top_k=None,
                     no_grad=True)
    first = TrainerRank(TrainingRuntime.for_model(model, p, trainer_options=options))
    list(first.forward_micro_batches(xs))
    assert first.stats_history[0].decision == "cold-capped" and path.exists()
    second = TrainerRank(TrainingRuntime.for_model(model, p, trainer_options=options))
    outs = second.dp_rank_forward(xs)
    assert [s.decision for s in second.stats_history] == ["admitted"]
    assert len(outs) == 3 and all(o.target_logprobs is not None for o in outs)
    assert outs[0].logits is None and outs[0].hidden_states is None  # only what was asked


def test_dp_rank_forward_with_grad_keeps_caller_order_and_backprops(built):
    p, model = built
    trainer = TrainerRank(TrainingRuntime.for_model(model, p,
                          trainer_options=TrainerRankOptions(test_memory_limit_bytes=16 * 2**20)))
    xs = make_inputs([6, 4, 7], seed=6)
    zero_grads(model)
    outs = trainer.dp_rank_forward([xs[0], [xs[1], xs[2]]])
    assert isinstance(outs[1], list) and len(outs[1]) == 2
    (loss_of(outs[0], 1.0) + loss_of(outs[1][0], 1.0) + loss_of(outs[1][1], 1.0)).backward()
    got = grads(model)
    want = _reference_grads(model, xs, [1.0, 1.0, 1.0])
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)
    for x, out in zip(xs, [outs[0], *outs[1]]):
        _check_output(model, x, out)


def test_when_the_smallest_form_ooms_the_error_is_chained_to_the_oom(built):
    p, model = built
    # Stand-in under-predicts; the virtual limit is below any forward of this model.
    priced = StandInModel({"selective": 1, "full": 1, "no-grad": 1}, "selective")
    trainer = TrainerRank(TrainingRuntime.for_model(model, p, memory_model=priced,
                          trainer_options=TrainerRankOptions(test_memory_limit_bytes=4096)))
    xs = make_inputs([16], seed=7, no_grad=True)
    with pytest.raises(TrainerRankMemoryError) as info:
        list(trainer.forward_micro_batches(xs))
    err = info.value
    assert isinstance(err.__cause__, torch.OutOfMemoryError)
    assert "ran out of memory at run time" in str(err) and err.indices_not_run == (0,)
    assert trainer.stats_history == []


def test_grad_forward_on_an_eval_mode_model_is_refused(built):
    from art.trainer_rank import TrainerRankRuntimeSupportError

    p, model = built
    trainer = TrainerRank(TrainingRuntime.for_model(model, p,
                          trainer_options=TrainerRankOptions(test_memory_limit_bytes=16 * 2**20)))
    model.eval()
    try:
        with pytest.raises(TrainerRankRuntimeSupportError, match="model.train"):
            list(trainer.forward_micro_batches(make_inputs([4])))
        assert len(list(trainer.forward_micro_batches(make_inputs([4]), no_grad=True))) == 1
    finally:
        model.train()


def test_options_default_to_the_environment(built, monkeypatch, tmp_path):
    p, model = built
    monkeypatch.setenv("ART_TRAINER_RANK_TEST_MEMORY_LIMIT_BYTES", str(16 * 2**20))
    monkeypatch.setenv("ART_TRAINER_RANK_PROFILE_PATH", str(tmp_path / "p.json"))
    trainer = TrainerRank(TrainingRuntime.for_model(model, p))
    assert trainer.usable_limit_bytes() == 16 * 2**20
    list(trainer.forward_micro_batches(make_inputs([5], no_grad=True)))
    assert (tmp_path / "p.json").exists()
    monkeypatch.setenv("ART_TRAINER_RANK_TRUST_WINDOWS", "2")
    with pytest.raises(ValueError, match="ART_TRAINER_RANK_TRUST_WINDOW"):
        TrainerRank(TrainingRuntime.for_model(model, p))
