#!/usr/bin/env python
"""The GPU check: the planner measured on one bare GPU machine in one prepared command.

    scripts/gpu_check [--out DIR]             # on the GPU machine (README, "GPU check")
    scripts/gpu_check --dry-run [--out DIR]   # the same path on CPU, tiny models, seconds

It installs what the machine lacks from the wheels carried in `.whl/` (offline; our package is
the repo root on the path), checks the device, builds the plan (_gpu_check/plan.py: the seed's
geometry cut to 8 layers under four recompute policies, the seed's group and pairs of
rollouts, grad and no grad; a dense geometry's few cells) and runs it in one worker process
per allocator setting (PYTORCH_CUDA_ALLOC_CONF unset, then expandable_segments:True; the
second only when the first measured a cell), each with its share of the matrix's GPU-time
budget (420 s). On a GPU it then runs the seed's call through TrainerRank on the same hybrid
geometry (scripts/seed_call.py, its own process, up to 130 s: seed_call.md / .json), once the
matrix's warm-ups have filled Triton's cache. The device call's timeout is 600 s, and the
check ends itself by 590 s. A worker starts a step only when its predicted seconds fit before
its deadline and is killed if it overruns it; every row it finished is kept. Writes
gpu_check.csv, .md, .png, .json and .log under --out (default bench/gpu; a dry run: a
temporary folder) and prints a one-line summary last. Exit status: 0 when cells were measured
and none failed, 1 otherwise, 2 when the check could not start (a module missing without its
wheel, no GPU, a plan over its budget).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

# A worker past its deadline gets this long to finish its step before it is killed; the
# report is written after, well inside the device call's timeout.
KILL_GRACE_SECONDS = 20.0
REPORT_MARGIN_SECONDS = 30.0


@dataclass(frozen=True)
class WorkerExit:
    returncode: int
    killed: bool
    seconds: float


def run_worker(command: Sequence[str], env: dict[str, str], hard_stop: float,
               on_line: Callable[[str], None]) -> WorkerExit:
    """Run one worker, passing each output line to `on_line`, and kill its whole process
    group at `hard_stop` (time.time() seconds) if it is still running."""
    start = time.time()
    proc = subprocess.Popen(list(command), env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True)
    stream: IO[str] = proc.stdout  # type: ignore[assignment]

    def pump() -> None:
        for line in stream:
            on_line(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    killed = False
    try:
        proc.wait(timeout=max(0.0, hard_stop - time.time()))
    except subprocess.TimeoutExpired:
        killed = True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    reader.join(timeout=5)
    return WorkerExit(proc.returncode, killed, time.time() - start)


def read_rows(path: Path) -> list[dict]:
    """The rows a worker wrote; a line cut short by a kill is dropped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="run the same path on CPU with tiny models and two cells")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default bench/gpu; with --dry-run a temporary "
                             "folder)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds of the matrix's work (default 420 on a GPU, 300 for a "
                             "dry run)")
    parser.add_argument("--seed-call-s", type=float, default=None,
                        help="seconds for the seed's call through TrainerRank after the "
                             "matrix (default 130 on a GPU; 0: none; a dry run runs none)")
    parser.add_argument("--show-plan", action="store_true",
                        help="print the plan (every step and its predicted seconds, for an "
                             "H200 or, with --dry-run, the CPU) and exit; needs no GPU")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plan-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--allocator", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--launched-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--probe-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.budget_s is not None and args.budget_s <= 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s}")
    if args.seed_call_s is not None and args.seed_call_s < 0:
        parser.error(f"--seed-call-s must be 0 or more, got {args.seed_call_s}")
    return args


def show_plan(args: argparse.Namespace) -> int:
    """The plan a run would start from (an H200's memory; the dry run's on CPU)."""
    from _gpu_check import plan as plans

    try:
        plan = (plans.dry_run_plan(args.budget_s or plans.DRY_RUN_BUDGET_SECONDS) if args.dry_run
                else plans.gpu_plan(budget_seconds=args.budget_s or plans.BUDGET_SECONDS))
    except ValueError as error:
        print(f"gpu_check: cannot plan: {error}")
        return 2
    print(f"plan {plan.name} ({plan.device}, {plan.dtype}, {plan.implementation}): "
          f"{len(plan.steps)} steps, {len(plan.cells())} cells, predicted "
          f"{plan.predicted_seconds():.0f} s of a {plan.budget_seconds:.0f} s budget (setup "
          f"{plan.setup_seconds:.0f} s + "
          + " + ".join(f"{a} {plan.predicted_seconds(a):.0f} s" for a in plan.allocators)
          + f"); the seed's group at scale {plan.seed_scale:g}; * = essential")
    for reason in plan.trimmed:
        print(f"trimmed: {reason}")
    for step in plan.steps:
        print(f"{step.predicted_seconds:7.1f} s  {'*' if step.essential else ' '} {step.name}")
    return 0


def worker_main(args: argparse.Namespace) -> int:
    from _gpu_check import worker
    from _gpu_check.plan import Plan

    plan = Plan.from_json(args.plan_file.read_text())
    return worker.run(plan, args.allocator, deadline=args.deadline,
                      launched_at=args.launched_at, rows=args.rows, probe_dir=args.probe_dir)


def main(argv: Sequence[str] | None = None) -> int:
    started = time.time()
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.show_plan:
        return show_plan(args)
    if args.worker:
        code = worker_main(args)
        # Every row is flushed: skip the interpreter's teardown of torch, Megatron and the
        # process group, which takes seconds of the budget for nothing.
        sys.stdout.flush()
        os._exit(code)
    out: Path = args.out or (Path(tempfile.gettempdir()) / "gpu_check-dry-run" if args.dry_run
                             else ROOT / "bench" / "gpu")
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "gpu_check.log").open("w")

    def say(text: str) -> None:
        print(text, flush=True)
        log.write(text + "\n")
        log.flush()

    command = "scripts/gpu_check " + shlex.join(sys.argv[1:] if argv is None else argv)
    try:
        return _check(args, out, say, started, command)
    finally:
        log.close()


def seed_call_allowance(args: argparse.Namespace) -> float:
    """Seconds for the seed's call after the matrix (GPU runs; 0: none)."""
    from _gpu_check.plan import SEED_CALL_SECONDS

    return SEED_CALL_SECONDS if args.seed_call_s is None else args.seed_call_s


def seed_call_command(out: Path) -> list[str]:
    """The seed's call (scripts/seed_call.py) through TrainerRank on the check's hybrid
    geometry: the runtime builder, the probe, admission under the seed's limit, the caller's
    backward, and the same rollouts as separate items to compare."""
    from _gpu_check.plan import HYBRID

    return [sys.executable, str(ROOT / "scripts" / "seed_call.py"), "--model", HYBRID.config,
            "--layers", str(HYBRID.layers), "--dtype", "bfloat16",
            "--json", str(out / "seed_call.json"), "--md", str(out / "seed_call.md")]


def run_seed_call(out: Path, say: Callable[[str], None], hard_stop: float) -> dict:
    """The seed's call in its own process (one GPU: TP=1, the seed's selective recompute),
    after the matrix; its lines go to the log, its report to seed_call.md / .json."""
    env = dict(os.environ, ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE="1",
               ART_MEGATRON_RECOMPUTE_GRANULARITY="selective")
    allowance = hard_stop - time.time()
    say(f"gpu_check: the seed's call through TrainerRank, {allowance:.0f} s until it is "
        "stopped")
    exit_ = run_worker(seed_call_command(out), env, hard_stop, lambda line: say(
        f"seed_call: {line}"))
    return {"allocator": "seed call", "alloc_conf": "", "seconds": round(exit_.seconds, 1),
            "exit": "killed" if exit_.killed else exit_.returncode,
            "deadline_seconds": round(allowance, 1), "report": "seed_call.md"}


def seed_call_summary(path: Path) -> str:
    """One line from the seed call's report (or why there is none)."""
    try:
        found = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        return f"gpu_check: the seed's call wrote no report ({type(error).__name__})"
    if "declined" in found:
        return f"gpu_check: the seed's call was declined: {found['declined']}"
    measured = found.get("measured_bytes") or 0
    return (f"gpu_check: the seed's call: {found.get('decision')} with "
            f"{found.get('recompute')}, {found.get('stats_packed_tokens', 0):,} packed tokens, "
            f"predicted {found.get('predicted_bytes', 0) / 2**20:,.0f} MiB / measured "
            f"{measured / 2**20:,.0f} MiB = "
            f"{found.get('predicted_bytes', 0) / max(1, measured):.3f}; shared vs separate "
            f"outputs max |diff| {found.get('output_max_abs_diff', float('nan')):.2e}")


def _check(args: argparse.Namespace, out: Path, say: Callable[[str], None], started: float,
           command: str) -> int:
    from _gpu_check import wheels

    device = "cpu" if args.dry_run else "cuda"
    try:
        setup = wheels.prepare(wheels.CPU_MODULES if args.dry_run else
                               [m for _, m in wheels.WHEELS.values()])
        info = wheels.device_info(device)
        say(f"gpu_check: {info.name} ({info.device}), {info.total_bytes / 2**30:.1f} GiB, "
            f"{info.free_bytes / 2**30:.1f} GiB free; {info.detail}; "
            + ", ".join(f"{k} {v}" for k, v in setup.versions.items()))
        from _gpu_check import plan as plans

        seed_call_seconds = 0.0 if args.dry_run else seed_call_allowance(args)
        if args.dry_run:
            plan = plans.dry_run_plan(args.budget_s or plans.DRY_RUN_BUDGET_SECONDS)
        else:
            from art.megatron.fla_support import fla_delta_rule_refusal

            refusal = fla_delta_rule_refusal()
            if refusal is not None:
                say(f"gpu_check: the hybrid runs the pure-torch delta rule: {refusal}")
            plan = plans.gpu_plan(min(info.free_bytes, info.total_bytes),
                                  args.budget_s or plans.BUDGET_SECONDS,
                                  delta_rule="torch" if refusal else "fla")
    except (wheels.SetupError, ValueError, ImportError) as error:
        say(f"gpu_check: cannot start: {type(error).__name__}: {error}")
        return 2
    say(f"gpu_check: plan {plan.name}: {len(plan.steps)} steps, {len(plan.cells())} cells, "
        f"predicted {plan.predicted_seconds():.0f} s of a {plan.budget_seconds:.0f} s budget"
        + (f"; trimmed: {'; '.join(plan.trimmed)}" if plan.trimmed else ""))
    from _gpu_check import report

    processes: list[dict] = []
    end = started + plan.budget_seconds
    # Past this no worker may run: the report must be written inside the device call.
    last = started + plans.DEVICE_TIMEOUT_SECONDS - REPORT_MARGIN_SECONDS
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    plan_file = work / "plan.json"
    plan_file.write_text(plan.to_json())
    reported: list[dict] = []
    missing: dict[str, str] = {}
    allocators = plan.allocators
    for n, allocator in enumerate(allocators):
        now = time.time()
        ahead = [plan.predicted_seconds(a) for a in allocators[n:]]
        # This process's share of what is left, by its predicted seconds.
        deadline = now + max(0.0, end - now) * ahead[0] / max(sum(ahead), 1e-9)
        rows_file = work / f"rows-{allocator}.jsonl"
        env = dict(os.environ)
        conf = plans.ALLOCATORS[allocator]
        if conf is None:
            env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        else:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        worker_command = [sys.executable, str(Path(__file__).resolve()), "--worker",
                          "--plan-file", str(plan_file), "--allocator", allocator,
                          "--deadline", repr(deadline), "--launched-at", repr(now),
                          "--rows", str(rows_file), "--probe-dir", str(work / "probes")]
        if n > 0 and not report.counts(reported)["ok"]:
            # Nothing measured under the first setting: the same failures would repeat, and
            # the device time is better left for a rerun.
            missing[allocator] = "its process was not started: the one before it measured no cell"
            say(f"gpu_check: {allocator} process not started: {allocators[n - 1]} measured no "
                "cell")
            processes.append({"allocator": allocator, "alloc_conf": conf or "",
                              "exit": "not started", "seconds": 0.0, "deadline_seconds": 0.0})
        else:
            say(f"gpu_check: {allocator} process (PYTORCH_CUDA_ALLOC_CONF={conf or 'unset'}), "
                f"{deadline - now:.0f} s until its deadline")
            exit_ = run_worker(worker_command, env, min(deadline + KILL_GRACE_SECONDS, last),
                               say)
            reported += read_rows(rows_file)
            missing[allocator] = (
                f"its process was killed {KILL_GRACE_SECONDS:.0f} s past its deadline"
                if exit_.killed else f"its process exited with status {exit_.returncode} "
                "before this step")
            processes.append({"allocator": allocator, "alloc_conf": conf or "",
                              "exit": "killed" if exit_.killed else exit_.returncode,
                              "seconds": round(exit_.seconds, 1),
                              "deadline_seconds": round(deadline - now, 1)})
        # Written after each process too: a run cut short still leaves its figures.
        rows_so_far = report.merged_rows(plan, reported, missing)
        summary = report.write_report(out, plan, rows_so_far, info, setup, command=command,
                                      elapsed=time.time() - started, processes=processes,
                                      final=n == len(allocators) - 1 and not seed_call_seconds)
    if seed_call_seconds > 0:
        # After the matrix, whose warm-ups have filled Triton's disk cache with the kernels
        # this geometry compiles; its share is what is left of the call, up to its allowance.
        processes.append(run_seed_call(out, say, min(time.time() + seed_call_seconds, last)))
        summary = report.write_report(out, plan, rows_so_far, info, setup, command=command,
                                      elapsed=time.time() - started, processes=processes)
        say(seed_call_summary(out / "seed_call.json"))
    say(summary)
    n = report.counts(rows_so_far)
    return 0 if n["ok"] and not n["failed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
