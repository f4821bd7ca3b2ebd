"""One allocator setting's process: builds each model of the plan through the calibration
harness (provider -> GPTModel + LoRA -> the layer probe TrainerRank runs), measures each cell
on the trainer's compute path (pack -> decoder -> chunked head -> caller loss -> backward,
inside the memory meter), and reads the caching allocator around it.

The parent starts one worker per `PYTORCH_CUDA_ALLOC_CONF` setting (the allocator reads it
once, at its first CUDA allocation). The allocator calls here take the device: on CPU (the
dry run) there is no caching allocator and they read zeros, so the same functions run.
"""

from __future__ import annotations

import gc
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _calibration.cells import POLICY_BY_NAME, Cell
from _calibration.harness import CalibrationModel

from _gpu_check.budget import Budget, StepRow, run_steps
from _gpu_check.plan import LORA_RANK, Plan, Step
from art.megatron.implementation import Implementation


@dataclass(frozen=True)
class AllocatorReading:
    """The caching allocator's allocated and reserved bytes, now and at their peaks since the
    last peak reset (all zero on CPU)."""

    allocated: int = 0
    reserved: int = 0
    allocated_peak: int = 0
    reserved_peak: int = 0


def allocator_reading(device: torch.device) -> AllocatorReading:
    if device.type != "cuda":
        return AllocatorReading()
    torch.cuda.synchronize(device)
    stats = torch.cuda.memory_stats(device)
    return AllocatorReading(int(stats.get("allocated_bytes.all.current", 0)),
                            int(stats.get("reserved_bytes.all.current", 0)),
                            int(stats.get("allocated_bytes.all.peak", 0)),
                            int(stats.get("reserved_bytes.all.peak", 0)))


def release_cached(device: torch.device) -> None:
    """Free what Python no longer references and, on CUDA, the allocator's unused segments, so
    the next cell's reserved bytes start from what is live."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def worker_implementation(device: str) -> Implementation:
    """The build without Transformer Engine: on CUDA the local spec over torch's CUDA kernels
    (`Implementation.detected_cuda_local`, as `detect` builds it without TE), on CPU its
    counterpart."""
    if device == "cuda":
        return Implementation.detected_cuda_local()
    return Implementation.cpu_local("flash")


def warm_up(model: CalibrationModel, tokens: int) -> None:
    """Unmeasured micro-batches through the cells' own path, once the model is built and
    before its probe: one sequence and two (fla's varlen kernels), a group sharing a prompt
    (the delta rule from initial states, the segmented attention's tree), with and without
    grad, two sizes each. fla autotunes its Triton kernels at their first call (benchmark
    buffers on the device) and torch.compile builds Megatron's jit_fuser functions at their
    first calls outside the meter's observer (a second shape recompiles them with dynamic
    sizes): both happen here, not inside a measurement."""
    from _calibration.harness import cell_sequences, run_micro_batch

    from art.trainer_rank._request import OutputRequest

    g = model.geometry
    group = Cell(g.name, "warm-up", LORA_RANK, 1, (tokens, tokens), "hidden_states", True,
                 shared_prefix=tokens // 2)
    runs: list[tuple[tuple[int, ...], str, bool, Any]] = [
        ((tokens,), "logprobs", True, None),
        ((tokens + tokens // 2, tokens), "logprobs", True, None),
        (group.lengths, group.outputs, True, cell_sequences(group, g.vocab_size, model.device)),
        ((tokens,), "logprobs", False, None),
        ((tokens + tokens // 2, tokens), "logprobs", False, None),
    ]
    for lengths, outputs, grad, sequences in runs:
        run_micro_batch(model.model, lengths, OutputRequest.parse(outputs), grad, model.layout,
                        model.implementation, model.device, sequences=sequences,
                        observe_allocations=False)


# Warm-up tokens per sequence: enough for whole kernel chunks on a GPU, few on CPU.
WARM_UP_TOKENS = {"cuda": 256, "cpu": 64}


class Worker:
    """The build / measure / release callbacks `run_steps` drives, for one plan."""

    def __init__(self, plan: Plan, probe_dir: Path) -> None:
        self.plan = plan
        self.probe_dir = probe_dir
        self.device = torch.device("cuda" if plan.device == "cuda" else "cpu")
        self.implementation = worker_implementation(plan.device)

    def build(self, step: Step) -> CalibrationModel:
        # Every allocator's cells of this model ask the probe for the same modes and tails,
        # so the second process finds the first one's probe under the same key.
        cells = [s.cell.cell for s in self.plan.cells()
                 if s.cell is not None and s.geometry == step.geometry
                 and s.policy == step.policy]
        release_cached(self.device)
        return CalibrationModel(
            self.plan.geometry(step.geometry).build(), POLICY_BY_NAME[step.policy],
            lora_rank=LORA_RANK, tensor_parallel=1, dtype=self.plan.dtype,
            implementation=self.implementation, cells=cells,
            probe_tokens=self.plan.probe_tokens, probe_dir=str(self.probe_dir),
            warm_up=lambda built: warm_up(built, WARM_UP_TOKENS[self.device.type]))

    def measure(self, model: CalibrationModel, step: Step) -> dict[str, Any]:
        assert step.cell is not None
        release_cached(self.device)
        before = allocator_reading(self.device)
        # As TrainerRank measures on a GPU: the allocator's statistics, no dispatch observer
        # (under it torch.compile'd kernels would run eagerly and keep more).
        result = model.measure(step.cell.cell, observe_allocations=False)
        # The meter reset the peaks when it started: these are the micro-batch's.
        after = allocator_reading(self.device)
        row = result.row()
        return {
            "trainer_rank_predicted_bytes": row["predicted_bytes"],
            "estimate_defaults_bytes": row["predicted_default_bytes"],
            "measured_bytes": row["measured_bytes"],
            "measured_forward_bytes": row["measured_forward_bytes"],
            "ratio": row["ratio"], "defaults_ratio": row["default_ratio"],
            "reserve_priced_bytes": row["reserve_bytes"],
            "reserved_minus_allocated_bytes": after.reserved_peak - after.allocated_peak,
            # What the micro-batch reserved beyond what it allocated, net of the slack the
            # segments held before it (the figure the priced reserve stands for).
            "reserve_seen_bytes": (after.reserved_peak - before.reserved)
            - (after.allocated_peak - before.allocated),
            "allocated_before_bytes": before.allocated, "reserved_before_bytes": before.reserved,
            "allocated_peak_bytes": after.allocated_peak,
            "reserved_peak_bytes": after.reserved_peak,
            "micro_batch_seconds": row["seconds"], "peak_at": row["peak_at"],
            "probe_key": row["probe_key"], "implementation": self.implementation.key,
        }

    def release(self) -> None:
        release_cached(self.device)


def run(plan: Plan, allocator: str, *, deadline: float, launched_at: float, rows: Path,
        probe_dir: Path) -> int:
    """The worker process's body: every step of `allocator`, one JSON row per line."""
    from art.megatron.distributed import initialize_distributed

    if plan.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check worker: the plan is for CUDA but torch sees no GPU")
    steps = plan.steps_for(allocator)
    initialize_distributed()
    worker = Worker(plan, probe_dir)
    rows.parent.mkdir(parents=True, exist_ok=True)
    with rows.open("a") as out:

        def write(row: StepRow) -> None:
            record = row.to_dict()
            out.write(json.dumps(record) + "\n")
            out.flush()
            print(f"gpu_check [{allocator}] {record['status']:7s} {record['seconds']:7.1f} s "
                  f"(predicted {record['predicted_seconds']:.1f}) {record['name']}"
                  + (f": {record['reason']}" if record["reason"] else "")
                  + (f": measured {record['measured_bytes'] / 2**20:,.0f} MiB, TrainerRank "
                     f"{record['ratio']:.3f}, defaults {record['defaults_ratio']:.3f}"
                     if record["status"] == "ok" and "ratio" in record else ""), flush=True)

        write(StepRow(steps[0], "ok", time.time() - launched_at,
                      figures={"pid": os.getpid(), "alloc_conf":
                               os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}))
        run_steps(steps, Budget(deadline), build=worker.build, measure=worker.measure,
                  release=worker.release, write=write)
    return 0
