"""The demo, one process per TP rank (launched by ./scripts/demo under torchrun).

A tiny Qwen3-shaped Megatron-Core model, loaded as pretrained from a random Hugging Face
checkpoint that transformers saves on the fly, with a rank-8 LoRA runs an RL-like training
step on CPU through the real `TrainerRank.forward_micro_batches`: groups of rollouts
sharing a prompt, target logprobs requested, a policy-gradient loss and backward per
micro-batch, all under a virtual memory limit (live tensor bytes past it raise
OutOfMemoryError, as CUDA would). Two groups are made too large on purpose: one fits only
under full recompute (escalated), one fits under nothing (declined before running, with the
recompute-aware message).

Exit status: 0 when every admitted item ran once with all its outputs, no OOM escaped and the
two oversized groups were handled as intended; 1 otherwise (the reason is printed); 2 for a
flag the demo cannot run with (one line; ./scripts/demo checks the flags before torchrun).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from art.megatron.geometry import load_geometry
from art.megatron.provider import Provider
from art.megatron.train import build_runtime_for_provider
from art.trainer_rank._impl import TrainerRank
from art.trainer_rank._options import TrainerRankOptions
from art.trainer_rank._request import MicroBatchShape, OutputRequest
from art.trainer_rank._types import (
    DECLINED,
    ESCALATED,
    ForwardOutput,
    MicroBatch,
    TrainerRankMemoryError,
)
from art.trainer_rank.compute.packing import packed_length_tokens, shares_prefixes
from art.trainer_rank.pricing.model import MemoryModel
from art.trainer_rank.ranks import agree as _agree

from _workload import WorkloadSpec, forward_inputs, rl_groups
from demo_launch import MIB, VOCAB, DemoInputError, parse_args, workload_spec

HIDDEN = 128


def demo_checkpoint(folder: Path) -> Path:
    """A random Qwen3 checkpoint (GQA, qk-norm, SwiGLU, RMSNorm, RoPE) at a size two CPU cores
    can train, saved by transformers like a downloaded model; the demo starts from it."""
    from _hf_checkpoint import save_random_checkpoint

    return save_random_checkpoint(folder, family="qwen3", layers=4, hidden=HIDDEN, vocab=VOCAB,
                                  heads=8, kv_heads=4, max_positions=8192)


def demo_geometry(folder: Path):
    """The checkpoint's geometry under a short name for the printout (its source stays the
    folder, which is where the pretrained weights are read from)."""
    return replace(load_geometry(folder), name=f"tiny-qwen3-{HIDDEN}")


@dataclass
class Oversized:
    """A group made too large on purpose, and what the planner should do with it."""

    index: int
    expect: str  # ESCALATED or DECLINED
    tokens: int


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        return _main(args)
    except DemoInputError as exc:
        # Every rank finds the same problem; one line from rank 0 says it.
        if os.environ.get("RANK", "0") == "0":
            print(f"demo: {exc}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    from peft import LoraConfig

    # The trainer logs escalations and declines as warnings; here they are in the table and
    # the closing message, and log lines would tear the progress bar.
    logging.getLogger("art.trainer_rank").setLevel(logging.ERROR)

    # Each rank saves the same seeded checkpoint in its own folder (torch.distributed is not up
    # yet to agree on one), then loads its shards of it as a pretrained model.
    workdir = tempfile.TemporaryDirectory(prefix="art-demo-checkpoint-")
    checkpoint = demo_checkpoint(Path(workdir.name))
    lora = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                      target_modules="all-linear")
    provider = Provider(demo_geometry(checkpoint), lora=lora, dtype="float32")
    state = provider.initialize_distributed()
    rank0 = state.rank == 0
    spec = workload_spec(args)
    groups = rl_groups(spec)
    items: list = forward_inputs(groups, target_logprobs=True)

    options = TrainerRankOptions.from_env()
    layout = provider.layout
    logprobs = OutputRequest(target_logprobs=True)

    share = shares_prefixes(provider.implementation, layout)

    def dynamic_bytes(lengths: tuple[int, ...], model: MemoryModel, shared: int = 0) -> int:
        shape = MicroBatchShape(lengths, outputs=logprobs, grad_enabled=True,
                                padded_tokens=packed_length_tokens(
                                    lengths, layout, shared if share else 0,
                                    provider.implementation))
        return int(model.estimate(shape).dynamic_bytes)

    largest = max(groups, key=lambda g: g.num_tokens)

    def limit_for(model: MemoryModel) -> int:
        if args.limit_mib:
            return int(args.limit_mib * MIB)
        if options.test_memory_limit_bytes is not None:  # ART_TRAINER_RANK_TEST_MEMORY_LIMIT_BYTES
            return options.test_memory_limit_bytes
        return int(1.7 * dynamic_bytes(largest.sequence_lengths_tokens, model))

    # TrainerRank probes its model when it is built, up to the sizes its limit can admit: build
    # it at the limit the default formulas suggest, then size the limit and the oversized
    # groups below with the very (probed) memory model admission uses.
    draft = limit_for(replace(MemoryModel.for_provider(provider),
                              head_chunk_tokens=options.head_chunk_tokens))
    trainer = TrainerRank(build_runtime_for_provider(
        provider, build_optimizer=False, model_initialization="pretrained",
        trainer_options=replace(options, test_memory_limit_bytes=draft)))
    memory_model = trainer.memory_model
    limit = limit_for(memory_model)
    trainer.options = replace(options, test_memory_limit_bytes=limit)
    full = memory_model.with_recompute(provider.recompute_as("full", "uniform", 1))
    # The oversized pairs share their prompt (_long_group), laid out once where attention
    # takes a prefix tree: price them as packed.
    oversized = _oversized_groups(
        spec, limit, lambda lengths, model=memory_model: dynamic_bytes(
            lengths, model, _long_prompt_tokens(lengths[0])), full, provider)
    for o in oversized:
        o.index = len(items)
        items.append(_long_group(spec, o.tokens, seed=args.seed + 1 + len(items)))
    if rank0:
        _print_intro(provider, spec, items, oversized, limit)

    seen: dict[int, int] = {}
    problems: list[str] = []
    micro_batches: list[MicroBatch] = []
    declined_error: TrainerRankMemoryError | None = None
    started = time.perf_counter()
    recorded = len(trainer.stats_history)
    progress = _Progress(len(items), enabled=rank0)
    with progress:
        try:
            for mb in trainer.forward_micro_batches(items):
                loss, tokens = _policy_gradient_loss(mb, seed=args.seed)
                loss.backward()
                problems += _check_outputs(mb)
                for i in mb.indices:
                    seen[i] = seen.get(i, 0) + 1
                micro_batches.append(mb)
                progress.advance(len(mb.indices), f"{mb.stats.decision}: {tokens} tokens")
                del loss, mb
        except TrainerRankMemoryError as exc:
            declined_error = exc
            progress.advance(len(exc.indices_not_run),
                             f"declined {len(exc.indices_not_run)} item(s) before running")
        except torch.OutOfMemoryError as exc:
            problems.append(f"an OutOfMemoryError escaped forward_micro_batches: {exc}")
    elapsed = time.perf_counter() - started
    # The trainer's records of the yielded stats carry the peak measured through the loss and
    # backward (known only once the loop moved on); one per micro-batch that ran.
    ran = [mb for mb in micro_batches if mb.indices]
    micro_batches = [replace(mb, stats=record) for mb, record in
                     zip(ran, trainer.stats_history[recorded:])]

    problems += _check_coverage(len(items), seen, declined_error,
                                {o.index for o in oversized if o.expect == DECLINED})
    problems += _check_oversized(oversized, micro_batches, declined_error)
    # Every rank must agree on success, so that torchrun's exit status is the demo's verdict.
    failed = _agree.max_over_replica(int(bool(problems)))
    if rank0:
        _print_table(micro_batches, declined_error, provider)
        print(f"\n{len(micro_batches)} micro-batches in {elapsed:.1f}s on {state.world_size} "
              f"ranks ({state.backend}); virtual limit {limit / MIB:.1f} MiB per rank.")
        if declined_error is not None:
            on_purpose = {o.index for o in oversized if o.expect == DECLINED}
            print("\nThe group made too large on purpose was declined before running:\n"
                  if set(declined_error.indices_not_run) <= on_purpose else
                  "\nNot run:\n")
            print(f"TrainerRankMemoryError: {declined_error}")
        for problem in problems:
            print(f"PROBLEM: {problem}", file=sys.stderr)
        print("\nOK: every admitted item ran once with its outputs; no OOM escaped."
              if not failed else "\nFAILED (see PROBLEM lines above)")
    from art.megatron.distributed import shutdown_distributed

    shutdown_distributed()
    return 1 if failed else 0


def _oversized_groups(spec, limit, dynamic_bytes, full, provider) -> list[Oversized]:
    """Two groups of two sequences: the smallest that does not fit under the configured
    recompute but fits under full recompute (escalated), and one that fits under neither
    (declined). Found by doubling then bisection over the memory model."""
    def full_bytes(lengths):
        return dynamic_bytes(lengths, full)

    def first_over(cost, start: int) -> int:
        n = start
        while cost((n, n)) <= limit:
            n *= 2
            if n > 1 << 16:
                raise DemoInputError(
                    f"--limit-mib: the limit of {limit / MIB:.1f} MiB per rank is above what "
                    "any group of two sequences under 65,536 tokens needs, so no group can "
                    "be made too large on purpose; lower --limit-mib")
        low, high = n // 2, n
        while high - low > 8:
            mid = (low + high) // 2
            low, high = (mid, high) if cost((mid, mid)) <= limit else (low, mid)
        return high

    out = []
    escalate_at = first_over(dynamic_bytes, spec.max_tokens // 2)
    decline_at = first_over(full_bytes, escalate_at)
    if full_bytes((escalate_at, escalate_at)) <= limit and (
        provider.effective_recompute.mode != "full"
    ):
        out.append(Oversized(index=-1, expect=ESCALATED, tokens=escalate_at))
    out.append(Oversized(index=-1, expect=DECLINED, tokens=math.ceil(decline_at * 1.1)))
    return out


def _long_prompt_tokens(tokens: int) -> int:
    return min(64, tokens // 2)


def _long_group(spec: WorkloadSpec, tokens: int, seed: int) -> list:
    """Two rollouts of `tokens` tokens each sharing a prompt, requesting target logprobs."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, spec.vocab_size, (_long_prompt_tokens(tokens),), generator=g)
    from _workload import RolloutGroup

    completions = tuple(
        torch.randint(0, spec.vocab_size, (tokens - prompt.numel(),), generator=g)
        for _ in range(2)
    )
    return forward_inputs([RolloutGroup(prompt, completions)], target_logprobs=True)[0]


def _policy_gradient_loss(mb: MicroBatch, seed: int) -> tuple[torch.Tensor, int]:
    """REINFORCE with group-normalised advantages: -sum(A_i * sum_t logp_i,t) / tokens."""
    terms, tokens = [], 0
    for index, (group_in, group_out) in zip(mb.indices, zip(mb.inputs, mb.outputs)):
        rewards = torch.rand(len(group_in), generator=torch.Generator().manual_seed(seed + index))
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6) if len(group_in) > 1 \
            else rewards - 0.5
        for seq_in, seq_out, advantage in zip(group_in, group_out, advantages):
            mask = seq_in.target_tokens != -100
            terms.append(-advantage * seq_out.target_logprobs[mask].sum())
            tokens += seq_in.num_tokens
    return torch.stack(terms).sum() / max(1, tokens), tokens


def _check_outputs(mb: MicroBatch) -> list[str]:
    problems = []
    for index, group_in, group_out in zip(mb.indices, mb.inputs, mb.outputs):
        if len(group_out) != len(group_in):
            problems.append(f"item {index}: {len(group_out)} outputs for {len(group_in)} inputs")
            continue
        for j, (seq_in, seq_out) in enumerate(zip(group_in, group_out)):
            lp = seq_out.target_logprobs if isinstance(seq_out, ForwardOutput) else None
            if lp is None or tuple(lp.shape) != (seq_in.num_tokens,):
                problems.append(f"item {index} sequence {j}: target logprobs missing or "
                                f"mis-shaped ({None if lp is None else tuple(lp.shape)})")
            elif not bool(torch.isfinite(lp).all()) or bool((lp > 0).any()):
                problems.append(f"item {index} sequence {j}: logprobs not finite or > 0")
    return problems


def _check_coverage(n_items: int, seen: dict[int, int],
                    declined: TrainerRankMemoryError | None,
                    may_decline: set[int]) -> list[str]:
    """Every item ran exactly once, except those the error lists as not run; only the items
    in `may_decline` (made too large on purpose) may be among those: an RL group that was not
    run has no outputs, whatever the reason (declined, or given up after run-time OOMs)."""
    not_run = set(declined.indices_not_run) if declined is not None else set()
    problems = []
    for i in range(n_items):
        count = seen.get(i, 0)
        if i in not_run:
            if count:
                problems.append(f"item {i} was declined but also ran {count} time(s)")
            elif i not in may_decline:
                problems.append(f"item {i} was not run, so its outputs are missing (a limit "
                                "too small for the workload?)")
        elif count != 1:
            problems.append(f"item {i} ran {count} times (expected once)")
    return problems


def _check_oversized(oversized: list[Oversized], micro_batches: list[MicroBatch],
                     declined: TrainerRankMemoryError | None) -> list[str]:
    problems = []
    for o in oversized:
        if o.expect == DECLINED:
            if declined is None or o.index not in declined.indices_not_run:
                problems.append(f"oversized item {o.index} ({2 * o.tokens} tokens) was not "
                                "declined")
            continue
        decisions = [mb.stats.decision for mb in micro_batches if o.index in mb.indices]
        if decisions != [o.expect]:
            problems.append(f"oversized item {o.index}: expected {o.expect}, got {decisions}")
    return problems


class _Progress:
    """A rich progress bar on rank 0 (a no-op elsewhere)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.enabled = enabled
        self.total = total
        self._progress = None
        self._task = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]items"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TextColumn("{task.description}"),
            )
            self._progress.__enter__()
            self._task = self._progress.add_task("starting", total=self.total)
        return self

    def advance(self, n: int, description: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=n, description=description)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)


def _print_intro(provider: Provider, spec: WorkloadSpec, items: list, oversized, limit) -> None:
    g = provider.geometry
    lengths = [sum(leaf.num_tokens for leaf in item) for item in items]
    print(f"model {g.name}: {g.num_layers} layers, hidden {g.hidden_size}, ffn "
          f"{g.ffn_hidden_size}, {g.num_attention_heads} heads / {g.num_query_groups} KV groups, "
          f"vocab {g.vocab_size}, {provider.dtype}, LoRA r={provider.lora_config.r} on all "
          "linears")
    print("weights: a random Qwen3 checkpoint saved by transformers on the fly, loaded as "
          "pretrained (model_initialization='pretrained'), each rank reading its shards")
    print(f"layout {provider.layout.summary}; {provider.implementation.key}")
    print(f"recompute from ART_MEGATRON_*: {provider.effective_recompute.summary}")
    print(f"workload: {spec.groups} prompts x {spec.rollouts_per_group} rollouts "
          f"({spec.min_tokens}-{spec.max_tokens} tokens each, shared prompt per group, target "
          f"logprobs, policy-gradient loss + backward per micro-batch): "
          f"{sum(lengths[:spec.groups]):,} tokens")
    for o in oversized:
        print(f"plus item {o.index}: a group of 2 x {o.tokens:,} tokens, too large on purpose "
              f"(should be {o.expect})")
    print(f"virtual memory limit: {limit / MIB:.1f} MiB of live tensors per rank "
          f"(ART_TRAINER_RANK_TEST_MEMORY_LIMIT_BYTES={limit})\n")


def _old_planner_bytes(packed_tokens: int, hidden: int, num_layers: int, dtype_bytes: int) -> int:
    """The estimate the seed's planner made (recompute-blind), for comparison."""
    factor = max(4, min(16, num_layers // 4 + 4))
    outputs = packed_tokens * 4  # target logprobs, fp32
    return int((outputs + packed_tokens * hidden * dtype_bytes * factor) * 1.10)


def _print_table(micro_batches: list[MicroBatch], declined: TrainerRankMemoryError | None,
                 provider: Provider) -> None:
    from rich.console import Console
    from rich.table import Table

    g = provider.geometry
    table = Table(title="micro-batches (dynamic bytes per rank, MiB)", title_justify="left")
    for name in ("#", "items", "seqs", "packed tok", "old planner", "predicted", "source",
                 "measured", "limit", "meas/pred", "decision", "recompute"):
        table.add_column(name, justify="left" if name in (
            "items", "source", "decision", "recompute") else "right", no_wrap=True)
    for i, mb in enumerate(micro_batches):
        s = mb.stats
        ratio = s.measured_over_predicted
        old = _old_planner_bytes(s.packed_tokens, g.hidden_size, g.num_layers, 4)
        table.add_row(
            str(i), _ranges(mb.indices), str(sum(len(x) for x in mb.inputs)),
            f"{s.packed_tokens:,}", f"{old / MIB:.1f}", f"{s.predicted_dynamic_bytes / MIB:.1f}",
            s.predicted_source,
            "-" if s.measured_peak_bytes is None else f"{s.measured_peak_bytes / MIB:.1f}",
            f"{s.usable_limit_bytes / MIB:.1f}", "-" if ratio is None else f"{ratio:.3f}",
            s.decision + (f" x{s.sub_forwards}" if s.sub_forwards > 1 else ""),
            _short(s.recompute_summary),
        )
    if declined is not None:
        table.add_row(
            "-", _ranges(list(declined.indices_not_run)), "", "", "",
            f"{declined.predicted_peak_bytes / MIB:.1f}", "", "not run",
            f"{declined.usable_limit_bytes / MIB:.1f}", "", DECLINED,
            _short(declined.recompute_summary),
        )
    Console(width=max(150, Console().width)).print(table)
    ratios = [mb.stats.measured_over_predicted for mb in micro_batches
              if mb.stats.measured_over_predicted is not None]
    if ratios:
        print(f"measured/predicted: min {min(ratios):.3f}, max {max(ratios):.3f} "
              "(below 1.000: the prediction was above what ran)")
    print("old planner: the recompute-blind formula that admitted the seed's 32k group at 5.9 GB; "
          "predicted: this planner (model = itemised memory model, profile = learned from the "
          "micro-batches measured before)")
    retries = sum(mb.stats.retries for mb in micro_batches)
    if retries:
        print(f"run-time OOMs caught and re-planned (not escaped): {retries}")
    for i, mb in enumerate(micro_batches):
        if mb.stats.note:
            print(f"micro-batch {i} ({mb.stats.decision}): {mb.stats.note}")


def _short(recompute_summary: str) -> str:
    """'full recompute (uniform, 1 layer(s) per checkpoint)' -> 'full (uniform, 1)'."""
    if recompute_summary == "no recompute":
        return "none"
    return recompute_summary.replace(" recompute", "").replace(" layer(s) per checkpoint", "")


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
