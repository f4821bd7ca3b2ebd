"""`python -m art.trainer_rank`: the parser of both commands and what each is for."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import NoReturn

from art.trainer_rank.cli import estimate, plan

DESCRIPTION = """\
Price LoRA training and scoring forwards of a Megatron-Core model before running them. No model
is built and no GPU is needed: the memory model computes every figure from the model's config,
the parallel layout, the recompute policy and one micro-batch's shape."""


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error on one line (the full usage is what --help is for)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog="python -m art.trainer_rank", description=DESCRIPTION)
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module, summary in (
        ("estimate", estimate,
         "one micro-batch's peak memory per rank as named terms, and whether it fits a GPU"),
        ("plan", plan,
         "which recompute policy and tensor/context-parallel layout to run on N GPUs"),
    ):
        sub = commands.add_parser(name, help=summary, description=module.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return int(args.run(args))
