"""torchrun worker of scripts/soak_ranks.py: random workloads through TrainerRank at DP=2 (TP=1)
with an OOM injected on rank 1 only, in a transformer layer's forward, the head, packing or the
caller's backward, at a random allocation. Every rank passes the same items; per workload the
ranks gather what they yielded and declined, and rank 0 checks that every item ran on exactly
one rank or was declined and listed, and that each output equals the unpacked reference.

argv: out_file, workloads, seed. Writes the counts as JSON (rank 0).
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "reliability"), str(ROOT / "tests"), str(ROOT)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _faults import Injector  # noqa: E402
from _fuzz import Leaf, ReferencePool, _check_leaf, _loss, _to_input, fuzz_provider  # noqa: E402

from art.megatron.distributed import initialize_distributed, shutdown_distributed  # noqa: E402
from art.megatron.train import build_runtime_for_provider  # noqa: E402
from art.trainer_rank import (  # noqa: E402
    TrainerRank,
    TrainerRankMemoryError,
    TrainerRankOptions,
)
from art.trainer_rank._impl import language_model  # noqa: E402

LIMIT_BYTES = 64 * 2**20
LOCATIONS = ("layer forward", "head", "packing", "caller backward")


def flatten(value):
    return [x for v in value for x in flatten(v)] if isinstance(value, list) else [value]


def workload(rng: random.Random, pool: ReferencePool) -> list:
    plan = []
    for _ in range(rng.randint(2, 6)):
        leaves = [Leaf(pool.sequence(), (True, rng.choice((0, 2)), False, rng.random() < 0.3))
                  for _ in range(rng.randint(1, 3))]
        plan.append(leaves if len(leaves) > 1 or rng.random() < 0.5 else leaves[0])
    return plan


def one(trainer: TrainerRank, inputs: list, injector: Injector, counts: Counter) -> dict:
    """The documented loop on this rank: an OOM in the caller's backward is caught and the
    loop iterates on (the trainer re-yields those items)."""
    seen: dict[int, object] = {}
    voided: set[int] = set()
    declined: tuple[int, ...] = ()
    with injector:
        try:
            for mb in trainer.forward_micro_batches(inputs):
                for index in mb.indices:
                    if index in seen and index not in voided:
                        counts["items yielded twice on one rank"] += 1
                    voided.discard(index)
                seen.update(zip(mb.indices, mb.outputs))
                loss = _loss([o for out in mb.outputs for o in flatten(out)])
                injector.in_caller_backward = True
                try:
                    if loss is not None:
                        loss.backward()
                except torch.OutOfMemoryError:
                    voided.update(mb.indices)
                finally:
                    injector.in_caller_backward = False
                del loss
        except TrainerRankMemoryError as exc:
            declined = exc.indices_not_run
        except torch.OutOfMemoryError:
            counts["escaped OOMs"] += 1
    for index in voided:
        seen.pop(index, None)
    return {"seen": seen, "declined": declined}


def main() -> None:
    out_file, workloads, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    warnings.filterwarnings("ignore")
    logging.getLogger("art.trainer_rank").setLevel(logging.CRITICAL)
    state = initialize_distributed()
    rank, world = state.rank, state.world_size
    provider = fuzz_provider()
    # Same seed on every rank: the same replica weights.
    runtime = build_runtime_for_provider(
        provider, build_optimizer=False, wrap_ddp=False, seed=0,
        trainer_options=TrainerRankOptions(test_memory_limit_bytes=LIMIT_BYTES,
                                           probe_layers=False))
    model = language_model(runtime.model[0])
    rng = random.Random(seed)  # same stream on every rank: the same workloads
    pool = ReferencePool(model, rng)
    pool.draw_length = lambda: rng.randint(4, 200)
    # Zero until something goes wrong: the figure names every failure kind it checked.
    counts: Counter = Counter({"escaped OOMs": 0, "items yielded twice on one rank": 0})
    started = time.perf_counter()
    for w in range(workloads):
        plan = workload(rng, pool)
        inputs = [_to_input(item, pool, False) for item in plan]
        location = LOCATIONS[w % len(LOCATIONS)]
        nth = rng.randint(1, 12)
        # A fresh trainer per workload: an injected OOM is recorded as a miss, which would
        # (rightly) shrink what every later workload is admitted.
        trainer = TrainerRank(runtime)
        injector = Injector(location, nth) if rank == 1 else Injector()
        for p in model.parameters():
            p.grad = None
        escaped_before = counts["escaped OOMs"]
        result = one(trainer, inputs, injector, counts)
        fired = injector.fired is not None
        gathered: list = [None] * world
        dist.all_gather_object(gathered, {
            "seen": sorted(result["seen"]), "declined": list(result["declined"]),
            "fired": fired, "escaped": counts["escaped OOMs"] - escaped_before})
        counts["workloads"] += 1
        counts["faults injected"] += sum(g["fired"] for g in gathered)
        if rank != 0:
            continue
        counts["escaped OOMs"] += sum(g["escaped"] for g in gathered[1:])
        ran = Counter(i for g in gathered for i in g["seen"])
        declined = {i for g in gathered for i in g["declined"]}
        counts["items"] += len(inputs)
        counts["items lost"] += sum(1 for i in range(len(inputs))
                                    if ran[i] == 0 and i not in declined)
        counts["items duplicated"] += sum(1 for i, n in ran.items() if n > 1)
        counts["items declined"] += len(declined)
        for index, out in result["seen"].items():  # rank 0's own outputs
            leaves = plan[index] if isinstance(plan[index], list) else [plan[index]]
            outs = out if isinstance(out, list) else [out]
            for k, (leaf, o) in enumerate(zip(leaves, outs)):
                counts["outputs checked"] += _check_leaf(leaf, o, pool, f"item {index}.{k}")
    if rank == 0:
        summary = dict(counts, ranks=world, layout="TP1 DP2", seed=seed, hangs=0,
                       seconds=round(time.perf_counter() - started, 1))
        Path(out_file).write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    shutdown_distributed()


if __name__ == "__main__":
    main()
