"""Admission policies the planner is benchmarked against (never used by the product).

- `seed_formula_bytes`: the pre-rewrite estimate quoted in the seed issue:
  activation_factor = max(4, min(16, layers // 4 + 4)); (outputs + tokens x hidden x dtype x
  factor) x 1.10. It ignores the recompute mode, so it admits what then runs out of memory.
- try-and-halve: start with everything and halve the number of items after every OOM, keeping
  the smaller size afterwards (what accelerate's find_executable_batch_size does).
- in-order greedy: the largest run of whole items, in order, that really fits, found by
  bisection on measured peaks.
- the oracle of a pass (`most_that_fits`): for each micro-batch a policy ran, the most that
  really fits with the same packing: its items plus as many of the items still waiting (in
  order) as keep the measured peak within the limit, found by bisection on measured peaks.
  A policy's utilisation is its tokens over the oracle's, micro-batch by micro-batch.
All three run micro-batches through `MicroBatchRunner`, the trainer's own compute path (pack,
decoder, chunked heads, caller loss and backward) inside the same virtual limit the trainer
uses, so an OOM is the same event for every policy.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from art.megatron.geometry import ModelGeometry
from art.trainer_rank._request import OutputRequest
from art.trainer_rank.compute.execute import run_sub_forward
from art.trainer_rank.compute.items import Item, outputs_union
from art.trainer_rank.measuring.meter import MemoryMeter, release_score_buffer

SEED_SAFETY_FACTOR = 1.10


def seed_activation_factor(num_layers: int) -> int:
    return max(4, min(16, num_layers // 4 + 4))


def seed_output_bytes(packed_tokens: int, outputs: OutputRequest, geometry: ModelGeometry,
                      dtype_bytes: int) -> int:
    """What the old planner added for requested outputs: the result tensors themselves."""
    per_token = 0
    if outputs.target_logprobs:
        per_token += 4
    if outputs.top_k:
        per_token += outputs.top_k * (4 + 8)
    if outputs.logits:
        per_token += geometry.vocab_size * 4
    if outputs.hidden_states:
        per_token += geometry.hidden_size * dtype_bytes
    return packed_tokens * per_token


def seed_formula_bytes(packed_tokens: int, outputs: OutputRequest, geometry: ModelGeometry,
                       dtype_bytes: int) -> int:
    static = (packed_tokens * geometry.hidden_size * dtype_bytes
              * seed_activation_factor(geometry.num_layers))
    output = seed_output_bytes(packed_tokens, outputs, geometry, dtype_bytes)
    return int((output + static) * SEED_SAFETY_FACTOR)


@dataclass
class RunResult:
    ok: bool
    peak_bytes: int
    seconds: float
    tokens: int


@dataclass
class MicroBatchRunner:
    """Runs whole items as one micro-batch (forward, heads, loss, backward) under a limit."""

    model: Any
    provider: Any
    limit_bytes: int | None
    head_chunk_tokens: int
    runs: int = 0
    ooms: int = 0

    def run(self, items: Sequence[Item], *, limit_bytes: int | None = -1,
            grad: bool = True) -> RunResult:
        """Without grad: the forward and heads only (scoring), no loss, no backward."""
        limit = self.limit_bytes if limit_bytes == -1 else limit_bytes
        leaves = [leaf for item in items for leaf in item.leaves]
        tokens = sum(leaf.num_tokens for leaf in leaves)
        release_score_buffer()
        started = time.perf_counter()
        self.runs += 1
        meter = MemoryMeter(limit_bytes=limit, device="cpu")
        try:
            with meter, torch.set_grad_enabled(grad):
                outputs = run_sub_forward(
                    self.model, leaves, implementation=self.provider.implementation,
                    layout=self.provider.layout, device=torch.device("cpu"),
                    head_chunk_tokens=self.head_chunk_tokens,
                    groups=[len(item.leaves) for item in items],  # packed as the trainer packs
                )
                if grad:
                    loss = sum(-(o.target_logprobs.sum()) for o in outputs
                               if o.target_logprobs is not None)
                    del outputs
                    loss.backward()
                    del loss
                else:
                    del outputs
        except torch.OutOfMemoryError:
            self.ooms += 1
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.zero_()  # an OOM mid-backward leaves partial gradients behind
            return RunResult(False, meter.peak_bytes, time.perf_counter() - started, tokens)
        return RunResult(True, meter.peak_bytes, time.perf_counter() - started, tokens)


@dataclass
class PassResult:
    """One policy's pass over the workload."""

    policy: str
    micro_batches: list[list[int]] = field(default_factory=list)  # item indices that ran
    micro_batch_tokens: list[int] = field(default_factory=list)
    micro_batch_peaks: list[int] = field(default_factory=list)
    predicted: list[int] = field(default_factory=list)  # the policy's own figure, if any
    escaped_ooms: int = 0  # OOMs the policy did not handle: its items were lost
    recovered_ooms: int = 0  # OOMs the policy caught and re-ran smaller
    items_lost: list[int] = field(default_factory=list)
    items_declined: list[int] = field(default_factory=list)
    wall_seconds: float = 0.0
    runs: int = 0  # forward+backward executions, failed ones included
    # The planner only: its decision, the source of its figure, the memory model's own figure.
    decisions: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    model_predicted: list[int] = field(default_factory=list)
    # The oracle of this pass (`most_that_fits`): tokens per micro-batch, and its runs.
    oracle_tokens: list[int] = field(default_factory=list)
    oracle_runs: int = 0

    @property
    def utilisation(self) -> float | None:
        """Tokens run / the oracle's tokens, over the micro-batches (None: no oracle run)."""
        if not self.oracle_tokens:
            return None
        return sum(self.micro_batch_tokens) / max(1, sum(self.oracle_tokens))


def seed_formula_pass(items: Sequence[Item], runner: MicroBatchRunner, limit: int,
                      geometry: ModelGeometry, dtype_bytes: int,
                      packed_length) -> PassResult:
    """The old planner: pack items in order while the formula says they fit; an OOM is the
    'CUDA OOM occurred despite the planner estimate' error, and its items are lost."""
    result = PassResult("seed formula")
    started = time.perf_counter()
    queue = list(items)
    while queue:
        chosen: list[Item] = []
        predicted = 0
        for item in queue:
            trial = chosen + [item]
            lengths = [leaf.num_tokens for it in trial for leaf in it.leaves]
            need = seed_formula_bytes(packed_length(lengths),
                                      outputs_union([x for it in trial for x in it.leaves]),
                                      geometry, dtype_bytes)
            if need > limit:
                break
            chosen, predicted = trial, need
        if not chosen:  # one item over the formula on its own: not run
            result.items_declined.append(queue[0].index)
            queue = queue[1:]
            continue
        queue = queue[len(chosen):]
        run = runner.run(chosen)
        result.runs += 1
        if run.ok:
            result.micro_batches.append([it.index for it in chosen])
            result.micro_batch_tokens.append(run.tokens)
            result.micro_batch_peaks.append(run.peak_bytes)
            result.predicted.append(predicted)
        else:
            result.escaped_ooms += 1
            result.items_lost += [it.index for it in chosen]
    result.wall_seconds = time.perf_counter() - started
    return result


def try_and_halve_pass(items: Sequence[Item], runner: MicroBatchRunner,
                       starting_items: int | None = None) -> PassResult:
    """Start with `starting_items` (default: all) in one micro-batch; after an OOM halve the
    item count and retry the same items; keep the reduced count afterwards. A single item
    that OOMs is lost."""
    result = PassResult("try-and-halve")
    started = time.perf_counter()
    queue = list(items)
    batch = starting_items or len(queue)
    while queue:
        chosen = queue[:batch]
        run = runner.run(chosen)
        result.runs += 1
        if run.ok:
            result.micro_batches.append([it.index for it in chosen])
            result.micro_batch_tokens.append(run.tokens)
            result.micro_batch_peaks.append(run.peak_bytes)
            queue = queue[len(chosen):]
            continue
        if batch == 1:
            result.escaped_ooms += 1
            result.items_lost.append(chosen[0].index)
            queue = queue[1:]
            continue
        result.recovered_ooms += 1
        batch = max(1, batch // 2)
    result.wall_seconds = time.perf_counter() - started
    return result


@dataclass
class _PeakOf:
    """Measured peaks of `chosen` plus the first `extra` waiting items, each run once."""

    runner: MicroBatchRunner
    chosen: list[Item]
    waiting: list[Item]
    grad: bool
    passed: PassResult
    peaks: dict[int, int] = field(default_factory=dict)

    def __call__(self, extra: int) -> int:
        if extra not in self.peaks:
            self.peaks[extra] = self.runner.run(self.chosen + self.waiting[:extra],
                                                limit_bytes=None, grad=self.grad).peak_bytes
            self.passed.oracle_runs += 1
        return self.peaks[extra]


def most_that_fits(passed: PassResult, items: Sequence[Item], runner: MicroBatchRunner,
                   limit: int, *, grad: bool = True) -> list[int]:
    """The oracle's tokens for each micro-batch of `passed`: its items plus the longest prefix
    of the items still waiting after it (in order) whose measured peak stays within `limit`
    (bisection on measured peaks of unlimited runs; the peak grows with every added item).
    Counts its runs in `passed.oracle_runs`."""
    by_index = {item.index: item for item in items}
    done: set[int] = set()
    skipped = set(passed.items_declined) | set(passed.items_lost)
    oracle_tokens: list[int] = []
    for indices in passed.micro_batches:
        done.update(indices)
        chosen = [by_index[i] for i in indices]
        waiting = [it for it in items if it.index not in done and it.index not in skipped]
        peak = _PeakOf(runner, chosen, waiting, grad, passed)
        low, high = 0, None  # `low` extra items fit (0: what the policy ran); `high` do not
        while low < len(waiting):
            step = min(max(1, 2 * low), len(waiting))
            if peak(step) <= limit:
                low = step
            else:
                high = step
                break
        while high is not None and high - low > 1:
            mid = (low + high) // 2
            if peak(mid) <= limit:
                low = mid
            else:
                high = mid
        oracle_tokens.append(sum(it.num_tokens for it in chosen + waiting[:low]))
    return oracle_tokens


def oracle_pass(items: Sequence[Item], runner: MicroBatchRunner, limit: int) -> PassResult:
    """In-order greedy: the largest run of whole items, in order, whose measured peak is within
    the limit (bisection on measured peaks, unlimited runs; the peak grows with every added
    item)."""
    result = PassResult("in-order greedy")
    started = time.perf_counter()
    peaks: dict[tuple[int, int], int] = {}

    def peak(start: int, count: int) -> int:
        key = (start, count)
        if key not in peaks:
            run = runner.run(items[start:start + count], limit_bytes=None)
            result.runs += 1
            peaks[key] = run.peak_bytes
        return peaks[key]

    start = 0
    while start < len(items):
        if peak(start, 1) > limit:
            result.items_declined.append(items[start].index)
            start += 1
            continue
        remaining = len(items) - start
        low, high = 1, None  # low fits; high (when known) does not
        while low < remaining:
            step = min(2 * low, remaining)
            if peak(start, step) <= limit:
                low = step
            else:
                high = step
                break
        while high is not None and high - low > 1:
            mid = (low + high) // 2
            if peak(start, mid) <= limit:
                low = mid
            else:
                high = mid
        chosen = items[start:start + low]
        result.micro_batches.append([it.index for it in chosen])
        result.micro_batch_tokens.append(sum(it.num_tokens for it in chosen))
        result.micro_batch_peaks.append(peak(start, low))
        start += low
    result.wall_seconds = time.perf_counter() - started
    return result
