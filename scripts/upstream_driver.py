"""A training driver written in upstream's call sequence (ART's own dev driver): nothing in
it knows this package is not ART's.

    torchrun --nproc_per_node=2 scripts/upstream_driver.py --steps 3

Under torchrun: default ART_MEGATRON_{TENSOR_MODEL,CONTEXT,PIPELINE_MODEL}_PARALLEL_SIZE=1, the
device from LOCAL_RANK, the process group, then `build_training_runtime(...)`,
`TrainerRank(runtime)`, and per step: zero_grad, forward_micro_batches, a loss from
target_logprobs, backward, dp_reduce of the loss sum and token count, optim_step. It trains a
LoRA on one fixed batch of random token sequences, starting from a random Qwen3 checkpoint
that transformers saves on the fly and `model_initialization="pretrained"` loads (`--model`
may name another checkpoint folder, or a shipped config for random weights), prints the
loss per step, and checks that the adapter moved and the base weights did not. Set
ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE=2 for TP=2; with TP=1 the two processes are data
parallel.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from typing import Any

import torch
import torch.distributed as dist

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None,
                        help="model identifier: a local HF checkpoint folder (pretrained) or a "
                        "shipped config name (random weights); default: a random Qwen3 "
                        "checkpoint in tiny-qwen3's shape, saved by transformers on the fly")
    parser.add_argument("--num-layers", type=int, default=2, help="provider_configure: layers")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--items", type=int, default=8, help="sequences in the fixed batch")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0, help="the batch's seed")
    parser.add_argument("--json", default=None, help="write this rank's report here")
    return parser.parse_args(argv)


def fixed_batch(vocab: int, items: int, max_tokens: int, seed: int, device: torch.device):
    """The same batch on every rank: next-token targets, last position ignored (-100)."""
    from art.trainer_rank import ForwardInput

    g = torch.Generator().manual_seed(seed)
    batch = []
    for _ in range(items):
        n = int(torch.randint(8, max_tokens + 1, (1,), generator=g))
        tokens = torch.randint(0, vocab, (n + 1,), generator=g)
        targets = tokens[1:].clone()
        targets[-1] = -100
        batch.append(ForwardInput(input_tokens=tokens[:-1].to(device),
                                  target_tokens=targets.to(device)))
    return batch


def _digest(params: list[tuple[str, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for name, p in params:
        h.update(name.encode())
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def _model_source(model: str | None) -> tuple[str, str]:
    """(model_identifier, model_initialization): a folder loads as pretrained, a config name
    builds random weights; without one, rank 0 saves a random Qwen3 checkpoint with
    transformers (tiny-qwen3's shape) and every rank loads it as pretrained."""
    if model is not None:
        return model, "pretrained" if os.path.isdir(model) else "random"
    import sys
    import tempfile

    folder: list[Any] = [None]
    if dist.get_rank() == 0:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _hf_checkpoint import save_random_checkpoint

        folder[0] = str(save_random_checkpoint(
            tempfile.mkdtemp(prefix="art-upstream-driver-"), layers=4, hidden=64, vocab=256,
            heads=8, kv_heads=4, head_dim=16, max_positions=4096))
    dist.broadcast_object_list(folder, src=0)
    return folder[0], "pretrained"


def train(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """Build, train `args.steps` steps; returns (report, trainer)."""
    from art.megatron import train as megatron_train
    from art.trainer_rank import AdamParams, TrainerRank

    for name in ("TENSOR_MODEL", "CONTEXT", "PIPELINE_MODEL"):
        os.environ.setdefault(f"ART_MEGATRON_{name}_PARALLEL_SIZE", "1")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    world_rank = dist.get_rank()

    def provider_configure(provider: Any) -> None:
        provider.num_layers = args.num_layers

    model, initialization = _model_source(args.model)
    runtime = megatron_train.build_training_runtime(
        model_identifier=model, provider_configure=provider_configure,
        print_env=world_rank == 0, model_initialization=initialization,
        provider_torch_dtype=DTYPES[args.dtype],
    )
    if args.model is None:  # the on-the-fly checkpoint is loaded on every rank: remove it
        dist.barrier()
        if world_rank == 0:
            import shutil

            shutil.rmtree(model, ignore_errors=True)
    rank = TrainerRank(runtime)
    data_parallel = megatron_train.ps.get_data_parallel_world_size()
    if world_rank == 0:
        print(f"TrainerRank ready: dp={data_parallel} device={rank.device}", flush=True)
    inputs = fixed_batch(runtime.provider.vocab_size, args.items, args.max_tokens, args.seed,
                         rank.device)
    named = list(rank.model.named_parameters())
    base_before = _digest([(n, p) for n, p in named if not p.requires_grad])
    adapter_before = _digest([(n, p) for n, p in named if p.requires_grad])

    losses, steps = [], []
    for step in range(args.steps):
        rank.zero_grad()
        loss_sum = torch.zeros((), device=rank.device)
        tokens = torch.zeros((), device=rank.device)
        micro_batches = 0
        for micro in rank.forward_micro_batches(inputs):
            micro_batches += 1
            loss = torch.zeros((), device=rank.device)
            for item, out in zip(micro.inputs, micro.outputs):
                mask = item.target_tokens != -100
                loss = loss - (out.target_logprobs * mask).sum()
                tokens += mask.sum()
            if loss.requires_grad:  # an empty micro-batch (DP lockstep) has nothing to learn
                loss.backward()
            loss_sum += loss.detach()
        rank.dp_reduce(loss_sum)
        rank.dp_reduce(tokens)
        metrics = rank.optim_step(params=AdamParams(learning_rate=args.lr),
                                  scale_grads=1.0 / float(tokens))
        losses.append(float(loss_sum / tokens))
        steps.append({**metrics, "micro_batches": micro_batches})
        if world_rank == 0:
            print(f"step {step}: loss {losses[-1]:.6f}  grad norm {metrics['grad_norm']:.6f}  "
                  f"micro-batches {micro_batches}", flush=True)
    named = list(rank.model.named_parameters())
    report = {
        "rank": world_rank,
        "world_size": dist.get_world_size(),
        "tensor_parallel": runtime.provider.tensor_model_parallel_size,
        "data_parallel": data_parallel,
        "model_initialization": initialization,
        "losses": losses,
        "steps": steps,
        "base_untouched": _digest([(n, p) for n, p in named if not p.requires_grad])
        == base_before,
        "adapter_changed": _digest([(n, p) for n, p in named if p.requires_grad])
        != adapter_before,
    }
    return report, rank


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report, _ = train(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f)
    if report["rank"] == 0:
        print(f"loss {report['losses'][0]:.6f} -> {report['losses'][-1]:.6f}; adapter changed: "
              f"{report['adapter_changed']}; base untouched: {report['base_untouched']}")
    dist.destroy_process_group()
    ok = report["adapter_changed"] and report["base_untouched"]
    return 0 if ok and report["losses"][-1] < report["losses"][0] else 1


if __name__ == "__main__":
    raise SystemExit(main())
