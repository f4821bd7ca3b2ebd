"""The seed report's call, end to end on CPU or one GPU: a Qwen3.5-pattern hybrid (three
Gated DeltaNet layers, then an attention layer), TP=2, selective recompute, a rank-1 LoRA, one
group of two rollouts of 19,222 and 19,221 tokens sharing a 5,733-token prompt, hidden states
and target log-probs requested, and the caller's backward.

    torchrun --nproc_per_node=2 scripts/seed_call.py [--scale 1.0] [--json report.json]
    ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE=1 python scripts/seed_call.py \
        --model Qwen3.5-27B --layers 8 --dtype bfloat16          # the GPU check, one H200

The model is the shipped `tiny-qwen3_5` config by default (hidden 64; random weights), built
with the segmented flash attention (on CUDA: what `Implementation.detect` finds), so the
prefix tree runs through every layer: the attention layer sees it as its layout, the Gated
DeltaNet layers continue each rollout from the prompt's final state and conv window. The
planner prices the group as the packer lays it out (the prompt once: 32,710 tokens at scale 1)
under a virtual limit set between its price under selective recompute and under full
recompute, which is where the seed's H200s stood: selective does not fit, full does. It
prints the decision with the numbers, the measured peak, then runs the two rollouts again as
separate items (each with its own copy of the prompt) and compares outputs and LoRA
gradients. `--scale` shrinks every length (the test runs a small one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SEED_LENGTHS = (19222, 19221)
SEED_PROMPT = 5733
MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply every length (prompt and rollouts) by this")
    parser.add_argument("--seed", type=int, default=0, help="token ids and weights")
    parser.add_argument("--json", default=None, help="write this rank's report here")
    parser.add_argument("--md", default=None,
                        help="write what rank 0 prints here, as a markdown page with the command")
    parser.add_argument("--model", default="tiny-qwen3_5",
                        help="a shipped model config (random weights at its dims)")
    parser.add_argument("--layers", type=int, default=None,
                        help="keep the model's first N layers (its layer pattern's start)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    if not 0 < args.scale <= 1:
        parser.error(f"--scale must be in (0, 1], got {args.scale}")
    return args


def seed_group(scale: float, vocab: int, seed: int) -> list[torch.Tensor]:
    """Two rollouts of one prompt that part right after it (the seed's shapes, scaled)."""
    prompt_tokens = max(1, round(SEED_PROMPT * scale))
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, vocab, (prompt_tokens,), generator=g)
    rollouts = []
    for k, n in enumerate(SEED_LENGTHS):
        own = torch.randint(1, vocab, (max(1, round(n * scale)) - prompt_tokens,), generator=g)
        own[0] = 1 + k  # the rollouts part at their first own token
        rollouts.append(torch.cat([prompt, own]))
    return rollouts


def _inputs(rollouts: list[torch.Tensor]) -> list[Any]:
    from art.trainer_rank import ForwardInput

    return [ForwardInput(input_tokens=t, target_tokens=torch.roll(t, -1), hidden_states=True)
            for t in rollouts]


def _loss(outputs: list[Any]) -> torch.Tensor:
    return sum(-out.target_logprobs.sum() + out.hidden_states.float().square().mean()
               for out in outputs)


def _lora_grads(model: Any) -> dict[str, torch.Tensor]:
    """The adapter's gradients (Megatron's DDP accumulates them in `main_grad`)."""
    grads = {}
    for name, p in model.named_parameters():
        grad = getattr(p, "main_grad", None)
        grad = p.grad if grad is None else grad
        if p.requires_grad and grad is not None:
            grads[name] = grad.detach().clone()
    return grads


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE", "2")
    os.environ.setdefault("ART_MEGATRON_RECOMPUTE_GRANULARITY", "selective")
    from peft import LoraConfig

    from art.megatron.geometry import load_geometry
    from art.megatron.implementation import Implementation
    from art.megatron.provider import Provider
    from art.megatron.train import build_runtime_for_provider
    from art.trainer_rank import TrainerRank, TrainerRankMemoryError
    from art.trainer_rank._options import TrainerRankOptions
    from art.trainer_rank.compute.items import make_items

    lora = LoraConfig(r=1, lora_alpha=2, lora_dropout=0.0,
                      target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"])
    geometry = load_geometry(args.model)
    if args.layers is not None:
        geometry = geometry.first_layers(args.layers)
    # CUDA builds what it detects (without Transformer Engine: the local spec over torch's
    # CUDA kernels); CPU the segmented flash attention, so the prefix tree runs there too.
    implementation = (Implementation.detect() if torch.cuda.is_available()
                      else Implementation.cpu_local("flash"))
    provider = Provider(geometry, lora=lora, dtype=args.dtype, implementation=implementation)
    state = provider.initialize_distributed()
    rank0 = state.rank == 0
    lines: list[str] = []

    def say(text: str) -> None:
        if rank0:
            print(text, flush=True)
            lines.append(text)

    started = time.perf_counter()

    def progress(text: str) -> None:
        """Standard output only (not the report): how far a run stopped from outside got."""
        if rank0:
            print(f"[{time.perf_counter() - started:.0f} s] {text}", flush=True)

    progress(f"building {geometry.name} ({implementation.key}, {args.dtype}) and probing it "
             "through TrainerRank")
    rollouts = seed_group(args.scale, provider.geometry.vocab_size, args.seed)
    group = _inputs(rollouts)
    options = TrainerRankOptions.from_env()
    trainer = TrainerRank(build_runtime_for_provider(
        provider, build_optimizer=False, model_initialization="random", seed=args.seed,
        trainer_options=replace(options, test_memory_limit_bytes=64 * 2**30)))
    progress("TrainerRank is ready")
    # The group's price under the configured (selective) and full recompute, as admission
    # prices it: the limit goes between, where the seed's GPUs were.
    item = make_items([group])[0]
    selective, shape, _ = trainer.admission.price_items([item], True)
    full_recompute = trainer.admission.full_recompute
    assert full_recompute is not None
    full, _, _ = trainer.admission.price_items([item], True, full_recompute)
    limit = (selective.dynamic_bytes + full.dynamic_bytes) // 2
    trainer.options = replace(trainer.options, test_memory_limit_bytes=limit)
    say(f"model {provider.geometry.name} ({provider.geometry.num_layers} layers: "
        f"{', '.join(provider.geometry.layer_types)}), {provider.layout.summary}, "
        f"{provider.effective_recompute.summary}, LoRA r1")
    say(f"group: {' + '.join(f'{len(r):,}' for r in rollouts)} = {shape.logical_tokens:,} "
        f"logical tokens sharing {item.shared_tokens:,}; packed {shape.packed_tokens:,}")
    say(f"priced per rank: selective {selective.dynamic_bytes / MIB:.1f} MiB, full recompute "
        f"{full.dynamic_bytes / MIB:.1f} MiB; virtual limit {limit / MIB:.1f} MiB")

    report: dict[str, Any] = {"rank": state.rank, "packed_tokens": shape.packed_tokens,
                              "logical_tokens": shape.logical_tokens,
                              "shared_tokens": item.shared_tokens, "limit_bytes": limit,
                              "selective_bytes": selective.dynamic_bytes,
                              "full_bytes": full.dynamic_bytes}
    progress("the group, its prompt laid out once")
    trainer.zero_grad()
    shared_outputs: list[Any] = []
    try:
        for micro in trainer.forward_micro_batches([group]):
            loss = _loss(micro.outputs[0])
            loss.backward()
            shared_outputs = [out.target_logprobs.detach() for out in micro.outputs[0]] + [
                out.hidden_states.detach() for out in micro.outputs[0]]
            del loss
    except TrainerRankMemoryError as error:
        report["declined"] = str(error)
        say(f"declined: {error}")
    else:
        stats = trainer.stats_history[-1]
        measured = stats.measured_peak_bytes or 0
        report.update(decision=stats.decision, recompute=stats.recompute_summary,
                      stats_packed_tokens=stats.packed_tokens,
                      predicted_bytes=stats.estimated_required_bytes,
                      measured_bytes=measured, note=stats.note)
        say(f"decision: {stats.decision} ({stats.note}); ran with {stats.recompute_summary}; "
            f"packed {stats.packed_tokens:,} tokens")
        say(f"predicted {stats.estimated_required_bytes / MIB:.1f} MiB, measured "
            f"{measured / MIB:.1f} MiB (predicted / measured "
            f"{stats.estimated_required_bytes / max(1, measured):.4f})")
        say(stats.term_table)
    shared_grads = _lora_grads(trainer.model)

    # The reference: the same rollouts as separate items, each with its own prompt copy.
    trainer.options = replace(trainer.options, test_memory_limit_bytes=64 * 2**30)
    progress("the rollouts as separate items")
    trainer.zero_grad()
    recorded = len(trainer.stats_history)
    alone: list[Any] = [None, None]
    for micro in trainer.forward_micro_batches(_inputs(rollouts)):
        loss = _loss(micro.outputs)
        loss.backward()
        for index, out in zip(micro.indices, micro.outputs):
            alone[index] = out
        del loss
    for record in trainer.stats_history[recorded:]:
        say(f"separate items: {record.decision}, {record.packed_tokens:,} tokens, predicted "
            f"{record.estimated_required_bytes / MIB:.1f} MiB, measured "
            f"{(record.measured_peak_bytes or 0) / MIB:.1f} MiB")
    alone_outputs = [o.target_logprobs.detach() for o in alone] + [
        o.hidden_states.detach() for o in alone]
    alone_grads = _lora_grads(trainer.model)
    if shared_outputs:
        report["output_max_abs_diff"] = max(
            (a - b).abs().max().item() for a, b in zip(shared_outputs, alone_outputs))
        scale = max(g.abs().max().item() for g in alone_grads.values())
        report["grad_max_rel_diff"] = max(
            (shared_grads[n] - alone_grads[n]).abs().max().item() for n in alone_grads) / scale
        report["grads_compared"] = len(alone_grads)
        say(f"shared vs separate items: outputs max |diff| {report['output_max_abs_diff']:.2e}, "
            f"LoRA gradients max |diff| / max |grad| {report['grad_max_rel_diff']:.2e} "
            f"({len(alone_grads)} tensors per rank)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.md and rank0:
        launcher = (f"torchrun --nproc_per_node={state.world_size}" if state.world_size > 1
                    else "python")
        command = f"{launcher} scripts/seed_call.py " + " ".join(
            a for a in (argv if argv is not None else sys.argv[1:]))
        Path(args.md).write_text(
            f"# The seed's call on {'CUDA' if torch.cuda.is_available() else 'CPU'} "
            "(written by scripts/seed_call.py)\n\n"
            f"Command: `{command.strip()}`\n\n```text\n" + "\n".join(lines) + "\n```\n")
    dist.barrier()
    from art.megatron.distributed import shutdown_distributed

    shutdown_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
