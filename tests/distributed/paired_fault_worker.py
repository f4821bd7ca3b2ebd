"""torchrun worker (2 ranks, gloo): a MoE checkpoint at EP=2 with TP=1, the expert-parallel
group being the two data-parallel ranks, and an out-of-memory error injected on rank 1 inside
its first MoE layer's forward, while rank 0 runs its own micro-batch's forward and waits for
rank 1 in the layer's all-to-all. Both ranks must leave forward_micro_batches with the same
TrainerRankMemoryError, within the fault timeout, instead of rank 1 re-planning alone and
rank 0 waiting for ever.

argv: out_dir. Writes rank<R>.json: the error (type, text) and the seconds the call took."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from upstream_driver_worker import driver_module

ROOT = Path(__file__).resolve().parents[2]
FAULT_TIMEOUT_S = 10.0


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    sys.path.insert(0, str(ROOT / "scripts"))
    from _hf_checkpoint import save_random_checkpoint

    from art.trainer_rank import ForwardInput

    folder = out / "moe"
    if dist.get_rank() == 0:
        save_random_checkpoint(folder, family="qwen3_moe", layers=2)
    dist.barrier()
    os.environ.update({"ART_MEGATRON_EXPERT_MODEL_PARALLEL_SIZE": "2",
                       "ART_MEGATRON_CONTEXT_PARALLEL_SIZE": "1",
                       "ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "1",
                       "ART_TRAINER_RANK_FAULT_TIMEOUT_S": str(FAULT_TIMEOUT_S)})
    driver = driver_module()
    args = driver.parse_args(["--dtype", "float32", "--steps", "0", "--model", str(folder)])
    _, trainer = driver.train(args)
    rank = dist.get_rank()
    mlp = trainer.model.decoder.layers[0].mlp

    def out_of_memory(module, inputs):
        raise torch.OutOfMemoryError("injected: out of memory in the MoE layer's forward")

    if rank == 1:
        mlp.register_forward_pre_hook(out_of_memory)
    g = torch.Generator().manual_seed(7)
    inputs = [ForwardInput(input_tokens=torch.randint(0, 256, (n,), generator=g),
                           target_tokens=torch.randint(0, 256, (n,), generator=g))
              for n in (24, 20)]
    started = time.monotonic()
    error = None
    try:
        for micro in trainer.forward_micro_batches(inputs):
            if micro.outputs:
                sum(-o.target_logprobs.sum() for o in micro.outputs).backward()
    except Exception as exc:  # noqa: BLE001 - the record says what was raised
        error = {"type": type(exc).__name__, "text": str(exc)}
    record = {"error": error, "seconds": time.monotonic() - started,
              "paired_forwards": trainer.paired_forwards}
    (out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
