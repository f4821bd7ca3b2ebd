"""dp_rank_forward with grad as upstream runs it: the whole call when it fits, else 2, 4, ...
sub-forwards of whole items whose graphs all live until the caller's backward (priced so, and
measured so through the caller's backward); a single item that fits in no form is declined
naming dp_rank_forward; a sub-forward that fails after others ran raises
TrainerRankPartialExecutionError. Real Megatron-Core model on CPU (tiny, fp32), default
probe's coefficients, the CPU meter's virtual limit."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from _trainer_helpers import VOCAB, grads, loss_of, make_inputs, zero_grads
from peft import LoraConfig

from art.megatron.implementation import Implementation
from art.megatron.provider import Provider
from art.megatron.settings import load_settings
from art.megatron.train import TrainingRuntime
from art.trainer_rank import (
    TrainerRank,
    TrainerRankMemoryError,
    TrainerRankOptions,
    TrainerRankPartialExecutionError,
)
from art.trainer_rank.compute.items import make_items
from art.trainer_rank.decide.held_split import price_held_split, token_balanced_chunks
from art.trainer_rank.measuring.device import GradSnapshot
from art.trainer_rank.measuring.meter import MemoryMeter

from _tiny import tiny_dense

LENGTHS = [300, 290, 310, 300]  # four separate items, as the call


@pytest.fixture(scope="module")
def built(megatron_process, tmp_path_factory):
    # A frozen base with a LoRA on every linear: what the memory model prices.
    p = Provider(tiny_dense(vocab=VOCAB),
                 settings=load_settings({"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective"}),
                 dtype="float32", implementation=Implementation.cpu_local(),
                 lora=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                 target_modules="all-linear"))
    return p, p.build_model(seed=0), str(tmp_path_factory.mktemp("probes"))


def _trainer(p, model, limit: int, memory_model: Any = None, probe_dir: str | None = None
             ) -> TrainerRank:
    # The probe's coefficients (measured once, then read from the cache folder): what a held
    # split keeps is each layer's measured kept bytes.
    return TrainerRank(TrainingRuntime.for_model(
        model, p, memory_model=memory_model,
        trainer_options=TrainerRankOptions(test_memory_limit_bytes=limit,
                                           probe_cache_dir=probe_dir)))


def _prices(trainer: TrainerRank, xs) -> dict[int, int]:
    """The call's dynamic peak, whole and in 2 and 4 held sub-forwards."""
    items = make_items(xs)
    return {k: price_held_split(trainer.admission, token_balanced_chunks(items, k), True)[0]
            .dynamic_bytes for k in (1, 2, 4)}


def _zero_allocated_grads(model) -> None:
    # Gradients that exist before the call: none is allocated by its backward, so the prices
    # computed here and the trainer's own agree (first_gradient_allocation_bytes = 0).
    for q in model.parameters():
        if q.requires_grad:
            q.grad = torch.zeros_like(q)


def _run(trainer: TrainerRank, xs) -> tuple[list[Any], dict[str, torch.Tensor], int]:
    """dp_rank_forward, then the caller's backward; the dynamic peak of both, measured, less
    the trainer's gradient snapshot (a copy of the adapters' gradients it takes before the
    call, so a backward that runs out of memory can be undone): the trainer lowers the limit
    by it rather than pricing it."""
    _zero_allocated_grads(trainer.model)
    snapshot = GradSnapshot.expected_bytes(trainer.model)
    with MemoryMeter() as meter:
        outs = trainer.dp_rank_forward(xs)
        loss = sum(loss_of(out, 1.0) for out in outs)
        loss.backward()
        del loss
    return outs, grads(trainer.model), meter.peak_bytes - snapshot


def test_token_balanced_chunks_keep_items_whole_and_in_order():
    items = make_items(make_inputs([10, 50, 20, 20, 5, 40], no_grad=False))
    for count in range(1, 7):
        chunks = token_balanced_chunks(items, count)
        assert len(chunks) == count
        assert [it.index for chunk in chunks for it in chunk] == list(range(6))
    # 145 tokens: the cut nearest 72.5 falls after 80 (items 0-2), not after 60.
    assert [[it.index for it in c] for c in token_balanced_chunks(items, 2)] == [[0, 1, 2],
                                                                                [3, 4, 5]]
    four = make_items(make_inputs([300, 290, 310, 300], no_grad=False))
    assert [len(c) for c in token_balanced_chunks(four, 2)] == [2, 2]


def test_a_call_that_fits_only_split_runs_as_held_sub_forwards(built):
    p, model, probes = built
    xs = make_inputs(LENGTHS, seed=7, top_k=None, logits=False, hidden_states=False)
    roomy = _trainer(p, model, 1 << 34, probe_dir=probes)
    prices = _prices(roomy, xs)
    assert prices[1] > prices[2] >= prices[4] > 0, prices
    whole_outs, whole_grads, _ = _run(roomy, xs)
    assert roomy.stats_history[-1].subforward_count == 1

    # A limit the whole call does not fit but two held sub-forwards do.
    limit = (prices[1] + prices[2]) // 2
    tight = _trainer(p, model, limit, probe_dir=probes)
    outs, got, measured = _run(tight, xs)
    stats = tight.stats_history[-1]
    assert (stats.decision, stats.subforward_count) == ("split", 2), stats
    assert stats.estimated_required_bytes == prices[2] <= limit
    assert "held by the other sub-forwards" in stats.term_table
    for a, b in zip(outs, whole_outs):
        torch.testing.assert_close(a.target_logprobs, b.target_logprobs, atol=2e-5, rtol=0)
    assert got.keys() == whole_grads.keys() and got
    for name in got:
        torch.testing.assert_close(got[name], whole_grads[name], atol=1e-5, rtol=1e-4)
    # Priced with every graph held through the caller's backward: at or a little above what
    # the forward and the backward really reached together.
    ratio = stats.estimated_required_bytes / measured
    print(f"held split: predicted {stats.estimated_required_bytes} measured {measured} "
          f"ratio {ratio:.4f}; whole {prices[1]} limit {limit}")
    assert 1.0 <= ratio <= 1.05, (stats.estimated_required_bytes, measured)
    assert measured <= limit


def test_a_single_item_that_fits_no_split_is_declined_naming_dp_rank_forward(built):
    p, model, probes = built
    (x,) = make_inputs([400], seed=8, top_k=None, logits=False, hidden_states=False)
    roomy = _trainer(p, model, 1 << 34, probe_dir=probes)
    price = _prices(roomy, [x])[1]
    full = roomy.admission.full_recompute
    tight = _trainer(p, model, price // 4, probe_dir=probes)
    assert full is not None
    with pytest.raises(TrainerRankMemoryError) as info:
        tight.dp_rank_forward([x])
    message = str(info.value)
    assert message.startswith("dp_rank_forward: the request (1 item(s), 1 sequence(s), 400 "
                              "logical tokens, grad)"), message
    assert "a single item cannot be split" in message and "item -1" not in message
    assert "separate top-level items" not in message
    assert info.value.indices_not_run == (0,)
    assert info.value.usable_limit_bytes == price // 4
    assert tight.stats_history == []


@dataclass
class UnderPricing:
    """A stand-in that scales the real memory model's estimates by `factor` (< 1): the only way
    to have admission accept a split that then runs out of memory in its second sub-forward."""

    model: Any
    factor: float

    def estimate(self, shape):
        e = self.model.estimate(shape)

        def s(n: int) -> int:
            return int(n * self.factor)

        return replace(e, forward_peak_bytes=s(e.forward_peak_bytes),
                       backward_peak_bytes=s(e.backward_peak_bytes),
                       retained_after_forward_bytes=s(e.retained_after_forward_bytes),
                       outputs_bytes=s(e.outputs_bytes))

    def with_recompute(self, recompute):
        return UnderPricing(self.model.with_recompute(recompute), self.factor)

    def max_tokens_that_fit(self, usable_bytes, **kw):
        return self.model.max_tokens_that_fit(int(usable_bytes / self.factor), **kw)

    def allocator_reserve_bytes(self, dynamic, largest):
        return self.model.allocator_reserve_bytes(dynamic, largest)


def test_a_sub_forward_failing_after_others_ran_raises_partial_execution(built):
    p, model, probes = built
    xs = make_inputs([300, 300], seed=9, top_k=None, logits=False, hidden_states=False)
    roomy = _trainer(p, model, 1 << 34, probe_dir=probes)
    items = make_items(xs)
    first = roomy.admission.price_items(items[:1], True)[0].estimate
    # Real moments: sub-forward 1 peaks at its forward; sub-forward 2's forward runs beside
    # sub-forward 1's graph. A limit between the two fails the second only.
    limit = (first.forward_peak_bytes
             + first.retained_after_forward_bytes + first.forward_peak_bytes) // 2
    prices = _prices(roomy, xs)
    factor = 0.98 * limit / prices[2]
    assert prices[1] * factor > limit  # the stand-in still refuses the whole call
    tight = _trainer(p, model, limit, UnderPricing(roomy.memory_model, factor), probes)
    zero_grads(model)
    with pytest.raises(TrainerRankPartialExecutionError) as info:
        tight.dp_rank_forward(xs)
    message = str(info.value)
    assert "sub-forward 2 of 2 ran out of memory after sub-forwards 1-1 had run" in message
    assert isinstance(info.value, TrainerRankMemoryError)
    assert info.value.indices_not_run == (0, 1)
    assert all(q.grad is None for q in model.parameters())  # nothing reached a backward
