"""The demo's flags and its launcher: ./scripts/demo runs this file, which reads and checks
the flags (and the ART_MEGATRON_* / ART_TRAINER_RANK_* environment) before torchrun starts,
so --help prints once, at once, and a bad value is one line naming it, exit status 2, before
any rank builds anything; then it execs torchrun with scripts/demo_worker.py, whose ranks
parse the same flags with `parse_args`.

The checks are the ones the run applies (the workload's own rules, TrainerRankOptions' for
the limit, the LoRA rule the provider applies), not copies of them.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
VOCAB = 512
# WorkloadSpec's fields -> the flag that sets each (its errors name the flag).
FLAGS = {"groups": "--groups", "rollouts_per_group": "--rollouts",
         "min_tokens": "--min-tokens", "max_tokens": "--max-tokens",
         "median_completion_tokens": "--median-completion", "seed": "--seed"}


class DemoInputError(ValueError):
    """A flag or setting the demo cannot run with; the message names it."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"demo: {message} (see ./scripts/demo --help)\n")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="./scripts/demo",
                description="The planner at work on a real Megatron-Core model: an RL step of "
                            "groups of rollouts, under a virtual memory limit, on 2 TP ranks "
                            "(CPU, gloo). Settings come from ART_MEGATRON_*.")
    p.add_argument("--groups", type=int, default=8, help="prompts (one group each)")
    p.add_argument("--rollouts", type=int, default=4, help="rollouts per prompt")
    p.add_argument("--min-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=1500)
    p.add_argument("--median-completion", type=int, default=110,
                   help="median completion length in tokens (log-normal, long-tailed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit-mib", type=float, default=None,
                   help="virtual memory limit per rank (default: ART_TRAINER_RANK_TEST_MEMORY_"
                   "LIMIT_BYTES when set, else 1.7x what the largest RL group needs under the "
                   "configured recompute, so that small groups share micro-batches)")
    p.add_argument("--lora-rank", type=int, default=8)
    return p


def workload_spec(args: argparse.Namespace) -> Any:
    """The WorkloadSpec the flags describe (its checks name the flags). Prompts take 16 to a
    quarter of --max-tokens (at most 160), so a --max-tokens the workload takes leaves room
    for completions."""
    from _workload import WorkloadSpec

    high = max(1, min(160, args.max_tokens // 4))
    return WorkloadSpec(
        groups=args.groups, rollouts_per_group=args.rollouts, min_tokens=args.min_tokens,
        max_tokens=args.max_tokens, median_completion_tokens=args.median_completion,
        vocab_size=VOCAB, seed=args.seed, prompt_tokens_range=(min(16, high), high),
        names=FLAGS,
    )


def check(args: argparse.Namespace) -> None:
    """Every flag against the rule the run applies to it; DemoInputError naming the flag."""
    from art.megatron.lora_config import validate_lora_config
    from art.trainer_rank._options import field_problem

    try:
        workload_spec(args)
    except ValueError as exc:
        raise DemoInputError(str(exc)) from None
    if args.limit_mib is not None:
        if not math.isfinite(args.limit_mib):
            raise DemoInputError(f"--limit-mib={args.limit_mib:g}: must be a finite number")
        limit = int(args.limit_mib * MIB)
        problem = field_problem("test_memory_limit_bytes", limit)
        if problem is not None:
            raise DemoInputError(f"--limit-mib={args.limit_mib:g} ({limit} bytes): {problem}")
    try:
        # The provider's own LoRA rule (it reads only these attributes of a LoraConfig).
        validate_lora_config(SimpleNamespace(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                             target_modules="all-linear"))
    except ValueError as exc:
        raise DemoInputError(f"--lora-rank={args.lora_rank}: {exc}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    check(args)
    return args


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_command(argv: list[str]) -> list[str]:
    """torchrun with the demo's worker, one process per TP rank (ART_DEMO_NPROC overrides),
    after the flags and the environment passed every check; DemoInputError or ValueError
    (naming the flag or variable) otherwise."""
    check(parse_args_only(argv))
    from art.megatron.settings import load_settings
    from art.trainer_rank._options import TrainerRankOptions

    settings = load_settings()
    options = TrainerRankOptions.from_env()
    nproc = os.environ.get("ART_DEMO_NPROC") or str(settings.tensor_model_parallel_size)
    args = parse_args_only(argv)
    limit, given = ((int(args.limit_mib * MIB), f"--limit-mib={args.limit_mib:g}")
                    if args.limit_mib is not None else
                    (options.test_memory_limit_bytes, "ART_TRAINER_RANK_TEST_MEMORY_LIMIT_BYTES="
                     + repr(os.environ.get("ART_TRAINER_RANK_TEST_MEMORY_LIMIT_BYTES"))))
    available = available_memory_bytes()
    if limit is not None and available is not None and nproc.isdigit() and \
            limit * int(nproc) > available:
        # The virtual limit stands in for a GPU, but the tensors are real: past the RAM free
        # here the kernel's OOM killer ends a rank instead of the planner declining an item.
        raise DemoInputError(
            f"{given}: {nproc} ranks x {limit / MIB:,.0f} MiB is more than this machine's "
            f"available memory ({available / MIB:,.0f} MiB); the virtual limit's tensors are "
            "real, so lower it")
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
            str(ROOT / "scripts" / "demo_worker.py"), *argv]


def parse_args_only(argv: list[str]) -> argparse.Namespace:
    return parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parse_args_only(argv)  # --help and usage errors end here, before the heavy imports
    for path in (str(ROOT / "scripts"), str(ROOT)):
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        command = launch_command(argv)
    except ValueError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    os.execv(sys.executable, command)
    return 0  # not reached: execv replaces this process


if __name__ == "__main__":
    sys.exit(main())
