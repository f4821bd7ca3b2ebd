"""Memory meter, layer probe and the calibration harness on real tiny Megatron-Core models."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from art.trainer_rank.measuring.meter import MemoryMeter

SMALL_PROBE_TOKENS = (64, 128, 192, 256, 320, 384)
# The production points' spacing (about 1.5x apart), stopping where test rows stop.
SLICE_PROBE_TOKENS = (48, 64, 96, 128, 192, 256, 384)



def _slice_model(cells: list, implementation: Any = None) -> Any:
    """The calibration model of `cells` (one geometry, policy, LoRA rank and TP size),
    probed at the slice's points; `implementation`: None for what this machine builds."""
    from _calibration.harness import POLICY_BY_NAME, CalibrationModel, calibration_geometries

    first = cells[0]
    return CalibrationModel(calibration_geometries()[first.geometry],
                            POLICY_BY_NAME[first.policy], lora_rank=first.lora_rank,
                            tensor_parallel=first.tensor_parallel, cells=cells,
                            probe_tokens=SLICE_PROBE_TOKENS, implementation=implementation)

def test_meter_counts_storages_not_views_and_not_preexisting_tensors():
    outside = torch.ones(1000)
    with MemoryMeter(device="cpu") as meter:
        view = outside.view(10, 100)  # a view of a storage that existed before: no allocation
        doubled = outside * 2  # 4000 bytes
        alias = doubled[:10]  # a view: same storage
        doubled.add_(1)  # in place: no allocation
        assert meter.live_bytes == 4000
        del doubled
        assert meter.live_bytes == 4000  # the view keeps the whole storage alive
        del alias
        assert meter.live_bytes == 0
        leaf = torch.ones(100, requires_grad=True)  # 400
        (leaf * leaf).sum().backward()  # saves the leaf itself; the grad is 400 bytes
        assert meter.live_bytes == 800
        assert meter.peak_bytes >= 4000
    del view


def test_off_grid_cells_priced_within_target_by_probe_and_by_default_formulas(
        megatron_process):
    """Seeded random rows between the probe points (one sequence or many), mlp recompute, a
    two-layer full unit, grad and no grad, the RL caller loss: the probe and the default
    formulas price every cell within [1.00, 1.05] of the measured peak, rows under 128
    tokens included (there torch's SwiGLU backward sets the layer's peak)."""
    from _calibration.cells import off_probe_points, test_slice
    from _calibration.harness import run_cells

    cells = test_slice(SLICE_PROBE_TOKENS)
    assert all(off_probe_points(sum(c.lengths), SLICE_PROBE_TOKENS) for c in cells)
    assert any(len(c.lengths) > 1 for c in cells) and any(c.loss == "rl" for c in cells)
    results = run_cells(cells, probe_tokens=SLICE_PROBE_TOKENS)
    for r in results:
        assert 1.0 <= r.ratio <= 1.05, ("probe", r.cell, r.measured_bytes, r.predicted_bytes)
        assert 1.0 <= r.default_ratio <= 1.05, (
            "defaults", r.cell, r.measured_bytes, r.predicted_default_bytes)
        assert r.reserve_bytes == 0  # CPU: the virtual limit counts live bytes exactly


def test_rungs_switched_at_run_time_are_priced_in_band(megatron_process):
    """Recompute rungs switched on a model built with another policy (what escalate and
    adaptive run): the selective model running no recompute, full recompute of its first one
    and three layers and uniform full; the full-recompute model running selective core_attn.
    The probe and the default formulas price each within [1.00, 1.05] of the measured peak."""
    from _calibration.cells import RUNGS_BY_BUILT, off_probe_points
    from _calibration.harness import Cell, run_cells

    picks = [("selective default", "none", (217, 91)),
             ("selective default", "full block 1 (selective core_attn on the rest)", (173,)),
             ("selective default", "full block 3 (selective core_attn on the rest)",
              (97, 80, 51)),
             ("selective default", "full uniform 1", (333,)),
             ("full uniform 1", "selective core_attn", (141, 70))]
    assert all(rung in RUNGS_BY_BUILT[built] for built, rung, _ in picks)
    assert all(off_probe_points(sum(n), SLICE_PROBE_TOKENS) for _, _, n in picks)
    cells = [Cell("gqa-128", rung, 8, 1, lengths, "logprobs", True, loss="rl",
                  built_with=built) for built, rung, lengths in picks]
    results = run_cells(cells, probe_tokens=SLICE_PROBE_TOKENS)
    for r in results:
        assert 1.0 <= r.ratio <= 1.05, ("probe", r.cell, r.measured_bytes, r.predicted_bytes)
        assert 1.0 <= r.default_ratio <= 1.05, (
            "defaults", r.cell, r.measured_bytes, r.predicted_default_bytes)


def test_default_formulas_price_the_gpu_shaped_build_from_measurement(megatron_process):
    """On the CPU stand-ins of the GPU build's fused kernels (flash attention, fused norm and
    SwiGLU) the MLP sets the backward peak: with mlp recompute the rebuilt fc1's forward
    working set (its LoRA temporaries) sits on the incoming gradients, the fused SwiGLU adds
    no temporary beyond its input's gradient, a rebuilt two-layer unit holds the first
    layer's output while the second runs, and the fused RoPE keeps no cos/sin copies. The
    default formulas price each within [1.00, 1.05] of the measured peak."""
    from _calibration.harness import Cell, run_cells

    cells = [Cell("gqa-128", policy, 8, 1, lengths, "logprobs", True, build="gpu-shaped")
             for policy, lengths in (("selective core_attn+mlp", (301, 77, 215)),
                                     ("none", (433,)), ("full uniform 2", (250, 90)))]
    # One KV group: the fused q/k norm keeps contiguous copies of the strided q and k views.
    cells.append(Cell("mqa-192", "selective default", 8, 1, (277, 41), "logprobs", True,
                      build="gpu-shaped"))
    for r in run_cells(cells, probe_tokens=(48, 64, 96)):
        assert 1.0 <= r.default_ratio <= 1.05, (
            "defaults", r.cell, r.measured_bytes, r.predicted_default_bytes)


def test_default_formulas_price_rebuilt_norms_and_short_rows(megatron_process):
    """Short rows, where the MLP's backward sets a layer's peak: with layernorm recompute the
    rebuilt norm output (restored storage + the re-run's own output and statistics) is live
    through the MLP's / attention's backward; the GPU-shaped build's SwiGLU stand-in keeps a
    few chunk-sized temporaries in its backward. The default formulas price each within
    [1.00, 1.05] of the measured peak."""
    from _calibration.harness import Cell, run_cells

    # Peaks: layer 4's backward, layer 4's forward, layer 4's backward (the MLP rebuilt).
    cells = [Cell("gqa-128", "selective layernorm", 8, 1, (90,), "hidden_states", True),
             Cell("gqa-128", "selective layernorm", 8, 1, (60, 17), "hidden_states", True,
                  build="gpu-shaped"),
             Cell("gqa-128", "selective core_attn+mlp", 8, 1, (80,), "hidden_states", True,
                  build="gpu-shaped")]
    for r in run_cells(cells, probe_tokens=(48, 64, 96)):
        assert 1.0 <= r.default_ratio <= 1.05, (
            "defaults", r.cell, r.measured_bytes, r.predicted_default_bytes)


def test_default_layer_formulas_match_the_probed_layer_on_short_rows(megatron_process):
    """At the probe's own points (where it is exact) the default formulas price a layer's
    forward exactly and its backward at most one hidden row per token high (the incoming
    gradient is counted twice where the residual stream passes it on as the same tensor):
    torch's SwiGLU backward, a rebuilt recomputed norm, the GPU-shaped SwiGLU stand-in's
    chunk temporaries. The caller's mean-square loss on hidden states: its backward's
    temporaries and the loss scalars."""
    from _calibration.harness import (
        POLICY_BY_NAME,
        CalibrationModel,
        Cell,
        calibration_geometries,
        implementation_for,
    )

    from art.trainer_rank._request import MicroBatchShape, OutputRequest
    from art.trainer_rank.pricing.layer_terms import PricedKind
    from art.trainer_rank.pricing.layers import price_layer
    from art.trainer_rank.pricing.tail import default_tail

    hidden = OutputRequest.parse("hidden_states")
    tokens = (48, 64, 96)
    for build, policy, modules in (("local", "none", frozenset()),
                                   ("local", "selective layernorm", frozenset({"layernorm"})),
                                   ("gpu-shaped", "none", frozenset())):
        cell = Cell("gqa-128", policy, 8, 1, (70,), "hidden_states", True, build=build)
        built = CalibrationModel(calibration_geometries()["gqa-128"], POLICY_BY_NAME[policy],
                                 lora_rank=8, tensor_parallel=1, cells=[cell],
                                 probe_tokens=tokens, implementation=implementation_for(build))
        dims = built.memory_default.dims
        mode = "sel:" + "+".join(sorted(modules)) if modules else "none"
        for s in tokens:
            probed = built.coefficients.layer_cost(PricedKind.ATTENTION, mode, s)
            assert probed is not None
            default = price_layer(dims, PricedKind.ATTENTION, modules, s, grad=True)
            row = s * dims.geometry.hidden_size * 4
            where = (build, policy, s, probed, default)
            assert probed.forward <= default.forward <= probed.forward + 8, where
            assert probed.backward <= default.backward <= probed.backward + row, where
            # The tail with hidden states and the caller's mean-square loss (no head): the
            # formulas are at most the final norm's inverse rms per token above the probe.
            batch = MicroBatchShape((s,), outputs=hidden)
            tail = default_tail(built.memory_default, batch, s)
            measured = built.coefficients.tail_cost(hidden, True, s)
            kept, forward, backward = (measured.kept_bytes, measured.forward_bytes,
                                       measured.backward_bytes)
            where = (build, policy, s, measured, tail)
            assert kept <= tail.kept and forward <= tail.forward <= forward + 4 * s, where
            assert backward <= tail.backward <= backward + 4 * s, where
            # The head's moment alone (the caller's mean-square told apart) is no larger
            # than the formulas' head moment, which stands for the whole backward.
            assert measured.head_backward_bytes <= tail.head_backward_peak, where


def test_profile_after_a_long_sequence_does_not_over_price_many_short_ones(megatron_process):
    """A profile learns measured / predicted, so a row of many short sequences is priced by
    the memory model and corrected, not off the long sequence's peak."""
    from _calibration.harness import POLICY_BY_NAME, CalibrationModel, Cell
    from _calibration.harness import calibration_geometries as geometries

    from art.trainer_rank.decide.profiles import Profile

    long_row = Cell("gqa-128", "selective default", 8, 1, (372,), "logprobs", True)
    short_row = Cell("gqa-128", "selective default", 8, 1, (9,) * 20 + (6,), "logprobs",
                     True)
    built = CalibrationModel(geometries()["gqa-128"], POLICY_BY_NAME["selective default"],
                             lora_rank=8, tensor_parallel=1, cells=[long_row],
                             probe_tokens=SLICE_PROBE_TOKENS)
    profile = Profile()
    seen = built.measure(long_row)
    profile.observe(sum(long_row.lengths), seen.measured_bytes, seen.predicted_bytes)
    short = built.measure(short_row)
    price = profile.predict(sum(short_row.lengths), 2.0, short.predicted_bytes)
    assert price is not None
    assert 1.0 <= price / short.measured_bytes <= 1.05, (price, short.measured_bytes)


def test_probe_is_cached_and_round_trips(megatron_process, tmp_path):
    from _calibration.harness import (
        POLICY_BY_NAME,
        CalibrationModel,
        Cell,
        calibration_geometries,
    )

    from art.megatron.implementation import Implementation
    from art.trainer_rank._request import MicroBatchShape, OutputRequest
    from art.trainer_rank.measuring import probe as probe_module

    geometry = calibration_geometries()["gqa-128"]
    cell = Cell("gqa-128", "selective mlp", 1, 1, (128,), "logprobs", True)
    # Megatron's unfused attention, whose s^2 scores give the probe quadratic terms to check.
    model = CalibrationModel(geometry, POLICY_BY_NAME["selective mlp"], lora_rank=1,
                             tensor_parallel=1, cells=[cell], probe_tokens=SMALL_PROBE_TOKENS,
                             implementation=Implementation.cpu_local("unfused"))
    coefficients = model.coefficients
    assert {m for _, m, _ in coefficients.layers} == {"nograd", "sel:mlp"}
    again = probe_module.ProbeCoefficients.from_json(coefficients.to_json())
    assert again == coefficients
    # A file measured by older code (another format) is refused, never silently reused.
    stale = json.loads(coefficients.to_json()) | {"format": probe_module.PROBE_FORMAT_VERSION - 1}
    with pytest.raises(ValueError, match="measure the probe again"):
        probe_module.ProbeCoefficients.from_json(json.dumps(stale))
    batch = MicroBatchShape((200,), outputs=OutputRequest(target_logprobs=True))
    probed = model.memory.estimate(batch)
    assert probed.coefficients_source == f"probe:{coefficients.key}"
    assert model.memory_default.estimate(batch).coefficients_source == "defaults"
    # The probe's quadratic terms are real: the unfused scores grow with s^2.
    small = model.memory.estimate(MicroBatchShape((256,), outputs=batch.outputs))
    large = model.memory.estimate(MicroBatchShape((1024,), outputs=batch.outputs))
    assert large.dynamic_bytes > 6 * small.dynamic_bytes
    # Same inputs, same cache key: the second probe is served from the cache.
    modes = probe_module.modes_for(geometry, model.provider.effective_recompute, True)
    second = probe_module.probe(
        model.model, geometry=geometry, layout=model.layout,
        implementation=model.implementation, dtype="float32", lora_rank=1, modes=modes,
        outputs={(OutputRequest(target_logprobs=True), True)}, tokens=SMALL_PROBE_TOKENS,
    )
    assert second is coefficients


def test_moe_layers_probe_and_measure_within_target(megatron_process):
    """MoE layers (local spec, SequentialMLP experts with LoRA) are probed like dense ones."""
    from _calibration.harness import POLICY_BY_NAME, CalibrationModel, Cell

    from _tiny import tiny_moe

    cells = [Cell("tiny-moe", "selective default", 8, 1, (96, 160), "logprobs", True),
             Cell("tiny-moe", "selective default", 8, 1, (96, 160), "logprobs", False)]
    model = CalibrationModel(tiny_moe(num_layers=2, hidden=64),
                             POLICY_BY_NAME["selective default"], lora_rank=8,
                             tensor_parallel=1, cells=cells, probe_tokens=SMALL_PROBE_TOKENS)
    assert {k for k, _, _ in model.coefficients.layers} == {"attention_moe"}
    for cell in cells:
        result = model.measure(cell)
        assert 1.0 <= result.ratio <= 1.05, (cell, result.measured_bytes, result.predicted_bytes)


def test_fit_is_exact_at_probe_points_and_never_below_a_convex_peak():
    from art.trainer_rank.measuring.probe import Fit

    def peak(s: float) -> float:  # which op wins changes with s, as in a real layer
        return max(40_000 * s, 60 * s * s + 2_000 * s, 3e6)

    tokens = (128, 256, 384, 512, 768, 1024, 1536, 2048)
    fit = Fit.fit(tokens, [peak(t) for t in tokens])
    for t in tokens:
        assert abs(fit.at(t) - peak(t)) <= 1
    for s in range(128, 4097, 64):
        assert fit.at(s) >= peak(s) - 1, s
    assert fit.at(1280) <= 1.05 * peak(1280)


def test_probe_for_provider_feeds_memory_model_for_provider(megatron_process):
    from _calibration.harness import POLICY_BY_NAME, CalibrationModel, Cell
    from _calibration.harness import calibration_geometries as geometries

    from art.trainer_rank._request import MicroBatchShape, OutputRequest
    from art.trainer_rank.measuring.probe import probe_for_provider
    from art.trainer_rank.pricing.model import MemoryModel

    cell = Cell("gqa-128", "full uniform 1", 8, 1, (192,), "logprobs", True)
    built = CalibrationModel(geometries()["gqa-128"], POLICY_BY_NAME["full uniform 1"],
                             lora_rank=8, tensor_parallel=1, cells=[cell],
                             probe_tokens=SMALL_PROBE_TOKENS)
    logprobs = OutputRequest(target_logprobs=True)
    coefficients = probe_for_provider(built.provider, built.model,
                                      outputs=[(logprobs, True), (logprobs, False)],
                                      tokens=SMALL_PROBE_TOKENS)
    assert {m for _, m, _ in coefficients.layers} == {"nograd", "none", "full:1"}
    model = MemoryModel.for_provider(built.provider, coefficients=coefficients)
    estimate = model.estimate(MicroBatchShape((192,), outputs=logprobs))
    assert estimate.coefficients_source == f"probe:{coefficients.key}"
    result = built.measure(cell)
    predicted = max(estimate.forward_peak_bytes, estimate.backward_peak_bytes)
    assert 1.0 <= predicted / result.measured_bytes <= 1.05


def test_reprice_uses_only_a_probe_stored_under_the_current_key(megatron_process, tmp_path,
                                                                monkeypatch):
    """`calibrate.py --reprice` re-prices measured rows with stored probes; a probe stored
    under another key (made by another version of the probe) is never used: an error names
    --reprobe, and with reprobe the model is probed again and its rows priced by it."""
    import pytest
    from _calibration.harness import (
        POLICY_BY_NAME,
        CalibrationModel,
        Cell,
        calibration_geometries,
        expected_probe_key,
    )
    from _calibration.reprice import reprice_rows

    from art.trainer_rank.measuring import probe as probe_module

    tokens = (48, 64, 96)
    cells = [Cell("gqa-128", "none", 8, 1, (70, 41), "logprobs", True),
             Cell("gqa-128", "none", 8, 1, (83,), "logits", False)]
    built = CalibrationModel(calibration_geometries()["gqa-128"], POLICY_BY_NAME["none"],
                             lora_rank=8, tensor_parallel=1, cells=cells, probe_tokens=tokens,
                             probe_dir=str(tmp_path))
    assert expected_probe_key(cells, tokens) == built.coefficients.key
    rows = [built.measure(c).row() for c in cells]
    del built
    again = reprice_rows(rows, str(tmp_path), probe_tokens=tokens)
    assert [(r["ratio"], r["default_ratio"]) for r in again] == [
        (r["ratio"], r["default_ratio"]) for r in rows]

    cache_key = probe_module.cache_key
    monkeypatch.setattr(probe_module, "cache_key",
                        lambda **kw: cache_key(**kw)[::-1])  # another probe version
    with pytest.raises(ValueError, match="--reprobe"):
        reprice_rows(rows, str(tmp_path), probe_tokens=tokens)
    reprobed = reprice_rows(rows, str(tmp_path), probe_tokens=tokens, reprobe=True)
    assert {r["probe_key"] for r in reprobed} == {expected_probe_key(cells, tokens)}
    assert {r["probe_key"] for r in reprobed} != {r["probe_key"] for r in rows}
    assert (tmp_path / f"probe-{reprobed[0]['probe_key']}.json").is_file()
    for r in reprobed:
        assert 1.0 <= r["ratio"] <= 1.05, r


def test_full_unit_mixing_layer_kinds_prices_the_held_incoming_gradient(megatron_process):
    """Full recompute, units of two layers on the hybrid: layers 3-4 (Gated DeltaNet, then
    attention) form one checkpoint priced from the two layers' probes. Megatron's checkpoint
    keeps the unit's incoming gradient referenced until the unit's backward returns, so the
    top layer's backward is probed with it held (`backward_held`); the micro-batch's peak is
    in that unit's backward and priced within [1.00, 1.05]. On Megatron's unfused attention,
    whose s^2 scores put the peak in that unit (on the segmented flash attention it is in the
    Gated DeltaNet unit below, where the held gradient does not decide the price)."""
    from _calibration.harness import Cell

    from art.megatron.implementation import Implementation

    cell = Cell("hybrid-128", "full uniform 2", 8, 1, (222,), "logprobs", True)
    model = _slice_model([cell], Implementation.cpu_local("unfused"))
    modes = {(k, m): fit for k, m, fit in model.coefficients.layers}
    assert modes[("attention", "none")].backward_held is not None
    result = model.measure(cell)
    assert result.peak_at == "backward: layers 3-4 backward (full recompute unit)", result.peak_at
    assert 1.0 <= result.ratio <= 1.05, (result.measured_bytes, result.predicted_bytes)


def test_hybrid_moe_prices_routing_state_and_expert_adapters(megatron_process):
    """Without grad, each MoE layer's token dispatcher keeps its routing state referenced
    after the layer returns (until its next call), so the gated attention layer on top runs
    with the three Gated DeltaNet MoE layers' state still live; the gate is a copy out of the
    QKV buffer, live through core attention. Probe (no-grad `kept`) and default formulas
    price the row within [1.00, 1.05] and name the earlier layers' state as a term. With
    grad the default formulas price what the experts keep: the activation and its product
    with the routing probabilities, each local expert's LoRA (rows per routed pair, A weights
    concatenated per expert), the router's indices and the dispatcher's map."""
    from _calibration.harness import Cell, micro_batch_shape

    from art.trainer_rank._request import OutputRequest

    cell = Cell("hybrid-moe-128", "none", 8, 1, (352,), "top_k=20", False)
    with_grad = Cell("hybrid-moe-128", "none", 8, 1, (348,), "logits", True)
    model = _slice_model([cell, with_grad])
    trained = model.measure(with_grad)
    assert 1.0 <= trained.default_ratio <= 1.05, (
        "defaults, grad", trained.measured_bytes, trained.predicted_default_bytes)
    assert 1.0 <= trained.ratio <= 1.05, ("probe, grad", trained.measured_bytes,
                                          trained.predicted_bytes)
    result = model.measure(cell)
    batch = micro_batch_shape(cell.lengths, OutputRequest.parse(cell.outputs), False,
                              model.layout, model.implementation)
    for memory in (model.memory, model.memory_default):
        names = {t.name for t in memory.estimate(batch).terms}
        assert "state kept by earlier layers (no grad)" in names, names
    assert 1.0 <= result.ratio <= 1.05, ("probe", result.measured_bytes, result.predicted_bytes)
    assert 1.0 <= result.default_ratio <= 1.05, (
        "defaults", result.measured_bytes, result.predicted_default_bytes)


def test_hybrid_row_of_many_sequences_prices_each_sequence_conv_padding(megatron_process):
    """A packed row of many short sequences: each Gated DeltaNet layer's causal conv pads
    every sequence on its own (`SegmentedCausalConv1d`) and keeps that padded input for
    backward, which the probe (one sequence per point) does not see; the estimate adds it per
    extra sequence, so the row lands within [1.00, 1.05]. On Megatron's unfused attention,
    whose score buffer puts the peak in the attention layer's backward, with every Gated
    DeltaNet layer's padded input still kept."""
    import random

    from _calibration.harness import Cell

    from art.megatron.implementation import Implementation

    rng = random.Random("many sequences")
    lengths = tuple(rng.randint(10, 40) for _ in range(13))
    cell = Cell("hybrid-128", "selective default", 8, 1, lengths, "logprobs", True)
    model = _slice_model([cell], Implementation.cpu_local("unfused"))
    result = model.measure(cell)
    assert result.peak_at == "backward: layer 4 backward", result.peak_at
    assert 1.0 <= result.ratio <= 1.05, (lengths, result.measured_bytes, result.predicted_bytes)
    assert 1.0 <= result.default_ratio <= 1.05, (
        lengths, result.measured_bytes, result.predicted_default_bytes)


def test_no_grad_peak_before_the_first_attention_layer_holds_no_score_buffer(
        megatron_process):
    """The hybrid's first three layers are Gated DeltaNet: without grad a row of short
    sequences (each padded to whole 64-token chunks there) peaks in one of them, before the
    attention layer's first call allocates Megatron's score buffer, so that peak is priced
    without it (probe within [1.00, 1.05]; the buffer term absent). The default formulas
    price that layer's working set: the padded chunk copies and the decay mask the CPU rule
    builds at once, on the views of in_proj's and the conv's outputs it runs on. On Megatron's
    unfused attention, the build that has a score buffer (the segmented flash attention has
    none to leave out)."""
    from _calibration.harness import Cell, micro_batch_shape

    from art.megatron.implementation import Implementation
    from art.trainer_rank._request import OutputRequest

    cell = Cell("hybrid-128", "none", 8, 1, (9, 23, 30, 46), "top_k=20", False)
    model = _slice_model([cell], Implementation.cpu_local("unfused"))
    result = model.measure(cell)
    estimate = model.memory.estimate(micro_batch_shape(
        cell.lengths, OutputRequest.parse(cell.outputs), False, model.layout,
        model.implementation))
    assert estimate.peak_at == "forward: layer 2", estimate.peak_at
    assert "attention score buffer" not in {t.name for t in estimate.terms}
    assert 1.0 <= result.ratio <= 1.05, (result.measured_bytes, result.predicted_bytes)
    assert 1.0 <= result.default_ratio <= 1.05, (
        result.measured_bytes, result.predicted_default_bytes)


def test_hybrid_rows_of_short_sequences_priced_from_sparse_chunk_rows(megatron_process):
    """Rows of many short sequences leave most of each 64-token chunk of a Gated DeltaNet
    layer as padding, where the rule's padded work, not the tokens, sets the layer's peak;
    one probe sequence never has that much padding. The probe measures rows of one short
    sequence per chunk, and its full-chunk line keeps the slope of rows the tokens dominate,
    so both kinds of row land within [1.00, 1.03] with the peak in a Gated DeltaNet layer:
    without grad (forward peak) and with grad (backward peak)."""
    import random
    import re

    from _calibration.harness import Cell

    rng = random.Random("sparse chunks")
    forward_row = tuple(rng.randint(12, 30) for _ in range(8))
    backward_row = tuple(rng.randint(8, 30) for _ in range(14))
    cells = [Cell("hybrid-128", "full uniform 1", 8, 1, forward_row, "top_k=20", False),
             Cell("hybrid-128", "full uniform 1", 8, 1, backward_row, "logprobs", True)]
    model = _slice_model(cells)
    for cell in cells:
        result = model.measure(cell)
        # Layers 1-3 are the Gated DeltaNet layers.
        assert re.match(r"(forward|backward): layer [123]\b", result.peak_at), (
            cell.lengths, result.peak_at)
        assert 1.0 <= result.ratio <= 1.03, (
            cell.lengths, result.measured_bytes, result.predicted_bytes)


def test_moe_checkpoint_units_hold_input_and_gradient_past_their_backward(megatron_process):
    """Full recompute, one layer per unit, on the MoE hybrid: each MoE layer's token
    dispatcher keeps the routing probabilities it computed while its unit was rebuilt, and
    their graph reaches the unit input Megatron's checkpoint detached into a leaf, so that
    input and its gradient outlive the unit's backward (with the routing state). By the
    first layer's backward three units above hold them: the peak moves there, priced by a
    term of its own, and the row lands within [1.00, 1.05]."""
    import random

    from _calibration.harness import Cell, micro_batch_shape

    from art.trainer_rank._request import OutputRequest

    rng = random.Random("moe checkpoint units")
    lengths = tuple(rng.randint(10, 45) for _ in range(4))
    cell = Cell("hybrid-moe-128", "full uniform 1", 8, 1, lengths, "logprobs", True)
    model = _slice_model([cell])
    result = model.measure(cell)
    estimate = model.memory.estimate(micro_batch_shape(
        lengths, OutputRequest.parse(cell.outputs), True, model.layout, model.implementation))
    assert estimate.peak_at == "backward: layer 1 backward", estimate.peak_at
    held = {t.name: t.bytes for t in estimate.terms if t.lifetime == "backward"}
    hidden_row = sum(lengths) * 128 * 4
    # Units 4, 3 and 2 hold their inputs and gradients, less the gradient unit 2 hands
    # down (unit 1's incoming gradient), and their routing state.
    assert held["held by MoE layers above"] > 5 * hidden_row, held
    assert 1.0 <= result.ratio <= 1.05, (lengths, result.measured_bytes, result.predicted_bytes)
    assert 1.0 <= result.default_ratio <= 1.05, (
        lengths, result.measured_bytes, result.predicted_default_bytes)


def test_gdn_no_grad_forward_sets_the_gpu_shaped_peak_priced_from_measurement(
        megatron_process):
    """Without grad and with flash attention, a Gated DeltaNet layer's forward sets the row's
    peak: the CPU rule's working set while it masks the decay, on in_proj's and the conv's
    outputs and the rule's input copies, before the rule's output exists and with no
    hidden-sized tensor beside the layer input (its norm sits in in_proj). The default
    formulas price such rows, one sequence and several, within [1.00, 1.05]."""
    from _calibration.harness import (
        POLICY_BY_NAME,
        Cell,
        calibration_geometries,
        calibration_provider,
        default_memory_model,
        implementation_for,
        micro_batch_shape,
        run_micro_batch,
    )

    from art.trainer_rank._request import OutputRequest

    cells = [Cell("hybrid-128", "none", 8, 1, (700,), "logprobs", False, build="gpu-shaped"),
             Cell("hybrid-128", "none", 8, 1, (130, 41, 300), "top_k=20", False,
                  build="gpu-shaped")]
    impl = implementation_for("gpu-shaped")
    provider = calibration_provider(calibration_geometries()["hybrid-128"],
                                    POLICY_BY_NAME["none"], lora_rank=8, tensor_parallel=1,
                                    dtype="float32", implementation=impl)
    model = provider.build_model(seed=0)
    memory = default_memory_model(cells[0])
    for cell in cells:
        outputs = OutputRequest.parse(cell.outputs)
        measured, _ = run_micro_batch(model, cell.lengths, outputs, False, provider.layout,
                                      impl, torch.device("cpu"))
        est = memory.estimate(micro_batch_shape(cell.lengths, outputs, False, provider.layout,
                                                impl))
        assert est.peak_at in ("forward: layer 1", "forward: layer 2", "forward: layer 3"), (
            est.peak_at)
        predicted = max(est.forward_peak_bytes, est.backward_peak_bytes)
        assert 1.0 <= predicted / measured <= 1.05, (cell.lengths, measured, predicted)


@pytest.mark.parametrize("build", ["flash", "unfused"])
def test_probe_runs_a_cpu_point_once_unless_it_left_allocations_behind(megatron_process,
                                                                      build):
    """A probe point measures the layer as the trainer meets it, with what a first run
    allocates to keep (the LoRA grads; on the unfused build the score buffer, released
    before each point) already in place. On CPU the point runs once and again only when its
    run left allocations behind: a new layer's first point runs twice and reads what the
    next does; the next runs once; a released score buffer makes a point run twice."""
    from _calibration.cells import calibration_geometries
    from _calibration.harness import POLICY_BY_NAME, calibration_provider

    from art.megatron.implementation import Implementation
    from art.trainer_rank.measuring import probe_runs
    from art.trainer_rank.measuring.meter import release_score_buffer

    geometry = calibration_geometries()["gqa-128"]
    implementation = Implementation.cpu_local("unfused" if build == "unfused" else "flash")
    provider = calibration_provider(geometry, POLICY_BY_NAME["none"], lora_rank=8,
                                    tensor_parallel=1, dtype="float32",
                                    implementation=implementation)
    model = provider.build_model(seed=0)
    layer = probe_runs.inner_model(model).decoder.layers[0]
    runs = []
    handle = layer.register_forward_hook(lambda *_: runs.append(1))
    inputs = probe_runs.probe_inputs(model, [150], provider.layout, implementation,
                                     torch.device("cpu"))

    def measure() -> tuple[dict[str, float], int]:
        runs.clear()
        row = probe_runs.measure_layer(layer, inputs, geometry.hidden_size, torch.float32,
                                       torch.device("cpu"), True)
        return row, len(runs)

    release_score_buffer()
    first, first_runs = measure()
    second, second_runs = measure()
    assert (first_runs, second_runs) == (2, 1)
    assert first == second
    release_score_buffer()
    third, third_runs = measure()
    assert third == second
    assert third_runs == (2 if build == "unfused" else 1)
    handle.remove()
