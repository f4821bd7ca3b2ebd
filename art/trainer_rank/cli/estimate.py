"""`estimate`: price one micro-batch with the memory model, offline (no model is built, no GPU
is needed): flags first, then ART_MEGATRON_* for whatever a flag leaves unset. Prints the
itemised peak per rank (or JSON) and, given --gpu-memory, whether it fits."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from art.trainer_rank.cli.args import (
    add_workload_arguments,
    implementation_from_args,
    lora_shape_from_args,
    parse_size_bytes,
    shared_prefix_caveat,
    workload_batch,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p)
    p.add_argument("--tp", type=int,
                   help="tensor parallel (ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE)")
    p.add_argument("--cp", type=int, help="context parallel")
    p.add_argument("--ep", type=int, help="expert parallel")
    p.add_argument("--pp", type=int, help="pipeline parallel")
    p.add_argument("--sp", dest="sp", action="store_true", default=None,
                   help="sequence parallel on (default: on when TP > 1)")
    p.add_argument("--no-sp", dest="sp", action="store_false")
    p.add_argument("--recompute", choices=("full", "selective", "none"))
    p.add_argument("--recompute-method", choices=("uniform", "block"))
    p.add_argument("--recompute-num-layers", type=int)
    p.add_argument("--recompute-modules",
                   help="selective modules, comma list (core_attn, mlp, layernorm, moe, ...)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--gpu-memory", type=parse_size_bytes,
                   help="usable memory per rank for the `fits` verdict (e.g. 107.192GB, 141GiB)")
    p.add_argument("--worst-case-routing", action="store_true",
                   help="MoE: price every token routed to this rank's experts")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")


def build_memory_model(args: argparse.Namespace, env: dict[str, str] | None = None):
    """The MemoryModel the flags (then ART_MEGATRON_*) describe."""
    from art.megatron.geometry import load_geometry
    from art.megatron.layout import ParallelLayout
    from art.megatron.recompute import resolve_recompute
    from art.megatron.settings import load_settings
    from art.trainer_rank.memory.model import MemoryModel

    environ = dict(os.environ if env is None else env)
    settings = load_settings(environ)
    geometry = load_geometry(args.model)
    tp = args.tp or settings.tensor_model_parallel_size
    sp = args.sp
    if sp is None:
        explicit = settings.source_of("sequence_parallel") != "default"
        sp = settings.sequence_parallel if explicit else tp > 1
    layout = ParallelLayout(
        tensor_parallel=tp,
        context_parallel=args.cp or settings.context_parallel_size,
        pipeline_parallel=args.pp or settings.pipeline_model_parallel_size,
        expert_parallel=args.ep or settings.expert_model_parallel_size,
        sequence_parallel=bool(sp) and tp > 1,
    )
    if args.recompute is not None:
        granularity = None if args.recompute == "none" else args.recompute
        method = args.recompute_method or ("uniform" if granularity == "full" else None)
        num_layers = args.recompute_num_layers
        if granularity == "full" and num_layers is None:
            num_layers = 1
    else:
        granularity = settings.recompute_granularity
        method = args.recompute_method or settings.recompute_method
        num_layers = args.recompute_num_layers or settings.recompute_num_layers
    modules: tuple[str, ...] | None = settings.recompute_modules
    if args.recompute_modules is not None:
        modules = tuple(m.strip() for m in args.recompute_modules.split(",") if m.strip())
    if granularity != "selective":
        modules = None if granularity is None and not args.recompute_modules else modules
    implementation = implementation_from_args(args, args.device)
    recompute = resolve_recompute(
        granularity=granularity, method=method if granularity == "full" else None,
        num_layers=num_layers if granularity == "full" else None,
        modules=modules if granularity == "selective" else None,
        moe_layers=geometry.moe_layers, layer_types=geometry.layer_types,
        pipeline_stages=layout.pipeline_parallel,
        norm_fused_into_linear=implementation.norm_fused_into_linear,
        has_shared_experts=geometry.shared_expert_ffn_hidden_size > 0,
    )
    lora = lora_shape_from_args(args)
    return MemoryModel(
        geometry, layout=layout, recompute=recompute, implementation=implementation,
        lora=lora, dtype=args.dtype or geometry.dtype,
        alloc_conf=environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        worst_case_routing=args.worst_case_routing,
    )


def run(args: argparse.Namespace) -> int:

    try:
        model = build_memory_model(args)
        batch = workload_batch(args)
        estimate = model.estimate(batch)
    except ValueError as exc:
        print(f"estimate: {exc}", file=sys.stderr)
        return 2
    caveat = shared_prefix_caveat(args, model.implementation)
    if caveat:
        print(caveat, file=sys.stderr)
    fits = None if args.gpu_memory is None else estimate.peak_bytes <= args.gpu_memory
    if args.json:
        payload = estimate.to_dict()
        payload["model"] = model.geometry.name
        payload["layout"] = model.layout.summary
        payload["implementation"] = model.implementation.key
        payload["dtype"] = model.dtype
        payload["recompute_layers"] = model.recompute.describe_layers()
        if args.gpu_memory is not None:
            payload["gpu_memory_bytes"] = args.gpu_memory
            payload["fits"] = fits
        print(json.dumps(payload, indent=2))
        return 0
    _print_table(model, estimate, args.gpu_memory, fits)
    return 0


def _print_table(model: Any, estimate: Any, gpu_memory: int | None, fits: bool | None) -> None:
    from rich.console import Console
    from rich.table import Table

    gib = 2**30 if estimate.peak_bytes >= 2**30 else 2**20
    unit = "GiB" if gib == 2**30 else "MiB"
    console = Console()
    title = (f"{model.geometry.name}  {model.layout.summary}  {model.implementation.key}  "
             f"{model.dtype}")
    table = Table(title=title, caption=f"{estimate.recompute_summary}; coefficients: "
                  f"{estimate.coefficients_source}")
    table.add_column("phase")
    table.add_column("term")
    table.add_column(unit, justify="right")
    table.add_column("how")
    for term in estimate.terms:
        table.add_row(term.phase, term.name, f"{term.bytes / gib:.3f}", term.note)
    table.add_section()
    rows = [("resident", estimate.resident_bytes), ("forward peak", estimate.forward_peak_bytes),
            ("backward peak", estimate.backward_peak_bytes), ("reserve", estimate.reserve_bytes),
            ("dynamic", estimate.dynamic_bytes), ("PEAK per rank", estimate.peak_bytes)]
    for name, value in rows:
        table.add_row("", name, f"{value / gib:.3f}",
                      estimate.peak_at if name == "dynamic" else "")
    console.print(table)
    if gpu_memory is not None:
        verdict = "fits" if fits else "DOES NOT FIT"
        console.print(f"{verdict}: peak {estimate.peak_bytes / 2**30:.3f} GiB vs usable "
                      f"{gpu_memory / 2**30:.3f} GiB ({gpu_memory / 1e9:.3f} GB)")


