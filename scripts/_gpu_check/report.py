"""The GPU check's outputs, all in one folder: gpu_check.csv (one row per planned cell, run or
not), gpu_check.md (what ran where, per-policy and per-cell tables, time predicted against
taken, what did not run and why), gpu_check.png (predicted against measured peaks, priced
against seen reserve; matplotlib when importable, else the MD says why there is none),
gpu_check.json (device, versions, plan, every step's row) and the one-line summary printed
last. Five files: the device call returns at most eight.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from _gpu_check.plan import Plan, Step
from _gpu_check.wheels import DeviceInfo, Setup

TARGET = (1.00, 1.05)  # the calibration's band for predicted / measured
MIB = 2**20
COLUMNS: tuple[str, ...] = (
    "allocator", "geometry", "policy", "label", "lengths", "shared_prefix", "packed_tokens",
    "outputs", "grad", "loss", "status", "reason", "trainer_rank_predicted_bytes",
    "estimate_defaults_bytes", "measured_bytes", "ratio", "defaults_ratio",
    "reserve_priced_bytes", "reserved_minus_allocated_bytes", "reserve_seen_bytes",
    "allocated_before_bytes", "reserved_before_bytes", "allocated_peak_bytes",
    "reserved_peak_bytes", "measured_forward_bytes", "micro_batch_seconds", "seconds",
    "predicted_seconds", "peak_at", "implementation", "probe_key")
FILES = ("gpu_check.csv", "gpu_check.md", "gpu_check.png", "gpu_check.json", "gpu_check.log")


def merged_rows(plan: Plan, reported: Sequence[dict[str, Any]],
                missing_reason: dict[str, str]) -> list[dict[str, Any]]:
    """One row per planned step, in plan order: the worker's row, or "not run" with the
    reason its process gave (`missing_reason`, by allocator)."""
    by_name = {r["name"]: r for r in reported}
    rows = []
    for step in plan.steps:
        row = by_name.get(step.name)
        if row is None:
            row = _not_run(step, missing_reason.get(step.allocator, "its process did not run"))
        rows.append(row)
    return rows


def _not_run(step: Step, reason: str) -> dict[str, Any]:
    from _gpu_check.budget import StepRow

    return StepRow(step, "not run", reason=reason).to_dict()


def cell_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["kind"] == "cell"]


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(cell_rows(rows))


def _ok(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in cell_rows(rows) if r["status"] == "ok"]


def _span(values: Sequence[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}" if values else "n/a"


def _inside(values: Sequence[float]) -> int:
    return sum(TARGET[0] <= v <= TARGET[1] for v in values)


def reserve_ratio(row: dict[str, Any]) -> float | None:
    """Seen over priced reserve; None where nothing is priced (CPU: no caching allocator)."""
    priced = row.get("reserve_priced_bytes") or 0
    return row["reserve_seen_bytes"] / priced if priced > 0 else None


def counts(rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    found = {"ok": 0, "failed": 0, "skipped": 0, "not run": 0}
    for r in cell_rows(rows):
        found[r["status"]] = found.get(r["status"], 0) + 1
    return found


def summary_line(plan: Plan, rows: Sequence[dict[str, Any]], device: DeviceInfo,
                 elapsed: float, md: Path) -> str:
    ok, n = _ok(rows), counts(rows)
    total = len(cell_rows(rows))
    parts = [f"gpu_check: {n['ok']}/{total} cells measured on {device.name} ({device.device})"]
    if ok:
        ratios = [r["ratio"] for r in ok]
        parts.append(f"TrainerRank predicted/measured {_span(ratios)} ({_inside(ratios)} in "
                     f"[{TARGET[0]:.2f}, {TARGET[1]:.2f}])")
        parts.append(f"defaults {_span([r['defaults_ratio'] for r in ok])}")
        reserves = [x for r in ok if (x := reserve_ratio(r)) is not None]
        parts.append(f"reserve seen/priced max {max(reserves):.2f}" if reserves else
                     "reserve not priced on this device")
    else:
        parts.append("no figures")
    parts.append(f"{n['failed']} failed, {n['skipped']} skipped, {n['not run']} not run")
    parts.append(f"{elapsed:.0f} s of a {plan.budget_seconds:.0f} s budget")
    parts.append(f"report {md}")
    return "; ".join(parts)


def _mib(value: Any) -> str:
    return f"{value / MIB:,.1f}" if isinstance(value, (int, float)) else "-"


def _ratio(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else "-"


def markdown(plan: Plan, rows: Sequence[dict[str, Any]], device: DeviceInfo, setup: Setup,
             *, command: str, elapsed: float, processes: Sequence[dict[str, Any]],
             plot_note: str | None) -> str:
    ok, n = _ok(rows), counts(rows)
    cells = cell_rows(rows)
    build = sorted({r.get("implementation") for r in ok if r.get("implementation")})
    lines = [
        "# GPU check (written by scripts/gpu_check)", "",
        f"- command: `{command}`",
        f"- device: {device.name} ({device.device}), {device.total_bytes / 2**30:.1f} GiB, "
        f"{device.free_bytes / 2**30:.1f} GiB free at the start; {device.detail}",
        "- software: " + ", ".join(f"{k} {v}" for k, v in setup.versions.items())
        + (f"; installed now from .whl/ into {setup.target}: {', '.join(setup.installed)}"
           if setup.installed else ""),
        f"- build: {', '.join(build) or plan.implementation}; {plan.dtype}, LoRA rank 1, TP=1; "
        f"the seed's group at scale {plan.seed_scale:g}",
        f"- plan `{plan.name}`: {len(plan.steps)} steps ({len(cells)} cells) predicted "
        f"{plan.predicted_seconds():.0f} s against a budget of {plan.budget_seconds:.0f} s"
        + (f"; trimmed to fit: {'; '.join(plan.trimmed)}" if plan.trimmed else ""),
        f"- wall time: {elapsed:.0f} s ("
        + ", ".join(f"{p['allocator']} process {p['seconds']:.0f} s, exit {p['exit']}"
                    for p in processes) + ")",
        f"- cells: {n['ok']} measured, {n['failed']} failed, {n['skipped']} skipped, "
        f"{n['not run']} not run",
        *(f"- the seed's call through TrainerRank (after the matrix): [{p['report']}]"
          f"({p['report']}), exit {p['exit']}" for p in processes if p.get("report")),
        "",
        ("Measured = `torch.cuda.max_memory_allocated` above the allocated bytes at the "
         "micro-batch's start (the memory meter resets the peak there and reads the allocator "
         "only, as TrainerRank's meter does on a GPU" if device.device == "cuda" else
         "Measured = the memory meter's peak of live tensor bytes above those at the "
         "micro-batch's start (CPU: no caching allocator")
        + "; packing, decoder, head, caller loss, backward); TrainerRank = the estimate's "
        "max(forward, backward) peak with the "
        "layer probe's coefficients, as a TrainerRank prices; defaults = the same with the "
        "estimate's formulas. Reserve priced = the estimate's allocator reserve for the "
        "process's PYTORCH_CUDA_ALLOC_CONF; reserved - allocated = the allocator's reserved "
        "minus allocated peaks; reserve seen = what the micro-batch reserved beyond what it "
        "allocated (the reserved peak above the reserved bytes at its start, less the "
        "measured peak).",
    ]
    if ok:
        ratios = [r["ratio"] for r in ok]
        lines += ["", "## Summary", "",
                  f"- TrainerRank predicted / measured: {_span(ratios)}, {_inside(ratios)} of "
                  f"{len(ok)} in [{TARGET[0]:.2f}, {TARGET[1]:.2f}]",
                  f"- defaults predicted / measured: "
                  f"{_span([r['defaults_ratio'] for r in ok])}, "
                  f"{_inside([r['defaults_ratio'] for r in ok])} of {len(ok)} in the band"]
        for allocator in plan.allocators:
            mine = [r for r in ok if r["allocator"] == allocator]
            seen = [x for r in mine if (x := reserve_ratio(r)) is not None]
            if seen:
                lines.append(f"- {allocator}: reserve seen / priced {_span(seen)} over "
                             f"{len(seen)} cells")
        lines += ["", "## Per policy", "",
                  "| allocator | geometry | policy | cells | TrainerRank min | max | in band | "
                  "defaults min | max | max reserve priced MiB | max reserve seen MiB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
        for r in ok:
            groups.setdefault((r["allocator"], r["geometry"], r["policy"]), []).append(r)
        for (allocator, geometry, policy), rs in groups.items():
            tr = [r["ratio"] for r in rs]
            d = [r["defaults_ratio"] for r in rs]
            lines.append(
                f"| {allocator} | {geometry} | {policy} | {len(rs)} | {min(tr):.4f} | "
                f"{max(tr):.4f} | {_inside(tr)} | {min(d):.4f} | {max(d):.4f} | "
                f"{_mib(max(r['reserve_priced_bytes'] for r in rs))} | "
                f"{_mib(max(r['reserve_seen_bytes'] for r in rs))} |")
    lines += ["", "## Every cell", "",
              "| allocator | geometry | policy | cell | packed | outputs | grad | TrainerRank MiB "
              "| defaults MiB | measured MiB | ratio | defaults ratio | reserve priced MiB | "
              "reserved - allocated MiB | reserve seen MiB | s | status |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in cells:
        lines.append(
            f"| {r['allocator']} | {r['geometry']} | {r['policy']} | {r['label']} | "
            f"{r['packed_tokens']:,} | {r['outputs']} | {'yes' if r['grad'] else 'no'} | "
            f"{_mib(r.get('trainer_rank_predicted_bytes'))} | "
            f"{_mib(r.get('estimate_defaults_bytes'))} | {_mib(r.get('measured_bytes'))} | "
            f"{_ratio(r.get('ratio'))} | {_ratio(r.get('defaults_ratio'))} | "
            f"{_mib(r.get('reserve_priced_bytes'))} | "
            f"{_mib(r.get('reserved_minus_allocated_bytes'))} | "
            f"{_mib(r.get('reserve_seen_bytes'))} | "
            f"{r['seconds']:.2f} | {r['status']} |")
    lines += ["", "## Time: predicted against taken", "",
              "| step | predicted s | taken s | status |", "|---|---|---|---|"]
    for r in rows:
        if r["kind"] != "cell":
            lines.append(f"| {r['name']} | {r['predicted_seconds']:.1f} | {r['seconds']:.1f} | "
                         f"{r['status']} |")
    for allocator in plan.allocators:
        mine = [r for r in cells if r["allocator"] == allocator and r["status"] == "ok"]
        if mine:
            lines.append(f"| {allocator}: {len(mine)} measured cells | "
                         f"{sum(r['predicted_seconds'] for r in mine):.1f} | "
                         f"{sum(r['seconds'] for r in mine):.1f} | ok |")
    missed = [r for r in rows if r["status"] != "ok"]
    if missed:
        lines += ["", "## Not measured", ""]
        lines += [f"- {r['name']}: {r['status']}" + (f" ({r['reason']})" if r["reason"] else "")
                  for r in missed]
    lines += ["", "## Plot", "",
              "![predicted against measured peaks; reserve priced against seen]"
              "(gpu_check.png)" if plot_note is None else f"No plot: {plot_note}."]
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[dict[str, Any]], path: Path) -> str | None:
    """Draw the PNG; returns None when drawn, else why not (for the MD)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        return f"matplotlib is not importable here ({error})"
    ok = _ok(rows)
    if not ok:
        return "no cell was measured"
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 6))
    colors = {"segmented": "tab:blue", "expandable": "tab:orange"}
    for allocator, color in colors.items():
        mine = [r for r in ok if r["allocator"] == allocator]
        if not mine:
            continue
        measured = [r["measured_bytes"] / MIB for r in mine]
        left.scatter(measured, [r["trainer_rank_predicted_bytes"] / MIB for r in mine], s=14,
                     color=color, label=f"TrainerRank (probe), {allocator}")
        left.scatter(measured, [r["estimate_defaults_bytes"] / MIB for r in mine], s=10,
                     marker="x", color=color, alpha=0.5, label=f"defaults, {allocator}")
        right.scatter([r["reserve_priced_bytes"] / MIB for r in mine],
                      [r["reserve_seen_bytes"] / MIB for r in mine], s=14, color=color,
                      label=allocator)
    values = [r[k] / MIB for r in ok for k in
              ("measured_bytes", "trainer_rank_predicted_bytes", "estimate_defaults_bytes")]
    low, top = max(min(values) * 0.9, 1e-3), max(values) * 1.1
    left.plot([low, top], [low, top], "k--", lw=0.8, label="predicted = measured")
    left.plot([low, top], [low * TARGET[1], top * TARGET[1]], "r:", lw=0.8, label="+5%")
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("measured dynamic peak (MiB)")
    left.set_ylabel("predicted dynamic peak (MiB)")
    left.set_title("predicted against measured, every measured cell")
    left.legend(fontsize=8)
    reserve = [r[k] / MIB for r in ok for k in ("reserve_priced_bytes", "reserve_seen_bytes")]
    edge = max([*reserve, 1.0]) * 1.1
    right.plot([0, edge], [0, edge], "k--", lw=0.8, label="seen = priced")
    right.set_xlabel("allocator reserve priced (MiB)")
    right.set_ylabel("reserved beyond allocated, seen (MiB)")
    right.set_title("allocator reserve" if any(reserve) else
                    "allocator reserve (none on CPU: no caching allocator)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_report(out: Path, plan: Plan, rows: Sequence[dict[str, Any]], device: DeviceInfo,
                 setup: Setup, *, command: str, elapsed: float,
                 processes: Sequence[dict[str, Any]], final: bool = True) -> str:
    """Every output file in `out`; returns the summary line. Not `final` (between the
    processes): no PNG, which only the last report draws (matplotlib takes a second)."""
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / FILES[0])
    png = out / FILES[2]
    png.unlink(missing_ok=True)
    note = plot(rows, png) if final else "drawn when the last process has run"
    md = out / FILES[1]
    md.write_text(markdown(plan, rows, device, setup, command=command, elapsed=elapsed,
                           processes=processes, plot_note=note))
    (out / FILES[3]).write_text(json.dumps({
        "command": command, "device": asdict(device), "setup": asdict(setup),
        "plan": {"name": plan.name, "budget_seconds": plan.budget_seconds,
                 "predicted_seconds": round(plan.predicted_seconds(), 1),
                 "steps": len(plan.steps), "cells": len(plan.cells()),
                 "seed_scale": plan.seed_scale, "trimmed": list(plan.trimmed),
                 "implementation": plan.implementation},
        "elapsed_seconds": round(elapsed, 1), "processes": list(processes),
        "steps": [_finite(r) for r in rows]}, indent=1))
    return summary_line(plan, rows, device, elapsed, md)


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN or inf: such a figure is written as null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items()}
