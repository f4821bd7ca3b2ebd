"""torchrun worker: ranks that pass different inputs to forward_micro_batches. The suite runs
`run` in trainer_worker.py's launch (see conftest.py).

argv: <tp size> <out dir>. Every rank writes rank<r>.json with what each phase raised and how
long it took:
1. rank r passes 3 + r top-level items (a different count on every rank);
2. equal counts, but rank 1's last sequence is longer (a different token count);
3. every rank passes the same list: must work after the two errors (nothing left hanging).
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

from art.megatron.implementation import Implementation
from art.megatron.provider import Provider
from art.megatron.settings import load_settings
from art.megatron.train import build_runtime_for_provider
from art.trainer_rank import ForwardInput, TrainerRank, TrainerRankOptions

from _tiny import tiny_dense


def _inputs(lengths: list[int]) -> list[ForwardInput]:
    g = torch.Generator().manual_seed(0)
    return [ForwardInput(input_tokens=torch.randint(0, 256, (n,), generator=g),
                         target_tokens=torch.randint(0, 256, (n,), generator=g)) for n in lengths]


def _phase(trainer: TrainerRank, inputs: list[ForwardInput]) -> dict:
    started = time.perf_counter()
    try:
        yielded = 0
        for mb in trainer.forward_micro_batches(inputs, no_grad=True):
            yielded += len(mb.indices)
        outcome = {"error": None, "yielded": yielded}
    except Exception as exc:  # what each rank saw is the result
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    outcome["seconds"] = time.perf_counter() - started
    return outcome


def run(tp: int, out_dir: Path) -> None:
    """The three phases on a trainer of its own at TP=tp; this rank's record to out_dir."""
    warnings.filterwarnings("ignore")
    provider = Provider(
        tiny_dense(num_layers=2),
        settings=load_settings({"ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": str(tp),
                                "ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective"}),
        dtype="float32", implementation=Implementation.cpu_local(),
    )
    trainer = TrainerRank(build_runtime_for_provider(
        provider, build_optimizer=False, wrap_ddp=False, trainable_parameter_mode="base_model",
        trainer_options=TrainerRankOptions(test_memory_limit_bytes=256 * 2**20)))
    rank = int(os.environ["RANK"])
    result = {
        "rank": rank,
        "count_mismatch": _phase(trainer, _inputs([8] * (3 + rank))),
        "token_mismatch": _phase(trainer, _inputs([8, 8, 8 + rank])),
        "agreed": _phase(trainer, _inputs([8, 9, 10])),
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    run(int(sys.argv[1]), Path(sys.argv[2]))


if __name__ == "__main__":
    main()
