"""torchrun worker (2 ranks, TP=2 with sequence parallel, gloo): OOMs injected on rank 1 only,
one scenario per phase, each in a fresh job world (its own store and process groups, since a
fault in a phase with collectives closes them).

argv: out_dir, fault_timeout_s, then one free port per world (the fault-free run's, then one
per scenario). Writes rank<r>.json: per
scenario the items seen, the error (type, text), when the call ended, when the fault fired,
the profile (observations and misses) and the decisions.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from art.megatron import cpu_runtime
from art.megatron.implementation import Implementation
from art.megatron.provider import Provider
from art.megatron.settings import load_settings
from art.megatron.train import build_runtime_for_provider
from art.trainer_rank import (
    ForwardInput,
    TrainerRank,
    TrainerRankMemoryError,
    TrainerRankOptions,
)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reliability"))
from _faults import Injector  # noqa: E402

from _tiny import tiny_dense  # noqa: E402

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
LIMIT_BYTES = 48 * 2**20
# (scenario, injected location on rank 1, which of its allocations there fails: a fraction of
# what the fault-free run made there)
SCENARIOS = [
    ("forward layer", "layer forward", 0.25),
    ("heads", "head", 0.5),
    ("caller backward", "caller backward", 0.5),
]


def start_world(port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, WORLD, RANK == 0, timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=RANK, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=WORLD)
    model_parallel_cuda_manual_seed(1234)


def end_world() -> None:
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def inputs() -> list:
    g = torch.Generator().manual_seed(3)

    def x(n: int) -> ForwardInput:
        return ForwardInput(input_tokens=torch.randint(0, 256, (n,), generator=g),
                            target_tokens=torch.randint(0, 256, (n,), generator=g))

    return [x(40), [x(24), x(30)], x(52), x(18)]


def leaves(value) -> list:
    return [value] if not isinstance(value, list) else [y for v in value for y in leaves(v)]


def trainer(provider: Provider, fault_timeout_s: float) -> TrainerRank:
    return TrainerRank(build_runtime_for_provider(
        provider, build_optimizer=False, wrap_ddp=False, trainable_parameter_mode="base_model",
        trainer_options=TrainerRankOptions(test_memory_limit_bytes=LIMIT_BYTES,
                                           probe_layers=False, fault_timeout_s=fault_timeout_s)))


def run(trainer: TrainerRank, injector: Injector) -> dict:
    """The documented training loop: an OOM in the caller's backward is caught and the loop
    iterates on; anything else ends it."""
    seen: list[int] = []
    result: dict = {"error": None}
    with injector:
        try:
            for mb in trainer.forward_micro_batches(inputs()):
                loss = sum(-o.target_logprobs.sum() for out in mb.outputs for o in leaves(out))
                injector.in_caller_backward = True
                try:
                    loss.backward()
                    seen.extend(mb.indices)
                except torch.OutOfMemoryError:
                    pass
                finally:
                    injector.in_caller_backward = False
                del loss
        except Exception as exc:  # noqa: BLE001 - the test checks the type
            result["error"] = {"type": type(exc).__name__, "text": str(exc),
                               "memory_error": isinstance(exc, TrainerRankMemoryError)}
    result.update(
        ended_at=time.time(), fired=injector.fired, fired_at=injector.fired_at,
        counts=dict(injector.counts), seen=seen,
        decisions=[s.decision for s in trainer.stats_history],
        profiles={sig: {"observations": p.observations, "misses": p.misses}
                  for sig, p in sorted(trainer.profiles.profiles.items())},
    )
    return result


def main() -> None:
    out_dir, fault_timeout_s, ports = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    cpu_runtime.install()
    provider = Provider(
        tiny_dense(num_layers=2),
        settings=load_settings({"ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": str(WORLD),
                                "ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective"}),
        dtype="float32", implementation=Implementation.cpu_local(),
    )
    results: dict = {}
    start_world(int(ports[0]))
    clean = run(trainer(provider, fault_timeout_s), Injector())
    results["clean"] = clean
    assert clean["error"] is None and clean["counts"], clean["error"]
    for k, (name, location, fraction) in enumerate(SCENARIOS, start=1):
        # The fault-free run's allocation counts place the fault (on rank 1 only).
        nth = max(1, int(clean["counts"].get(location, 0) * fraction))
        injector = Injector(location, nth) if RANK == 1 else Injector()
        end_world()  # a fault closes the groups: every scenario gets a world of its own
        start_world(int(ports[k]))
        # A hang shows where each rank waits (the test's own timeout then fails it).
        faulthandler.dump_traceback_later(3 * fault_timeout_s)
        results[name] = run(trainer(provider, fault_timeout_s), injector)
        faulthandler.cancel_dump_traceback_later()
        print(f"rank {RANK} {name}: fired={results[name]['fired']} "
              f"error={(results[name]['error'] or {}).get('text', '')[:300]}", flush=True)
    end_world()
    with open(os.path.join(out_dir, f"rank{RANK}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
