"""The command line's shared flags: the model, one micro-batch (sequences, shared prefix,
outputs, grad), LoRA and resident checkpoint slots; memory sizes with units."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from art.megatron.layout import ParallelLayout
from art.trainer_rank._request import (
    FieldError,
    LoraShape,
    MicroBatchShape,
    OutputRequest,
    output_request_problem,
)
from art.trainer_rank.compute.packing import packed_length_tokens, packed_tokens_problem

if TYPE_CHECKING:
    from art.trainer_rank.pricing.row_changes import ExpertShare

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
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"memory size {text!r} must be more than 0 bytes")
    return size


def _lengths(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--sequences takes a comma list of token counts, got {text!r}"
        ) from None


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
    p.add_argument("--packed-tokens", type=int, default=None,
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
                   help="flash: no s^2 term (TE's THD attention, or the segmented attention "
                        "over torch's kernels with --build local); unfused: local spec with "
                        "s^2 scores and a bool mask")
    p.add_argument("--build", choices=("te", "local"), default=None,
                   help="te: Transformer Engine layer spec (default); local: Megatron's local "
                        "spec, e.g. a CUDA cluster without Transformer Engine (the segmented "
                        "attention over torch's CUDA SDPA kernels, which takes shared "
                        "prefixes; unfused with --attention unfused, the default there)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"))


def workload_batch(args: argparse.Namespace, *, vocab_size: int,
                   layouts: Sequence[ParallelLayout]) -> MicroBatchShape:
    """The MicroBatchShape the workload flags describe, checked with the rules TrainerRank
    applies to what it runs (the model's vocabulary, the outputs rule, packing for
    `layouts`): a group of --sequences sharing --shared-prefix tokens packs to
    sum - (n - 1) x prefix tokens (the prefix once)."""
    lengths = tuple(args.sequences) if args.sequences else (args.tokens,)
    flag = "--sequences" if args.sequences else "--tokens"
    try:
        MicroBatchShape(lengths)
    except FieldError as exc:
        raise exc.named(flag, ",".join(map(str, lengths))) from None
    prefix = getattr(args, "shared_prefix", 0) or 0
    if prefix < 0 or prefix > min(lengths):
        raise ValueError(
            f"--shared-prefix {prefix}: must be between 0 and the shortest sequence "
            f"({min(lengths)} tokens)"
        )
    packed = args.packed_tokens
    if packed is not None:
        worst = max(layouts, key=lambda lo: packed_length_tokens(lengths, lo))
        problem = packed_tokens_problem(lengths, packed, worst)
        if problem is not None:
            raise ValueError(f"--packed-tokens {packed}: {problem}")
    if prefix:
        if len(lengths) < 2:
            raise ValueError(f"--shared-prefix {prefix}: needs a group; give --sequences with "
                             "2 or more lengths")
        shared = sum(lengths) - (len(lengths) - 1) * prefix
        if packed is not None and packed != shared:
            raise ValueError(
                f"--packed-tokens {packed} contradicts --shared-prefix {prefix} ({len(lengths)} "
                f"sequences of {sum(lengths)} tokens pack to {shared}); give one of them"
            )
        packed = shared
    try:
        outputs = OutputRequest.parse(args.outputs)
    except ValueError as exc:
        raise ValueError(f"--outputs {args.outputs!r}: {exc}") from None
    problem = output_request_problem(outputs, grad=not args.no_grad, vocab_size=vocab_size)
    if problem is not None:
        raise ValueError(f"--outputs {args.outputs!r} {problem}")
    return MicroBatchShape(lengths, outputs=outputs, grad_enabled=not args.no_grad,
                           padded_tokens=packed or 0)


def implementation_from_args(args: argparse.Namespace, device: str = "cuda") -> Any:
    """The Implementation --build and --attention name on `device`: te (flash) by default,
    the local spec with --build local or --attention unfused."""
    from art.megatron.implementation import Implementation

    build = getattr(args, "build", None) or ("local" if args.attention == "unfused" else "te")
    if build == "te":
        if args.attention == "unfused":
            raise ValueError("--build te runs Transformer Engine's flash attention; "
                             "--attention unfused needs --build local")
        return Implementation(device=device)
    if args.attention == "unfused":
        return Implementation(spec="local", attention="unfused", norm="torch",
                              swiglu_fused=False, device=device)
    return Implementation.cuda_local() if device == "cuda" else Implementation.cpu_local("flash")


def shared_prefix_caveat(args: argparse.Namespace, implementation: Any) -> str | None:
    """The warning that a --shared-prefix row is one this build does not pack: TE's THD
    attention takes no prefix tree, so each rollout is packed in full and the shared row's
    price is below what would run (the local spec's attention takes it, on CPU and CUDA)."""
    prefix = getattr(args, "shared_prefix", 0) or 0
    if not prefix or implementation.attention_takes_tree or not args.sequences:
        return None
    full = sum(args.sequences)
    return (
        f"note: --shared-prefix {prefix} prices the prefix-tree row; the {implementation.key} "
        f"build packs every rollout in full ({full} tokens), since Transformer Engine's THD "
        f"attention takes no shared prefix. For what TrainerRank runs there, drop "
        f"--shared-prefix (or pass --packed-tokens {full}); --build local prices a build "
        f"without Transformer Engine, which shares it."
    )


# LoraShape's fields -> the flag that sets each.
_LORA_FLAGS = {"rank": "--lora-rank", "resident_adapters": "--resident-adapters",
               "resident_snapshots": "--resident-snapshots",
               "resident_adapter_rank": "--resident-adapter-rank"}


def lora_shape_from_args(args: Any) -> LoraShape:
    """The LoraShape of --lora-rank and the resident checkpoint slots (LoraShape's own rules;
    an error names the flag)."""
    try:
        return LoraShape(rank=args.lora_rank,
                         resident_adapters=getattr(args, "resident_adapters", 0),
                         resident_snapshots=getattr(args, "resident_snapshots", 0),
                         resident_adapter_rank=getattr(args, "resident_adapter_rank", 0))
    except FieldError as exc:
        raise exc.named(_LORA_FLAGS[exc.field]) from None


EXPERT_LOAD_HELP = (
    "MoE under expert parallel: price the router's spread instead of the even share, as "
    "shares of it: the busiest EP rank's pairs in one MoE layer (working), the same averaged "
    "over the MoE layers (held), the busiest expert's over the even count per expert "
    "(expert); one value sets all three (e.g. 1.2, or 1.25,1.1,1.8)")


def parse_expert_load(text: str) -> ExpertShare:
    """--expert-load: '1.2' -> each share 1.2; '1.25,1.1,1.8' -> working, held, expert (an
    ExpertShare at every row length)."""
    from art.trainer_rank.pricing.row_changes import ANY_ROW_TOKENS, ExpertShare

    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (1, 3) or not all(math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(
            f"--expert-load takes one share or three (working,held,expert), got {text!r}")
    if min(values) < 1.0:
        raise argparse.ArgumentTypeError(
            f"--expert-load shares are the busiest rank's or expert's load over the even share, "
            f"so at least 1.0; got {text!r} (1.0 is balanced routing, the default)")
    working, held, expert = values * 3 if len(values) == 1 else values
    if held > working:
        raise argparse.ArgumentTypeError(
            f"--expert-load's held share (the busiest rank's load averaged over the MoE layers, "
            f"{held}) cannot exceed its working share (the largest in one layer, {working})")
    return ExpertShare(ANY_ROW_TOKENS, working, held, expert)


def refuse_expert_load_without_experts(load: ExpertShare | None, geometry: Any) -> None:
    """--expert-load on a model with no routed experts is refused (ValueError)."""
    if load is not None and not geometry.is_moe:
        raise ValueError(f"--expert-load prices a router's spread, but {geometry.name} has no "
                         "routed experts")


def expert_load_json(load: ExpertShare | None) -> dict[str, float] | None:
    """--json's `expert_load`: the three shares priced under EP, or None (balanced routing)."""
    return None if load is None else {"working": load.working, "held": load.held,
                                      "expert": load.expert}
