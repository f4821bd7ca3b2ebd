"""The memory model's arithmetic: terms, phases, recompute ordering, reserve, the seed case.

Pure arithmetic (no model is built): the default coefficients, as the what-if CLI uses them.
"""

from __future__ import annotations

import time

import pytest

from art.megatron.geometry import load_geometry
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.megatron.recompute import resolve_recompute
from art.trainer_rank._request import LoraShape, MicroBatchShape, OutputRequest
from art.trainer_rank.pricing.budget import AllocatorReserve, expandable_segments
from art.trainer_rank.pricing.model import MemoryModel

GIB = 2**30
SEED_LENGTHS = (16355, 16355)  # 32,710 packed tokens in two sequences


def _model(geometry, *, tp=1, sp=False, cp=1, ep=1, granularity="full", method="uniform",
           num_layers=1, modules=None, impl=None, lora=1, alloc_conf=None, worst=False):
    impl = impl or Implementation.gpu_te()
    recompute = resolve_recompute(
        granularity=granularity, method=method if granularity == "full" else None,
        num_layers=num_layers if granularity == "full" else None,
        modules=modules if granularity == "selective" else None,
        moe_layers=geometry.moe_layers, layer_types=geometry.layer_types,
        norm_fused_into_linear=impl.norm_fused_into_linear,
    )
    layout = ParallelLayout(tensor_parallel=tp, sequence_parallel=sp, context_parallel=cp,
                            expert_parallel=ep)
    return MemoryModel(geometry, layout=layout,
                       recompute=recompute, implementation=impl, lora=LoraShape(lora),
                       dtype="bfloat16", alloc_conf=alloc_conf, worst_case_routing=worst)


def _batch(lengths=SEED_LENGTHS, outputs="hidden_states", grad=True):
    return MicroBatchShape(lengths, outputs=OutputRequest.parse(outputs), grad_enabled=grad)


@pytest.fixture(scope="module")
def seed_geometry():
    return load_geometry("Qwen3.5-27B")


def test_phase_peaks_are_sums_of_their_named_terms(seed_geometry):
    est = _model(seed_geometry, tp=2, sp=True).estimate(_batch())
    by_phase = {p: sum(t.bytes for t in est.terms if t.lifetime == p)
                for p in ("resident", "forward", "backward", "reserve")}
    assert by_phase["resident"] == est.resident_bytes
    assert by_phase["forward"] == est.forward_peak_bytes
    assert by_phase["backward"] == est.backward_peak_bytes
    assert by_phase["reserve"] == est.reserve_bytes
    assert est.dynamic_bytes == max(est.forward_peak_bytes, est.backward_peak_bytes) \
        + est.reserve_bytes
    assert est.peak_bytes == est.resident_bytes + est.dynamic_bytes
    d = est.to_dict()
    assert {"peak_bytes", "dynamic_bytes", "resident_bytes", "terms"} <= set(d)
    assert d["terms"]["weights"] == next(t.bytes for t in est.terms if t.name == "weights")
    assert "full recompute" in est.table() and est.coefficients_source == "defaults"


def test_seed_case_full_recompute_matches_observed_peaks(seed_geometry):
    """Seed: full recompute ran at 41 GiB per rank at TP2 and 22 GiB at TP4 (allocated
    peaks, so compared without the allocator reserve)."""
    for tp, observed_gib in ((2, 41.0), (4, 22.0)):
        est = _model(seed_geometry, tp=tp, sp=True).estimate(_batch())
        allocated = est.resident_bytes + max(est.forward_peak_bytes, est.backward_peak_bytes)
        assert 0.90 * observed_gib <= allocated / GIB <= 1.10 * observed_gib, (tp, est.table())


def test_seed_case_selective_recompute_exceeds_the_budgets(seed_geometry):
    for tp, usable_bytes in ((2, 107.192e9), (4, 119.289e9)):
        est = _model(seed_geometry, tp=tp, sp=True, granularity="selective").estimate(_batch())
        assert est.peak_bytes > usable_bytes, (tp, est.peak_bytes / 1e9)
        # A flat per-micro-batch constant (5.894 GB) is far below this mode's dynamic peak.
        assert est.dynamic_bytes > 10 * 5.894e9


def test_recompute_modes_order_dynamic_peaks(seed_geometry):
    batch = _batch(lengths=(4096,), outputs="logprobs")
    none = _model(seed_geometry, tp=2, sp=True, granularity=None).estimate(batch)
    selective = _model(seed_geometry, tp=2, sp=True, granularity="selective",
                       modules=("core_attn", "mlp")).estimate(batch)
    full = _model(seed_geometry, tp=2, sp=True).estimate(batch)
    assert none.dynamic_bytes > selective.dynamic_bytes > full.dynamic_bytes
    nograd = _model(seed_geometry, tp=2, sp=True, granularity=None).estimate(
        _batch(lengths=(4096,), outputs="logprobs", grad=False))
    assert nograd.backward_peak_bytes == 0
    assert nograd.forward_peak_bytes < full.dynamic_bytes


def test_block_recompute_lies_between_full_and_none(seed_geometry):
    batch = _batch(lengths=(8192,), outputs="logprobs")
    block = _model(seed_geometry, tp=2, sp=True, method="block", num_layers=32).estimate(batch)
    full = _model(seed_geometry, tp=2, sp=True).estimate(batch)
    none = _model(seed_geometry, tp=2, sp=True, granularity=None).estimate(batch)
    assert full.dynamic_bytes < block.dynamic_bytes < none.dynamic_bytes


def test_hybrid_layers_are_priced_by_type(seed_geometry):
    from art.trainer_rank.pricing.layer_terms import Dims, PricedKind
    from art.trainer_rank.pricing.layers import price_layer

    d = Dims(seed_geometry, ParallelLayout(tensor_parallel=2, sequence_parallel=True),
             Implementation.gpu_te(), 2, 1, frozenset(LoraShape().target_modules))
    gdn = price_layer(d, PricedKind.LINEAR_ATTENTION, frozenset(), 8192, grad=True)
    attn = price_layer(d, PricedKind.ATTENTION, frozenset(), 8192, grad=True)
    assert gdn.kept != attn.kept and gdn.kept > 0 and attn.kept > 0
    # Selective core_attn recompute cannot touch Gated DeltaNet layers.
    assert price_layer(d, PricedKind.LINEAR_ATTENTION, frozenset({"core_attn"}), 8192,
                       grad=True).kept == gdn.kept


def test_unfused_attention_adds_an_s_squared_term():
    g = load_geometry("Qwen3-8B")
    cpu = Implementation(spec="local", attention="unfused", norm="torch", swiglu_fused=False,
                         device="cpu")
    a = _model(g, impl=cpu, granularity=None).estimate(_batch((2048,), "logprobs"))
    b = _model(g, impl=cpu, granularity=None).estimate(_batch((4096,), "logprobs"))
    assert "packed attention mask" in a.to_dict()["terms"]
    assert b.dynamic_bytes > 2.5 * a.dynamic_bytes  # clearly more than linear growth
    flash = _model(g, granularity=None)
    fa = flash.estimate(_batch((2048,), "logprobs"))
    fb = flash.estimate(_batch((4096,), "logprobs"))
    assert "packed attention mask" not in fa.to_dict()["terms"]
    assert fb.dynamic_bytes < 2.2 * fa.dynamic_bytes


def test_context_parallel_prices_the_busiest_rank():
    g = load_geometry("Qwen3-8B")
    one = _model(g, granularity="selective").estimate(_batch((32768,), "logprobs"))
    two = _model(g, granularity="selective", cp=2).estimate(_batch((32768,), "logprobs"))
    assert two.dynamic_bytes < 0.6 * one.dynamic_bytes


def test_moe_worst_case_routing_costs_more():
    g = load_geometry("Qwen3-30B-A3B")
    batch = _batch((8192,), "logprobs")
    balanced = _model(g, granularity=None, ep=4).estimate(batch)
    worst = _model(g, granularity=None, ep=4, worst=True).estimate(batch)
    assert worst.dynamic_bytes > balanced.dynamic_bytes
    # With every expert local (EP=1) the worst case is the balanced case.
    assert _model(g, granularity=None, worst=True).estimate(batch).dynamic_bytes == \
        _model(g, granularity=None).estimate(batch).dynamic_bytes


def test_reserve_covers_largest_allocation_and_fragmentation():
    assert expandable_segments("expandable_segments:True")
    assert not expandable_segments("max_split_size_mb:128")
    assert not expandable_segments(None)
    r = AllocatorReserve("cuda", None)
    assert r.reserve_bytes(100 * GIB, 1 * GIB) == 10 * GIB
    assert r.reserve_bytes(10 * GIB, 3 * GIB) == 3 * GIB
    assert AllocatorReserve("cuda", "expandable_segments:True").reserve_bytes(100 * GIB, GIB) \
        == 2 * GIB
    # CPU: no caching allocator; the virtual limit counts live bytes, so nothing is held back.
    assert AllocatorReserve("cpu", None).reserve_bytes(100 * GIB, 3 * GIB) == 0
    # A 1.2M-token no-grad pack: the reserve alone covers its largest single allocation, which
    # fragmented memory cannot serve from scattered free blocks.
    g = load_geometry("Qwen3.5-35B-A3B")
    segmented = _model(g, tp=2, sp=True, granularity=None).estimate(
        _batch((1196952,), "logprobs", grad=False))
    assert segmented.reserve_bytes >= segmented.largest_allocation_bytes
    assert segmented.reserve_bytes >= int(0.10 * segmented.forward_peak_bytes)


def test_max_tokens_that_fit_is_the_boundary():
    g = load_geometry("Qwen3-8B")
    model = _model(g, granularity="selective")
    out = OutputRequest(target_logprobs=True)
    usable = 20 * GIB
    n = model.max_tokens_that_fit(usable, outputs=out, grad_enabled=True, sequences=2)
    assert n > 0

    def dyn(tokens: int) -> int:
        per = tokens // 2
        return model.estimate(MicroBatchShape((per, tokens - per), outputs=out)).dynamic_bytes

    assert dyn(n) <= usable < dyn(n + 1)
    assert model.max_tokens_that_fit(1, outputs=out, grad_enabled=True) == 0


def test_estimate_is_cheap(seed_geometry):
    model = _model(seed_geometry, tp=2, sp=True, granularity="selective")
    start = time.perf_counter()
    for n in range(1000, 1200):
        model.estimate(_batch((n, n), "logprobs"))
    per_call = (time.perf_counter() - start) / 200
    assert per_call < 0.01, f"{per_call * 1e3:.2f} ms per estimate"


def test_full_logits_at_tp_price_the_gathered_chunk_and_the_no_grad_head(seed_geometry):
    name = "gathered logits chunk (TP all-gather)"
    tokens = 1000
    gathered = 2 * tokens * seed_geometry.vocab_size * 4  # TP pieces + concatenation, fp32
    for grad in (True, False):
        est = _model(seed_geometry, tp=2).estimate(_batch((tokens,), "logits", grad))
        forward = {t.name: t.bytes for t in est.terms if t.lifetime == "forward"}
        assert forward[name] == gathered
        assert est.peak_at == "forward: head"
        if not grad:
            # The decoder call has returned: its input and output are no longer live.
            assert "embedding output" not in forward and "decoder output" not in forward
    one_rank = _model(seed_geometry, tp=1).estimate(_batch((tokens,), "logits", False))
    assert name not in {t.name for t in one_rank.terms}


def test_terms_are_found_by_kind_not_by_display_name(monkeypatch):
    """The composition sums, drops and halves pre-decoder terms by what they are (the score
    buffer, the mask-type tensors, the embedding output, the rotary table): renaming every
    one of them changes no price. Megatron's unfused attention, which has a score buffer and
    a dense mask to find."""
    from dataclasses import replace

    from art.trainer_rank.pricing import model as model_module

    def memory():
        return _model(load_geometry("Qwen3-8B"), granularity="selective", modules=("core_attn",),
                      impl=Implementation.cpu_local("unfused"))

    batches = [_batch((300, 200), outputs, grad)
               for outputs in ("logprobs", "logits") for grad in (True, False)]
    before = [memory().estimate(b) for b in batches]
    named = model_module.pre_decoder_terms

    def renamed(*args, **kwargs):
        return [replace(t, name=f"renamed {i}") for i, t in enumerate(named(*args, **kwargs))]

    monkeypatch.setattr(model_module, "pre_decoder_terms", renamed)
    for batch, was in zip(batches, before):
        now = memory().estimate(batch)
        assert was.score_buffer_bytes > 0
        assert (now.dynamic_bytes, now.score_buffer_bytes, now.retained_after_forward_bytes,
                [t.bytes for t in now.terms]) == (
            was.dynamic_bytes, was.score_buffer_bytes, was.retained_after_forward_bytes,
            [t.bytes for t in was.terms]), batch


def test_an_ep_rank_s_experts_take_every_ep_rank_s_tokens():
    """Under balanced routing each of the EP ranks sends 1/EP of its token-expert pairs to
    this rank's experts, so (with every rank priced at this rank's tokens) a rank's experts
    hold as many pairs at EP=2 as at EP=1: spreading the experts shrinks their weights, not
    their activations. Measured at EP=2 on two ranks: bench/calibration/ep2."""
    g = load_geometry("Qwen3-30B-A3B")
    batch = _batch((8192,), "logprobs")
    one = _model(g, granularity=None, ep=1).estimate(batch)
    two = _model(g, granularity=None, ep=2).estimate(batch)
    assert two.dynamic_bytes == pytest.approx(one.dynamic_bytes, rel=1e-3)
    assert two.resident_bytes < one.resident_bytes


def test_the_final_norm_s_rows_in_the_tail_are_this_cp_rank_s():
    # The final norm runs inside the decoder on this CP rank's rows; only its output is
    # gathered to the whole row. Every per-row term of the norm in the tail (its inverse rms,
    # its fp32 upcast, the pow backward it adds beside a caller's mean-square on hidden
    # states) counts those rows, so CP=2 takes half of each off the whole-row tail.
    from art.trainer_rank.pricing.tail import default_tail

    g = load_geometry("Qwen3-8B")
    impl = Implementation.cpu_local("flash")
    assert impl.norm == "torch"
    tokens = 4096
    batch = _batch((tokens,), "hidden_states")
    one = default_tail(_model(g, impl=impl, granularity=None), batch, tokens)
    two = default_tail(_model(g, impl=impl, granularity=None, cp=2), batch, tokens)
    other_rank_rows = tokens // 2
    per_row = 4 + g.hidden_size * 4 + g.hidden_size * 4  # rms, bf16 upcast, pow backward
    assert one.backward - two.backward == other_rank_rows * per_row
