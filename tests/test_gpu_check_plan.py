"""scripts/gpu_check's parts without a model: the plan (the seed's geometry and group, every
policy, both allocator settings, its predicted seconds inside the budget), the trim rules,
the budget stop (partial rows written, essentials kept), a worker killed at its hard stop,
the carried wheels' install, the CPU sides of the device calls, and the README's recipe."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
import zipfile
from dataclasses import replace
from pathlib import Path

import gpu_check
import pytest
import torch
from _gpu_check import budget, plan, report, wheels, worker
from _gpu_check.plan import POLICIES, SEED_LABEL, Plan, Step

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu() -> Plan:
    return plan.gpu_plan()


def test_the_gpu_plan_fits_its_budget_inside_the_device_call(gpu: Plan) -> None:
    assert gpu.budget_seconds == plan.BUDGET_SECONDS == 420
    assert 0 < gpu.predicted_seconds() <= gpu.budget_seconds
    # The last worker is killed by then, the seed's call has its allowance after it, and the
    # report still has its margin.
    assert (plan.BUDGET_SECONDS + gpu_check.KILL_GRACE_SECONDS
            <= plan.DEVICE_TIMEOUT_SECONDS - gpu_check.REPORT_MARGIN_SECONDS)
    assert (plan.BUDGET_SECONDS + plan.SEED_CALL_SECONDS
            <= plan.DEVICE_TIMEOUT_SECONDS - gpu_check.REPORT_MARGIN_SECONDS)
    assert all(s.predicted_seconds > 0 for s in gpu.steps)


def test_the_seed_geometry_cut_to_eight_layers(gpu: Plan) -> None:
    g = gpu.geometry(plan.HYBRID.name).build()
    la = g.linear_attention
    assert la is not None
    assert (g.hidden_size, g.ffn_hidden_size, g.num_attention_heads, g.num_query_groups,
            g.head_dim, g.vocab_size) == (5120, 17408, 24, 4, 256, 248320)
    assert (la.num_key_heads, la.key_head_dim, la.num_value_heads, la.value_head_dim,
            la.conv_kernel_size) == (16, 128, 48, 128, 4)
    assert g.layer_types == ("linear_attention",) * 3 + ("attention",) + (
        "linear_attention",) * 3 + ("attention",)
    dense = gpu.geometry(plan.DENSE.name).build()
    assert not dense.is_hybrid and (dense.hidden_size, dense.ffn_hidden_size,
                                    dense.num_attention_heads, dense.num_query_groups,
                                    dense.head_dim, dense.vocab_size) == (
        4096, 12288, 32, 8, 128, 151936)
    assert gpu.dtype == "bfloat16" and gpu.device == "cuda"
    assert gpu.implementation == "local/flash/fused-norm/swiglu-unfused/cuda"
    assert {(s.cell.cell.lora_rank, s.cell.cell.tensor_parallel) for s in gpu.cells()
            if s.cell} == {(1, 1)}


def test_every_policy_and_the_seed_group_run_under_both_allocators(gpu: Plan) -> None:
    assert gpu.allocators == ("segmented", "expandable")
    assert gpu.seed_scale == 1.0  # the whole group fits one H200 at 8 layers
    for allocator in gpu.allocators:
        steps = gpu.steps_for(allocator)
        assert steps[0].kind == "start"
        for policy in POLICIES:
            assert any(s.kind == "model" and s.policy == policy for s in steps), policy
            seed = [s.cell.cell for s in steps
                    if s.cell and s.policy == policy and s.cell.label == SEED_LABEL]
            assert {(c.outputs, c.grad) for c in seed} >= {("hidden_states", True),
                                                          ("logprobs", True)}, policy
            assert all(c.lengths == (19222, 19221) and c.shared_prefix == 5733 for c in seed)
        labels = {s.cell.label for s in steps if s.cell and s.geometry == plan.DENSE.name}
        assert plan.DENSE_GROUP_LABEL in labels
    hybrid = [s.cell for s in gpu.steps_for("segmented")
              if s.cell and s.geometry == plan.HYBRID.name]
    assert {c.label for c in hybrid} == {SEED_LABEL, "pair 2k", "pair 4k", "pair 8k",
                                         "pair 16k"}
    assert {c.cell.grad for c in hybrid} == {True, False}
    assert {c.cell.outputs for c in hybrid} == {"logprobs", "hidden_states"}
    assert len({s.name for s in gpu.steps}) == len(gpu.steps)  # rows are matched by name
    # Only the first process probes; the second reads its probes.
    assert {s.probes for s in gpu.steps if s.kind == "model" and s.allocator == "segmented"} \
        == {True}
    assert not any(s.probes for s in gpu.steps_for("expandable"))


def test_a_smaller_gpu_scales_the_seed_group_and_drops_what_does_not_fit() -> None:
    small = plan.gpu_plan(gpu_memory_bytes=80 * 2**30, budget_seconds=10**6)
    assert small.seed_scale < 1.0
    lengths, prompt = plan.seed_lengths(small.seed_scale)
    seeds = [s for s in small.cells() if s.cell and s.cell.label == SEED_LABEL]
    assert {s.policy for s in seeds} == set(POLICIES)
    assert all(s.cell.cell.lengths == lengths and s.cell.cell.shared_prefix == prompt
               for s in seeds if s.cell)
    assert any("priced over" in t for t in small.trimmed)


def test_trimming_keeps_every_policy_and_the_seed_group(gpu: Plan) -> None:
    whole = plan.gpu_plan(budget_seconds=10**6)
    assert not whole.trimmed and len(whole.cells()) > len(gpu.cells())
    essentials = whole.setup_seconds + sum(s.predicted_seconds for s in whole.steps
                                           if s.essential)
    # Every rule applied: what is left is the essential steps, every policy's among them.
    tight = plan.fit_to_budget(replace(whole, budget_seconds=essentials + 1))
    assert tight.predicted_seconds() <= tight.budget_seconds
    assert len(tight.trimmed) == len(plan.TRIM_RULES)
    assert all(s.essential for s in tight.steps)
    for allocator in whole.allocators:
        for policy in POLICIES:
            assert [s.name for s in whole.steps_for(allocator) if s.essential
                    and s.policy == policy] == [s.name for s in tight.steps_for(allocator)
                                                if s.essential and s.policy == policy]
    with pytest.raises(ValueError, match="over its budget"):
        plan.fit_to_budget(replace(whole, budget_seconds=essentials - 1))


def test_plan_json_round_trip(gpu: Plan) -> None:
    assert Plan.from_json(gpu.to_json()) == gpu
    dry = plan.dry_run_plan()
    assert Plan.from_json(dry.to_json()) == dry


def test_the_dry_run_plan_is_two_cells_per_allocator() -> None:
    dry = plan.dry_run_plan()
    assert dry.device == "cpu" and dry.allocators == ("segmented", "expandable")
    for allocator in dry.allocators:
        cells = [s.cell for s in dry.steps_for(allocator) if s.cell]
        assert len(cells) == 2
        hybrid, dense = cells
        assert hybrid.cell.shared_prefix > 0 and hybrid.row.tokens < sum(hybrid.cell.lengths)
        assert dry.geometry(hybrid.cell.geometry).build().is_hybrid
        assert not dry.geometry(dense.cell.geometry).build().is_hybrid


def test_the_parent_prices_the_workers_lora_without_peft() -> None:
    """what_if_model skips peft's import (seconds) yet prices what the worker builds."""
    from _calibration.cells import POLICY_BY_NAME
    from _calibration.harness import calibration_provider

    from art.trainer_rank.pricing.model import MemoryModel

    implementation = plan.planning_implementation("cuda")
    for check in (plan.HYBRID, plan.DENSE):
        g = check.build()
        _, priced = plan.what_if_model(g, "full uniform 1", "bfloat16", implementation)
        built = calibration_provider(g, POLICY_BY_NAME["full uniform 1"],
                                     lora_rank=plan.LORA_RANK, tensor_parallel=1,
                                     dtype="bfloat16", implementation=implementation)
        assert priced == replace(MemoryModel.for_provider(built), alloc_conf=None)


# -------------------------------------------------------------------------- the budget stop

class Clock:
    """A clock the fake steps advance by what each one takes."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _fake_run(steps: tuple[Step, ...], deadline: float, *, fail_build: str = "",
              fail_cell: str = "", slow: float = 1.0) -> list[dict]:
    clock = Clock()
    rows: list[dict] = []

    def build(step: Step) -> str:
        clock.now += step.predicted_seconds
        if step.geometry == fail_build:
            raise RuntimeError("CUDA out of memory while building")
        return step.geometry

    def measure(model: str, step: Step) -> dict:
        assert model == step.geometry
        clock.now += step.predicted_seconds * slow
        if step.cell and step.cell.label == fail_cell:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return {"measured_bytes": 1}

    budget.run_steps(steps, budget.Budget(clock.now + deadline, clock=clock), build=build,
                     measure=measure, release=lambda: None,
                     write=lambda row: rows.append(row.to_dict()))
    return rows


def test_the_budget_stop_writes_every_step_and_keeps_the_essentials(gpu: Plan) -> None:
    steps = gpu.steps_for("segmented")
    work = [s for s in steps if s.kind != "start"]
    # Enough for every essential step and a little more: pairs go, groups and models stay.
    essentials = sum(s.predicted_seconds for s in work if s.essential)
    rows = _fake_run(steps, essentials + 5)
    assert [r["name"] for r in rows] == [s.name for s in work]
    by_status = {st: [r for r in rows if r["status"] == st] for st in ("ok", "skipped")}
    assert {r["name"] for r in rows if r["essential"]} <= {r["name"] for r in by_status["ok"]}
    assert by_status["skipped"] and all(r["reason"].startswith("budget:")
                                        for r in by_status["skipped"])
    # Cells twice as slow as predicted: the scale (median of taken / predicted) catches on.
    allowed = sum(s.predicted_seconds for s in work)
    slow = _fake_run(steps, allowed, slow=2.0)
    assert any(r["status"] == "skipped" for r in slow)
    # Past the deadline by at most one step that ran slower than its scaled prediction.
    longest = max(s.predicted_seconds for s in work)
    assert sum(r["seconds"] for r in slow) <= allowed + 2 * longest


def test_a_failed_model_or_cell_is_a_row_and_the_run_goes_on() -> None:
    dry = plan.dry_run_plan()
    steps = dry.steps_for("segmented")
    rows = _fake_run(steps, 10**6, fail_build=plan.DRY_HYBRID.name, fail_cell="pair 256")
    status = {r["name"]: (r["status"], r["reason"]) for r in rows}
    model, seed, dense_model, dense = (s.name for s in steps[1:])
    assert status[model][0] == "failed" and "RuntimeError: CUDA out of memory" in status[model][1]
    assert status[seed] == ("skipped", "its model failed to build")
    assert status[dense_model][0] == "ok"
    assert status[dense][0] == "failed" and status[dense][1].startswith("OutOfMemoryError")


def test_a_refused_step_leaves_room_for_later_essentials() -> None:
    clock = Clock()
    essential = Step("model", "segmented", "g", "p", 10.0, essential=True)
    optional = Step("cell", "segmented", "g", "p", 5.0)
    b = budget.Budget(clock.now + 12.0, clock=clock)
    assert b.refusal(optional, [essential]) is not None  # 5 + 10 > 12
    assert b.refusal(optional, []) is None
    assert b.refusal(essential, [essential]) is None  # an essential step only needs its own
    for taken in (20.0, 5.0, 30.0):  # median 4x predicted: a 5 s step now needs 20 s
        b.record(optional, taken)
    assert b.scale("cell") == 4.0 and b.refusal(optional, []) is not None
    assert b.scale("model") == 1.0  # cells only so far
    b.record(essential, 15.0)  # a model 1.5x its prediction: later models are held so too
    assert b.need(essential) == 15.0


def test_a_worker_past_its_hard_stop_is_killed_and_its_rows_kept(tmp_path: Path) -> None:
    dry = plan.dry_run_plan()
    first = dry.steps_for("segmented")
    lines: list[str] = []
    start = time.time()
    code = "print('working', flush=True); import time; time.sleep(60)"
    exit_ = gpu_check.run_worker([sys.executable, "-c", code], {}, start + 2.0, lines.append)
    assert exit_.killed and time.time() - start < 15 and lines == ["working"]
    # The rows it wrote before: the first two steps; a line cut by the kill is dropped.
    rows_file = tmp_path / "rows.jsonl"
    done = [budget.StepRow(s, "ok", 1.0).to_dict() for s in first[:2]]
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in done) + '{"kind": "ce')
    reported = gpu_check.read_rows(rows_file)
    assert len(reported) == 2
    merged = report.merged_rows(dry, reported, {"segmented": "its process was killed"})
    assert [r["name"] for r in merged] == [s.name for s in dry.steps]
    assert [r["status"] for r in merged[:2]] == ["ok", "ok"]
    assert {r["status"] for r in merged[2:]} == {"not run"}
    info = wheels.device_info("cpu")
    setup = wheels.Setup((), "", wheels.versions())
    line = report.write_report(tmp_path, dry, merged, info, setup, command="test",
                               elapsed=3.0, processes=[])
    assert "0/4 cells measured" in line and "4 not run" in line
    with (tmp_path / "gpu_check.csv").open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == 4 and {r["status"] for r in table} == {"not run"}
    assert "its process was killed" in (tmp_path / "gpu_check.md").read_text()


# -------------------------------------------------------------------------- setup and device

def _wheel(folder: Path, module: str) -> Path:
    """A minimal pure-Python wheel holding one module."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{module}-1.0-py3-none-any.whl"
    info = f"{module}-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{module}/__init__.py", "VALUE = 7\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: "
                                    "true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_prepare_installs_the_carried_wheels_offline(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    module = "gpu_check_carried_probe"
    _wheel(tmp_path / "whl", module)
    setup = wheels.prepare([module], wheel_dir=tmp_path / "whl", target=tmp_path / "site")
    assert setup.installed == (f"{module}-1.0-py3-none-any.whl",)
    assert __import__(module).VALUE == 7
    assert sys.path[0] == str(tmp_path / "site")
    assert str(ROOT) in sys.path
    child = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True)
    assert child.returncode == 0  # the workers inherit PYTHONPATH
    # Importable already: nothing is installed again.
    assert wheels.prepare([module], wheel_dir=tmp_path / "none").installed == ()
    with pytest.raises(wheels.SetupError, match="pip download"):
        wheels.prepare(["gpu_check_never_there"], wheel_dir=tmp_path / "none",
                       target=tmp_path / "site2")


def test_the_device_calls_run_on_cpu_too() -> None:
    """What is CUDA-only on the machine has its CPU side, which the dry run takes."""
    info = wheels.device_info("cpu")
    assert info.device == "cpu" and info.total_bytes >= info.free_bytes > 0
    cpu = torch.device("cpu")
    assert worker.allocator_reading(cpu) == worker.AllocatorReading()
    worker.release_cached(cpu)
    assert worker.worker_implementation("cpu").key == plan.planning_implementation("cpu").key
    if not torch.cuda.is_available():
        with pytest.raises(wheels.SetupError, match="no GPU"):
            wheels.device_info("cuda")


def test_the_readme_gives_the_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    text = (ROOT / "README.md").read_text()
    assert wheels.DOWNLOAD_COMMAND in text
    # The plan's lines the README quotes (its summary and what was trimmed) are what
    # --show-plan prints now.
    assert gpu_check.main(["--show-plan"]) == 0
    printed = capsys.readouterr().out.splitlines()
    for line in printed[:1 + len(plan.gpu_plan().trimmed)]:
        assert line in text
    assert '{"command": "scripts/gpu_check --out $OUT"' in text
    assert '"carry": [".whl"]' in text
    assert f'"timeout_s": {plan.DEVICE_TIMEOUT_SECONDS + 10}' in text
    assert "/.whl/" in (ROOT / ".gitignore").read_text().split()


def test_the_readme_quotes_the_committed_gpu_run() -> None:
    """The summary line README quotes is the one the committed run printed last."""
    log = ROOT / "bench" / "gpu" / "gpu_check.log"
    last = log.read_text().strip().splitlines()[-1]
    assert last.startswith("gpu_check: ") and last in (ROOT / "README.md").read_text()


def test_a_first_process_that_measured_nothing_starts_no_second(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its failures would repeat: the device time is kept for a rerun. The workers here are
    stand-ins that exit at once without a row."""
    started: list[list[str]] = []

    def worker_exits(command, env, hard_stop, on_line):
        started.append(list(command))
        return gpu_check.WorkerExit(1, False, 0.1)

    monkeypatch.setattr(gpu_check, "run_worker", worker_exits)
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 1
    assert len(started) == 1 and "segmented" in started[0]
    text = (tmp_path / "gpu_check.md").read_text()
    assert "expandable process 0 s, exit not started" in text
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert {r["reason"] for r in rows if r["allocator"] == "expandable"} == {
        "its process was not started: the one before it measured no cell"}


def test_the_seed_call_runs_the_check_s_hybrid_and_is_summarised(tmp_path: Path) -> None:
    import seed_call

    command = gpu_check.seed_call_command(tmp_path)
    args = seed_call.parse_args(command[2:])
    assert (args.model, args.layers, args.dtype) == (plan.HYBRID.config, plan.HYBRID.layers,
                                                    "bfloat16")
    assert args.json == str(tmp_path / "seed_call.json")
    report_file = tmp_path / "seed_call.json"
    assert "wrote no report" in gpu_check.seed_call_summary(report_file)
    report_file.write_text(json.dumps({
        "decision": "escalated", "recompute": "full recompute of the first 1 layer(s)",
        "stats_packed_tokens": 32710, "predicted_bytes": 3 * 2**30,
        "measured_bytes": 2 * 2**30, "output_max_abs_diff": 0.01}))
    line = gpu_check.seed_call_summary(report_file)
    assert "escalated" in line and "32,710 packed tokens" in line and "= 1.500" in line
    report_file.write_text(json.dumps({"declined": "does not fit: 9 GiB over"}))
    assert "declined: does not fit" in gpu_check.seed_call_summary(report_file)


def test_the_readme_s_show_plan_command_runs_where_python3_has_no_torch() -> None:
    """`scripts/gpu_check --show-plan` (README) runs nothing on a GPU: where the system's
    python3 has no torch (this machine's), the wrapper takes the project's .venv, as a dry
    run does; on the GPU machine it keeps python3 (CUDA torch, no network to build a venv)."""
    done = subprocess.run([str(ROOT / "scripts" / "gpu_check"), "--show-plan"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("plan gpu ("), done.stdout[:200]
