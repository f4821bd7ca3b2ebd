"""`python -m art.trainer_rank <command>`: a dispatcher; `estimate` lives here.

Each command is a module exposing `add_arguments(parser)` and `run(args) -> int`; the
dispatcher imports it only when its command runs. `plan` is expected in `_plan.py` (it is
registered as soon as that module has both functions).

`estimate` prices one micro-batch with the memory model, offline (no model is built, no GPU is
needed): flags first, then ART_MEGATRON_* for whatever a flag leaves unset.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

COMMANDS: dict[str, tuple[str, str]] = {
    "estimate": ("art.trainer_rank._cli", "price one micro-batch: itemised peak per rank"),
    "plan": ("art.trainer_rank._plan", "price policies x layouts for a GPU count"),
}

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
_UNITS = {"": 2**30, "gib": 2**30, "g": 2**30, "gb": 10**9, "mib": 2**20, "mb": 10**6,
          "tib": 2**40, "tb": 10**12, "b": 1}


def parse_size_bytes(text: str) -> int:
    """'107.192GB' -> bytes (decimal), '141GiB' or '141' -> bytes (binary GiB)."""
    match = _SIZE.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"memory size {text!r} is not a number with an optional unit (GiB, GB, MiB, MB); "
            "a bare number means GiB"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _lengths(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"--sequences takes a comma list of token counts, got {text!r}"
        ) from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--sequences needs lengths >= 1, got {text!r}")
    return values


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The micro-batch and model flags that `estimate` and `plan` share."""
    p.add_argument("--model", required=True,
                   help="shipped model name (e.g. Qwen3.5-27B) or a config.json / checkpoint path")
    batch = p.add_mutually_exclusive_group(required=True)
    batch.add_argument("--sequences", type=_lengths,
                       help="packed sequence lengths in tokens, comma separated")
    batch.add_argument("--tokens", type=int, help="one sequence of this many tokens")
    p.add_argument("--shared-prefix", type=int, default=0, metavar="TOKENS",
                   help="the --sequences are one group (a prompt's rollouts) sharing their first "
                        "TOKENS tokens: the packed row holds them once (prefix-tree packing)")
    p.add_argument("--packed-tokens", type=int, default=0,
                   help="tokens in the packed row when it differs from the sum (prefer "
                        "--shared-prefix, which derives it from the group's shape)")
    p.add_argument("--outputs", default="logprobs",
                   help="requested outputs, e.g. logprobs,top_k=20,hidden_states "
                        "(default logprobs)")
    p.add_argument("--no-grad", action="store_true", help="a scoring forward (no backward)")
    p.add_argument("--lora-rank", type=int, default=1, help="LoRA rank (0: no adapter)")
    p.add_argument("--resident-adapters", type=int, default=0,
                   help="trainable checkpoint slots loaded beside the runtime's adapter")
    p.add_argument("--resident-snapshots", type=int, default=0,
                   help="forward-only checkpoint snapshots resident")
    p.add_argument("--resident-adapter-rank", type=int, default=0,
                   help="LoRA rank of the resident slots (default: --lora-rank)")
    p.add_argument("--attention", choices=("flash", "unfused"), default="flash",
                   help="flash: Transformer Engine spec, cu_seqlens, no s^2 term (GPU); "
                        "unfused: local spec with s^2 scores and a bool mask")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"))


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


def workload_batch(args: argparse.Namespace):
    """The MicroBatchShape the workload flags describe: a group of --sequences sharing
    --shared-prefix tokens packs to sum - (n - 1) x prefix tokens (the prefix once)."""
    from art.trainer_rank._request import MicroBatchShape, OutputRequest

    lengths = tuple(args.sequences) if args.sequences else (args.tokens,)
    prefix = getattr(args, "shared_prefix", 0) or 0
    if args.packed_tokens < 0:
        raise ValueError(f"--packed-tokens must be >= 0, got {args.packed_tokens}")
    if prefix < 0 or prefix > min(lengths):
        raise ValueError(
            f"--shared-prefix must be between 0 and the shortest sequence ({min(lengths)} "
            f"tokens), got {prefix}"
        )
    packed = args.packed_tokens
    if prefix:
        if len(lengths) < 2:
            raise ValueError("--shared-prefix needs a group: give --sequences with 2 or more")
        shared = sum(lengths) - (len(lengths) - 1) * prefix
        if packed and packed != shared:
            raise ValueError(
                f"--packed-tokens {packed} contradicts --shared-prefix {prefix} ({len(lengths)} "
                f"sequences of {sum(lengths)} tokens pack to {shared}); give one of them"
            )
        packed = shared
    return MicroBatchShape(lengths, outputs=OutputRequest.parse(args.outputs),
                           grad_enabled=not args.no_grad, padded_tokens=packed)


def shared_prefix_caveat(args: argparse.Namespace, device: str) -> str | None:
    """The warning that a --shared-prefix row is one TrainerRank packs only on CPU: the
    packed-layout attention refuses CUDA tensors, so on a GPU each rollout is packed in full
    and the shared row's price is below what would run."""
    prefix = getattr(args, "shared_prefix", 0) or 0
    if not prefix or device != "cuda" or not args.sequences:
        return None
    full = sum(args.sequences)
    return (
        f"note: --shared-prefix {prefix} prices the prefix-tree row; on a GPU this build packs "
        f"every rollout in full ({full} tokens), since its packed-layout attention runs on CPU "
        f"only. For what TrainerRank runs on a GPU, drop --shared-prefix (or pass "
        f"--packed-tokens {full})."
    )


def build_memory_model(args: argparse.Namespace, env: dict[str, str] | None = None):
    """The MemoryModel the flags (then ART_MEGATRON_*) describe."""
    from art.megatron.geometry import load_geometry
    from art.megatron.implementation import Implementation
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
    if args.attention == "flash":
        implementation = Implementation(device=args.device)
    else:
        implementation = Implementation(spec="local", attention="unfused", norm="torch",
                                        swiglu_fused=False, device=args.device)
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
    caveat = shared_prefix_caveat(args, model.implementation.device)
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m art.trainer_rank")
    commands = parser.add_subparsers(dest="command", required=True)
    handlers: dict[str, Any] = {}
    for name, (module_name, help_text) in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if not (hasattr(module, "add_arguments") and hasattr(module, "run")):
            continue
        sub = commands.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(sub)
        handlers[name] = module.run
    args = parser.parse_args(argv)
    return int(handlers[args.command](args))


def lora_shape_from_args(args: Any) -> Any:
    """The LoraShape of --lora-rank and the resident checkpoint slots."""
    from art.trainer_rank._request import LoraShape

    return LoraShape(rank=max(args.lora_rank, 0),
                     resident_adapters=getattr(args, "resident_adapters", 0),
                     resident_snapshots=getattr(args, "resident_snapshots", 0),
                     resident_adapter_rank=getattr(args, "resident_adapter_rank", 0))
