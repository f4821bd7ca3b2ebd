#!/usr/bin/env python
"""Planner benchmarks on this machine: accuracy, utilisation, overhead -> bench/RESULTS.md.

    .venv/bin/python scripts/bench_planner.py                    # all three sections
    .venv/bin/python scripts/bench_planner.py --sections overhead
    .venv/bin/python scripts/bench_planner.py --groups 8 --quick # a small, fast pass

1. Accuracy: predicted / measured dynamic peak from the calibration harness
   (bench/calibration/calibration.csv, written by scripts/calibrate.py; run it first), per recompute
   policy, TP size, output mix, LoRA rank and grad mode; plus the trainer's own
   predicted / measured for every micro-batch of the utilisation run.
2. Utilisation: one RL-like workload (scripts/_workload.py, seeded) under one virtual
   limit, run by the planner cold and warm, with grad and without (scoring), the seed's
   constant-factor formula, try-and-halve on OOM, and in-order greedy packing on measured peaks.
   Each planner pass is compared with its oracle: for every micro-batch it ran, the most that
   really fits with the same packing (its items plus the longest run of waiting items, in
   order, whose measured peak stays within the limit; bisection on measured peaks). All on the
   demo model (Qwen3-shaped, 4 layers, hidden 128, rank-8 LoRA on
   every linear, fp32, selective recompute as in the seed), TP=1, CPU.
3. Overhead: one admission decision with 10 ... 10,000 pending top-level items, and as a
   fraction of one forward+backward of the demo model.
Timings are benchmarks, not tests. Targets: accuracy in [1.00, 1.05]; utilisation >= 0.95
warm and >= 0.80 cold with zero escaped OOMs; <= 2 ms per decision at 1,000 items.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
os.environ.setdefault("OMP_NUM_THREADS", "1")
BENCH = ROOT / "bench"
MIB = 2**20
ACCURACY_TARGET = (1.00, 1.05)


# ----------------------------------------------------------------------------- accuracy

def _quantiles(values: list[float]) -> tuple[float, float, float, float]:
    values = sorted(values)
    return values[0], statistics.median(values), values[-1], (
        sum(ACCURACY_TARGET[0] <= v <= ACCURACY_TARGET[1] for v in values) / len(values))


def _accuracy_cells() -> list[Any]:
    """Seeded off-grid rows on the small geometry, every recompute policy, LoRA ranks 1, 8
    and 64 (TP=1; the TP=2 cells come from scripts/calibrate.py under torchrun)."""
    from _calibration.cells import off_grid_matrix

    return off_grid_matrix(2, rows_per_model=2, geometries=("gqa-128",), max_tokens=2000)


def _run_calibration(path: Path) -> None:
    """No calibration CSV yet: run the calibration harness here (TP=1 in this process, the
    quick TP=2 subset through scripts/calibrate.py under torchrun)."""
    import subprocess
    import tempfile

    from _calibration.harness import run_cells

    results = run_cells(_accuracy_cells(),
                        progress=lambda line: print(f"calibration: {line}", flush=True))
    rows = [r.row() for r in results]
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "calibrate.py"), "--quick", "--tp", "2",
             "--out", tmp], capture_output=True, text=True, timeout=900, cwd=ROOT)
        tp2 = Path(tmp) / "calibration.csv"
        if proc.returncode == 0 and tp2.exists():
            rows += [r for r in csv.DictReader(tp2.open()) if r["tensor_parallel"] == "2"]
        else:
            print(f"calibration: TP=2 run failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
    _write_csv(path, rows)


def accuracy(out: dict[str, Any], calibration_csv: Path) -> None:
    path = calibration_csv.resolve()
    if not path.exists():
        path = BENCH / "accuracy_cells.csv"
        print(f"accuracy: {calibration_csv} not found; running the calibration harness into "
              f"{path}", file=sys.stderr)
        _run_calibration(path)
    rows = list(csv.DictReader(path.open()))
    for r in rows:
        r["ratio"] = float(r["ratio"])
        r["default_ratio"] = float(r["default_ratio"])
    table = []
    for dim in ("policy", "tensor_parallel", "outputs", "lora_rank", "grad"):
        for value in sorted({r[dim] for r in rows}, key=str):
            group = [r for r in rows if r[dim] == value]
            for column in ("ratio", "default_ratio"):
                lo, med, hi, inside = _quantiles([r[column] for r in group])
                table.append(dict(dimension=dim, value=value, coefficients=(
                    "probe" if column == "ratio" else "defaults"), cells=len(group),
                    min=round(lo, 4), median=round(med, 4), max=round(hi, 4),
                    in_target=round(inside, 3)))
    _write_csv(BENCH / "accuracy_summary.csv", table)

    def cell(r: dict[str, Any]) -> str:
        return (f"{r['geometry']} / {r['policy']} / TP{r['tensor_parallel']} / r{r['lora_rank']} "
                f"/ {r['lengths']} tok / {r['outputs']} / "
                f"{'grad' if r['grad'] == 'True' else 'no grad'}")

    summary = {"source": str(path.relative_to(ROOT)), "cells": len(rows), "table": table}
    for column, label in (("ratio", "probe"), ("default_ratio", "defaults")):
        lo = min(rows, key=lambda r: r[column])
        hi = max(rows, key=lambda r: r[column])
        values = [r[column] for r in rows]
        summary[label] = dict(
            min=lo[column], min_cell=cell(lo), max=hi[column], max_cell=cell(hi),
            median=statistics.median(values),
            in_target=sum(ACCURACY_TARGET[0] <= v <= ACCURACY_TARGET[1] for v in values)
            / len(values),
            under=sum(v < 1.0 for v in values))
    out["accuracy"] = summary
    _plot_accuracy(rows)


def _plot_accuracy(rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = sorted({r["policy"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=False)
    for ax, column, title in ((axes[0], "ratio", "probe coefficients"),
                              (axes[1], "default_ratio", "default formulas (TrainerRank default)")):
        data = [[r[column] for r in rows if r["policy"] == p] for p in policies]
        ax.boxplot(data, vert=True, showfliers=True)
        ax.set_xticks(range(1, len(policies) + 1), policies, rotation=35, ha="right",
                      fontsize=8)
        ax.axhspan(*ACCURACY_TARGET, color="tab:green", alpha=0.15, label="target [1.00, 1.05]")
        ax.axhline(1.0, color="tab:red", lw=0.8)
        ax.set_title(f"predicted / measured dynamic peak: {title}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(BENCH / "accuracy.png", dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- utilisation

def _demo_provider():
    from peft import LoraConfig

    from art.megatron.geometry import geometry_from_hf_dict
    from art.megatron.implementation import Implementation
    from art.megatron.provider import Provider
    from art.megatron.settings import load_settings

    geometry = geometry_from_hf_dict(
        dict(model_type="qwen3", num_hidden_layers=4, hidden_size=128, intermediate_size=384,
             num_attention_heads=8, num_key_value_heads=4, head_dim=16, vocab_size=512,
             max_position_embeddings=8192, torch_dtype="float32"),
        name="tiny-qwen3-128")
    return Provider(geometry,
                    settings=load_settings({"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective"}),
                    lora=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
                    dtype="float32", implementation=Implementation.cpu_local())


def _recompute_of(trainer: Any, stats: Any) -> Any:
    escalated = stats.decision == "escalated" and trainer.admission.full_recompute is not None
    return trainer.admission.full_recompute if escalated else trainer.admission.recompute


def _planner_pass(name: str, trainer: Any, items: list[Any], *, grad: bool = True) -> Any:
    import torch
    from bench_baselines import PassResult

    from art.trainer_rank import TrainerRankMemoryError

    result = PassResult(name)
    before = len(trainer.stats_history)
    started = time.perf_counter()
    try:
        for mb in trainer.forward_micro_batches(items, no_grad=not grad):
            if grad:
                loss = sum(-(o.target_logprobs.sum()) for out in mb.outputs for o in out)
                loss.backward()
                del loss
            result.micro_batches.append(list(mb.indices))
    except TrainerRankMemoryError as exc:
        result.items_declined = list(exc.indices_not_run)
    except torch.OutOfMemoryError:
        result.escaped_ooms += 1
    result.wall_seconds = time.perf_counter() - started
    stats = trainer.stats_history[before:]
    result.micro_batch_tokens = [s.logical_tokens for s in stats]
    result.micro_batch_peaks = [int(s.measured_peak_bytes or 0) for s in stats]
    result.predicted = [s.predicted_dynamic_bytes for s in stats]
    result.recovered_ooms = sum(s.retries for s in stats)
    result.runs = len(stats) + result.recovered_ooms
    # The memory model's own figure for the same items (the planner uses max(model, profile)).
    by_index = {i: item for i, item in enumerate(items)}
    result.model_predicted = [
        trainer.admission.price([leaf for i in mb for leaf in by_index[i]], grad,
                                _recompute_of(trainer, s))[0].model_dynamic_bytes
        for mb, s in zip(result.micro_batches, stats)]
    result.decisions = [s.decision for s in stats]
    result.sources = [s.predicted_source for s in stats]
    return result


def utilisation(out: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from bench_baselines import (
        MicroBatchRunner,
        most_that_fits,
        oracle_pass,
        seed_formula_bytes,
        seed_formula_pass,
        try_and_halve_pass,
    )

    from art.megatron.train import TrainingRuntime
    from art.trainer_rank import TrainerRank, TrainerRankOptions
    from art.trainer_rank._request import OutputRequest
    from art.trainer_rank.compute.items import make_items
    from art.trainer_rank.compute.packing import packed_length_tokens

    from _workload import WorkloadSpec, forward_inputs, rl_groups

    provider = _demo_provider()
    provider.initialize_distributed()
    model = provider.build_model(seed=0)
    spec = WorkloadSpec(groups=args.groups, rollouts_per_group=4, min_tokens=24,
                        max_tokens=args.max_tokens, median_completion_tokens=80,
                        completion_sigma=0.9, prompt_tokens_range=(16, 64), vocab_size=512,
                        seed=args.seed)
    inputs = forward_inputs(rl_groups(spec), target_logprobs=True)
    items = make_items(inputs)
    # Sizing only, priced with the default formulas so the limit does not depend on the
    # probe (and stays comparable between runs); the trainers below probe as TrainerRank does.
    options = TrainerRankOptions(test_memory_limit_bytes=1, probe_layers=False)
    probe_trainer = TrainerRank(TrainingRuntime.for_model(model, provider, trainer_options=options))
    # The limit: `--limit-groups` average groups' worth of the memory model's price, so that a
    # micro-batch holds a few groups and packing decisions matter.
    mean_group = statistics.mean(
        probe_trainer.admission.price(item.leaves, True)[0].model_dynamic_bytes for item in items)
    limit = int(args.limit_groups * mean_group)
    options = replace(options, test_memory_limit_bytes=limit, probe_layers=True)

    # Warm the process (first-call allocations, lazy imports) outside every measured pass.
    runner = MicroBatchRunner(model, provider, limit, options.head_chunk_tokens)
    runner.run(items[:1], limit_bytes=None)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()

    def zero() -> None:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()

    layout = provider.layout
    passes = []
    trainer = TrainerRank(TrainingRuntime.for_model(model, provider, trainer_options=options))
    zero()
    passes.append(_planner_pass("planner (cold)", trainer, inputs))
    zero()
    passes.append(_planner_pass("planner (warm)", trainer, inputs))
    zero()
    # Scoring: the same items without grad (a signature of its own, so the first pass is cold).
    passes.append(_planner_pass("planner (cold, no grad)", trainer, inputs, grad=False))
    passes.append(_planner_pass("planner (warm, no grad)", trainer, inputs, grad=False))
    for p in passes:
        p.oracle_tokens = most_that_fits(p, items, runner, limit, grad="no grad" not in p.policy)
        zero()
    passes.append(seed_formula_pass(items, runner, limit, provider.geometry, 4,
                                    lambda lengths: packed_length_tokens(lengths, layout)))
    zero()
    passes.append(try_and_halve_pass(items, runner))
    zero()
    greedy = oracle_pass(items, runner, limit)
    passes.append(greedy)
    zero()

    total_tokens = sum(item.num_tokens for item in items)
    greedy_mean = statistics.mean(greedy.micro_batch_tokens)
    rows = []
    for p in passes:
        done = sum(p.micro_batch_tokens)
        mean = done / max(1, len(p.micro_batches))
        rows.append(dict(
            policy=p.policy, micro_batches=len(p.micro_batches), runs=p.runs,
            tokens_done=done, tokens_total=total_tokens,
            mean_tokens_per_micro_batch=round(mean, 1),
            oracle_tokens=sum(p.oracle_tokens) if p.oracle_tokens else "",
            utilisation=round(p.utilisation, 3) if p.utilisation is not None else "",
            oracle_runs=p.oracle_runs if p.oracle_tokens else "",
            mean_over_in_order_greedy=round(mean / greedy_mean, 3),
            escaped_ooms=p.escaped_ooms, recovered_ooms=p.recovered_ooms,
            items_lost=len(p.items_lost), items_declined=len(p.items_declined),
            max_peak_over_limit=round(max(p.micro_batch_peaks, default=0) / limit, 3),
            wall_seconds=round(p.wall_seconds, 1)))
    _write_csv(BENCH / "utilisation.csv", rows)
    per_mb = []
    for p in passes:
        for i, (indices, tokens, peak) in enumerate(zip(p.micro_batches, p.micro_batch_tokens,
                                                         p.micro_batch_peaks)):
            predicted = p.predicted[i] if i < len(p.predicted) else 0
            model_figure = p.model_predicted[i] if i < len(p.model_predicted) else 0
            per_mb.append(dict(
                policy=p.policy, micro_batch=i, items="+".join(map(str, indices)),
                tokens=tokens,
                oracle_tokens=p.oracle_tokens[i] if i < len(p.oracle_tokens) else "",
                measured_peak_bytes=peak, predicted_bytes=predicted or "",
                predicted_over_measured=round(predicted / peak, 4) if predicted and peak else "",
                model_over_measured=round(model_figure / peak, 4) if model_figure and peak else "",
                decision=p.decisions[i] if i < len(p.decisions) else "",
                source=p.sources[i] if i < len(p.sources) else ""))
    _write_csv(BENCH / "utilisation_micro_batches.csv", per_mb)
    # The seed formula's figure for the largest item, next to what it really needed.
    largest = max(items, key=lambda it: it.num_tokens)
    seed_largest = seed_formula_bytes(
        packed_length_tokens(list(largest.sequence_lengths_tokens), layout),
        OutputRequest(target_logprobs=True), provider.geometry, 4)
    model_largest = trainer.admission.price(largest.leaves, True)[0]
    measured_largest = runner.run([largest], limit_bytes=None).peak_bytes
    run_seconds = [r.seconds for r in [runner.run(items[:3], limit_bytes=None)
                                       for _ in range(3)]]
    zero()
    out["utilisation"] = dict(
        model=provider.geometry.name, recompute=provider.effective_recompute.summary,
        lora="rank 8, all linears", layout=layout.summary, limit_bytes=limit,
        workload=dict(groups=spec.groups, rollouts_per_group=spec.rollouts_per_group,
                      sequences=sum(len(it.leaves) for it in items), tokens=total_tokens,
                      max_tokens=spec.max_tokens, seed=spec.seed,
                      lengths=sorted(n for it in items for n in it.sequence_lengths_tokens)),
        rows=rows,
        largest_item=dict(tokens=largest.num_tokens, seed_formula_bytes=seed_largest,
                          model_dynamic_bytes=model_largest.model_dynamic_bytes,
                          model_peak_bytes=max(model_largest.estimate.forward_peak_bytes,
                                               model_largest.estimate.backward_peak_bytes),
                          reserve_bytes=model_largest.estimate.reserve_bytes,
                          coefficients_source=model_largest.estimate.coefficients_source,
                          measured_bytes=measured_largest),
        three_item_forward_backward_seconds=statistics.median(run_seconds),
        three_item_tokens=sum(it.num_tokens for it in items[:3]),
    )
    planner_ratios = {}
    for p in passes[:4]:
        pairs = [(m, pr, pk) for m, pr, pk in zip(p.model_predicted, p.predicted,
                                                  p.micro_batch_peaks) if pk]
        planner_ratios[p.policy] = dict(
            model_over_measured=[round(m / pk, 4) for m, _, pk in pairs],
            admitted_over_measured=[round(pr / pk, 4) for _, pr, pk in pairs],
            sources=list(p.sources))
    out["utilisation"]["planner_ratios"] = planner_ratios
    _plot_utilisation(passes, limit)
    return dict(model=model, provider=provider, trainer=trainer, limit=limit, spec=spec)


def _plot_utilisation(passes: list[Any], limit: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    names = [p.policy for p in passes]
    means = [sum(p.micro_batch_tokens) / max(1, len(p.micro_batches)) for p in passes]
    colors = ["tab:blue", "tab:blue", "tab:cyan", "tab:cyan", "tab:red", "tab:orange",
              "tab:green"]
    bars = axes[0].bar(range(len(names)), means, color=colors[:len(names)])
    for i, (bar, p) in enumerate(zip(bars, passes)):
        label = f"{len(p.micro_batches)} mb"
        if p.utilisation is not None:
            oracle_mean = sum(p.oracle_tokens) / max(1, len(p.oracle_tokens))
            axes[0].hlines(oracle_mean, i - 0.4, i + 0.4, color="black", lw=1.5,
                           label="the pass's oracle" if i == 0 else None)
            label += f"\n{p.utilisation:.3f} of oracle"
        if p.escaped_ooms:
            label += f"\n{p.escaped_ooms} OOM: {len(p.items_lost)} items lost"
        if p.recovered_ooms:
            label += f"\n{p.recovered_ooms} OOM retried"
        axes[0].text(bar.get_x() + bar.get_width() / 2, bar.get_height(), label,
                     ha="center", va="bottom", fontsize=7)
    axes[0].set_xticks(range(len(names)), names, rotation=25, fontsize=7)
    axes[0].set_ylabel("mean tokens per micro-batch")
    axes[0].set_title("same workload, same virtual limit (oracle: most that fits, measured)",
                      fontsize=9)
    axes[0].legend(fontsize=7)
    ax = axes[1]
    for p, color in zip(passes, colors):
        ax.scatter(p.micro_batch_tokens, [b / MIB for b in p.micro_batch_peaks], s=14,
                   label=p.policy, color=color, alpha=0.7,
                   marker="x" if "warm" in p.policy else "o")
    ax.axhline(limit / MIB, color="black", lw=0.8, label="virtual limit")
    ax.set_ylim(0, 1.08 * limit / MIB)
    ax.set_xlabel("tokens in the micro-batch")
    ax.set_ylabel("measured dynamic peak (MiB)")
    ax.set_title("micro-batches that completed", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(BENCH / "utilisation.png", dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- overhead

def _clear_caches(admission: Any) -> None:
    """Forget the memory model's per-shape estimates and admission's cached prices and caps
    (a decision on new items finds none)."""
    admission.memory_model.clear_caches()
    admission.clear_caches()


def overhead(out: dict[str, Any], ctx: dict[str, Any], args: argparse.Namespace) -> None:
    import torch

    from art.megatron.train import TrainingRuntime
    from art.trainer_rank import ForwardInput, TrainerRank
    from art.trainer_rank.compute.items import make_items
    from art.trainer_rank.decide.plan import PlanRequest

    from _workload import group_lengths

    model, provider = ctx["model"], ctx["provider"]
    warm_trainer = ctx["trainer"]  # has profiles from the utilisation passes
    limit = ctx["limit"]
    rows = []
    for n in args.overhead_items:
        spec = replace(ctx["spec"], groups=n, seed=args.seed + n)
        inputs = [[ForwardInput(input_tokens=torch.zeros(t, dtype=torch.long),
                                target_tokens=torch.zeros(t, dtype=torch.long))
                   for t in g.sequence_lengths_tokens] for g in group_lengths(spec)]
        items = make_items(inputs)
        for state in ("cold", "warm"):
            if state == "cold":
                trainer = TrainerRank(TrainingRuntime.for_model(
                    model, provider, trainer_options=warm_trainer.options))
            else:
                trainer = warm_trainer
            first: list[float] = []
            for _ in range(args.overhead_repeats):
                _clear_caches(trainer.admission)
                t0 = time.perf_counter()
                trainer.admission.plan(PlanRequest(tuple(items), True, limit))
                first.append(time.perf_counter() - t0)
            # A whole pass of decisions over the N items (no execution): the per-decision mean.
            _clear_caches(trainer.admission)
            pending = list(items)
            decisions = 0
            t0 = time.perf_counter()
            while pending and decisions < 200:
                plan = trainer.admission.plan(PlanRequest(tuple(pending), True, limit))
                chosen = {it.index for it in plan.items}
                pending = [it for it in pending if it.index not in chosen]
                decisions += 1
            pass_seconds = time.perf_counter() - t0
            rows.append(dict(items=n, profile=state,
                             first_decision_ms=round(1e3 * statistics.median(first), 3),
                             decisions_in_pass=decisions,
                             mean_decision_ms=round(1e3 * pass_seconds / decisions, 3)))
            print(f"overhead: {n} items, {state}: first {rows[-1]['first_decision_ms']} ms, "
                  f"mean {rows[-1]['mean_decision_ms']} ms over {decisions}", flush=True)
    forward_s = out["utilisation"]["three_item_forward_backward_seconds"]
    for r in rows:
        r["fraction_of_forward_backward"] = round(r["mean_decision_ms"] / 1e3 / forward_s, 5)
    _write_csv(BENCH / "overhead.csv", rows)
    out["overhead"] = dict(rows=rows, forward_backward_seconds=forward_s,
                           forward_backward_tokens=out["utilisation"]["three_item_tokens"])
    _plot_overhead(rows)


def _plot_overhead(rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for state, marker in (("cold", "o"), ("warm", "s")):
        sub = [r for r in rows if r["profile"] == state]
        ax.plot([r["items"] for r in sub], [r["first_decision_ms"] for r in sub], marker=marker,
                label=f"first decision, {state} profile")
        ax.plot([r["items"] for r in sub], [r["mean_decision_ms"] for r in sub], marker=marker,
                ls="--", label=f"mean over a pass, {state}")
    ax.axhline(2.0, color="gray", ls=":", label="target: 2 ms at 1,000 items")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("pending top-level items")
    ax.set_ylabel("ms per admission decision")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(BENCH / "overhead.png", dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- output

def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default="accuracy,utilisation,overhead")
    # Sized so that the policies that pack everything at once (the seed formula, the first
    # try of try-and-halve) allocate at most ~1.5 GB of attention scores before the limit
    # trips: the local spec's unfused attention is quadratic in the packed row.
    parser.add_argument("--groups", type=int, default=12, help="RL groups in the workload")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--limit-groups", type=float, default=3.0,
                        help="virtual limit = this many average groups' model price")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overhead-items", type=int, nargs="+",
                        default=[10, 100, 1000, 10000])
    parser.add_argument("--overhead-repeats", type=int, default=5)
    parser.add_argument("--calibration-csv", type=Path,
                        default=BENCH / "calibration" / "calibration.csv",
                        help="the calibration output of scripts/calibrate.py; when "
                        "missing, the harness's quick matrix is run here")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("art.trainer_rank").setLevel(logging.ERROR)
    BENCH.mkdir(exist_ok=True)
    sections = set(args.sections.split(","))
    results_path = BENCH / "results.json"
    out: dict[str, Any] = json.loads(results_path.read_text()) if results_path.exists() else {}
    out["machine"] = dict(cpus=os.cpu_count(), threads=os.environ.get("OMP_NUM_THREADS"),
                          load_average=os.getloadavg()[0], date=time.strftime("%Y-%m-%d %H:%M"))
    if "accuracy" in sections:
        accuracy(out, args.calibration_csv)
    ctx = None
    if "utilisation" in sections or "overhead" in sections:
        ctx = utilisation(out, args)
        out["utilisation"]["machine"] = out["machine"]
    if "overhead" in sections and ctx is not None:
        overhead(out, ctx, args)
        out["overhead"]["machine"] = out["machine"]
    results_path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    from bench_report import write_results

    write_results(out, BENCH / "RESULTS.md")
    print(f"wrote {BENCH / 'RESULTS.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
