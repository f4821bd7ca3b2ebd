"""Shared-prefix packing on a GRPO-shaped workload: packed vs logical tokens, and the wall time
and live-tensor peak of forward + backward with the prompt shared vs every rollout in full.

Workload (seeded): P prompts x R rollouts, prompts uniform in [prompt_min, prompt_max] tokens,
completions uniform in [completion_min, completion_max], random token ids. Each group is one
packed row (one micro-batch) through the trainer's own sub-forward (pack, decoder, chunked
heads) with target log-probs, a policy-gradient-shaped loss and backward; once laid out as a
prefix tree ("shared") and once with every sequence in full ("unshared"), alternating which
runs first per group so drift hits both. The model is a real Megatron-Core GPTModel on CPU
(local spec, segmented flash attention: the unshared rows of ~10-30k tokens do not fit the
unfused path's S x S tensors). Figures go to bench/shared_prefix.{json,md}.

    .venv/bin/python scripts/bench_shared_prefix.py            # 8 prompts x 8 rollouts
    .venv/bin/python scripts/bench_shared_prefix.py --prompts 2 --rollouts 4 --out /tmp/x
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from art.megatron.distributed import initialize_distributed  # noqa: E402
from art.megatron.geometry import geometry_from_hf_dict  # noqa: E402
from art.megatron.implementation import Implementation  # noqa: E402
from art.megatron.layout import ParallelLayout  # noqa: E402
from art.megatron.model_builder import (  # noqa: E402
    RecomputeConfig,
    build_gpt_model,
    build_transformer_config,
)
from art.trainer_rank._types import ForwardInput  # noqa: E402
from art.trainer_rank.compute.execute import run_sub_forward  # noqa: E402
from art.trainer_rank.compute.packing import pack_sequences  # noqa: E402
from art.trainer_rank.measuring.meter import MemoryMeter  # noqa: E402


def workload(args: argparse.Namespace, vocab: int) -> list[list[ForwardInput]]:
    g = torch.Generator().manual_seed(args.seed)
    groups = []
    for _ in range(args.prompts):
        n_prompt = int(torch.randint(args.prompt_min, args.prompt_max + 1, (1,), generator=g))
        prompt = torch.randint(1, vocab, (n_prompt,), generator=g)
        leaves = []
        for _ in range(args.rollouts):
            n = int(torch.randint(args.completion_min, args.completion_max + 1, (1,), generator=g))
            tokens = torch.cat([prompt, torch.randint(1, vocab, (n,), generator=g)])
            targets = torch.cat([tokens[1:], tokens.new_full((1,), -100)])
            targets[: n_prompt - 1] = -100  # score the completion, as RL does
            leaves.append(ForwardInput(input_tokens=tokens, target_tokens=targets))
        groups.append(leaves)
    return groups


def run_group(model, leaves, implementation, layout, shared: bool) -> tuple[float, int, int]:
    """(seconds, packed tokens, peak live bytes) of forward + heads + loss + backward."""
    model.zero_grad(set_to_none=True)
    batch = pack_sequences([leaf.input_tokens for leaf in leaves], implementation=implementation,
                           layout=layout, groups=[len(leaves)] if shared else None)
    start = time.perf_counter()
    with MemoryMeter() as meter:
        outputs = run_sub_forward(model, leaves, implementation=implementation, layout=layout,
                                  device=torch.device("cpu"), head_chunk_tokens=2048,
                                  groups=[len(leaves)] if shared else None)
        advantages = torch.linspace(-1.0, 1.0, len(outputs))
        loss = sum(-a * out.target_logprobs.sum() for a, out in zip(advantages, outputs))
        loss.backward()
        del outputs, loss
    return time.perf_counter() - start, batch.padded_tokens, meter.peak_bytes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--rollouts", type=int, default=8)
    p.add_argument("--prompt-min", type=int, default=1000)
    p.add_argument("--prompt-max", type=int, default=4000)
    p.add_argument("--completion-min", type=int, default=100)
    p.add_argument("--completion-max", type=int, default=2000)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "bench")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    initialize_distributed()
    geometry = geometry_from_hf_dict(
        dict(model_type="qwen3", num_hidden_layers=args.layers, hidden_size=args.hidden,
             intermediate_size=3 * args.hidden, num_attention_heads=8, num_key_value_heads=4,
             head_dim=args.hidden // 4, vocab_size=512, max_position_embeddings=8192),
        name=f"tiny-qwen3-{args.layers}x{args.hidden}",
    )
    implementation = Implementation.cpu_local("flash")
    layout = ParallelLayout()
    config = build_transformer_config(geometry, layout=layout,
                                      recompute=RecomputeConfig("selective"), dtype="float32",
                                      implementation=implementation)
    model = build_gpt_model(geometry, config, implementation=implementation, seed=0)
    rows = []
    for index, leaves in enumerate(workload(args, geometry.vocab_size)):
        order = (True, False) if index % 2 == 0 else (False, True)
        result = {}
        for shared in order:
            result[shared] = run_group(model, leaves, implementation, layout, shared)
        logical = sum(leaf.num_tokens for leaf in leaves)
        rows.append({
            "group": index,
            "logical_tokens": logical,
            "packed_tokens_shared": result[True][1], "packed_tokens_unshared": result[False][1],
            "seconds_shared": round(result[True][0], 3),
            "seconds_unshared": round(result[False][0], 3),
            "peak_bytes_shared": result[True][2], "peak_bytes_unshared": result[False][2],
        })
        print(f"group {index}: {logical:,} logical, {result[True][1]:,} packed shared; "
              f"fwd+bwd {result[True][0]:.2f}s shared vs {result[False][0]:.2f}s unshared",
              flush=True)
    totals = {
        "logical_tokens": sum(r["logical_tokens"] for r in rows),
        "packed_tokens_shared": sum(r["packed_tokens_shared"] for r in rows),
        "packed_tokens_unshared": sum(r["packed_tokens_unshared"] for r in rows),
        "seconds_shared": round(sum(r["seconds_shared"] for r in rows), 3),
        "seconds_unshared": round(sum(r["seconds_unshared"] for r in rows), 3),
        "peak_bytes_shared": max(r["peak_bytes_shared"] for r in rows),
        "peak_bytes_unshared": max(r["peak_bytes_unshared"] for r in rows),
    }
    totals["packed_over_logical"] = round(totals["packed_tokens_shared"]
                                          / totals["logical_tokens"], 4)
    totals["time_shared_over_unshared"] = round(totals["seconds_shared"]
                                                / totals["seconds_unshared"], 4)
    totals["peak_shared_over_unshared"] = round(totals["peak_bytes_shared"]
                                                / totals["peak_bytes_unshared"], 4)
    meta = {
        "command": "python scripts/bench_shared_prefix.py " + " ".join(sys.argv[1:]),
        "workload": {k: getattr(args, k) for k in ("prompts", "rollouts", "prompt_min",
                                                   "prompt_max", "completion_min",
                                                   "completion_max", "seed")},
        "model": f"{geometry.name} ({implementation.key}, float32, selective recompute)",
        "machine": f"{platform.machine()}, torch {torch.__version__}, "
                   f"{torch.get_num_threads()} thread(s)",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "shared_prefix.json").write_text(
        json.dumps({**meta, "totals": totals, "groups": rows}, indent=2) + "\n")
    lines = [
        "# Shared-prefix packing: GRPO-shaped workload (written by scripts/bench_shared_prefix.py)",
        "", f"`{meta['command'].strip()}`; {meta['model']}; {meta['machine']}.", "",
        f"- tokens: {totals['logical_tokens']:,} logical, {totals['packed_tokens_shared']:,} "
        f"packed shared (x{totals['packed_over_logical']}), "
        f"{totals['packed_tokens_unshared']:,} unshared",
        f"- forward+backward wall time, shared / unshared (same run, alternating order): "
        f"{totals['seconds_shared']:.1f} s / {totals['seconds_unshared']:.1f} s = "
        f"x{totals['time_shared_over_unshared']}",
        f"- largest live-tensor peak of a group, shared / unshared: "
        f"{totals['peak_bytes_shared'] / 2**20:.0f} MiB / "
        f"{totals['peak_bytes_unshared'] / 2**20:.0f} MiB = "
        f"x{totals['peak_shared_over_unshared']}",
        "", "| group | logical | packed shared | s shared | s unshared | peak MiB shared | "
        "peak MiB unshared |", "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['group']} | {r['logical_tokens']:,} | {r['packed_tokens_shared']:,} | "
        f"{r['seconds_shared']} | {r['seconds_unshared']} | "
        f"{r['peak_bytes_shared'] / 2**20:.0f} | {r['peak_bytes_unshared'] / 2**20:.0f} |"
        for r in rows
    ]
    (args.out / "shared_prefix.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[4:7]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
