"""How far a router's busiest expert-parallel rank strays from the even share, row to row.

    torchrun --nproc_per_node=2 scripts/routing_spread.py [--draws N] [--md FILE]

The calibration's two MoE models (the attention + MoE model and the hybrid MoE: 8 experts,
top-2, random weights, fp32) at EP=2 with TP=1 on two gloo ranks. For each row length, many
random-token rows: on each, the probe's own measurement (`measuring/routing.py`,
`routing_shares` over one row: the working, held and expert shares of one no-grad forward).
The probe reads the largest of each over its first `ROUTING_DRAWS` rows (seeds 0 onwards);
the table shows that bound beside the spread of all rows, and the fraction of the other rows
that exceed it, which a price read from it puts under where that share sets the peak. The
figures are this tiny random router's; a trained router with a load-balancing loss spreads
differently.
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


SHARES = ("working", "held", "expert")


def spread(geometry_name: str, draws: int) -> list[dict[str, float]]:
    from _calibration.cells import POLICY_BY_NAME, calibration_geometries
    from _calibration.harness import calibration_provider

    from art.megatron.implementation import Implementation
    from art.trainer_rank.measuring.routing import ROUTING_DRAWS, routing_shares

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
                                 seed=seed, draws=1)[0] for seed in range(draws)]
        row: dict[str, float] = {"tokens": n}
        for name in SHARES:
            values = [getattr(s, name) for s in shares]
            bound = max(values[:ROUTING_DRAWS])
            others = values[ROUTING_DRAWS:]
            row |= {f"{name}_bound": bound, f"{name}_mean": statistics.mean(values),
                    f"{name}_sd": statistics.pstdev(values), f"{name}_max": max(values),
                    f"{name}_above": sum(v > bound for v in others) / max(1, len(others))}
        rows.append(row)
    return rows


def markdown(results: dict[str, list[dict[str, float]]], draws: int) -> str:
    from art.trainer_rank.measuring.routing import ROUTING_DRAWS

    lines = [
        "# The router's spread under expert parallel (CPU)",
        "",
        f"Written by `torchrun --nproc_per_node=2 scripts/routing_spread.py --draws {draws}`. "
        "Per model and row length, over random-token rows (one no-grad forward each), the "
        "router's shares of the even share (`measuring/routing.py`): working, the busiest "
        "EP rank's experts in one MoE layer; held, the busiest rank's averaged over the MoE "
        "layers; expert, the busiest expert in one layer over the even count per expert. "
        f"`bound` is what the probe prices at: the largest over its {ROUTING_DRAWS} rows "
        "(seeds 0 onwards; the memory model then takes the largest at a row's length or "
        "longer); `above` is the fraction of the other rows whose share is higher, which that "
        "bound puts under where the share sets the peak.",
        "",
    ]
    for name, rows in results.items():
        lines += [f"## {name}", "",
                  "| tokens | " + " | ".join(f"{s} bound | {s} mean | {s} sd | {s} max | "
                                             f"{s} above" for s in SHARES) + " |",
                  "|---|" + "---|" * 5 * len(SHARES)]
        for r in rows:
            cells = " | ".join(
                f"{r[f'{s}_bound']:.3f} | {r[f'{s}_mean']:.3f} | {r[f'{s}_sd']:.3f} | "
                f"{r[f'{s}_max']:.3f} | {r[f'{s}_above']:.0%}" for s in SHARES)
            lines.append(f"| {r['tokens']:,} | {cells} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--md", type=Path)
    args = parser.parse_args()
    from art.trainer_rank.measuring.routing import ROUTING_DRAWS

    if args.draws <= ROUTING_DRAWS:
        parser.error(f"--draws must exceed the probe's {ROUTING_DRAWS} rows, got {args.draws}")
    results = {name: spread(name, args.draws) for name in GEOMETRIES}
    if dist.get_rank() == 0:
        text = markdown(results, args.draws)
        print(text)
        if args.md:
            args.md.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
