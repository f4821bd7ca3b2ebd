"""`plan`: the seed's case decided as the seed observed it, the grid, the recommendation order,
the JSON keys, the exit codes and the plot. All offline: pricing only, no model is built."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout

import pytest

from art.megatron.layout import ParallelLayout
from art.trainer_rank._request import MicroBatchShape, OutputRequest
from art.trainer_rank.cli.main import main as cli_main
from art.trainer_rank.cli.plan import plot_plan
from art.trainer_rank.cli.planner import (
    GIB,
    GPU_MEMORY_GIB,
    POLICIES,
    CurrentCell,
    candidate_layouts,
    current_cell,
    max_packed_tokens,
    memory_model_for,
    plan,
    scaled_batch,
)

from _tiny import tiny_dense

# The seed: one group of two ~16-20k-token sequences, 38,443 logical / 32,710 packed tokens,
# hidden states requested, rank-1 LoRA, Qwen3.5-27B on H200s.
SEED_BATCH = MicroBatchShape(
    (19222, 19221), outputs=OutputRequest(hidden_states=True), grad_enabled=True,
    padded_tokens=32710,
)
H200 = int(GPU_MEMORY_GIB["H200"] * GIB)
SEED_ARGS = ["plan", "--model", "Qwen3.5-27B", "--sequences", "19222,19221",
             "--shared-prefix", "5733", "--outputs", "hidden_states", "--lora-rank", "1",
             "--gpu", "H200"]


def run_cli(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        rc = cli_main(argv)
    return rc, out.getvalue()


@pytest.mark.parametrize("gpus, tp", [(2, 2), (4, 4), (4, 2)])
def test_seed_case_selective_does_not_fit_and_full_does(gpus: int, tp: int) -> None:
    result = plan("Qwen3.5-27B", batch=SEED_BATCH, gpus=gpus, gpu_memory_bytes=H200,
                  lora_rank=1)
    selective = result.cell("selective", tp)
    full = result.cell("full", tp)
    assert not selective.fits and full.fits
    # Per-rank figures: selective is many times what full needs, and is over the device.
    assert selective.peak_bytes > H200 > full.peak_bytes
    assert selective.peak_bytes > 3 * full.peak_bytes
    rec = result.recommended
    # On four GPUs selective+mlp (less recompute than full) fits at TP4 and is preferred.
    expected = "full" if gpus == 2 else "selective+mlp"
    assert rec is not None and rec.policy.name == expected
    assert rec.fits and rec.layout.tensor_parallel * rec.layout.context_parallel <= gpus
    summary = next(line for line in result.layout_summaries()
                   if line.startswith(f"TP{tp}" + (":" if gpus == tp else " DP")))
    assert "selective does not fit" in summary and "full fits" in summary
    assert "GiB/rank" in summary


def test_seed_case_mlp_recompute_is_priced_below_selective() -> None:
    """With fused SwiGLU (the TE build) an mlp checkpoint keeps only its input: fc1's output
    is no longer counted as kept, so selective+mlp is clearly cheaper than selective."""
    result = plan("Qwen3.5-27B", batch=SEED_BATCH, gpus=2, gpu_memory_bytes=H200, lora_rank=1)
    selective = result.cell("selective", 2).peak_bytes
    with_mlp = result.cell("selective+mlp", 2).peak_bytes
    assert with_mlp < 0.8 * selective, (with_mlp / 2**30, selective / 2**30)


def test_seed_case_tp4_per_rank_below_tp2() -> None:
    result = plan("Qwen3.5-27B", batch=SEED_BATCH, gpus=4, gpu_memory_bytes=H200, lora_rank=1)
    assert result.cell("full", 4).peak_bytes < result.cell("full", 2).peak_bytes
    assert result.cell("selective", 4).peak_bytes < result.cell("selective", 2).peak_bytes


def test_seed_case_cli_text_names_the_decision() -> None:
    rc, text = run_cli([*SEED_ARGS, "--gpus", "2"])
    assert rc == 0
    assert "TP2: " in text and "selective does not fit" in text and "full fits" in text
    assert "recommended: full recompute" in text
    assert "ART_MEGATRON_RECOMPUTE_GRANULARITY=full" in text
    assert "peak = resident + dynamic" in text  # the term table of the choice


def test_the_group_shape_gives_the_packed_row_and_contradictions_are_refused() -> None:
    shared = json.loads(run_cli([*SEED_ARGS, "--gpus", "2", "--json"])[1])
    bare = [a if a != "--shared-prefix" else "--packed-tokens" for a in SEED_ARGS]
    bare[bare.index("--packed-tokens") + 1] = "32710"
    assert json.loads(run_cli([*bare, "--gpus", "2", "--json"])[1])["cells"] == shared["cells"]
    err = io.StringIO()
    with redirect_stderr(err):
        rc, _ = run_cli([*SEED_ARGS, "--gpus", "2", "--packed-tokens", "30000"])
    assert rc == 2 and "contradicts --shared-prefix 5733" in err.getvalue()


def test_json_has_the_documented_keys() -> None:
    rc, text = run_cli([*SEED_ARGS, "--gpus", "4", "--json"])
    assert rc == 0
    data = json.loads(text)
    for key in ("model", "dtype", "lora_rank", "implementation", "gpus", "gpu_memory_bytes",
                "batch", "policies", "layouts", "cells", "current", "recommended", "plot"):
        assert key in data, key
    assert data["policies"] == ["none", "selective", "selective+mlp", "full"]
    assert data["batch"]["packed_tokens"] == 32710
    assert data["batch"]["logical_tokens"] == 38443
    assert len(data["cells"]) == len(data["layouts"]) * 4
    for cell in data["cells"]:
        for key in ("policy", "layout", "tensor_parallel", "context_parallel", "data_parallel",
                    "limit_bytes", "fits", "peak_bytes", "headroom_bytes", "max_tokens", "env",
                    "unavailable"):
            assert key in cell, key
        if cell["unavailable"] is None:
            assert cell["estimate"]["peak_bytes"] == cell["peak_bytes"]
            assert cell["headroom_bytes"] == cell["limit_bytes"] - cell["peak_bytes"]
    rungs = data["recompute_rungs"]  # the recommended layout under the configured policy
    assert rungs["layout"] == "TP4" and rungs["rungs"][-1]["name"] == "full uniform 1"
    assert set(rungs["picks"]) == {"configured", "escalate", "adaptive"}
    rec = data["recommended"]
    assert rec["policy"] == "selective+mlp"  # four GPUs: it fits at TP4 (see above)
    assert rec["env"]["ART_MEGATRON_RECOMPUTE_GRANULARITY"] == "selective"
    assert rec["env"]["ART_MEGATRON_RECOMPUTE_MODULES"] == "core_attn,mlp"
    assert "peak = resident + dynamic" in rec["term_table"]


def test_candidate_layouts_cover_every_tp_cp_dividing_the_gpus() -> None:
    names = [(lo.tensor_parallel, lo.context_parallel, lo.data_parallel)
             for lo in candidate_layouts(4)]
    assert sorted(names) == sorted([(1, 1, 4), (2, 1, 2), (1, 2, 2), (4, 1, 1), (2, 2, 1),
                                    (1, 4, 1)])
    assert all(lo.sequence_parallel == (lo.tensor_parallel > 1) for lo in candidate_layouts(8))
    with pytest.raises(ValueError, match="gpus must be >= 1"):
        candidate_layouts(0)


def test_layouts_megatron_cannot_build_are_marked_not_priced() -> None:
    # Qwen3.5-27B has 4 KV groups: TP 8 cannot shard them.
    result = plan("Qwen3.5-27B", batch=SEED_BATCH, gpus=8, gpu_memory_bytes=H200)
    tp8 = result.cell("full", 8)
    assert tp8.unavailable and "num_key_value_heads=4" in tp8.unavailable
    assert tp8.estimate is None and not tp8.fits
    assert "n/a" in result.table()
    # Megatron's unfused attention refuses CP, but the runtime builds the segmented flash
    # attention for CP > 1, so plan prices CP cells as that build: they are not marked.
    rc, text = run_cli(["plan", "--model", "tiny-qwen3", "--tokens", "512", "--gpus", "2",
                        "--gpu-memory", "1GiB", "--attention", "unfused", "--json"])
    data = json.loads(text)
    cp2 = [c for c in data["cells"] if c["context_parallel"] == 2]
    assert cp2 and all(c["unavailable"] is None and c["runnable"] for c in cp2)


def test_recommendation_prefers_least_recompute_then_fewest_gpus() -> None:
    batch = MicroBatchShape((2048,), outputs=OutputRequest(target_logprobs=True))
    geometry = tiny_dense(num_layers=4, hidden=256, vocab=1024)
    roomy = plan(geometry, batch=batch, gpus=4, gpu_memory_bytes=64 * GIB)
    rec = roomy.recommended
    assert rec is not None and (rec.policy.name, rec.gpus_per_replica) == ("none", 1)

    # A limit between full's and none's peak at TP1: something with recompute wins, and
    # nothing with less recomputation fits at any layout that the order ranks first.
    cells = {(c.policy.name, c.layout): c for c in roomy.cells}
    tp1 = candidate_layouts(4)[0]
    limit = (cells[("full", tp1)].peak_bytes + cells[("none", tp1)].peak_bytes) // 2
    tight = plan(geometry, batch=batch, gpus=4, gpu_memory_bytes=limit)
    rec = tight.recommended
    assert rec is not None and rec.fits
    for c in tight.cells:
        if c.fits:
            assert (c.policy.cost_rank, c.gpus_per_replica) >= (rec.policy.cost_rank,
                                                                 rec.gpus_per_replica)


def test_nothing_fits_exit_code_and_message() -> None:
    rc, text = run_cli(["plan", "--model", "Qwen3.5-27B", "--tokens", "32768", "--gpus", "1",
                        "--gpu-memory", "10GiB"])
    assert rc == 3
    assert "nothing fits on 1 GPU(s)" in text


def test_invalid_request_is_exit_code_2_with_the_reason(capsys) -> None:
    rc = cli_main(["plan", "--model", "Qwen3.5-27B", "--tokens", "100", "--gpus", "2",
                   "--gpu", "H200", "--outputs", "logprobs,bogus"])
    assert rc == 2
    assert "unknown output 'bogus'" in capsys.readouterr().err


def test_max_packed_tokens_is_the_boundary() -> None:
    geometry = tiny_dense(num_layers=4, hidden=256, vocab=1024)
    layout = candidate_layouts(1)[0]
    batch = MicroBatchShape((1000, 500), outputs=OutputRequest(target_logprobs=True),
                            padded_tokens=1400)
    model, _ = memory_model_for(geometry, layout, POLICIES[1], implementation=_te(),
                                lora_rank=1, dtype="bfloat16", alloc_conf=None)
    usable = 256 * 2**20
    n = max_packed_tokens(model, batch, usable)
    assert n > 0
    assert model.estimate(scaled_batch(batch, n)).dynamic_bytes <= usable
    assert model.estimate(scaled_batch(batch, int(n * 1.01) + 2)).dynamic_bytes > usable
    scaled = scaled_batch(batch, 2800)
    assert scaled.packed_tokens == 2800 and len(scaled.sequence_lengths_tokens) == 2
    assert max_packed_tokens(model, batch, 0) == 0


def test_current_cell_follows_the_environment() -> None:
    env = {"ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "2",
           "ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective",
           "ART_MEGATRON_RECOMPUTE_METHOD": "none", "ART_MEGATRON_RECOMPUTE_NUM_LAYERS": "none"}
    assert current_cell(env) == CurrentCell("selective", 2, 1)
    assert current_cell({}) == CurrentCell("full", 1, 1)  # the settings' default: full uniform 1
    assert current_cell({"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective",
                         "ART_MEGATRON_RECOMPUTE_MODULES": "mlp,core_attn"}) == CurrentCell(
        "selective+mlp", 1, 1)
    assert current_cell({"ART_MEGATRON_RECOMPUTE_METHOD": "block",
                         "ART_MEGATRON_RECOMPUTE_NUM_LAYERS": "2"}) is None


def test_current_cell_is_the_layout_a_launch_on_the_gpus_gets() -> None:
    """With no layout size set, a launch over N GPUs runs the runtime's default layout (CP =
    N, and for a MoE model EP = N with expert TP 1): plan marks that cell, not TP1 DP N."""
    from art.megatron.geometry import load_geometry

    dense, moe = load_geometry("Qwen3-8B"), load_geometry("Qwen3-30B-A3B")
    assert current_cell({}, gpus=4, geometry=dense) == CurrentCell("full", 1, 4)
    assert current_cell({}, gpus=4, geometry=moe) == CurrentCell("full", 1, 4, 4)
    assert current_cell({}, gpus=1, geometry=moe) == CurrentCell("full", 1, 1)
    # A layout size set: the default layout does not apply.
    tp2 = {"ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "2"}
    assert current_cell(tp2, gpus=4, geometry=moe) == CurrentCell("full", 2, 1)
    # Experts over EP 4 with expert TP 2 are not a cell of the grid (its EP cells have
    # expert TP 1); EP 4 with expert TP 1 is.
    split = {**tp2, "ART_MEGATRON_EXPERT_MODEL_PARALLEL_SIZE": "4"}
    assert current_cell(split, gpus=4, geometry=moe) is None
    whole = {**split, "ART_MEGATRON_EXPERT_TENSOR_PARALLEL_SIZE": "1"}
    assert current_cell(whole, gpus=4, geometry=moe) == CurrentCell("full", 2, 1, 4)
    rc, text = run_cli(["plan", "--model", "Qwen3-30B-A3B", "--tokens", "4096", "--gpus", "4",
                        "--gpu", "H200", "--json"])
    current = json.loads(text)["current"]
    assert current == {"policy": "full", "tensor_parallel": 1, "context_parallel": 4,
                       "expert_parallel": 4}


def test_a_moe_model_is_planned_with_its_experts_spread_too() -> None:
    """A MoE model's layouts come twice: experts at EP 1 (expert TP = TP) and spread over
    the most GPUs that divide them (expert TP 1), as the runtime's default layout spreads
    them; spreading them shrinks the experts' weights on each rank, so the spread cell of a
    layout holds less, and its launch line sets EP and expert TP."""
    from art.megatron.geometry import load_geometry

    moe = load_geometry("Qwen3-30B-A3B")  # 128 experts
    layouts = candidate_layouts(8, moe)
    assert len(layouts) == 2 * len(candidate_layouts(8))
    spread = [lo for lo in layouts if lo.expert_parallel > 1]
    assert {lo.expert_parallel for lo in spread} == {8}
    assert all(lo.expert_tensor_parallel == 1 for lo in spread)
    assert [lo.expert_parallel for lo in candidate_layouts(8, load_geometry("Qwen3-8B"))] \
        == [1] * len(candidate_layouts(8))
    batch = MicroBatchShape((16384,), outputs=OutputRequest(target_logprobs=True))
    result = plan(moe, batch=batch, gpus=8, gpu_memory_bytes=H200)
    for tp in (1, 2):
        at_1, at_8 = result.cell("none", tp, 1, 1), result.cell("none", tp, 1, 8)
        assert at_8.estimate.resident_bytes < 0.5 * at_1.estimate.resident_bytes
        assert at_8.env["ART_MEGATRON_EXPERT_MODEL_PARALLEL_SIZE"] == "8"
        assert at_8.env["ART_MEGATRON_EXPERT_TENSOR_PARALLEL_SIZE"] == "1"
        assert "ART_MEGATRON_EXPERT_MODEL_PARALLEL_SIZE" not in at_1.env
    rec = result.recommended
    assert rec is not None and rec.layout.expert_parallel == 8
    assert "spread over EP 8 (expert TP 1" in result.report()
    # Experts that no larger GPU count divides stay at EP 1 only: 6 GPUs, 128 experts -> 2.
    assert {lo.expert_parallel for lo in candidate_layouts(6, moe)} == {1, 2}


def test_plot_draws_a_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    batch = MicroBatchShape((1024,), outputs=OutputRequest(target_logprobs=True))
    result = plan(tiny_dense(), batch=batch, gpus=2, gpu_memory_bytes=GIB // 4)
    path = plot_plan(result, tmp_path / "plan.png", points=6)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_prices_the_router_spread_the_plan_was_given(tmp_path) -> None:
    """Every memory model the plot prices its lines with takes the plan's --expert-load."""
    pytest.importorskip("matplotlib")
    from art.megatron.geometry import load_geometry
    from art.trainer_rank.cli.args import parse_expert_load
    from art.trainer_rank.cli.planner import _default_factory

    load = parse_expert_load("1.3")
    seen: list[object] = []

    def recording(**kwargs):
        seen.append(kwargs.get("expert_load"))
        return _default_factory(**kwargs)

    batch = MicroBatchShape((1024,), outputs=OutputRequest(target_logprobs=True))
    result = plan(load_geometry("tiny-qwen3-moe"), batch=batch, gpus=2, gpu_memory_bytes=H200,
                  expert_load=load)
    plot_plan(result, tmp_path / "plan.png", points=3, factory=recording)
    assert seen and all(x == load for x in seen)


def _te():
    from art.megatron.implementation import Implementation

    return Implementation.gpu_te()


def test_layouts_trainer_rank_refuses_are_priced_marked_and_never_recommended() -> None:
    # Pipeline parallel builds and is priced, but TrainerRank refuses it at construction:
    # plan marks it and recommends only what TrainerRank runs.
    pp2 = ParallelLayout(tensor_parallel=1, pipeline_parallel=2, data_parallel=1)
    tp2 = next(lo for lo in candidate_layouts(2) if lo.tensor_parallel == 2)
    result = plan("Qwen3-8B", batch=SEED_BATCH, gpus=2, gpu_memory_bytes=H200,
                  layouts=[tp2, pp2])
    refused = result.cell("full", 1, 1)
    assert refused.fits and not refused.runnable
    assert "pipeline parallel size 2" in refused.not_runnable
    assert "TrainerRank cannot run it yet" in refused.verdict()
    rec = result.recommended
    assert rec is not None and rec.layout == tp2
    assert any("TP1 PP2: " in line and "cannot run this layout yet" in line
               for line in result.layout_summaries())
    # When only a refused layout fits, nothing is recommended and the report says why.
    only = plan("Qwen3-8B", batch=SEED_BATCH, gpus=2, gpu_memory_bytes=H200, layouts=[pp2])
    assert any(c.fits for c in only.cells) and only.recommended is None
    assert "only TP1 PP2, which it cannot run yet" in only.report()


def test_context_parallel_cells_are_runnable_on_dense_and_hybrid_models() -> None:
    # Dense attention runs under CP (segmented flash attention over the CP group): priced,
    # runnable, and recommendable.
    dense = plan("Qwen3-8B", batch=SEED_BATCH, gpus=2, gpu_memory_bytes=H200)
    cp2 = dense.cell("full", 1, 2)
    assert cp2.fits and cp2.runnable and not cp2.unavailable
    assert all(c.runnable for c in dense.cells)
    only_cp = plan("Qwen3-8B", batch=SEED_BATCH, gpus=2, gpu_memory_bytes=H200,
                   layouts=[lo for lo in candidate_layouts(2) if lo.context_parallel == 2])
    assert only_cp.recommended is not None and only_cp.recommended.layout.context_parallel == 2
    # The seed's hybrid: its Gated DeltaNet layers run the whole row on every CP rank, priced
    # as such (CP saves no memory on them), so its CP cells are runnable too.
    result = plan("Qwen3.5-27B", batch=SEED_BATCH, gpus=2, gpu_memory_bytes=H200)
    assert all(c.runnable for c in result.cells)
    hybrid_cp = result.cell("full", 1, 2).estimate
    tp1 = plan("Qwen3.5-27B", batch=SEED_BATCH, gpus=1, gpu_memory_bytes=H200).cell(
        "full", 1, 1).estimate
    assert hybrid_cp.peak_bytes < tp1.peak_bytes  # attention layers and MLPs still split
    rc, text = run_cli([*SEED_ARGS, "--gpus", "2", "--json"])
    cells = {(c["policy"], c["layout"]): c for c in json.loads(text)["cells"]}
    assert rc == 0
    assert cells[("full", "TP1 CP2")]["runnable"] is True
    assert cells[("full", "TP1 CP2")]["unavailable"] is None


def test_a_shared_prefix_on_a_gpu_warns_that_trainer_rank_packs_it_in_full() -> None:
    err = io.StringIO()
    with redirect_stderr(err):
        rc, _ = run_cli([*SEED_ARGS, "--gpus", "2", "--json"])
    assert rc == 0
    assert "packs every rollout in full (38443 tokens)" in err.getvalue()
    assert "--packed-tokens 38443" in err.getvalue()
    err = io.StringIO()
    with redirect_stderr(err):
        run_cli([a for a in SEED_ARGS if a not in ("--shared-prefix", "5733")] + ["--gpus", "2"])
    assert "packs every rollout in full" not in err.getvalue()


def test_plan_prices_its_ep_cells_at_a_router_spread_given() -> None:
    """`plan --expert-load` prices the experts of the EP cells at the spread given (at EP 1
    every pair is this rank's, so those cells do not move); a dense model refuses it."""
    base = ["plan", "--model", "Qwen3-30B-A3B", "--tokens", "8192", "--gpus", "4",
            "--gpu", "H200", "--json"]
    even = {c["layout"] + c["policy"]: c for c in json.loads(run_cli(base)[1])["cells"]}
    spread = {c["layout"] + c["policy"]: c
              for c in json.loads(run_cli([*base, "--expert-load", "1.3,1.1,2"])[1])["cells"]}
    assert json.loads(run_cli([*base, "--expert-load", "1.2"])[1])["expert_load"] == {
        "working": 1.2, "held": 1.2, "expert": 1.2}
    moved = [k for k in even if even[k]["peak_bytes"] != spread[k]["peak_bytes"]]
    assert moved and all(spread[k]["expert_parallel"] > 1 for k in moved)
    assert all(spread[k]["peak_bytes"] > even[k]["peak_bytes"] for k in moved)
    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        rc = cli_main(["plan", "--model", "Qwen3-8B", "--tokens", "64", "--gpus", "2",
                       "--gpu", "H200", "--expert-load", "1.2"])
    assert rc == 2 and "no routed experts" in err.getvalue()
