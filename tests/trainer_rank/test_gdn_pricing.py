"""The default formulas' Gated DeltaNet blocks equal what the real layer keeps, block by block
(scripts/gdn_blocks.py's measurement: storages saved for backward, by the block that created
them), in bf16 at an off-grid token count."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gdn_blocks.py"
MIXER_BLOCKS = ("input norm + in_proj", "split, qkv transpose copy", "causal conv1d + silu",
                "q/k l2norm", "q/k repeat, gates (g, beta)", "gated delta rule",
                "gated output norm", "out_proj")
# The rows every layer kind shares: the bf16 residual is not kept (the frozen torch pre-MLP
# norm keeps its fp32 upcast), SwiGLU keeps what torch's unfused one keeps.
SHARED_BLOCKS = ("residual add", "pre-MLP norm", "fc1", "swiglu", "fc2")


def test_gated_delta_net_blocks_are_priced_as_measured(megatron_process):
    spec = importlib.util.spec_from_file_location("gdn_blocks", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    measured, provider, _ = script.measure(333, "bfloat16")
    priced = dict(script.priced(provider, 333))
    got = dict(measured)
    assert "layer input" not in priced  # bf16: the frozen in_proj norm keeps its fp32 upcast
    for block in MIXER_BLOCKS + SHARED_BLOCKS:
        assert priced[block] == pytest.approx(got.get(block, 0), rel=0.01, abs=64), block
    assert sum(priced.values()) == pytest.approx(sum(got.values()), rel=0.01)


def test_full_chunk_line_takes_the_slope_of_rows_the_tokens_dominate():
    """Inside a chunk the probe's points give the full-chunk line's slope. A point whose
    padding is large enough for the rule's padded work to set the peak reads a flatter slope
    (its value lies above the tokens' line); the sparse-chunk rows price that regime, so the
    line takes the steepest slope, and a nearly full row is priced on it exactly."""
    from art.trainer_rank.pricing.chunked import split_points
    from art.trainer_rank.pricing.fit import Fit

    def peak(tokens: int, padded: int) -> float:
        # Larger of the tokens' line (20 per token) and the padded work's line (8 per token,
        # 6 per padded token): the padded work wins at 32 of 64 tokens, not at 48 or 96.
        return max(1000.0 + 20 * tokens, 1096.0 + 8 * tokens + 6 * padded)

    points = (32, 48, 64, 96, 128, 192, 256)
    rows = [{"forward": peak(t, -(-t // 64) * 64)} for t in points]
    whole, _, within = split_points(points, rows, 64, lambda ts, vs: Fit.fit(ts, vs).at)
    assert whole == (64, 128, 192, 256)
    assert within.forward == pytest.approx(20.0)


def test_sparse_rows_past_the_second_fill_are_read_on_the_chord_to_the_full_chunk():
    """On rows of one short segment per chunk a quantity is convex in the fill. Where the
    kernel's padded work stops setting the peak between the two measured fills (1 and 8
    tokens a chunk), the line through them falls ever further under the truth past the
    second fill; the chord to the full chunk bounds it and is exact where the rest is one
    line. A row with a segment longer than a chunk keeps the line: its partly filled chunks
    are fewer than the sparse rows'."""
    from art.trainer_rank.pricing.chunked import SparseChunks
    from art.trainer_rank.pricing.fit import Fit

    def truth(tokens: float, padded: int) -> float:
        # Padded work falling steeply with the fill up to about 4 tokens a chunk, then one
        # line (a quantity measured above the kept state, which grows with the tokens).
        chunks = padded / 64
        fill = tokens / chunks
        return chunks * max(20000.0 - 2000 * fill, 12000.0 - 100 * fill)

    pads = (128, 256, 448, 512)
    sparse = SparseChunks(64, (1, 8), (("backward",
                                        Fit.fit(pads, [truth(p / 64, p) for p in pads]),
                                        Fit.fit(pads, [truth(8 * p / 64, p) for p in pads])),))

    def full_chunks(padded: int) -> float:
        return truth(padded, padded)

    # 7 segments of 16 tokens in 7 chunks: the chord is exact, the line far under.
    assert sparse.value("backward", 112, 448, full_chunks, segments=7) == round(truth(112, 448))
    assert sparse.value("backward", 112, 448) < 0.5 * truth(112, 448)
    # One sequence of 112 tokens in 2 chunks is not a sparse row: the line, as before.
    assert sparse.value("backward", 112, 128, full_chunks, segments=1) == sparse.value(
        "backward", 112, 128)


def test_cp_row_of_short_segments_is_read_on_the_sparse_chord():
    """The committed CP2 row of six short sequences (113 tokens, 7 segments with the padded
    tail, 7 kernel chunks; measured under torchrun) peaks in a Gated DeltaNet layer's
    backward, whose sparse-row value falls steeply from 1 to 8 tokens a chunk and then along
    one line to the full chunk. Read on the line through the two fills it was under its peak
    on both hybrids (0.9997); on the chord, in the band. Re-priced from the committed rows."""
    import csv

    from _calibration.reprice import reprice_rows

    for matrix in ("hybrid-cp2", "moe-cp2"):
        folder = Path(__file__).resolve().parents[2] / "bench" / "calibration" / matrix
        with open(folder / "calibration.csv") as f:
            group = [r for r in csv.DictReader(f)
                     if r["policy"] == "none" and r["lora_rank"] == "8"]
        priced = {r["lengths"]: r for r in reprice_rows(group, str(folder / "probes"))}
        row = priced["13+9+16+55+9+11"]
        assert row["peak_at"] == "backward: layer 3 backward", row["peak_at"]
        assert 1.0 <= float(row["ratio"]) <= 1.05, (matrix, row["ratio"])


def test_chunked_models_get_probe_points_inside_a_chunk_on_every_device():
    """A hybrid's probe fits its Gated DeltaNet layers over whole-chunk points and needs one
    inside a chunk for the within-chunk slope: the CUDA grids are all whole chunks, so a
    hybrid's default grid gains points inside one (without them the fit stops with an
    error), and a probe cut short by a memory limit keeps three whole-chunk points and one
    inside (one whole point would price every larger row at its value)."""
    from _calibration.cells import calibration_geometries

    from art.megatron.implementation import Implementation
    from art.trainer_rank.measuring.probe import PROBE_TOKENS, default_probe_tokens
    from art.trainer_rank.pricing.chunked import (
        WHOLE_CHUNK_POINTS,
        fewest_chunked_points,
        split_points,
    )
    from art.trainer_rank.pricing.fit import Fit

    hybrid, dense = calibration_geometries()["hybrid-128"], calibration_geometries()["gqa-128"]
    for device, implementation in (("cuda", Implementation.gpu_te()),
                                   ("cuda", Implementation.cpu_local("unfused")),
                                   ("cpu", Implementation.cpu_local())):
        points = default_probe_tokens(device, implementation, hybrid)
        assert set(default_probe_tokens(device, implementation, dense)) <= set(points)
        rows = [{"forward": 1000.0 + 7 * t + 3 * (-(-t // 64) * 64)} for t in points]
        whole, _, within = split_points(points, rows, 64, lambda ts, vs: Fit.fit(ts, vs).at)
        assert len(whole) >= WHOLE_CHUNK_POINTS and within.forward == pytest.approx(7.0)
        head = points[:fewest_chunked_points(points)]
        assert sum(1 for t in head if t % 64 == 0) == WHOLE_CHUNK_POINTS
        assert any(t % 64 for t in head)
    assert default_probe_tokens("cpu", Implementation.cpu_local(), hybrid) == PROBE_TOKENS


def _hybrid_layer_0(head_dim: int):
    """A 4-layer hybrid (Gated DeltaNet head dims `head_dim`) built with rank-8 LoRA on the
    CPU local spec, no recompute: (geometry, implementation, provider, model, inner model,
    pricing dims, its first, Gated DeltaNet, layer)."""
    from _calibration.cells import POLICY_BY_NAME, lora_targets_for
    from _calibration.harness import calibration_provider

    from art.megatron.geometry import geometry_from_hf_dict
    from art.megatron.implementation import Implementation
    from art.trainer_rank.measuring import probe_runs
    from art.trainer_rank.pricing.layer_terms import Dims

    geometry = geometry_from_hf_dict(dict(
        model_type="qwen3_5_text", num_hidden_layers=4, hidden_size=128,
        intermediate_size=384, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
        vocab_size=1024, max_position_embeddings=4096, tie_word_embeddings=False,
        full_attention_interval=4, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
        linear_conv_kernel_dim=4, partial_rotary_factor=0.25), name=f"hybrid-dk{head_dim}")
    implementation = Implementation.cpu_local()
    provider = calibration_provider(geometry, POLICY_BY_NAME["none"], lora_rank=8,
                                    tensor_parallel=1, dtype="float32",
                                    implementation=implementation)
    model = provider.build_model(seed=0)
    inner = probe_runs.inner_model(model)
    dims = Dims(geometry, provider.layout, implementation, 4, 8,
                frozenset(lora_targets_for(geometry)))
    layer = inner.decoder.layers[0]  # Gated DeltaNet
    return geometry, implementation, provider, model, inner, dims, layer


def _tree_row(geometry, implementation, provider, inner, prompt: int, deeper: int,
              own: tuple[int, ...], generator, grad: bool):
    """A row of one group sharing a `prompt` (the first two sequences also share `deeper`
    tokens after it, a third depth), each sequence's `own` tokens after: the layer's probe
    inputs over it and the row's recurrent calls (segment lengths per depth)."""
    from dataclasses import replace

    import torch
    from _calibration.harness import micro_batch_shape

    from art.trainer_rank._request import OutputRequest
    from art.trainer_rank.compute.forward import _rotary, local_row
    from art.trainer_rank.compute.packing import pack_sequences
    from art.trainer_rank.measuring import probe_runs

    shared = torch.randint(1, geometry.vocab_size, (prompt + deeper,), generator=generator)
    sequences = [torch.cat([shared[:prompt + (deeper if k < 2 else 0)], torch.full((n,), 1 + k)])
                 for k, n in enumerate(own)]
    batch = pack_sequences(sequences, implementation=implementation, layout=provider.layout,
                           device="cpu", groups=[len(sequences)])
    row = local_row(inner, batch)
    tokens = row.tokens.shape[1]
    rotary = _rotary(inner, batch, torch.zeros(tokens, 1, geometry.hidden_size),
                     row.positions[0])
    inputs = probe_runs.ProbeInputs(replace(batch, packed_seq_params=row.packed_seq_params),
                                    rotary, tokens)
    recurrent = micro_batch_shape([len(s) for s in sequences], OutputRequest.parse("logprobs"),
                                  grad, provider.layout, implementation, sequences).recurrent
    assert sum(map(sum, recurrent.calls)) == tokens
    return inputs, recurrent


@pytest.mark.parametrize("head_dim, rows",
                         [(16, ((700,),)), (32, ((20,),)), (128, ((20,), (300,)))])
def test_rule_is_priced_at_its_highest_moments_whatever_the_head_dims(
        megatron_process, head_dim, rows):
    """The CPU rule's forward peaks masking the decay, adding a chunk's output, updating the
    state or stacking the outputs, and its backward at one of the moments of its two
    gradients, depending on the head dims and the chunk count; in grad mode the forward also
    runs beside what the layer's frame holds and backward does not keep. A Gated DeltaNet
    layer's forward, with and without grad, and its backward with the incoming gradient held
    (as a full-recompute unit calls it) are priced at the measured peak or a few hundred bytes
    above (one sequence: the conv's per-sequence padding is priced apart)."""
    import torch

    from art.trainer_rank.measuring import probe_runs
    from art.trainer_rank.measuring.meter import release_score_buffer
    from art.trainer_rank.pricing.layer_terms import PricedKind
    from art.trainer_rank.pricing.layers import price_layer

    geometry, implementation, provider, model, inner, dims, layer = _hybrid_layer_0(head_dim)
    for lengths in rows:
        inputs = probe_runs.probe_inputs(model, list(lengths), provider.layout,
                                         implementation, torch.device("cpu"))
        for grad in (False, True):
            release_score_buffer()
            measured = probe_runs.measure_layer(layer, inputs, geometry.hidden_size,
                                                torch.float32, torch.device("cpu"), grad,
                                                hold_incoming=grad)
            priced = price_layer(dims, PricedKind.LINEAR_ATTENTION, frozenset(), sum(lengths),
                                 grad=grad)
            pairs = [("forward", priced.forward, measured["forward"])]
            if grad:
                pairs.append(("backward", priced.backward_held, measured["backward"]))
            for name, price, got in pairs:
                assert 0 <= price - got <= 0.001 * got, (lengths, grad, name, price, got)


def test_rule_backward_over_several_sequences_holds_the_first_gradient_at_the_row(
        megatron_process):
    """The rule's second gradient (through the chunk matrix) holds what the first returned.
    Over one sequence those are views of the padded chunk gradients; over several, each
    sequence's rows are copied into tensors of the row's tokens and the padded ones die. With
    head dims 16 the second gradient is the rule's highest moment, so a row of short
    sequences (much of each chunk padding) holds less than one sequence over as many chunks:
    its layer's backward with the incoming gradient held is priced at the measured peak or a
    few hundred bytes above, at several fills (at one token a chunk the first gradient's
    moment is the highest)."""
    import torch

    from art.trainer_rank.measuring import probe_runs
    from art.trainer_rank.measuring.meter import release_score_buffer
    from art.trainer_rank.pricing.chunked import padded_chunk_tokens
    from art.trainer_rank.pricing.layer_terms import PricedKind
    from art.trainer_rank.pricing.layers import price_layer

    geometry, implementation, provider, model, inner, dims, layer = _hybrid_layer_0(16)
    for lengths in ((147, 70, 96, 79), (43,) * 9, (100, 28), (1,) * 3):
        inputs = probe_runs.probe_inputs(model, list(lengths), provider.layout,
                                         implementation, torch.device("cpu"))
        release_score_buffer()
        measured = probe_runs.measure_layer(layer, inputs, geometry.hidden_size, torch.float32,
                                            torch.device("cpu"), True, hold_incoming=True)
        priced = price_layer(dims, PricedKind.LINEAR_ATTENTION, frozenset(), sum(lengths),
                             grad=True, padded=padded_chunk_tokens(lengths),
                             segments=len(lengths))
        got = measured["backward"]
        assert 0 <= priced.backward_held - got <= 0.001 * got, (
            lengths, priced.backward_held, got)


def test_no_grad_prefix_tree_row_is_priced_one_call_at_a_time(megatron_process):
    """A row of prefix trees runs its Gated DeltaNet rule one varlen call per depth; without
    grad nothing of a call outlives it but its output, so the rule's decay, WY inverse and
    working set live for one call at a time, beside the earlier calls' outputs and its own
    stacked initial states (its final states come after its peak). A group sharing a prompt,
    two of its sequences a deeper part (three calls), run without grad through the trainer's
    sub-forward, peaks at a Gated DeltaNet layer and is priced inside [1.00, 1.05] of the
    measured peak by the formulas."""
    import torch
    from _calibration.cells import POLICY_BY_NAME, Cell, calibration_geometries
    from _calibration.harness import (
        calibration_provider,
        cell_sequences,
        implementation_for,
        micro_batch_shape,
        run_micro_batch,
    )

    from art.trainer_rank._request import OutputRequest
    from art.trainer_rank.pricing.layer_terms import PricedKind
    from art.trainer_rank.pricing.model import MemoryModel

    cell = Cell("hybrid-128", "none", 8, 1, (317, 68, 2, 111, 21, 2, 2, 2), "logprobs", False,
                build="gpu-shaped", shared_prefix=1, deeper=49)
    geometry = calibration_geometries()[cell.geometry]
    implementation = implementation_for(cell.build)
    provider = calibration_provider(geometry, POLICY_BY_NAME[cell.policy],
                                    lora_rank=cell.lora_rank, tensor_parallel=1,
                                    dtype=cell.dtype, implementation=implementation)
    model = provider.build_model(seed=0)
    outputs = OutputRequest.parse(cell.outputs)
    sequences = cell_sequences(cell, geometry.vocab_size)
    measured, _ = run_micro_batch(model, cell.lengths, outputs, False, provider.layout,
                                  implementation, torch.device("cpu"), sequences=sequences)
    batch = micro_batch_shape(cell.lengths, outputs, False, provider.layout, implementation,
                              sequences)
    assert batch.recurrent is not None and len(batch.recurrent.calls) == 3
    estimate = MemoryModel.for_provider(provider).estimate(batch)
    layer = int(estimate.peak_at.removeprefix("forward: layer "))
    assert PricedKind.of(geometry.layer_types[layer - 1], False).linear, estimate.peak_at
    assert 1.0 <= estimate.forward_peak_bytes / measured <= 1.05, (
        estimate.forward_peak_bytes, measured)


@pytest.mark.parametrize("head_dim, rows", [
    (16, ((5, 0, (40,) * 12),)),
    (32, ((1, 49, (267, 18, 1, 110, 20, 1, 1, 1)),)),
    (128, ((1, 49, (267, 18, 1, 110, 20, 1, 1, 1)), (452, 0, (12, 33, 1, 36, 1, 1, 1, 11)))),
])
def test_no_grad_layer_over_prefix_trees_is_priced_at_its_highest_call(
        megatron_process, head_dim, rows):
    """A Gated DeltaNet layer runs a row of groups sharing a prompt (`rows`: prompt, a deeper
    part the first two sequences share, each sequence's own tokens) one rule call per depth.
    Without grad it holds one call's working set, decay and inverse at a time, beside the
    earlier calls' outputs, its stacked initial states and, from the chunk loop on, the final
    states it hands on; which moment is highest depends on the head dims. The layer's no-grad
    forward is priced at the measured peak or up to 0.2% above."""
    import torch

    from art.trainer_rank.measuring import probe_runs
    from art.trainer_rank.measuring.meter import release_score_buffer
    from art.trainer_rank.pricing.layer_terms import PricedKind
    from art.trainer_rank.pricing.layers import price_layer

    geometry, implementation, provider, model, inner, dims, layer = _hybrid_layer_0(head_dim)
    generator = torch.Generator().manual_seed(0)
    for prompt, deeper, own in rows:
        inputs, recurrent = _tree_row(geometry, implementation, provider, inner, prompt,
                                      deeper, own, generator, grad=False)
        calls, tokens = recurrent.calls, inputs.rows
        assert len(calls) == (3 if deeper else 2)
        release_score_buffer()
        measured = probe_runs.measure_layer(layer, inputs, geometry.hidden_size,
                                            torch.float32, torch.device("cpu"), False)
        priced = price_layer(dims, PricedKind.LINEAR_ATTENTION, frozenset(), tokens,
                             grad=False, rule_calls=calls)
        assert 0 <= priced.forward - measured["forward"] <= 0.002 * measured["forward"], (
            calls, priced.forward, measured["forward"])


@pytest.mark.parametrize("prompt, deeper, own", [
    (3, 0, (4, 12, 4, 183, 22, 11, 4, 18, 4, 36, 4, 215, 15, 39, 5, 41)),
    (1, 36, (58, 38, 39, 2, 160, 2, 15, 2, 2, 284, 6, 298, 2, 37, 10, 39)),
])
def test_full_recompute_unit_over_prefix_trees_is_priced_at_its_backward(
        megatron_process, prompt, deeper, own):
    """A full-recompute unit of one Gated DeltaNet layer over a row of groups sharing a
    prompt (`deeper`: tokens the first two sequences also share, a third depth). Its forward
    saves nothing, so it holds its continued segments' initial states only in its own
    backward, where it rebuilds them: one layer's states, not every layer's. A call that
    handed final states to the depth below gets their gradients back, and the CPU rule
    rebuilds those states beside them. The unit's measured backward is priced from its
    peak and one layer's states within 2% above."""
    import torch

    from art.trainer_rank.measuring import probe_runs
    from art.trainer_rank.pricing.layer_terms import PricedKind
    from art.trainer_rank.pricing.layers import price_layer
    from art.trainer_rank.pricing.layers_gdn import prefix_tree_state_bytes
    from art.trainer_rank.pricing.passes import Unit, full_unit_peak

    geometry, implementation, provider, model, inner, dims, layer = _hybrid_layer_0(32)
    inputs, recurrent = _tree_row(geometry, implementation, provider, inner, prompt, deeper,
                                  own, torch.Generator().manual_seed(0), grad=True)
    tokens = inputs.rows
    assert len(recurrent.calls) == (3 if deeper else 2)
    measured = probe_runs.measure_layer(layer, inputs, geometry.hidden_size, torch.float32,
                                        torch.device("cpu"), True, full_layers=1,
                                        hold_incoming=True)["backward"]
    priced_layer = price_layer(dims, PricedKind.LINEAR_ATTENTION, frozenset(), tokens,
                               grad=True, rule_calls=recurrent.calls)
    x = tokens * geometry.hidden_size * 4
    priced = (full_unit_peak(Unit(True, 0, x, x, (priced_layer,)))
              + prefix_tree_state_bytes(dims, recurrent.continued_segments))
    assert 1.0 <= priced / measured <= 1.02, (recurrent.calls, priced, measured)


def test_cp_rows_sharing_a_prompt_under_full_recompute_price_one_unit_s_states():
    """The committed CP2 hybrid rows sharing a prompt, run with full recompute one layer a
    unit (measured under torchrun). Two of them, 16 sequences sharing a 3- and a 12-token
    prompt, peak at a Gated DeltaNet unit's backward, beside the states that unit rebuilt.
    Priced with every Gated DeltaNet layer's states held through the pass, the formulas were
    5.5% over both; with the states the layers really hold at once all three are in the
    band. Re-priced from the committed rows."""
    import csv

    from _calibration.reprice import reprice_rows

    folder = Path(__file__).resolve().parents[2] / "bench" / "calibration" / "hybrid-cp2"
    with open(folder / "calibration.csv") as f:
        # The model's whole group: its probe's key covers every output its rows request.
        group = [r for r in csv.DictReader(f)
                 if r["policy"] == "full uniform 1" and r["lora_rank"] == "8"]
    sharing = [r for r in reprice_rows(group, str(folder / "probes"))
               if int(r["shared_prefix"]) > 0]
    assert len(sharing) == 3
    for row in sharing:
        assert 1.0 <= float(row["default_ratio"]) <= 1.05, row
        assert 1.0 <= float(row["ratio"]) <= 1.05, row


def test_cp_row_with_a_tail_segment_is_read_where_the_probe_measured():
    """Under CP a Gated DeltaNet layer runs the whole row, and a 103-token sequence at CP2
    is padded to 104 with a 1-token tail segment: three kernel chunks for 104 tokens, 88
    padded. Read at that padding, the probe's within-chunk slope (the steepest its points
    give, over at most a chunk of padding) is stretched over 88 tokens and the committed
    CP2 hybrid MoE row (measured under torchrun) priced 7% under its peak. Read at one
    sequence of 104 tokens, with the formulas pricing the tail's chunk (pricing/
    probe_reading.py), and with the formulas' unit at the probe's one-sequence moment
    right (`test_cp_gated_deltanet_units_backward_meets_the_probe`), it is in the band.
    Re-priced from the committed row and its rank probes."""
    import csv

    from _calibration.reprice import reprice_rows

    folder = Path(__file__).resolve().parents[2] / "bench" / "calibration" / "moe-cp2"
    with open(folder / "calibration.csv") as f:
        group = [r for r in csv.DictReader(f)
                 if r["geometry"] == "hybrid-moe-128" and r["policy"] == "full uniform 1"
                 and r["lora_rank"] == "64"]
    priced = {r["lengths"]: r for r in reprice_rows(group, str(folder / "probes"))}
    row = priced["103"]
    assert row["peak_at"] == "backward: layer 1 backward"
    assert 1.0 <= float(row["ratio"]) <= 1.05, row["ratio"]


@pytest.mark.parametrize("matrix, kind", [("hybrid-cp2", "linear_attention"),
                                          ("moe-cp2", "linear_attention_moe")])
def test_cp_gated_deltanet_units_backward_meets_the_probe(matrix, kind):
    """Under CP a Gated DeltaNet mixer runs beside its gathered whole-row input, but its
    blocks' backward holds the residual stream's gradient of this rank's rows only: the
    whole-row input gradient appears at the gather's backward. A full-recompute unit's
    backward by the formulas against the committed CP2 probe's (measured on two torchrun
    ranks) at its one-sequence whole-row points: within 0.5%. Holding the gathered row's
    gradient twice through every mixer block priced it 4-5% over."""
    import csv

    from _calibration.harness import default_memory_model
    from _calibration.reprice import cell_of

    from art.trainer_rank.measuring.probe import ProbeCoefficients
    from art.trainer_rank.pricing.chunked import padded_chunk_tokens
    from art.trainer_rank.pricing.layer_terms import PricedKind
    from art.trainer_rank.pricing.layers import price_layer
    from art.trainer_rank.pricing.passes import Unit, full_unit_peak

    folder = Path(__file__).resolve().parents[2] / "bench" / "calibration" / matrix
    with open(folder / "calibration.csv") as f:
        row = next(r for r in csv.DictReader(f) if r["policy"] == "full uniform 1")
    model = default_memory_model(cell_of(row))
    probe = ProbeCoefficients.from_json(next(
        (folder / "probes").rglob(f"probe-{row['probe_key']}.json")).read_text())
    fit = next(fit for k, mode, fit in probe.layers if k == kind and mode == "full:1")
    cp = model.layout.context_parallel
    for tokens in (64, 128, 192, 256, 384, 512):  # whole rows, each one sequence
        local = tokens // cp
        layer = price_layer(model.dims, PricedKind(kind), frozenset(), local, grad=True,
                            padded=padded_chunk_tokens([tokens]))
        x = model.dims.hidden_tokens(local) * model.geometry.hidden_size * 4
        priced = full_unit_peak(Unit(True, 0, x, x, (layer,)))
        assert abs(priced / fit.cost(tokens).backward - 1) <= 0.005, (tokens, priced)


def test_probe_priced_unit_over_a_row_with_a_tail_segment_meets_its_peak(megatron_process):
    """A row laid out with a short tail segment of its own (as TP's sequence split and CP's
    2 x CP chunks pad it) runs that tail as another kernel chunk, which none of the probe's
    single sequences holds. The probe reads the row from its whole-chunk curve less its
    within-chunk slope, and the formulas correct what that reading misses: the formulas at
    the row less the formulas read the probe's way at the probe's points, both at one
    sequence of the row's tokens (pricing/probe_reading.py). A real Gated DeltaNet
    full-recompute unit, probed on this layer, is priced at its measured backward within
    0.2% on such rows (the correction against one sequence over the same chunks read 0.7%
    under on the 171-token row)."""
    import torch

    from art.trainer_rank.measuring import probe as probe_module
    from art.trainer_rank.measuring import probe_runs
    from art.trainer_rank.measuring.meter import release_score_buffer
    from art.trainer_rank.pricing.chunked import padded_chunk_tokens, with_points_inside_chunks
    from art.trainer_rank.pricing.coefficients import LayerMode, RecomputeMode
    from art.trainer_rank.pricing.layer_terms import PricedKind
    from art.trainer_rank.pricing.model import MemoryModel

    geometry, implementation, provider, model, inner, dims, layer = _hybrid_layer_0(16)
    kind = PricedKind.LINEAR_ATTENTION
    coefficients = probe_module.probe(
        model, geometry=geometry, layout=provider.layout, implementation=implementation,
        dtype="float32", lora_rank=8,
        modes=[LayerMode(kind, RecomputeMode(grad=True)),
               LayerMode(kind, RecomputeMode(grad=True, full_layers=1))],
        tokens=with_points_inside_chunks((64, 128, 192, 256, 320, 384)))
    priced_with = MemoryModel.for_provider(provider).with_coefficients(coefficients)
    for lengths in ((170, 1), (230, 2), (103, 1)):
        inputs = probe_runs.probe_inputs(model, list(lengths), provider.layout, implementation,
                                         torch.device("cpu"))
        release_score_buffer()
        got = probe_runs.measure_layer(layer, inputs, geometry.hidden_size, torch.float32,
                                       torch.device("cpu"), True, full_layers=1)["backward"]
        tokens, padded = sum(lengths), padded_chunk_tokens(lengths)
        change = priced_with._unit_segments_change(0, kind, 1, tokens, padded, 1, len(lengths))
        price = coefficients.layer_cost(kind, "full:1", tokens, padded, change).backward
        assert abs(price / got - 1) <= 0.002, (lengths, price, got)


@pytest.mark.parametrize("matrix", ["hybrid", "hybrid-tp2"])
def test_a_partial_rotary_attention_layer_keeps_what_the_probe_measured(matrix):
    """Qwen3.5's attention rotates a quarter of each head: the torch RoPE's cos and sin
    copies, which the layer keeps for backward, are [s, rotary dim], not [s, head dim]. The
    formulas' attention layer (the hybrid without MoE, selective core_attn) against the
    committed probe's, measured on the local flash build at TP1 and on two torchrun ranks at
    TP2: the same kept bytes and forward peak within 8 bytes, at points between the probe's.
    Priced at the head's width they were 192 bytes a token over."""
    import csv

    from _calibration.harness import default_memory_model, expected_probe_key
    from _calibration.reprice import cell_of

    from art.trainer_rank.measuring.probe import ProbeCoefficients
    from art.trainer_rank.pricing.layer_terms import PricedKind
    from art.trainer_rank.pricing.layers import price_layer

    folder = Path(__file__).resolve().parents[2] / "bench" / "calibration" / matrix
    with open(folder / "calibration.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["geometry"] == "hybrid-128"
                and r["policy"] == "selective default" and r["lora_rank"] == "8"
                and not r.get("built_with")]
    cells = [cell_of(r) for r in rows]
    model = default_memory_model(cells[0])
    assert model.geometry.rotary_dim < model.geometry.head_dim
    probe = ProbeCoefficients.from_json(next(
        (folder / "probes").rglob(f"probe-{expected_probe_key(cells)}.json")).read_text())
    fit = next(fit for k, mode, fit in probe.layers
               if k == PricedKind.ATTENTION and mode == "sel:core_attn")
    for tokens in (300, 700, 1500):
        layer = price_layer(model.dims, PricedKind.ATTENTION, frozenset({"core_attn"}), tokens,
                            grad=True)
        measured = fit.cost(tokens)
        assert abs(layer.kept - measured.kept) <= 8, (tokens, layer.kept - measured.kept)
        assert abs(layer.forward - measured.forward) <= 8, (tokens, layer.forward
                                                            - measured.forward)
