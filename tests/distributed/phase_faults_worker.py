"""torchrun worker (2 ranks, TP=2 with sequence parallel, gloo): faults injected on rank 1 only,
one scenario per phase and kind (an OOM, or another exception: a bug, the caller's own), each
in a fresh job world (its own store and process groups, since a fault in a phase with
collectives closes them). Then, in the same launch, what ART_TEST_PHASE_FAULTS_THEN names
(comma-separated), each in worlds of its own: "cp2", the packing and forward-layer scenarios
again at TP=1 x CP=2; "boundary" and "waves", the faults published by hand of
_published_fault.py; "ep-probe", an OOM in the probe a MoE model's TrainerRank runs when it is
built at EP=2.

argv: out_dir, fault_timeout_s (every world's store, and the fuzz's control store, listens on a
port rank 0 is given by the OS: `launch_store`). Writes rank<r>.json: per
scenario the items seen, the error (type, text), when the call ended, when the fault fired,
the profile (observations and misses) and the decisions; under "cp2" the CP=2 scenarios' and
under "boundary" and "waves" those scenarios' records.
"""

from __future__ import annotations

import contextlib
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
    AdamParams,
    ForwardInput,
    TrainerRank,
    TrainerRankMemoryError,
    TrainerRankOptions,
)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reliability"))
from _faults import Injector  # noqa: E402
from _published_fault import GROUP_TIMEOUT_S, TENSOR_PARALLEL  # noqa: E402
from _published_fault import SCENARIOS as BY_HAND  # noqa: E402

from _tiny import tiny_dense, tiny_moe  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from soak_ranks_worker import soak_tp  # noqa: E402

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
# TP=WORLD by default; with 4 ranks and TP=2 the job is two replicas (DP=2). ONLY: run those
# scenarios (comma-separated; no fuzz).
# CP: context parallel ranks (TP=1 then; the segmented flash attention splits every row).
CP = int(os.environ.get("ART_TEST_PHASE_FAULTS_CP", 1))
TP = int(os.environ.get("ART_TEST_PHASE_FAULTS_TP", WORLD // CP))
ONLY = (set(os.environ["ART_TEST_PHASE_FAULTS_ONLY"].split(","))
        if os.environ.get("ART_TEST_PHASE_FAULTS_ONLY") else None)
THEN = [s for s in os.environ.get("ART_TEST_PHASE_FAULTS_THEN", "").split(",") if s]
# The scenarios the "cp2" stage runs.
CP2_ONLY = {"packing", "forward layer"}
LIMIT_BYTES = 48 * 2**20
# (scenario, what rank 1 raises (None: an OOM), where, which of its allocations there fails: a
# fraction of what the fault-free run made there). "packing" fails the first packing
# allocation: micro-batch 0's, before any of its collectives (recovered by the vote);
# "optimizer step": in Megatron's gradient norm, before its model-parallel all-reduce;
# "caller loop": the caller's loop body raises after it received micro-batch 0.
SCENARIOS = [
    ("packing", None, "packing", 1e-9),
    ("forward layer", None, "layer forward", 0.25),
    ("heads", None, "head", 0.5),
    ("caller backward", None, "caller backward", 0.5),
    ("optimizer step", None, "optimizer step", 0.0),
    ("error in forward layer", ValueError, "layer forward", 0.25),
    ("error in optimizer step", ValueError, "optimizer step", 0.0),
    ("error in caller loop", ValueError, "caller loop", 0.0),
    ("break on every rank", None, "break", 0.0),
    # The layers probed on first use while the call plans (probe on, no cache): rank 1's
    # third probe point fails, with its peer inside the probe's TP collectives.
    ("probe", None, "probe", 0.0),
    ("error in probe", ValueError, "probe", 0.0),
]
# How long a rank that left the loop waits for its peers to leave too (the fault timeout).
CALLER_LOOP_TIMEOUT_S = 3.0
# The bounded TP=2 workload fuzz after the scenarios: the rank soak's trial, a few small
# workloads, faults on rank 1 alternating between packing (recovered) and fatal places.
FUZZ_WORKLOADS = 4


class StepFault:
    """Rank 1's failure inside Megatron's optimizer step: its gradient-norm computation raises
    before the all-reduce the other rank is then blocked in."""

    def __init__(self, raises: type[Exception] | None, active: bool) -> None:
        self.raises = raises
        self.active = active  # the other rank steps for real
        self.fired: str | None = None
        self.fired_at: float | None = None

    def __enter__(self) -> StepFault:
        import megatron.core.optimizer.optimizer as optimizer_module

        if not self.active:
            return self

        self._module = optimizer_module
        self._original = optimizer_module.get_grad_norm_fp32
        fault = self

        def grad_norm(*args, **kwargs):
            fault.fired, fault.fired_at = "optimizer step", time.time()
            if fault.raises is not None:
                raise fault.raises("injected in the gradient norm")
            raise torch.OutOfMemoryError("injected: out of memory in the gradient norm")

        optimizer_module.get_grad_norm_fp32 = grad_norm
        return self

    def __exit__(self, *exc) -> None:
        if self.active:
            self._module.get_grad_norm_fp32 = self._original


class ProbeFault:
    """Rank 1's failure in a probe on first use: its third layer run raises (an OOM, or
    `raises`) before the collectives its peer's run of that point then waits in."""

    NTH = 3

    def __init__(self, raises: type[Exception] | None, active: bool) -> None:
        self.raises = raises
        self.active = active
        self.runs = 0
        self.fired: str | None = None
        self.fired_at: float | None = None

    def __enter__(self) -> ProbeFault:
        from art.trainer_rank.measuring import probe_runs

        self._module, self._original = probe_runs, probe_runs._metered_run
        fault = self

        def metered_run(*args, **kwargs):
            fault.runs += 1
            if fault.active and fault.runs == self.NTH:
                fault.fired, fault.fired_at = "probe", time.time()
                if fault.raises is not None:
                    raise fault.raises("injected in a probe point")
                raise torch.OutOfMemoryError("injected: out of memory in a probe point")
            return fault._original(*args, **kwargs)

        probe_runs._metered_run = metered_run
        return self

    def __exit__(self, *exc) -> None:
        self._module._metered_run = self._original


def start_world(out_dir: str, name: str, tp: int = TP, cp: int = CP,
                timeout_s: float = 60, ep: int = 1) -> dist.Store:
    """A fresh job world at TP=tp x CP=cp (the rest data parallel; experts over `ep` ranks),
    its store returned."""
    store = launch_store(out_dir, name)
    dist.init_process_group("gloo", store=store, rank=RANK, world_size=WORLD,
                            timeout=timedelta(seconds=timeout_s))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             context_parallel_size=cp,
                                             expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(1234)
    return store


def launch_store(out_dir: str, name: str) -> dist.TCPStore:
    """A store every rank of the launch shares. Rank 0's listens on a port the OS gives it at
    once, and the others read that port from a file: a port chosen ahead of time can be
    taken meanwhile (by an earlier world's gloo connections, or torchrun's own store)."""
    port_file = os.path.join(out_dir, f"world-{name}.port")
    if RANK == 0:
        # Not waiting for the others here: they learn the port from the file below.
        store = dist.TCPStore("127.0.0.1", 0, WORLD, True, timedelta(seconds=60),
                              wait_for_workers=False)
        with open(port_file + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(port_file + ".tmp", port_file)
    else:
        deadline = time.time() + 60
        while not os.path.exists(port_file):
            if time.time() > deadline:
                raise TimeoutError(f"rank 0 wrote no {port_file} within 60 s")
            time.sleep(0.01)
        with open(port_file) as f:
            port = int(f.read())
        store = dist.TCPStore("127.0.0.1", port, WORLD, False, timedelta(seconds=60))
    return store


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


def provider(tp: int, cp: int) -> Provider:
    return Provider(
        tiny_dense(num_layers=2),
        settings=load_settings({"ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": str(tp),
                                "ART_MEGATRON_CONTEXT_PARALLEL_SIZE": str(cp),
                                "ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective"}),
        dtype="float32", implementation=Implementation.cpu_local("flash" if cp > 1 else "unfused"),
    )


def trainer(fault_timeout_s: float, tp: int, cp: int, *, step: bool = False,
            probe: bool = False) -> TrainerRank:
    """A trainer on a fresh provider at TP=tp x CP=cp; `step`: LoRA adapters with Megatron's
    DDP and optimizer (what optim_step steps), else the base model, forwards only; `probe`:
    the layer probe on (measured on first use, never read from a cache), else off."""
    return TrainerRank(build_runtime_for_provider(
        provider(tp, cp), build_optimizer=step, wrap_ddp=step,
        trainable_parameter_mode="lora" if step else "base_model",
        trainer_options=TrainerRankOptions(test_memory_limit_bytes=LIMIT_BYTES,
                                           probe_layers=probe, probe_cache=False,
                                           fault_timeout_s=fault_timeout_s)))


def run(trainer: TrainerRank, injector: Injector, *, step: StepFault | None = None,
        probe: ProbeFault | None = None, leave_loop: type[Exception] | None = None) -> dict:
    """The documented training loop: an OOM in the caller's backward is caught and the loop
    iterates on; anything else ends it. `step`: an optimizer step follows, with that fault;
    `probe`: the call's probes on first use run with that fault; `leave_loop`: the loop body
    raises it at the first micro-batch."""
    seen: list[int] = []
    result: dict = {"error": None}
    with injector, probe or contextlib.nullcontext():
        try:
            for mb in trainer.forward_micro_batches(inputs()):
                loss = sum(-o.target_logprobs.sum() for out in mb.outputs for o in leaves(out))
                if leave_loop is not None:
                    injector.fired, injector.fired_at = "caller loop", time.time()
                    raise leave_loop("injected in the caller's loop body")
                injector.in_caller_backward = True
                try:
                    loss.backward()
                    seen.extend(mb.indices)
                except torch.OutOfMemoryError:
                    pass
                finally:
                    injector.in_caller_backward = False
                del loss
            if step is not None:
                with step:
                    trainer.optim_step(params=AdamParams(learning_rate=1e-3, grad_clip_norm=1.0))
        except Exception as exc:  # noqa: BLE001 - the test checks the type
            result["error"] = {"type": type(exc).__name__, "text": str(exc),
                               "memory_error": isinstance(exc, TrainerRankMemoryError),
                               "failing_rank": getattr(exc, "failing_rank", None),
                               "error_type": getattr(exc, "error_type", None)}
    for fault in (step, probe):
        if fault is not None and fault.fired is not None:
            injector.fired, injector.fired_at = fault.fired, fault.fired_at
    result.update(
        ended_at=time.time(), fired=injector.fired, fired_at=injector.fired_at,
        counts=dict(injector.counts), seen=seen,
        decisions=[s.decision for s in trainer.stats_history],
        retries=[s.retries for s in trainer.stats_history],
        profiles={sig: {"observations": p.observations, "misses": p.misses}
                  for sig, p in sorted(trainer.profiles.profiles.items())},
    )
    return result


def run_break(trainer: TrainerRank) -> dict:
    """Both ranks break out of the loop at micro-batch 0 (no fault), then call again."""
    started = time.time()
    for _ in trainer.forward_micro_batches(inputs()):
        break
    left_s = time.time() - started
    result = run(trainer, Injector())
    result["left_s"] = left_s
    return result


def run_scenarios(out_dir: str, fault_timeout_s: float, tp: int, cp: int,
                  only: set[str] | None, prefix: str) -> dict:
    """The fault-free call, then every scenario (those in `only`), each in a world of its own
    at TP=tp x CP=cp; their records by name."""
    results: dict = {}
    start_world(out_dir, f"{prefix}clean", tp, cp)
    clean = run(trainer(fault_timeout_s, tp, cp), Injector())
    results["clean"] = clean
    assert clean["error"] is None and clean["counts"], clean["error"]
    scenarios = [s for s in SCENARIOS if only is None or s[0] in only]
    for k, (name, raises, location, fraction) in enumerate(scenarios, start=1):
        # The fault-free run's allocation counts place the fault (on rank 1 only).
        nth = max(1, int(clean["counts"].get(location, 0) * fraction))
        mine = RANK == 1
        injector = Injector(location, nth, raises) if mine and fraction else Injector()
        step = StepFault(raises, mine) if location == "optimizer step" else None
        probe = ProbeFault(raises, mine) if location == "probe" else None
        end_world()  # a fault closes the groups: every scenario gets a world of its own
        start_world(out_dir, f"{prefix}scenario-{k}", tp, cp)
        # A hang shows where each rank waits (the test's own timeout then fails it).
        faulthandler.dump_traceback_later(3 * fault_timeout_s)
        timeout_s = (CALLER_LOOP_TIMEOUT_S if location in ("caller loop", "break")
                     else fault_timeout_s)
        if location == "break":
            results[name] = run_break(trainer(timeout_s, tp, cp))
        else:
            results[name] = run(
                trainer(timeout_s, tp, cp, step=location == "optimizer step",
                        probe=location == "probe"),
                injector, step=step, probe=probe,
                leave_loop=raises if mine and location == "caller loop" else None)
        faulthandler.cancel_dump_traceback_later()
        print(f"rank {RANK} {prefix}{name}: fired={results[name]['fired']} "
              f"error={(results[name]['error'] or {}).get('text', '')[:300]}", flush=True)
    end_world()
    return results


def start_up_probe_fault(out_dir: str, fault_timeout_s: float) -> dict:
    """A MoE model at TP=1 x EP=2 (experts across the two data-parallel ranks), whose
    TrainerRank probes every layer mode when it is built: rank 1's third probe point runs
    out of memory while its peer waits in the probe's all-to-alls. The record: the error
    each rank's constructor raised, when it ended and when the fault fired."""
    start_world(out_dir, "ep-probe", 1, 1, ep=WORLD)
    fault = ProbeFault(None, RANK == 1)
    faulthandler.dump_traceback_later(3 * fault_timeout_s)
    result: dict = {"error": None}
    with fault:
        try:
            TrainerRank(build_runtime_for_provider(
                Provider(tiny_moe(num_layers=2), settings=load_settings({
                    "ART_MEGATRON_EXPERT_MODEL_PARALLEL_SIZE": str(WORLD),
                    "ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective"}),
                    dtype="float32", implementation=Implementation.cpu_local()),
                build_optimizer=False, wrap_ddp=False, trainable_parameter_mode="base_model",
                trainer_options=TrainerRankOptions(
                    test_memory_limit_bytes=LIMIT_BYTES, probe_cache=False,
                    fault_timeout_s=fault_timeout_s)))
        except Exception as exc:  # noqa: BLE001 - the test checks the type
            result["error"] = {"type": type(exc).__name__, "text": str(exc),
                               "memory_error": isinstance(exc, TrainerRankMemoryError)}
    faulthandler.cancel_dump_traceback_later()
    result.update(ended_at=time.time(), fired=fault.fired, fired_at=fault.fired_at)
    end_world()
    return result


def published_fault(out_dir: str, name: str) -> dict:
    """One scenario of _published_fault.py in a world of its own."""
    store = start_world(out_dir, name, TENSOR_PARALLEL[name], 1, timeout_s=GROUP_TIMEOUT_S)
    faulthandler.dump_traceback_later(3 * GROUP_TIMEOUT_S)
    result = BY_HAND[name](store)
    faulthandler.cancel_dump_traceback_later()
    end_world()
    return result


def main() -> None:
    out_dir, fault_timeout_s = sys.argv[1], float(sys.argv[2])
    cpu_runtime.install()
    results = run_scenarios(out_dir, fault_timeout_s, TP, CP, ONLY, "")
    if ONLY is None:
        counts, _ = soak_tp(FUZZ_WORKLOADS, seed=1, control=launch_store(out_dir, "fuzz"),
                            max_items=4, max_tokens=120)
        results["fuzz"] = dict(counts)
    for stage in THEN:
        if stage == "cp2":
            results[stage] = run_scenarios(out_dir, fault_timeout_s, 1, 2, CP2_ONLY, "cp2-")
        elif stage == "ep-probe":
            results[stage] = start_up_probe_fault(out_dir, fault_timeout_s)
        else:
            results[stage] = published_fault(out_dir, stage)
    with open(os.path.join(out_dir, f"rank{RANK}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
