"""`plan`: the question to ask before renting GPUs. Prices one micro-batch under each recompute
policy crossed with each tensor/context-parallel layout the GPU count allows, and recommends the
cell that fits with the least recomputation, then the fewest GPUs per model replica, then the
most headroom. Prints the recommendation and a table per layout (or JSON); --plot draws the
predicted peak against packed tokens. Exit status: 0 when something fits, 3 when nothing
does, 2 for an invalid request."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from art.megatron.geometry import load_geometry
from art.megatron.implementation import Implementation
from art.trainer_rank._request import MicroBatchShape
from art.trainer_rank.cli.args import (
    EXPERT_LOAD_HELP,
    add_workload_arguments,
    lora_shape_from_args,
    parse_expert_load,
    parse_size_bytes,
    refuse_expert_load_without_experts,
    shared_prefix_caveat,
    workload_batch,
)
from art.trainer_rank.cli.args import (
    implementation_from_args as workload_implementation,
)
from art.trainer_rank.cli.planner import (
    GIB,
    GPU_MEMORY_GIB,
    MemoryModelFactory,
    PlanResult,
    Policy,
    built_implementation,
    candidate_layouts,
    current_cell,
    layout_env,
    layout_name,
    memory_model_for,
    plan,
    scaled_batch,
)
from art.trainer_rank.cli.rungs import RungChoices, price_rungs

_PLOT_STYLES: tuple[dict[str, Any], ...] = (
    {"linestyle": "-", "linewidth": 3.0, "alpha": 0.6},
    {"linestyle": "--", "linewidth": 2.0},
    {"linestyle": ":", "linewidth": 2.0},
    {"linestyle": "-", "linewidth": 1.5},
)


def plot_plan(result: PlanResult, path: str | Path, *, points: int = 40,
              factory: MemoryModelFactory | None = None) -> Path:
    """Predicted peak per rank against packed tokens, one line per policy, one panel per
    layout, with the device limit as a horizontal line and the requested tokens as a vertical
    one: where a line crosses the limit (dot) is where that policy stops fitting."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(
            "plan --plot needs matplotlib; install it with `pip install matplotlib` (it is in "
            "this package's [test] extra)"
        ) from exc
    layouts = [lo for lo in result.layouts()
               if any(not c.unavailable for c in result.cells if c.layout == lo)]
    if not layouts:
        raise ValueError("no layout could be priced, nothing to plot")
    columns = min(3, len(layouts))
    rows = math.ceil(len(layouts) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 4.0 * rows), squeeze=False,
                             sharey=True)
    top_tokens = max(result.batch.packed_tokens * 2, 64)
    grid = sorted({max(1, round(top_tokens * (i + 1) / points)) for i in range(points)})
    limit_gib = result.gpu_memory_bytes / GIB
    for ax, layout in zip(axes.flat, layouts):
        for cell in (c for c in result.cells if c.layout == layout and not c.unavailable):
            memory_model, _ = memory_model_for(
                result.geometry, layout, cell.policy, implementation=result.implementation,
                lora_rank=result.lora_rank, dtype=result.dtype,
                alloc_conf=result.alloc_conf, factory=factory, lora=result.lora,
                expert_load=result.expert_load,
            )
            peaks = [memory_model.estimate(scaled_batch(result.batch, n)).peak_bytes / GIB
                     for n in grid]
            # Policies often coincide (e.g. selective = none where no layer has core
            # attention to recompute): distinct dash patterns keep every line visible.
            style = _PLOT_STYLES[cell.policy.cost_rank % len(_PLOT_STYLES)]
            line = ax.plot(grid, peaks, label=cell.policy.name, **style)[0]
            if cell.max_tokens and cell.max_tokens <= grid[-1]:
                ax.plot([cell.max_tokens], [limit_gib], marker="o", color=line.get_color(),
                        markersize=5)
        ax.axhline(limit_gib, color="black", linestyle="-.", linewidth=1, label="GPU memory")
        ax.axvline(result.batch.packed_tokens, color="grey", linestyle=":", linewidth=1,
                   label="this micro-batch")
        ax.set_title(layout_name(layout))
        ax.set_xlabel("packed tokens")
        ax.set_ylim(0, limit_gib * 1.6)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(layouts):]:
        ax.axis("off")
    axes[0][0].set_ylabel("predicted peak per rank (GiB)")
    axes[0][0].legend(fontsize=8, loc="best")
    fig.suptitle(f"{result.model}: {result.batch.outputs.key}, "
                 f"{'grad' if result.batch.grad_enabled else 'no grad'}, "
                 f"{result.gpus} x {limit_gib:.0f} GiB")
    # The title's band at the top: a fixed height, whatever the number of panel rows.
    fig.tight_layout(rect=(0.0, 0.0, 1.0, 1.0 - 0.4 / fig.get_figheight()))
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def add_arguments(parser: Any) -> None:
    """The workload as `estimate` takes it, plus the GPUs; the layout and recompute are what
    `plan` varies, so it takes no --tp/--cp/--recompute."""
    add_workload_arguments(parser)
    parser.add_argument("--gpus", type=int, required=True,
                        help="GPUs available: every TP x CP that divides this is priced, the "
                        "rest of the GPUs being data parallel")
    memory = parser.add_mutually_exclusive_group(required=True)
    memory.add_argument("--gpu", choices=sorted(GPU_MEMORY_GIB),
                        help="GPU model, for its memory (" + ", ".join(
                            f"{k}: {v} GiB" for k, v in GPU_MEMORY_GIB.items()) + ")")
    memory.add_argument("--gpu-memory", type=parse_size_bytes,
                        help="memory per GPU (e.g. 141GB, 139.8GiB; a bare number is GiB)")
    parser.add_argument("--expert-load", type=parse_expert_load,
                        metavar="WORKING[,HELD,EXPERT]", help=EXPERT_LOAD_HELP + " (the EP cells)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="also draw predicted peak per rank against tokens, one line per "
                        "policy, one panel per layout, with the GPU memory as a line")


def batch_from_args(args: Any, geometry: Any, gpus: int) -> MicroBatchShape:
    """The workload flags' micro-batch, checked for `geometry` and every layout of `gpus`."""
    return workload_batch(args, vocab_size=geometry.vocab_size,
                          layouts=candidate_layouts(gpus, geometry))


def implementation_from_args(args: Any) -> Implementation:
    """The CUDA build --build / --attention name (see cli.args.implementation_from_args)."""
    return workload_implementation(args, "cuda")


def configured_rungs(result: PlanResult, env: Any) -> tuple[Any, RungChoices] | None:
    """The rungs of the recommended layout (else the one with the most model-parallel ranks)
    under the ART_MEGATRON_RECOMPUTE_* policy of `env`, priced for the plan's micro-batch;
    None without grad."""
    from art.megatron.provider import Provider
    from art.megatron.settings import ENV_PREFIX, load_settings

    if not result.batch.grad_enabled:
        return None
    rec = result.recommended
    runnable = [c for c in result.cells if not c.unavailable]
    if not runnable:
        return None
    cell = rec or max(runnable, key=lambda c: c.gpus_per_replica)
    recompute_env = {k: v for k, v in env.items() if k.startswith(ENV_PREFIX + "RECOMPUTE_")}
    settings = load_settings({**layout_env(cell.layout), **recompute_env})
    provider = Provider(result.geometry, settings=settings, dtype=result.dtype,
                        implementation=built_implementation(result.implementation,
                                                            cell.layout))
    memory_model, _ = memory_model_for(
        result.geometry, cell.layout, Policy("configured", settings.recompute_granularity,
                                             settings.recompute_method,
                                             settings.recompute_num_layers,
                                             settings.recompute_modules),
        implementation=result.implementation, lora_rank=result.lora_rank, dtype=result.dtype,
        alloc_conf=result.alloc_conf, lora=result.lora, expert_load=result.expert_load)
    return cell.layout, price_rungs(provider, memory_model, result.batch,
                                    result.gpu_memory_bytes)


def run(args: Any) -> int:
    """Print the plan (or JSON); 0 when something fits, 3 when nothing does (argparse's
    usage errors are 2), 2 for an invalid request."""
    try:
        try:
            candidate_layouts(args.gpus)
        except ValueError as exc:
            raise ValueError(f"--gpus {args.gpus}: {exc}") from None
        geometry = load_geometry(args.model)
        refuse_expert_load_without_experts(args.expert_load, geometry)
        batch = batch_from_args(args, geometry, args.gpus)
        lora = lora_shape_from_args(args)
        memory_bytes = int(GPU_MEMORY_GIB[args.gpu] * GIB) if args.gpu else args.gpu_memory
        result = plan(
            geometry, batch=batch, gpus=args.gpus, gpu_memory_bytes=memory_bytes,
            lora_rank=args.lora_rank, dtype=args.dtype, lora=lora,
            implementation=implementation_from_args(args),
            alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            current=current_cell(gpus=args.gpus, geometry=geometry),
            expert_load=args.expert_load,
        )
    except ValueError as exc:
        print(f"plan: {exc}", file=sys.stderr)
        return 2
    try:
        rungs = configured_rungs(result, os.environ)
    except ValueError as exc:
        print(f"plan: {exc}", file=sys.stderr)
        return 2
    caveat = shared_prefix_caveat(args, implementation_from_args(args))
    if caveat:
        print(caveat, file=sys.stderr)
    plot_path = plot_plan(result, args.plot) if args.plot else None
    if args.json:
        out = result.to_dict()
        out["plot"] = None if plot_path is None else str(plot_path)
        out["recompute_rungs"] = None if rungs is None else {
            "layout": layout_name(rungs[0]), **rungs[1].to_dict()}
        print(json.dumps(out, indent=2))
    else:
        lines = [] if rungs is None else [
            f"at {layout_name(rungs[0])} under your ART_MEGATRON_RECOMPUTE_* policy:",
            *rungs[1].lines()]
        print(result.report(lines))
        if plot_path is not None:
            print(f"\nplot written to {plot_path}")
    return 0 if result.recommended is not None else 3
