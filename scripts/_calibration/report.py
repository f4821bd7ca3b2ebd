"""The calibration's report: a matrix's rows summarised as calibration.md (counts in the band,
per policy, every cell) and drawn as calibration.png."""

from __future__ import annotations

from pathlib import Path

TARGET = (1.00, 1.05)


def summarize(rows: list[dict]) -> str:
    lo, hi = TARGET
    builds = sorted({r.get("build") or "local" for r in rows})
    lines = ["# Memory model calibration (CPU, real Megatron-Core runs)", ""]
    if builds != ["local"]:
        lines += [f"Build: {', '.join(builds)} (local: the local spec with the segmented "
                  "flash attention, the CPU default; local-unfused: the local spec with "
                  "Megatron's unfused attention; gpu-shaped: the local spec with CPU "
                  "stand-ins that keep for backward what the GPU build's fused kernels keep, "
                  "art/megatron/cpu_fused.py, and the segmented flash attention).", ""]
    inside = sum(lo <= r["ratio"] <= hi for r in rows)
    d_inside = sum(lo <= r["default_ratio"] <= hi for r in rows)
    low = min(rows, key=lambda r: r["ratio"])
    high = max(rows, key=lambda r: r["ratio"])
    d_low = min(rows, key=lambda r: r["default_ratio"])
    d_high = max(rows, key=lambda r: r["default_ratio"])

    def name(r: dict) -> str:
        return (f"{r['geometry']} / {_policy(r)} / LoRA r{r['lora_rank']} / "
                f"{_layout(r)} / {_lengths(r)} / {r['outputs']} / "
                f"{'grad, ' + r['loss'] + ' loss' if r['grad'] else 'no grad'}")

    lines += [
        "Cells are seeded random packed rows (one sequence or many, never within 4% of a "
        "probe point), so the probe is judged between its sample points, not on them. "
        "Ratio = predicted / measured dynamic peak (bytes allocated inside one micro-batch: "
        "packing, decoder forward, chunked head, caller loss, backward; weights, LoRA grads and "
        "optimizer state are live before and excluded). Predicted = max(forward peak, backward "
        "peak) of the estimate, without the allocator reserve.",
        "",
        f"- cells: {len(rows)}; packed rows {min(r['packed_tokens'] for r in rows)}-"
        f"{max(r['packed_tokens'] for r in rows)} tokens",
        f"- probe coefficients: {inside} of {len(rows)} cells inside [{lo:.2f}, {hi:.2f}]; "
        f"min {low['ratio']:.4f} ({name(low)}); max {high['ratio']:.4f} ({name(high)})",
        f"- default formulas (no probe): {d_inside} of {len(rows)} cells inside "
        f"[{lo:.2f}, {hi:.2f}]; min {d_low['default_ratio']:.4f} ({name(d_low)}); "
        f"max {d_high['default_ratio']:.4f} ({name(d_high)})",
        *own_routing_summary(rows),
        "",
        "## Per policy",
        "",
        "| policy | cells | probe min | probe max | probe inside | defaults min | "
        "defaults max | defaults inside |",
        "|---|---|---|---|---|---|---|---|",
    ]
    policies: dict[str, list[dict]] = {}
    for r in rows:
        policies.setdefault(f"{_policy(r)} ({_layout(r)})", []).append(r)
    for pol, rs in policies.items():
        lines.append(
            f"| {pol} | {len(rs)} | {min(x['ratio'] for x in rs):.4f} | "
            f"{max(x['ratio'] for x in rs):.4f} | "
            f"{sum(lo <= x['ratio'] <= hi for x in rs)} | "
            f"{min(x['default_ratio'] for x in rs):.4f} | "
            f"{max(x['default_ratio'] for x in rs):.4f} | "
            f"{sum(lo <= x['default_ratio'] <= hi for x in rs)} |")
    own = any(r.get("own_routing_ratio") not in (None, "") for r in rows)
    lines += ["", "## Every cell", "",
              "| geometry | policy | LoRA r | layout | row | outputs | grad | loss | "
              "measured MiB | predicted MiB | ratio | defaults ratio | "
              + ("routed at (working / held / expert) | ratio at its own routing | "
                 "defaults ratio at its own routing | " if own else "") + "peak at |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"
              + ("---|---|---|" if own else "") + "---|"]
    for r in rows:
        routed = (f"{' / '.join(f'{float(x):.3f}' for x in str(r['own_routing']).split('/'))}"
                  f" | {r['own_routing_ratio']:.4f} | {_own_default(r)} | " if own else "")
        lines.append(
            f"| {r['geometry']} | {_policy(r)} | {r['lora_rank']} | {_layout(r)} | "
            f"{_lengths(r)} | {r['outputs']} | {'yes' if r['grad'] else 'no'} | "
            f"{r['loss'] if r['grad'] else '-'} | "
            f"{r['measured_bytes'] / 2**20:.2f} | {r['predicted_bytes'] / 2**20:.2f} | "
            f"{r['ratio']:.4f} | {r['default_ratio']:.4f} | {routed}{r['peak_at']} |")
    return "\n".join(lines) + "\n"


def own_routing_summary(rows: list[dict]) -> list[str]:
    """Under expert parallel, the probe column priced at each row's own routing: what the
    memory model gets wrong once the router's spread is known (none: no EP rows)."""
    lo, hi = TARGET
    own = [r for r in rows if r.get("own_routing_ratio") not in (None, "")]
    if not own:
        return []
    low = min(own, key=lambda r: r["own_routing_ratio"])
    high = max(own, key=lambda r: r["own_routing_ratio"])
    inside = sum(lo <= r["own_routing_ratio"] <= hi for r in own)
    lines = [
        f"- probe coefficients at each row's own routing (the shares its forward routed its "
        f"MoE layers at, in place of the router's spread the price covers before a row runs, "
        f"measuring/routing.py): {inside} of {len(own)} cells inside [{lo:.2f}, {hi:.2f}]; "
        f"min {low['own_routing_ratio']:.4f}; max {high['own_routing_ratio']:.4f}"]
    formulas = [r for r in own if r.get("own_routing_default_ratio") not in (None, "")]
    if formulas:
        ratios = [r["own_routing_default_ratio"] for r in formulas]
        lines.append(
            f"- default formulas at each row's own routing (those shares given as "
            f"`estimate --expert-load` gives them, in place of the even share): "
            f"{sum(lo <= x <= hi for x in ratios)} of {len(formulas)} cells inside "
            f"[{lo:.2f}, {hi:.2f}]; min {min(ratios):.4f}; max {max(ratios):.4f}")
    return lines


def _own_default(row: dict) -> str:
    value = row.get("own_routing_default_ratio")
    return "-" if value in (None, "") else f"{float(value):.4f}"


def _layout(row: dict) -> str:
    cp = int(row.get("context_parallel") or 1)
    ep = int(row.get("expert_parallel") or 1)
    return (f"TP{row['tensor_parallel']}" + (f" CP{cp}" if cp > 1 else "")
            + (f" EP{ep}" if ep > 1 else ""))


def _policy(row: dict) -> str:
    """The policy a row ran; a rung switched at run time names the policy it was built with."""
    built = row.get("built_with") or ""
    return f"{row['policy']}, switched on {built}" if built else str(row["policy"])


def _lengths(row: dict) -> str:
    """A packed row as 'N tok' (one sequence), 'N tok in k seqs', or for a group sharing a
    prompt 'N tok in k seqs sharing P (+D)' (N: the packed row, prompt once)."""
    parts = str(row["lengths"]).split("+")
    total = sum(int(p) for p in parts)
    shared, deeper = int(row.get("shared_prefix") or 0), int(row.get("deeper") or 0)
    if shared:
        more = f" (+{deeper} by two)" if deeper else ""
        return f"{int(row['packed_tokens'])} tok in {len(parts)} seqs sharing {shared}{more}"
    return f"{total} tok" if len(parts) == 1 else f"{total} tok in {len(parts)} seqs"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 6))
    measured = [r["measured_bytes"] / 2**20 for r in rows]
    predicted = [r["predicted_bytes"] / 2**20 for r in rows]
    default = [r["predicted_default_bytes"] / 2**20 for r in rows]
    a.scatter(measured, default, s=8, alpha=0.5, label="defaults (formulas)", color="tab:gray")
    a.scatter(measured, predicted, s=10, label="probe", color="tab:blue")
    top = max(measured + predicted + default) * 1.05
    a.plot([0, top], [0, top], "k--", lw=0.8, label="predicted = measured")
    a.plot([0, top], [0, top * 1.05], "r:", lw=0.8, label="+5%")
    a.set_xlabel("measured dynamic peak (MiB)")
    a.set_ylabel("predicted dynamic peak (MiB)")
    a.set_xscale("log")
    a.set_yscale("log")
    a.legend()
    a.set_title("predicted vs measured, every cell")
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["policy"], rows[i]["ratio"]))
    b.scatter(range(len(rows)), [rows[i]["ratio"] for i in order], s=8, label="probe")
    b.scatter(range(len(rows)), [rows[i]["default_ratio"] for i in order], s=6, alpha=0.5,
              color="tab:gray", label="defaults")
    b.axhspan(TARGET[0], TARGET[1], color="tab:green", alpha=0.15, label="target [1.00, 1.05]")
    b.set_xlabel("cell (sorted by policy, then ratio)")
    b.set_ylabel("predicted / measured")
    b.legend()
    b.set_title("ratio per cell")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
