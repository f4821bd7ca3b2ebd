"""scripts/upstream_driver.py under torchrun (2 ranks, one launch): TP=2 and TP=1 x DP=2 train
the same adapter on the same fixed batch, so their steps must agree to fp32 rounding (the
clipped grad norm counts the TP-sharded LoRA factors on every rank); the loss goes down, the
adapter moves, the base does not; the driver reads the DP size through `train.ps` as upstream's
does. Then upstream's DP waves: contiguous, dealt round-robin, in lockstep, with a collective in
the loop."""

from __future__ import annotations

import json

import pytest

from _torchrun import ROOT, run_torchrun

pytestmark = pytest.mark.torchrun


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("upstream_driver")
    run_torchrun(ROOT / "tests" / "distributed" / "upstream_driver_worker.py", str(out),
                 timeout_s=400, env={"ART_TRAINER_RANK_PROBE_LAYERS": "false",
                                     "ART_MEGATRON_RANDOM_STATE": "11"})
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_driver_trains_at_tp2_and_dp2(reports):
    for report in reports:
        for phase in ("tp2", "dp2"):
            r = report[phase]
            assert r["adapter_changed"] and r["base_untouched"], phase
            assert r["losses"][-1] < r["losses"][0], (phase, r["losses"])
            assert all(step["update_successful"] == 1.0 for step in r["steps"])
        assert report["tp2"]["tensor_parallel"] == 2 and report["dp2"]["tensor_parallel"] == 1
        # Both start from the checkpoint the driver saved with transformers, loaded as pretrained.
        assert report["tp2"]["model_initialization"] == "pretrained" == \
            report["dp2"]["model_initialization"]


def test_tp2_steps_equal_tp1_steps(reports):
    tp2, dp2 = reports[0]["tp2"], reports[0]["dp2"]
    assert tp2["losses"] == pytest.approx(dp2["losses"], rel=1e-5, abs=1e-6)
    norms = [s["grad_norm"] for s in tp2["steps"]], [s["grad_norm"] for s in dp2["steps"]]
    # Step 0 is before any Adam update: the clipped norm agrees to fp32 rounding (counting the
    # sharded LoRA factors on TP rank 0 only would put TP=2's far below).
    assert norms[0][0] == pytest.approx(norms[1][0], rel=1e-6)
    assert norms[0] == pytest.approx(norms[1], rel=1e-4)
    assert tp2["adapter"].keys() == dp2["adapter"].keys()
    # Adam turns rounding-level gradient differences into differences of up to ~lr on
    # elements whose gradient is near zero: nearly all elements agree to fp32 rounding.
    close = total = 0
    for key in tp2["adapter"]:
        a, b = tp2["adapter"][key], dp2["adapter"][key]
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-3, key
        close += sum(abs(x - y) <= 2e-5 for x, y in zip(a, b))
        total += len(a)
    assert close / total > 0.99
    # Both DP ranks hold the same adapter after the steps.
    assert reports[1]["dp2"]["adapter"] == dp2["adapter"]


def test_cp2_steps_equal_dp2_steps(reports):
    """CP=2 (each rank holds half of every row, the layer probe measured on those halves)
    trains exactly as TP=1 x DP=2 on the same global batch: the step scales DDP's DP x CP
    average back to the sum of the CP ranks' parts."""
    cp2, dp2 = reports[0]["cp2"], reports[0]["dp2"]
    assert cp2["context_parallel"] == 2 and cp2["data_parallel"] == 1
    assert cp2["probed_layers"] > 0
    assert cp2["adapter_changed"] and cp2["base_untouched"]
    assert cp2["losses"] == pytest.approx(dp2["losses"], rel=1e-5, abs=1e-6)
    norms = [s["grad_norm"] for s in cp2["steps"]], [s["grad_norm"] for s in dp2["steps"]]
    assert norms[0][0] == pytest.approx(norms[1][0], rel=1e-5)
    assert norms[0] == pytest.approx(norms[1], rel=1e-4)
    for key in cp2["adapter"]:
        a, b = cp2["adapter"][key], dp2["adapter"][key]
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-3, key
    assert reports[1]["cp2"]["adapter"] == cp2["adapter"]


def test_hybrid_cp2_steps_equal_dp2_steps(reports):
    """A Gated DeltaNet hybrid at CP=2 (its recurrence over the whole row gathered on each CP
    rank, its attention split) trains as at TP=1 x DP=2."""
    cp2, dp2 = reports[0]["hybrid"]["cp2"], reports[0]["hybrid"]["dp2"]
    assert cp2["adapter_changed"] and cp2["base_untouched"]
    assert cp2["losses"] == pytest.approx(dp2["losses"], rel=1e-5, abs=1e-6)
    assert [s["grad_norm"] for s in cp2["steps"]] == pytest.approx(
        [s["grad_norm"] for s in dp2["steps"]], rel=1e-4)
    for key in cp2["adapter"]:
        a, b = cp2["adapter"][key], dp2["adapter"][key]
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-3, key


def test_moe_ep2_steps_equal_ep1_steps(reports):
    """A MoE checkpoint at EP=2 (each rank holds half the experts; gloo's all-to-all) trains
    exactly as at EP=1."""
    ep2, ep1 = reports[0]["moe"]["ep2"], reports[0]["moe"]["ep1"]
    assert ep2["adapter_changed"] and ep2["base_untouched"]
    assert ep2["losses"] == pytest.approx(ep1["losses"], rel=1e-5, abs=1e-6)
    assert [s["grad_norm"] for s in ep2["steps"]] == pytest.approx(
        [s["grad_norm"] for s in ep1["steps"]], rel=1e-4)


def test_moe_cp2_ep2_steps_equal_ep1_steps(reports):
    """The MoE checkpoint at CP=2 x EP=2 (each rank holds half of every row, its experts take
    both halves' routed tokens) trains exactly as at TP=1 x DP=2: the step scales DDP's
    average (an expert's over Megatron's expert data-parallel group, CP folded in) back to
    the sum of the CP ranks' parts."""
    cp2, ep1 = reports[0]["moe"]["cp2ep2"], reports[0]["moe"]["ep1"]
    assert (cp2["context_parallel"], cp2["expert_parallel"], cp2["data_parallel"]) == (2, 2, 1)
    assert cp2["adapter_changed"] and cp2["base_untouched"]
    assert cp2["losses"] == pytest.approx(ep1["losses"], rel=1e-5, abs=1e-6)
    assert [s["grad_norm"] for s in cp2["steps"]] == pytest.approx(
        [s["grad_norm"] for s in ep1["steps"]], rel=1e-4)


def test_driver_reads_the_data_parallel_size_through_train_ps(reports):
    assert reports[0]["tp2"]["data_parallel"] == 1 and reports[0]["dp2"]["data_parallel"] == 2


def test_dp_ranks_take_upstream_waves_in_lockstep(reports):
    a, b = reports[0]["waves"], reports[1]["waves"]
    assert (a["dp_rank"], b["dp_rank"], a["dp_size"]) == (0, 1, 2)
    assert len(a["rows"]) == len(b["rows"])  # the same number of micro-batches on every rank
    assert all(total == 2 for total in a["totals"] + b["totals"])
    waves = []
    for ra, rb in zip(a["rows"], b["rows"]):
        # Both ranks' micro-batches of one step belong to the same wave.
        wave = (ra["global_start"], ra["global_stop"])
        assert wave == (rb["global_start"], rb["global_stop"])
        assert ra["global_count"] == rb["global_count"] == wave[1] - wave[0]
        for report, row in ((a, ra), (b, rb)):
            start, stop = wave
            assert set(row["indices"]) <= set(range(start + report["dp_rank"], stop, 2)), row
            assert row["local_count"] == len(row["indices"])
        if not waves or waves[-1] != wave:
            waves.append(wave)
    # Contiguous waves over every item, each run once.
    assert waves[0][0] == 0 and waves[-1][1] == a["items"]
    assert all(w[1] == v[0] for w, v in zip(waves, waves[1:]))
    assert len(waves) > 1  # the cold cap and the limit really did narrow them
    assert sorted(i for r in a["rows"] + b["rows"] for i in r["indices"]) == list(range(7))
    assert "empty" in [r["decision"] for r in a["rows"] + b["rows"]]
