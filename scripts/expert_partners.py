"""EP partners' rows: what a rank's experts take from the rows its expert-parallel partners run.

    torchrun --nproc_per_node=2 scripts/expert_partners.py [--md bench/expert_partners.md]

The calibration's hybrid MoE (8 experts, top-2, LoRA r8, fp32) at EP=2 with TP=1 on two gloo
ranks, where the expert-parallel group is the two data-parallel ranks and each runs a packed
row of its own. Per pair of rows (rank 0's, rank 1's), with and without grad, under two
recompute policies: each rank's measured dynamic peak (the calibration harness's micro-batch:
packing, decoder, head, caller loss, backward) against the default formulas' price beside the
partner's row (`MicroBatchShape.expert_partner_tokens`, as TrainerRank prices under paired
forwards) and beside a partner of its own size (what was priced before).

The router routes evenly, round-robin (`measuring/routing.py`: token t's experts are 2t and
2t + 1 modulo 8), which sends each rank's tokens half to each rank's experts exactly: the
figures measure what the partners' rows add, not how far this tiny random router strays from
the even share (the probe measures that apart: README, "Expert parallel").
tests/distributed/test_expert_partners.py runs the same measurement.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (rank 0's row, rank 1's row): a short row beside a long one, the reverse roles at other
# sizes, then equal rows.
ROWS = ((48, 720), (600, 96), (256, 256))
POLICIES = ("none", "selective default")


def measure() -> list[dict[str, Any]]:
    """This rank's records (every rank of the two calls it): {own, partner, grad, policy,
    measured, priced, priced_as_own} in bytes. Builds its own parallel state per policy."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from _calibration.harness import (
        POLICY_BY_NAME,
        Cell,
        calibration_geometries,
        calibration_provider,
        default_memory_model,
        micro_batch_shape,
        run_micro_batch,
    )
    from megatron.core import parallel_state

    from art.megatron.implementation import Implementation
    from art.trainer_rank._request import OutputRequest
    from art.trainer_rank.measuring.routing import even_routing

    geometry = calibration_geometries()["hybrid-moe-128"]
    impl = Implementation.cpu_local("flash")
    outputs = OutputRequest.parse("logprobs")
    records = []
    for policy in POLICIES:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        provider = calibration_provider(
            geometry, POLICY_BY_NAME[policy], lora_rank=8, tensor_parallel=1,
            context_parallel=1, expert_parallel=2, dtype="float32", implementation=impl)
        provider.initialize_distributed()
        rank = dist.get_rank()
        model = provider.build_model(seed=0)
        device = next(model.parameters()).device
        with even_routing(model):  # the round-robin router (module docstring)
            run_micro_batch(model, [16], outputs, True, provider.layout, impl, device)
            for rows in ROWS:
                own, partner = rows[rank], rows[1 - rank]
                memory = default_memory_model(Cell("hybrid-moe-128", policy, 8, 1, (own,),
                                                   "logprobs", True, expert_parallel=2))
                for grad in (True, False):
                    torch.manual_seed(11 + rank)
                    measured = max(run_micro_batch(model, [own], outputs, grad,
                                                   provider.layout, impl, device)[0]
                                   for _ in range(2))
                    shape = micro_batch_shape([own], outputs, grad, memory.layout,
                                              memory.implementation)
                    beside = replace(shape, expert_partner_tokens=partner)
                    records.append({
                        "own": own, "partner": partner, "grad": grad, "policy": policy,
                        "measured": measured,
                        "priced": int(memory.estimate(beside).dynamic_bytes),
                        "priced_as_own": int(memory.estimate(shape).dynamic_bytes)})
    return records


README_START = "<!-- expert_partners.py: start -->"
README_END = "<!-- expert_partners.py: end -->"


def table(records: list[dict[str, Any]]) -> list[str]:
    """One line per distinct record (equal rows measure alike on both ranks)."""
    mib = 2**20
    lines = ["| policy | this rank's row | partner's row | grad | measured MiB | ratio | "
             "ratio, partner as this row |", "|---|---|---|---|---|---|---|"]
    seen = set()
    for r in sorted(records, key=lambda r: (r["policy"], r["own"] - r["partner"], r["own"],
                                            not r["grad"])):
        line = (f"| {r['policy']} | {r['own']} | {r['partner']} | "
                f"{'yes' if r['grad'] else 'no'} | {r['measured'] / mib:.2f} | "
                f"{r['priced'] / r['measured']:.4f} | {r['priced_as_own'] / r['measured']:.4f} |")
        if line not in seen:
            seen.add(line)
            lines.append(line)
    return lines


def markdown(records: list[dict[str, Any]], seconds: float) -> str:
    lines = [
        "# EP partners' rows (CPU, real Megatron-Core, EP=2 across two data-parallel ranks)",
        "",
        f"Written by `torchrun --nproc_per_node=2 scripts/expert_partners.py --md "
        f"bench/expert_partners.md --readme` on {time.strftime('%Y-%m-%d')} "
        f"({seconds:.0f} s). The calibration's hybrid MoE (8 experts, top-2, LoRA r8, fp32), a "
        "round-robin router (each rank's tokens half to each rank's experts), output "
        "log-probs. Ratio: the default formulas' dynamic peak / the measured one; beside the "
        "partner's row (as TrainerRank prices under paired forwards) and beside a row of this "
        "rank's size (as it was priced before).",
        "",
        *table(records),
    ]
    return "\n".join(lines) + "\n"


def update_readme(records: list[dict[str, Any]], readme: Path = ROOT / "README.md") -> None:
    """Replace the README's block (between its two markers) with this run's table, the
    policy without recompute (the other measures alike)."""
    text = readme.read_text()
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    body = "\n".join(table([r for r in records if r["policy"] == POLICIES[0]]))
    readme.write_text(f"{head}{README_START}\n{body}\n{README_END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--md", type=Path, default=None, help="write the table here")
    parser.add_argument("--readme", action="store_true",
                        help="rewrite README's block with this run's table")
    args = parser.parse_args()
    started = time.perf_counter()
    mine = measure()
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        text = markdown([r for part in every for r in part], time.perf_counter() - started)
        print(text)
        if args.md is not None:
            args.md.write_text(text)
        if args.readme:
            update_readme([r for part in every for r in part])
    from art.megatron.distributed import shutdown_distributed

    shutdown_distributed()


if __name__ == "__main__":
    main()
