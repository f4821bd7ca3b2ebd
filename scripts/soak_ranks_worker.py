"""torchrun worker of scripts/soak_ranks.py: random workloads through TrainerRank with an OOM
injected on the last rank only, in packing, a transformer layer's forward, the head or the
caller's backward, at a random allocation (scripts/_rank_faults.py).

DP=2 (TP=1): every rank passes the same items; per workload the ranks gather what they yielded
and declined, and rank 0 checks that every item ran on exactly one rank or was declined and
listed, and that each output equals the unpacked reference.
TP=2 (one replica of both ranks, sequence parallel): `tp_fault_trial` per workload: the
fault-free run's outputs are the reference; a fault in packing is agreed and recovered, any
other ends the call on both ranks with the same error (then a fresh world).

argv: out_file, workloads, seed, layout ("dp2" or "tp2"), control_port. Writes the counts as
JSON (rank 0).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
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

sys.path.insert(0, str(ROOT / "scripts"))
from _fuzz import (  # noqa: E402
    ATOL,
    Leaf,
    ReferencePool,
    _check_leaf,
    _loss,
    _to_input,
    fuzz_geometry,
    fuzz_provider,
)
from _rank_faults import (  # noqa: E402
    Injector,
    Worlds,
    caller_loop,
    fault_trial,
    flatten,
    tp_fault_trial,
)

from art.megatron import cpu_runtime  # noqa: E402
from art.megatron.distributed import initialize_distributed, shutdown_distributed  # noqa: E402
from art.megatron.implementation import Implementation  # noqa: E402
from art.megatron.provider import Provider  # noqa: E402
from art.megatron.settings import load_settings  # noqa: E402
from art.megatron.train import build_runtime_for_provider  # noqa: E402
from art.trainer_rank import TrainerRank, TrainerRankOptions  # noqa: E402
from art.trainer_rank.compute.forward import language_model  # noqa: E402

LIMIT_BYTES = 64 * 2**20
LOCATIONS = ("layer forward", "head", "packing", "caller backward")
# At TP=2 a micro-batch's first packing is recoverable (before any collective), the others end
# the call on both ranks and need a fresh world: half of each.
TP_LOCATIONS = ("packing", "layer forward", "packing", "head", "packing", "caller backward")


def workload(rng: random.Random, pool: ReferencePool) -> list:
    plan = []
    for _ in range(rng.randint(2, 6)):
        leaves = [Leaf(pool.sequence(), (True, rng.choice((0, 2)), False, rng.random() < 0.3))
                  for _ in range(rng.randint(1, 3))]
        plan.append(leaves if len(leaves) > 1 or rng.random() < 0.5 else leaves[0])
    return plan


def main() -> None:
    out_file, workloads, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    layout, control_port = sys.argv[4], int(sys.argv[5])
    warnings.filterwarnings("ignore")
    # Silent unless the launch keeps its log (soak_ranks.py --log): then the protocol's
    # warnings (faults published, groups closed) say what each rank did before a failure.
    logging.getLogger("art.trainer_rank").setLevel(
        logging.WARNING if os.environ.get("ART_SOAK_VERBOSE") else logging.CRITICAL)
    if layout in ("tp2", "tp2dp2"):
        if layout == "tp2":
            counts, seconds = soak_tp(workloads, seed, control_port)
            name = "TP2 (sequence parallel)"
        else:
            counts, seconds = soak_tp_dp(workloads, seed, control_port)
            name = "TP2 DP2 (sequence parallel), faults on two ranks at once"
        if int(os.environ["RANK"]) == 0:
            summary = dict(counts, ranks=int(os.environ["WORLD_SIZE"]), seed=seed, hangs=0,
                           layout=name, seconds=seconds)
            Path(out_file).write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
        return
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
        with injector:
            result = caller_loop(trainer, inputs, injector, loss_of=_loss)
        counts["items yielded twice on one rank"] += len(result.yielded_twice)
        fired = injector.fired is not None
        gathered: list = [None] * world
        dist.all_gather_object(gathered, {
            "seen": sorted(result.seen), "declined": list(result.declined),
            "fired": fired, "escaped": result.escaped_ooms})
        counts["workloads"] += 1
        counts["faults injected"] += sum(g["fired"] for g in gathered)
        if rank != 0:
            continue
        counts["escaped OOMs"] += sum(g["escaped"] for g in gathered)
        ran = Counter(i for g in gathered for i in g["seen"])
        declined = {i for g in gathered for i in g["declined"]}
        counts["items"] += len(inputs)
        counts["items lost"] += sum(1 for i in range(len(inputs))
                                    if ran[i] == 0 and i not in declined)
        counts["items duplicated"] += sum(1 for i, n in ran.items() if n > 1)
        counts["items declined"] += len(declined)
        for index, out in result.seen.items():  # rank 0's own outputs
            leaves = plan[index] if isinstance(plan[index], list) else [plan[index]]
            outs = out if isinstance(out, list) else [out]
            for k, (leaf, o) in enumerate(zip(leaves, outs)):
                counts["outputs checked"] += _check_leaf(leaf, o, pool, f"item {index}.{k}")
    if rank == 0:
        summary = dict(counts, ranks=world, layout="TP1 DP2", seed=seed, hangs=0,
                       seconds=round(time.perf_counter() - started, 1))
        Path(out_file).write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    shutdown_distributed()


def tp_provider() -> Provider:
    """fuzz_provider's model and LoRA at TP=2 with sequence parallel."""
    lora = fuzz_provider().lora_config
    return Provider(
        fuzz_geometry(),
        settings=load_settings({"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective",
                                "ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "2"}),
        lora=lora, dtype="float32", implementation=Implementation.cpu_local(),
    )


def same_outputs(index: int, got: object, want: object) -> int:
    """One item's outputs equal the fault-free run's (another packing may differ by ATOL)."""
    checked = 0
    for k, (g, w) in enumerate(zip(flatten(got), flatten(want), strict=True)):
        for name in ("target_logprobs", "logits", "hidden_states"):
            a, b = getattr(g, name), getattr(w, name)
            assert (a is None) == (b is None), f"item {index}.{k}: {name} present on one run"
            if a is not None:
                torch.testing.assert_close(a.detach(), b.detach(), atol=ATOL, rtol=0,
                                           msg=f"item {index}.{k}: {name}")
                checked += 1
        if g.top_k is not None:
            torch.testing.assert_close(g.top_k.logprobs.detach(), w.top_k.logprobs.detach(),
                                       atol=ATOL, rtol=0, msg=f"item {index}.{k}: top_k")
            checked += 1
    return checked


def tp_workload(rng: random.Random, pool: ReferencePool, max_items: int = 6) -> list:
    plan = []
    for _ in range(rng.randint(2, max_items)):
        leaves = [Leaf(pool.sequence(), (True, rng.choice((0, 2)), rng.random() < 0.2,
                                         rng.random() < 0.3))
                  for _ in range(rng.randint(1, 3))]
        plan.append(leaves if len(leaves) > 1 or rng.random() < 0.5 else leaves[0])
    return plan


def _make_tp_trainer() -> TrainerRank:
    return TrainerRank(build_runtime_for_provider(
        tp_provider(), build_optimizer=False, wrap_ddp=False, seed=0,
        trainer_options=TrainerRankOptions(test_memory_limit_bytes=LIMIT_BYTES,
                                           probe_layers=False)))


# TP=2 x DP=2 (replicas {0, 1} and {2, 3}): the two ranks that fail together, in turn: one
# in each replica, both of one replica, and every other pair; and where each one fails:
# both before any collective (each replica recovers), one there and one inside, or both
# inside. Five location pairs against six rank pairs: every combination within 30 workloads.
FAULT_PAIRS: tuple[tuple[int, int], ...] = ((1, 3), (0, 1), (1, 2), (2, 3), (0, 3), (0, 2))
LOCATION_PAIRS: tuple[tuple[str, str], ...] = (
    ("packing", "packing"), ("packing", "layer forward"), ("layer forward", "head"),
    ("head", "packing"), ("caller backward", "caller backward"))


def _fault_soak(rank: int, world: int, control: int | dist.Store, tensor_parallel: int,
                seed: int, max_tokens: int
                ) -> tuple[Worlds, random.Random, ReferencePool, Counter]:
    """What a fault soak starts from: the ranks' worlds, one random stream every rank draws
    the same workloads and faults from, a pool of sequences (the fault-free run is the
    reference) and the zeroed counts."""
    cpu_runtime.install()  # Megatron's CUDA-only calls, on CPU
    worlds = Worlds(rank, world, control, tensor_parallel=tensor_parallel)
    worlds.start()
    rng = random.Random(seed)
    pool = ReferencePool(None, rng)
    pool.draw_length = lambda: rng.randint(4, max_tokens)
    counts: Counter = Counter({"escaped OOMs": 0, "items yielded twice on one rank": 0,
                               "items lost": 0, "items duplicated": 0,
                               "workloads where ranks disagree": 0,
                               "fatal errors not naming the failing rank": 0})
    return worlds, rng, pool, counts


def soak_tp_dp(workloads: int, seed: int, control_port: int, *, max_items: int = 6,
               max_tokens: int = 200) -> tuple[Counter, float]:
    """`workloads` TP=2 x DP=2 trials (fault_trial on 4 ranks), each with OOMs injected on
    two ranks at once (FAULT_PAIRS in turn), at LOCATION_PAIRS in turn (packing: the first
    allocation, elsewhere a random one); returns the counts and the seconds taken."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != 4:
        raise SystemExit(f"the tp2dp2 soak runs on 4 ranks, not {world}")
    worlds, rng, pool, counts = _fault_soak(rank, world, control_port, 2, seed, max_tokens)
    started = time.perf_counter()
    for w in range(workloads):
        plan = tp_workload(rng, pool, max_items)
        inputs = [_to_input(item, pool, False) for item in plan]
        faults = {}
        pair = zip(FAULT_PAIRS[w % len(FAULT_PAIRS)], LOCATION_PAIRS[w % len(LOCATION_PAIRS)])
        for failing, location in pair:
            nth = 1 if location == "packing" else rng.randint(1, 12)
            faults[failing] = (location, nth)
        # A rank still in one workload after 45 s (the process groups time out at 60 s)
        # prints where every thread of it waits.
        faulthandler.dump_traceback_later(45)
        fault_trial(worlds=worlds, make_trainer=_make_tp_trainer, inputs=inputs,
                    faults=faults, loss_of=_loss, compare=same_outputs, counts=counts)
        faulthandler.cancel_dump_traceback_later()
    worlds.end()
    return counts, round(time.perf_counter() - started, 1)


def soak_tp(workloads: int, seed: int, control: int | dist.Store, *, max_items: int = 6,
            max_tokens: int = 200) -> tuple[Counter, float]:
    """`workloads` TP=2 trials (tp_fault_trial), faults on rank 1 cycling through LOCATIONS;
    returns the counts and the seconds taken. `control`: the control store, or its port.
    Also run by the test suite's phase-fault launch (a few workloads)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    worlds, rng, pool, counts = _fault_soak(rank, world, control, world, seed, max_tokens)
    make_trainer = _make_tp_trainer
    started = time.perf_counter()
    for w in range(workloads):
        plan = tp_workload(rng, pool, max_items)
        inputs = [_to_input(item, pool, False) for item in plan]
        # packing's first allocation of a micro-batch comes before its collectives.
        location = TP_LOCATIONS[w % len(TP_LOCATIONS)]
        nth = 1 if location == "packing" else rng.randint(1, 12)
        tp_fault_trial(worlds=worlds, make_trainer=make_trainer, inputs=inputs,
                       location=location, nth=nth, loss_of=_loss, compare=same_outputs,
                       counts=counts)
    worlds.end()
    return counts, round(time.perf_counter() - started, 1)


if __name__ == "__main__":
    main()
