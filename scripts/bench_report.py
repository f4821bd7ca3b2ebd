"""bench/RESULTS.md from bench/results.json (written by scripts/bench_planner.py).

Every figure comes from the JSON; each target gets a met / missed-by line. Nothing in the
file is written by hand: it is rewritten whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MIB = 2**20


def _mib(n: float) -> str:
    return f"{n / MIB:.2f} MiB"


def _table(rows: list[dict[str, Any]], columns: list[str]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in columns) + " |")
    return lines


def _accuracy(acc: dict[str, Any]) -> list[str]:
    lines = ["## 1. Accuracy: predicted / measured dynamic peak", ""]
    if "missing" in acc:
        return lines + [f"Not run: {acc['missing']} was not found (run scripts/calibrate.py).",
                        ""]
    lines += [
        f"Source: `{acc['source']}` ({acc['cells']} cells, scripts/calibrate.py's harness: real "
        "Megatron-Core micro-batches on the trainer's compute path, CPU, measured = peak of "
        "bytes allocated inside the micro-batch). Target: every cell in [1.00, 1.05].", "",
        "| coefficients | cells in target | under-predicted cells | median | worst low (cell) "
        "| worst high (cell) |",
        "|---|---|---|---|---|---|",
    ]
    for label in ("probe", "defaults"):
        s = acc[label]
        lines.append(
            f"| {label} | {s['in_target']:.1%} | {s['under']} | {s['median']:.3f} | "
            f"{s['min']:.3f} ({s['min_cell']}) | {s['max']:.3f} ({s['max_cell']}) |")
    lines += ["", "Per dimension (min / median / max, share of cells in target):", ""]
    lines += _table(acc["table"], ["dimension", "value", "coefficients", "cells", "min",
                                   "median", "max", "in_target"])
    lines += ["", "![accuracy](accuracy.png)", ""]
    for label in ("probe", "defaults"):
        s = acc[label]
        if s["min"] >= 1.0 and s["max"] <= 1.05:
            lines.append(f"- {label}: target met in every cell.")
        else:
            parts = []
            if s["min"] < 1.0:
                parts.append(f"under-predicts by up to {1 - s['min']:.1%} ({s['min_cell']})")
            if s["max"] > 1.05:
                parts.append(f"over-predicts by up to {s['max'] - 1:.1%} ({s['max_cell']}), "
                             f"{s['max'] - 1.05:.1%} past the 5% band")
            lines.append(f"- {label}: target missed: " + "; ".join(parts) + ".")
    return lines + [""]


def _run_line(section: dict[str, Any]) -> list[str]:
    m = section.get("machine")
    if not m:
        return []
    return [f"Run {m.get('date')}, 1-minute load average {m.get('load_average', 0):.1f} at "
            "the start of the script.", ""]


def _utilisation(u: dict[str, Any]) -> list[str]:
    w = u["workload"]
    rows = u["rows"]
    lines = [
        "## 2. Utilisation: RL-like workload under one virtual limit", "", *_run_line(u),
        f"Model {u['model']} ({u['recompute']}, LoRA {u['lora']}, {u['layout']}, fp32, CPU). "
        f"Workload: {w['groups']} groups x {w['rollouts_per_group']} rollouts "
        f"({w['sequences']} sequences, {w['tokens']} tokens; lengths long-tailed, "
        f"{min(w['lengths'])}-{max(w['lengths'])} tokens, cap {w['max_tokens']}; seed "
        f"{w['seed']}). Virtual limit {_mib(u['limit_bytes'])} (live tensor bytes; an "
        "allocation past it raises torch.OutOfMemoryError). Every policy runs the same items "
        "in the same process through the same compute path; a group is one top-level item and "
        "is never split.", "",
        "*utilisation* = tokens the pass ran / its oracle's tokens. The oracle of a pass: for "
        "every micro-batch the pass ran, the most that really fits with the same packing (its "
        "items plus the longest run of the items still waiting, in order, whose measured peak "
        "stays within the limit; bisection on measured peaks of unlimited runs, "
        "*oracle_runs* of them). The no-grad passes score the same items (forward and heads "
        "only). *mean_over_in_order_greedy*: mean tokens per micro-batch over the in-order "
        "greedy pass's (whole items in order, as many as really fit). *runs* counts "
        "forward(+backward) executions, failed ones included. *escaped* OOMs lose their "
        "items; *recovered* ones are re-run smaller.", "",
    ]
    lines += _table(rows, ["policy", "micro_batches", "runs", "tokens_done", "tokens_total",
                           "mean_tokens_per_micro_batch", "oracle_tokens", "utilisation",
                           "oracle_runs", "mean_over_in_order_greedy", "escaped_ooms",
                           "recovered_ooms", "items_lost", "items_declined",
                           "max_peak_over_limit", "wall_seconds"])
    largest = u["largest_item"]
    lines += [
        "", "![utilisation](utilisation.png)", "",
        f"The largest group ({largest['tokens']} tokens) really needs "
        f"{_mib(largest['measured_bytes'])}; the planner's memory model (coefficients: "
        f"{largest.get('coefficients_source', 'defaults')}) prices its peak (max of forward "
        f"and backward) at {_mib(largest['model_peak_bytes'])} "
        f"({largest['model_peak_bytes'] / largest['measured_bytes']:.3f}x) and admits against "
        f"that plus the allocator reserve ({_mib(largest['reserve_bytes'])}, the largest single "
        f"allocation), {_mib(largest['model_dynamic_bytes'])} "
        f"({largest['model_dynamic_bytes'] / largest['measured_bytes']:.3f}x); the seed's "
        "formula at "
        f"{_mib(largest['seed_formula_bytes'])} "
        f"({largest['seed_formula_bytes'] / largest['measured_bytes']:.2f}x the truth).", "",
    ]
    by = {r["policy"]: r for r in rows}
    for name, target in (("planner (warm)", 0.95), ("planner (cold)", 0.80),
                         ("planner (warm, no grad)", 0.95), ("planner (cold, no grad)", 0.80)):
        r = by.get(name)
        if r is None or r.get("utilisation", "") == "":
            continue
        verdict = "met" if r["utilisation"] >= target and r["escaped_ooms"] == 0 else "missed"
        extra = "" if verdict == "met" else f" by {target - r['utilisation']:.3f}"
        lines.append(f"- {name}: utilisation {r['utilisation']:.3f} (target >= {target}), "
                     f"{r['escaped_ooms']} escaped OOMs: target {verdict}{extra}.")
    return lines + [""]


def _overhead(o: dict[str, Any]) -> list[str]:
    rows = o["rows"]
    lines = [
        "## 3. Overhead: time per admission decision", "", *_run_line(o),
        "`Admission.plan` (a queue, `PlanMode.NEXT`) on the demo model's memory model with N "
        "pending top-level items "
        "(groups of 4 rollouts from the workload generator), grad, the utilisation limit. "
        "*first* = one decision with all N pending and the estimate cache cleared (median of "
        "repeats); *mean* = a whole pass of decisions (up to 200) over the N items without "
        "running them, divided by the decisions. *cold* = no learned profile (the cold cap "
        "applies), *warm* = the profiles learned in section 2. Compared with one forward+"
        f"backward of three groups ({o['forward_backward_tokens']} tokens) of the demo model: "
        f"{o['forward_backward_seconds'] * 1e3:.0f} ms on this machine.", "",
    ]
    lines += _table(rows, ["items", "profile", "first_decision_ms", "decisions_in_pass",
                           "mean_decision_ms", "fraction_of_forward_backward"])
    lines += ["", "![overhead](overhead.png)", ""]
    at_1000 = [r for r in rows if r["items"] == 1000]
    if at_1000:
        worst = max(max(r["first_decision_ms"], r["mean_decision_ms"]) for r in at_1000)
        verdict = "met" if worst <= 2.0 else f"missed by {worst - 2.0:.2f} ms"
        lines.append(f"- At 1,000 items the slowest figure is {worst:.2f} ms per decision "
                     f"(target <= 2 ms): {verdict}.")
    return lines + [""]


def write_results(out: dict[str, Any], path: Path) -> None:
    m = out.get("machine", {})
    lines = [
        "# Planner benchmarks", "",
        "Written by `.venv/bin/python scripts/bench_planner.py` (figures in `bench/results.json` "
        "and the CSVs next to this file). Benchmarks, not tests: nothing fails on a time. "
        f"Machine: {m.get('cpus')} CPU cores shared with other jobs (1-minute load average "
        f"{m.get('load_average', 0):.1f} at the start), OMP_NUM_THREADS={m.get('threads')}, "
        f"{m.get('date')}.", "",
    ]
    if "accuracy" in out:
        lines += _accuracy(out["accuracy"])
    if "utilisation" in out:
        lines += _utilisation(out["utilisation"])
    if "overhead" in out:
        lines += _overhead(out["overhead"])
    path.write_text("\n".join(lines).rstrip("\n") + "\n")
