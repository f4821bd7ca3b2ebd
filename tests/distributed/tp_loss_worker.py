"""torchrun worker: loss and a gradient norm of the tiny model at TP = WORLD_SIZE;
`loss_and_grad` also runs in-process at TP=1 for the reference."""

from __future__ import annotations

import json
import os
import sys

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from art.megatron.distributed import initialize_distributed, shutdown_distributed
from art.megatron.layout import ParallelLayout
from art.megatron.model_builder import RecomputeConfig, build_gpt_model, build_transformer_config

from _tiny import tiny_dense


def loss_and_grad(geometry, tp: int, granularity: str) -> dict:
    recompute = RecomputeConfig("full", "uniform", 1) if granularity == "full" else RecomputeConfig(
        granularity if granularity != "none" else None
    )
    config = build_transformer_config(
        geometry, layout=ParallelLayout(tensor_parallel=tp), recompute=recompute, dtype="float32"
    )
    # Megatron's CPU initialisation draws the full master weight from the seed and keeps this
    # rank's shard, so TP=1 and TP=2 hold the same function.
    model = build_gpt_model(geometry, config, seed=0)
    torch.manual_seed(1)
    tokens = torch.randint(0, geometry.vocab_size, (1, 40))
    positions = torch.arange(tokens.shape[1])[None]
    logits = model(tokens, positions, attention_mask=None)
    loss = vocab_parallel_cross_entropy(
        logits.transpose(0, 1).float().contiguous(), tokens.t().contiguous()
    ).mean()
    loss.backward()
    # Embedding gradients are vocab-sharded: sum squared norms over the TP group.
    grad_sq = sum(float(p.grad.float().pow(2).sum()) for p in model.parameters()
                  if p.grad is not None and getattr(p, "tensor_model_parallel", False))
    grad_sq_t = torch.tensor([grad_sq], dtype=torch.float64)
    torch.distributed.all_reduce(grad_sq_t, group=parallel_state.get_tensor_model_parallel_group())
    return {"loss": loss.item(), "sharded_grad_sq": grad_sq_t.item()}


def run(granularities: list[str], out_dir: str) -> None:
    """One model per recompute granularity at TP = WORLD_SIZE; this rank's record to out_dir."""
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    initialize_distributed(tensor_parallel=tp)
    geometry = tiny_dense(num_layers=2)
    rank = int(os.environ.get("RANK", 0))
    record = {"rank": rank, "tp": tp,
              "by_granularity": {g: loss_and_grad(geometry, tp, g) for g in granularities}}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


def main() -> None:
    """argv: comma-separated recompute granularities (one model each, in one launch), the
    output folder."""
    run(sys.argv[1].split(","), sys.argv[2])
    shutdown_distributed()


if __name__ == "__main__":
    main()
