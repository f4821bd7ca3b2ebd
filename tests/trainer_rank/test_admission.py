"""Admission decisions and messages.

The memory model here is a linear stand-in (bytes = rate x packed tokens, rate by recompute
mode) so each decision boundary is placed exactly; the real MemoryModel is exercised in
test_trainer.py and test_seed_scaled_down.py. The recompute policies are the real resolved ones.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from art.megatron.recompute import resolve_recompute
from art.trainer_rank._types import (
    ADMITTED,
    COLD_CAPPED,
    DECLINED,
    ESCALATED,
    SPLIT,
    ForwardInput,
)
from art.trainer_rank.compute.items import make_items
from art.trainer_rank.decide.admission import Admission, AdmissionPolicy
from art.trainer_rank.decide.plan import PlanRequest
from art.trainer_rank.decide.profiles import ProfileStore

MOE = (False,) * 4
SELECTIVE = resolve_recompute(granularity="selective", method=None, num_layers=None,
                              modules=None, moe_layers=MOE)
FULL = resolve_recompute(granularity="full", method="uniform", num_layers=1, modules=None,
                         moe_layers=MOE)
RATE = {"selective": 100, "full": 10, "none": 100}


@dataclasses.dataclass
class _Estimate:
    dynamic_bytes: int
    resident_bytes: int = 1000
    reserve_bytes: int = 0

    def table(self) -> str:
        return "stand-in"


@dataclasses.dataclass
class LinearModel:
    recompute: object = SELECTIVE
    per_tp: int = 1
    # < 1: stands for measured (probe) coefficients below the default formulas (scale 1)
    scale: float = 1.0

    def estimate(self, shape):
        grad_mode = self.recompute.mode if shape.grad_enabled else "none"
        per_token = RATE[grad_mode] if shape.grad_enabled else 20
        return _Estimate(int(per_token * shape.packed_tokens * self.scale) // self.per_tp)

    def with_recompute(self, recompute):
        return LinearModel(recompute, self.per_tp, self.scale)

    def max_tokens_that_fit(self, usable_bytes, *, outputs, grad_enabled, sequences=1):
        per_token = RATE[self.recompute.mode] if grad_enabled else 20
        return usable_bytes // per_token


def admission(**policy) -> Admission:
    return Admission(
        memory_model=LinearModel(),
        profiles=ProfileStore(),
        recompute=SELECTIVE,
        topology="tiny|TP1",
        adapter="r1",
        packed_length=lambda lengths, shared=0: sum(lengths),  # as if nothing were shared
        full_recompute=FULL,
        next_tp_model=lambda: (2, LinearModel(per_tp=2)),
        policy=AdmissionPolicy(**policy),
    )


def items(*groups):
    return make_items(
        [
            [ForwardInput(input_tokens=torch.arange(n)) for n in g] if isinstance(g, tuple)
            else ForwardInput(input_tokens=torch.arange(g))
            for g in groups
        ]
    )


def plan_next(adm: Admission, pending, grad: bool, usable_bytes: int):
    """The next micro-batch of a queue, as the trainer asks for it (no gradients pending)."""
    return adm.plan(PlanRequest(tuple(pending), grad, usable_bytes))


def warm(adm: Admission, grad: bool) -> None:
    """One observation for the signature, as a measured first micro-batch leaves behind."""
    pricing, shape, sig = adm.price(items(10)[0].leaves, grad)
    adm.profiles.observe(sig, shape.packed_tokens, pricing.model_peak_bytes,
                         pricing.model_peak_bytes)


def test_cold_start_runs_the_smallest_item_first_under_a_cap():
    adm = admission(cold_start_fraction=0.25)
    plan = plan_next(adm, items(300, 50, 400, 60, 70), grad=True, usable_bytes=100_000)
    # model admits 1000 tokens; the cap is 250: smallest (50) first, then what fits under 250.
    assert plan.decision == COLD_CAPPED
    assert sum(it.num_tokens for it in plan.items) <= 250
    assert [it.index for it in plan.items] == [1, 3, 4]


def test_warm_admits_the_largest_set_of_whole_items_that_fits():
    adm = admission()
    warm(adm, True)
    plan = plan_next(adm, items(300, 500, 400, 60), grad=True, usable_bytes=100_000)
    assert plan.decision == ADMITTED
    # 300 + 500 fit (800 of 1000 tokens), 400 does not, 60 still does: first fit, whole items.
    assert [it.index for it in plan.items] == [0, 1, 3]
    assert plan.shape.packed_tokens == 860 and plan.pricing.dynamic_bytes == 86_000
    plan2 = plan_next(adm, [items(300, 500, 400, 60)[2]], grad=True, usable_bytes=100_000)
    assert [it.index for it in plan2.items] == [2]


def test_profile_correction_raises_the_model_inside_the_trust_window_only():
    adm = admission(trust_window=2.0)
    _, shape, sig = adm.price(items(100)[0].leaves, True)
    adm.profiles.observe(sig, 100, 30_000, 10_000)  # measured 3x the model
    pricing, _, _ = adm.price(items(150)[0].leaves, True)
    assert pricing.source == "model x profile correction" and pricing.dynamic_bytes == 45_000
    outside, _, _ = adm.price(items(300)[0].leaves, True)
    assert outside.source == "model" and outside.dynamic_bytes == 30_000
    over = admission(trust_window=2.0)
    _, _, sig = over.price(items(100)[0].leaves, True)
    for tokens in (100, 120, 150):  # the model over-predicts by 20%: never priced below it
        over.profiles.observe(sig, tokens, tokens * 80, tokens * 100)
    assert over.price(items(150)[0].leaves, True)[0].dynamic_bytes == 15_000


def test_where_the_model_under_predicted_sizes_grow_by_the_trust_window_only():
    adm = admission(trust_window=2.0)
    _, _, sig = adm.price(items(100)[0].leaves, True)
    adm.profiles.observe(sig, 100, 15_000, 10_000)  # the model said 10_000
    plan = plan_next(adm, items(150, 40, 30, 500), grad=True, usable_bytes=100_000)
    assert plan.decision == ADMITTED and [it.index for it in plan.items] == [0, 1]
    assert plan.shape.packed_tokens <= 200 and "growing at most x2" in plan.note
    adm.profiles.observe(sig, 190, 28_000, 19_000)
    assert plan_next(adm, items(150, 40, 30, 500), grad=True, usable_bytes=100_000
                         ).shape.packed_tokens == 220  # the cap moved to 380
    exact = admission()
    _, _, sig = exact.price(items(100)[0].leaves, True)
    exact.profiles.observe(sig, 100, 9_000, 10_000)  # the model over-predicts: no cap
    assert [it.index for it in plan_next(exact, items(150, 40, 30, 500), grad=True,
                                               usable_bytes=100_000).items] == [0, 1, 2, 3]


def test_no_grad_group_that_does_not_fit_is_split_into_sub_forwards():
    adm = admission()
    warm(adm, False)
    plan = plan_next(adm, items((400, 300, 350, 200)), grad=False, usable_bytes=16_000)
    assert plan.decision == SPLIT
    assert plan.sub_forwards == ((0, 1), (2, 3))  # 700 and 550 tokens x 20 B <= 16000
    assert plan.pricing.dynamic_bytes <= 16_000


def test_split_prices_the_outputs_earlier_sub_forwards_leave_behind():
    adm = dataclasses.replace(admission(), held_output_bytes=lambda shape: 10 * shape.packed_tokens)
    warm(adm, False)
    plan = plan_next(adm, items((400, 300, 350, 200)), grad=False, usable_bytes=16_000)
    # [400+300] = 14000; then 350 alone with 7000 held = 14000; +200 would be 18000; 200 alone
    # with 10500 held = 14500.
    assert plan.decision == SPLIT and plan.sub_forwards == ((0, 1), (2,), (3,))
    assert plan.pricing.dynamic_bytes == 14_500 and plan.pricing.held_bytes == 10_500


def test_grad_item_escalates_to_full_recompute_when_only_that_fits():
    adm = admission()
    warm(adm, True)
    plan = plan_next(adm, items((600, 600)), grad=True, usable_bytes=100_000)
    assert plan.decision == ESCALATED and plan.escalate
    assert plan.pricing.recompute is FULL and plan.pricing.dynamic_bytes == 12_000


def test_decline_names_mode_prices_remedies_and_says_which_fit():
    adm = admission(escalate_to_full_recompute=False)
    warm(adm, True)
    plan = plan_next(adm, items(50, (600, 600)), grad=True, usable_bytes=100_000)
    assert plan.decision == ADMITTED
    plan = plan_next(adm, items(50, (600, 600))[1:], grad=True, usable_bytes=100_000)
    assert plan.decision == DECLINED and plan.sub_forwards == ()
    err = plan.error
    msg = str(err)
    assert "selective recompute (core_attn)" in msg
    assert "item 1" in msg and "1200 packed tokens" in msg
    assert "0.000 GiB" not in msg.split("usable limit of")[1][:5]
    assert "full recompute (uniform, 1 layer(s) per checkpoint) it would need" in msg
    assert "fits" in msg and "At TP=2" in msg
    assert "ART_MEGATRON_RECOMPUTE_GRANULARITY=full" in err.suggestion
    assert "ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE=2" in err.suggestion
    assert err.indices_not_run == (1,)
    assert err.predicted_peak_bytes == 120_000 and err.usable_limit_bytes == 100_000


def test_next_tp_alternative_is_priced_with_the_decisions_coefficients():
    # The decision prices with probe coefficients 0.8x the formulas; the next TP size has
    # only formulas: it is priced at 0.8x them too, so a TP=2 that fits is offered.
    adm = dataclasses.replace(admission(escalate_to_full_recompute=False),
                              memory_model=LinearModel(scale=0.8),
                              default_memory_model=LinearModel())
    plan = plan_next(adm, items(2500), grad=True, usable_bytes=110_000)
    assert plan.decision == DECLINED and plan.pricing.dynamic_bytes == 200_000
    msg = str(plan.error)
    # formulas at TP=2: 125,000 bytes (does not fit); x0.8: 100,000 (fits)
    assert "At TP=2 (same recompute) it would need 97.7 KiB per rank" in msg
    assert "x0.800" in msg and "fits (if" in msg
    assert "ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE=2" in plan.error.suggestion


def test_decline_when_nothing_fits_says_so():
    adm = admission()
    warm(adm, True)
    plan = plan_next(adm, items(20_000), grad=True, usable_bytes=100_000)
    assert plan.decision == DECLINED
    msg = str(plan.error)
    assert msg.count("does not fit") == 2  # full recompute and TP=2
    assert "RECOMPUTE_GRANULARITY" not in plan.error.suggestion
    no_grad = plan_next(adm, items(20_000), grad=False, usable_bytes=100_000)
    assert no_grad.decision == DECLINED
    assert "recompute cannot help" in str(no_grad.error)


@pytest.mark.parametrize("usable", [5_000, 50_000])
def test_a_recorded_miss_shrinks_what_is_admitted(usable):
    adm = admission()
    warm(adm, False)
    first = plan_next(adm, items(100, 100, 100), grad=False, usable_bytes=usable)
    tokens = first.shape.packed_tokens
    adm.profiles.record_miss(first.signature, tokens, usable, first.pricing.model_peak_bytes)
    again = plan_next(adm, items(100, 100, 100), grad=False, usable_bytes=usable)
    assert again.decision == DECLINED or again.shape.packed_tokens < tokens


def test_first_gradients_count_only_the_layers_a_backward_reached_at_its_peak():
    """Gradients not allocated yet are allocated by the backward top-down: at a peak in layer
    k's backward only the layers from k up (and parameters outside the layers) have theirs."""
    from art.trainer_rank.measuring.device import unallocated_gradients

    class Layer(torch.nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.lora = torch.nn.Parameter(torch.zeros(n))
            self.frozen = torch.nn.Parameter(torch.zeros(n), requires_grad=False)

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(10), Layer(20), Layer(30)])

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.decoder = Decoder()
            self.head = torch.nn.Parameter(torch.zeros(5))

    model = Model()
    model.decoder.layers[2].lora.grad = torch.zeros(30)  # already allocated
    gradients = unallocated_gradients(model, num_layers=3)
    assert gradients.per_layer == (40, 80, 0) and gradients.outside_layers == 20
    assert gradients.total_bytes == 140
    assert gradients.allocated_down_to(1) == 80 + 20
    assert gradients.allocated_down_to(0) == 140
    assert gradients.allocated_down_to(None) == 20  # a peak in the head's backward


def _greedy_reference(queue, usable_bytes: int) -> list[int]:
    """The one-candidate-per-item greedy scan admission's bisection must agree with, on the
    linear stand-in (grad, selective: 100 bytes per packed token; warm, so no cap): items in
    queue order, each added if the packed set still fits, up to MAX_MISFITS_SCANNED misfits
    in a row."""
    from art.trainer_rank.decide.admission import MAX_MISFITS_SCANNED

    chosen, tokens, misfits = [queue[0].index], queue[0].num_tokens, 0
    for item in queue[1:]:
        if RATE["selective"] * (tokens + item.num_tokens) <= usable_bytes:
            chosen.append(item.index)
            tokens += item.num_tokens
            misfits = 0
        else:
            misfits += 1
            if misfits >= MAX_MISFITS_SCANNED:
                break
    return sorted(chosen)


@pytest.mark.parametrize("count", [1_000, 10_000])
def test_a_call_of_many_short_items_is_planned_in_logarithmically_many_estimates(count):
    # Pricing every candidate prefix made a call of n short items cost n estimates of up to
    # n sequences each (quadratic); bisection over the prefix prices O(log n) of them, and
    # the micro-batch chosen is the one the item-by-item greedy scan chooses.
    import random

    rng = random.Random(count)
    lengths = [rng.randint(8, 32) for _ in range(count)]
    for usable in (10 ** 9, 100 * sum(lengths) // 3):  # everything fits / a third does
        adm = admission()
        warm(adm, True)
        queue = items(*lengths)
        estimates = 0
        original = adm.memory_model.estimate

        def counted(shape, original=original):
            nonlocal estimates
            estimates += 1
            return original(shape)

        adm.memory_model.estimate = counted
        plan = plan_next(adm, queue, grad=True, usable_bytes=usable)
        assert estimates <= 4 * count.bit_length() + 20, estimates
        assert [it.index for it in plan.items] == _greedy_reference(queue, usable)
        assert plan.pricing.dynamic_bytes <= usable
        if usable == 10 ** 9:
            assert len(plan.items) == count


def test_a_wave_of_many_short_items_finds_its_fitting_prefix_by_bisection(monkeypatch):
    import random

    rng = random.Random(7)
    lengths = [rng.randint(8, 32) for _ in range(2_000)]
    adm = admission()
    warm(adm, True)
    queue = items(*lengths)
    usable = 100 * sum(lengths) // 2
    calls = 0
    original = adm.fits_together

    def counted(self, request):
        nonlocal calls
        calls += 1
        return original(request)

    monkeypatch.setattr(Admission, "fits_together", counted)
    fitting = adm.fitting_prefix(queue, {True: usable})
    # The largest prefix that fits, as the one-prefix-at-a-time scan finds it.
    total, expected = 0, 0
    for n in lengths:
        if (total + n) * 100 > usable:
            break
        total, expected = total + n, expected + 1
    assert fitting == expected and calls <= 2 * 2_000 .bit_length() + 4, (fitting, calls)


def test_a_decision_reads_the_queue_only_near_its_answer(monkeypatch):
    # Running sums built over the whole queue made every decision cost the queue's length:
    # a call of 10,000 items packed a few at a time paid 10,000 x (its micro-batches).
    from art.trainer_rank._request import OutputRequest

    queue = items(*([20] * 10_000))
    adm = admission()
    warm(adm, True)
    usable = 100 * 20 * 12  # about a dozen items per micro-batch
    unions = 0
    original = OutputRequest.union.__func__

    def counted(cls, requests):
        nonlocal unions
        unions += 1
        return original(cls, requests)

    monkeypatch.setattr(OutputRequest, "union", classmethod(counted))
    plan = plan_next(adm, queue, grad=True, usable_bytes=usable)
    assert 1 < len(plan.items) < 50
    assert unions <= 4 * len(plan.items) + 20, unions
