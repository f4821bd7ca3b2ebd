"""How far a router's busiest expert-parallel rank strays from the even share, row to row.

    torchrun --nproc_per_node=2 scripts/routing_spread.py [--draws N] [--md FILE]

The calibration's two MoE models (the attention + MoE model and the hybrid MoE: 8 experts,
top-2, random weights, fp32) at EP=2 with TP=1 on two gloo ranks. For each row length, many
random-token rows: on each, the probe's own measurement (`measuring/routing.py`,
`routing_shares`: the largest share of the even share any EP rank's experts took in any MoE
layer on one no-grad forward). The probe measures one row per length; the first column is
one such row (seed 0), and the others show how far another row of the same length lands
from it, which is what a price read from one row must cover. The figures are this tiny
random router's; a trained router with a load-balancing loss spreads differently.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

LENGTHS = (64, 128, 256, 512, 1024, 2048)
GEOMETRIES = ("moe-128", "hybrid-moe-128")


def spread(geometry_name: str, draws: int) -> list[dict[str, float]]:
    from _calibration.cells import POLICY_BY_NAME, calibration_geometries
    from _calibration.harness import calibration_provider

    from art.megatron.implementation import Implementation
    from art.trainer_rank.measuring.routing import routing_shares

    implementation = Implementation.cpu_local("flash")
    provider = calibration_provider(calibration_geometries()[geometry_name],
                                    POLICY_BY_NAME["none"], lora_rank=8, tensor_parallel=1,
                                    expert_parallel=2, dtype="float32",
                                    implementation=implementation)
    provider.initialize_distributed()
    model = provider.build_model(seed=0)
    device = next(model.parameters()).device
    rows = []
    for n in LENGTHS:
        shares = [routing_shares(model, [n], provider.layout, implementation, device,
                                 seed=seed)[0][1] for seed in range(draws)]
        ordered = sorted(shares)
        rows.append({
            "tokens": n, "one_row": shares[0], "mean": statistics.mean(shares),
            "sd": statistics.pstdev(shares), "p90": ordered[max(0, int(0.9 * draws) - 1)],
            "max": ordered[-1],
            "above_one_row": sum(s > shares[0] for s in shares[1:]) / max(1, draws - 1),
        })
    return rows


def markdown(results: dict[str, list[dict[str, float]]], draws: int) -> str:
    lines = [
        "# The router's spread under expert parallel (CPU)",
        "",
        f"Written by `torchrun --nproc_per_node=2 scripts/routing_spread.py --draws {draws}`. "
        "Per model and row length: the busiest EP rank's share of the even share (largest "
        "over MoE layers and ranks) on random-token rows, one no-grad forward each; `one "
        "row` is seed 0's (the probe measures one row per length); `rows above it` is the "
        "fraction of the other rows whose share is higher, which a price read from one row "
        "alone puts under (where the experts set the peak).",
        "",
    ]
    for name, rows in results.items():
        lines += [f"## {name}", "",
                  "| tokens | one row | mean | sd | p90 | max | rows above it |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['tokens']:,} | {r['one_row']:.3f} | {r['mean']:.3f} | {r['sd']:.3f} | "
                  f"{r['p90']:.3f} | {r['max']:.3f} | {r['above_one_row']:.0%} |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--md", type=Path)
    args = parser.parse_args()
    if args.draws < 2:
        parser.error(f"--draws must be at least 2, got {args.draws}")
    results = {name: spread(name, args.draws) for name in GEOMETRIES}
    if dist.get_rank() == 0:
        text = markdown(results, args.draws)
        print(text)
        if args.md:
            args.md.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
