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
    EXPERT_LOAD_HELP,
    add_workload_arguments,
    expert_load_json,
    implementation_from_args,
    lora_shape_from_args,
    parse_expert_load,
    parse_size_bytes,
    refuse_expert_load_without_experts,
    shared_prefix_caveat,
    workload_batch,
)
from art.trainer_rank.cli.rungs import price_rungs


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p)
    # Layout and recompute flags are read as ART_MEGATRON_* values are (same parser, same
    # checks, same words such as `none`): each one stands for the variable it names.
    p.add_argument("--tp", help="tensor parallel (ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE)")
    p.add_argument("--cp", help="context parallel (ART_MEGATRON_CONTEXT_PARALLEL_SIZE)")
    p.add_argument("--ep", help="expert parallel (ART_MEGATRON_EXPERT_MODEL_PARALLEL_SIZE)")
    p.add_argument("--pp", help="pipeline parallel (ART_MEGATRON_PIPELINE_MODEL_PARALLEL_SIZE)")
    p.add_argument("--sp", dest="sp", action="store_true", default=None,
                   help="sequence parallel on (default: on when TP > 1)")
    p.add_argument("--no-sp", dest="sp", action="store_false")
    p.add_argument("--recompute",
                   help="full, selective or none (ART_MEGATRON_RECOMPUTE_GRANULARITY); given, "
                        "it and the --recompute-* flags replace every ART_MEGATRON_RECOMPUTE_*")
    p.add_argument("--recompute-method", help="uniform or block (ART_MEGATRON_RECOMPUTE_METHOD)")
    p.add_argument("--recompute-num-layers",
                   help="layers per full checkpoint (ART_MEGATRON_RECOMPUTE_NUM_LAYERS)")
    p.add_argument("--recompute-modules",
                   help="selective modules, comma list (core_attn, mlp, layernorm, moe, ...)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--gpu-memory", type=parse_size_bytes,
                   help="usable memory per rank for the `fits` verdict (e.g. 107.192GB, 141GiB); "
                        "exit status 3 when the peak does not fit")
    p.add_argument("--worst-case-routing", action="store_true",
                   help="MoE: price every token routed to this rank's experts")
    p.add_argument("--expert-load", type=parse_expert_load, metavar="WORKING[,HELD,EXPERT]",
                   help=EXPERT_LOAD_HELP)
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")


# flag attribute -> (ART_MEGATRON_* variable, the flag as the user spells it)
_SETTING_FLAGS: dict[str, tuple[str, str]] = {
    "tp": ("TENSOR_MODEL_PARALLEL_SIZE", "--tp"),
    "cp": ("CONTEXT_PARALLEL_SIZE", "--cp"),
    "ep": ("EXPERT_MODEL_PARALLEL_SIZE", "--ep"),
    "pp": ("PIPELINE_MODEL_PARALLEL_SIZE", "--pp"),
    "recompute": ("RECOMPUTE_GRANULARITY", "--recompute"),
    "recompute_method": ("RECOMPUTE_METHOD", "--recompute-method"),
    "recompute_num_layers": ("RECOMPUTE_NUM_LAYERS", "--recompute-num-layers"),
    "recompute_modules": ("RECOMPUTE_MODULES", "--recompute-modules"),
}


def flag_settings(args: argparse.Namespace, env: dict[str, str]) -> Any:
    """The Settings of ART_MEGATRON_* in `env` with the flags laid over them, parsed and
    checked by the runtime's own parser; an error names the flag a value came from."""
    from art.megatron.settings import ENV_PREFIX, load_settings

    merged = dict(env)
    if args.recompute is not None:
        # --recompute describes the whole policy: the environment's recompute knobs would
        # otherwise mix with it (e.g. a NUM_LAYERS meant for full under --recompute selective).
        merged = {k: v for k, v in merged.items()
                  if not k.startswith(ENV_PREFIX + "RECOMPUTE_")}
    labels: dict[str, str] = {}
    for attribute, (variable, flag) in _SETTING_FLAGS.items():
        value = getattr(args, attribute)
        if value is not None:
            merged[ENV_PREFIX + variable] = str(value)
            labels[ENV_PREFIX + variable] = flag
    if args.sp is not None:
        merged[ENV_PREFIX + "SEQUENCE_PARALLEL"] = "true" if args.sp else "false"
        labels[ENV_PREFIX + "SEQUENCE_PARALLEL"] = "--sp" if args.sp else "--no-sp"
    return load_settings(merged, labels=labels)


def build_provider(args: argparse.Namespace, env: dict[str, str] | None = None) -> Any:
    """The Provider the flags (then ART_MEGATRON_*) describe, validated as a launch with
    those settings would be (settings parser, then the provider's layout, kernel and
    recompute checks against the model): what TrainerRank could not build is refused."""
    from art.megatron.geometry import load_geometry
    from art.megatron.provider import Provider

    environ = dict(os.environ if env is None else env)
    geometry = load_geometry(args.model)
    settings = flag_settings(args, environ)
    implementation = implementation_from_args(args, args.device)
    return Provider(geometry, settings=settings, dtype=args.dtype or geometry.dtype,
                    implementation=implementation)


def build_memory_model(args: argparse.Namespace, env: dict[str, str] | None = None,
                       provider: Any = None):
    """The MemoryModel of `build_provider`'s provider (built here when not given)."""
    from art.trainer_rank.pricing.model import MemoryModel

    environ = dict(os.environ if env is None else env)
    provider = provider or build_provider(args, environ)
    geometry, implementation = provider.geometry, provider.implementation
    load = getattr(args, "expert_load", None)
    if load is not None:
        if args.worst_case_routing:
            raise ValueError("--expert-load and --worst-case-routing both set the routing to "
                             "price; give one")
        refuse_expert_load_without_experts(load, geometry)
        if provider.layout.expert_parallel == 1:
            raise ValueError(
                "--expert-load prices a router's spread over expert-parallel ranks, and this "
                "layout is EP=1; set --ep (or ART_MEGATRON_EXPERT_MODEL_PARALLEL_SIZE)")
    return MemoryModel(
        geometry, layout=provider.layout, recompute=provider.effective_recompute,
        implementation=implementation, lora=lora_shape_from_args(args), dtype=provider.dtype,
        alloc_conf=environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        worst_case_routing=args.worst_case_routing, expert_load=load,
    )


def run(args: argparse.Namespace) -> int:
    """Print the estimate (or JSON); exit status 0, or 3 when --gpu-memory is given and the
    peak does not fit; 2 for an invalid request (argparse's usage errors are 2 as well)."""
    try:
        provider = build_provider(args)
        model = build_memory_model(args, provider=provider)
        batch = workload_batch(args, vocab_size=model.geometry.vocab_size,
                               layouts=[model.layout])
        estimate = model.estimate(batch)
        rungs = price_rungs(provider, model, batch, args.gpu_memory)
    except ValueError as exc:
        print(f"estimate: {exc}", file=sys.stderr)
        return 2
    caveat = shared_prefix_caveat(args, model.implementation)
    if caveat:
        print(caveat, file=sys.stderr)
    fits = None if args.gpu_memory is None else estimate.peak_bytes <= args.gpu_memory
    status = 3 if fits is False else 0
    if args.json:
        payload = estimate.to_dict()
        payload["model"] = model.geometry.name
        payload["layout"] = model.layout.summary
        payload["implementation"] = model.implementation.key
        payload["dtype"] = model.dtype
        # The router's spread priced under EP: given by --expert-load, else balanced (null).
        payload["expert_load"] = expert_load_json(model.expert_load)
        payload["recompute_layers"] = model.recompute.describe_layers()
        if args.gpu_memory is not None:
            payload["gpu_memory_bytes"] = args.gpu_memory
            payload["fits"] = fits
        payload["recompute_rungs"] = None if rungs is None else rungs.to_dict()
        print(json.dumps(payload, indent=2))
        return status
    _print_table(model, estimate, args.gpu_memory, fits,
                 [] if rungs is None else rungs.lines())
    return status


def _print_table(model: Any, estimate: Any, gpu_memory: int | None, fits: bool | None,
                 rung_lines: list[str]) -> None:
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
        table.add_row(str(term.lifetime), term.name, f"{term.bytes / gib:.3f}", term.note)
    table.add_section()
    rows = [("resident", estimate.resident_bytes), ("forward peak", estimate.forward_peak_bytes),
            ("backward peak", estimate.backward_peak_bytes), ("reserve", estimate.reserve_bytes),
            ("dynamic", estimate.dynamic_bytes), ("PEAK per rank", estimate.peak_bytes)]
    for name, value in rows:
        table.add_row("", name, f"{value / gib:.3f}",
                      estimate.peak_at if name == "dynamic" else "")
    console.print(table)
    if rung_lines:
        print("\n".join(rung_lines))
    if gpu_memory is not None:
        verdict = "fits" if fits else "DOES NOT FIT"
        console.print(f"{verdict}: peak {estimate.peak_bytes / 2**30:.3f} GiB vs usable "
                      f"{gpu_memory / 2**30:.3f} GiB ({gpu_memory / 1e9:.3f} GB)")


