#!/usr/bin/env python
"""TrainerRank against a bare Megatron loop on the same micro-batches -> bench/throughput.md.

    .venv/bin/python scripts/bench_throughput.py --pairs 9  # every case (about 12 minutes)
    .venv/bin/python scripts/bench_throughput.py --quick    # small sizes, one round each

The bare loop is what a user would write without TrainerRank: for each micro-batch TrainerRank
chose (same items, same packed row, same layout, same model object), embedding, decoder and
output layer of the Megatron-Core model, then a plain log_softmax and gather of the target
tokens, and the caller's loss and backward when grad is on. It runs twice per round: as it
is, and inside the CPU memory meter at the trainer's limit (the virtual device the trainer
runs on here). All three run in this process, interleaved in rounds (the order rotates from
round to round so that a drift of the machine falls on all), and the table gives the median
of each side and the median of the per-round ratios. Cases: 16 sequences with grad; 1,000
and 10,000 short items without grad (per-item cost, and whether time grows linearly with the
item count); one 8k-token row with grad;
start-up (`TrainerRank(runtime)`) with an empty probe cache and with the probe cached, and the
first call of each job against a steady call. Timings are benchmarks, not tests.
Goals: <= 1.03 at 16 sequences, <= 1.15 at 1,000 and 10,000 items, linear in the item count.
Each ratio comes with a distribution-free 95% interval of its median (order statistics of
the per-round ratios). The 16-sequence case runs three times the rounds of the others: a
round takes about a second, and the machine's noise from round to round (up to +-10% here)
would otherwise leave an interval wider than the goal's margin.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
os.environ.setdefault("OMP_NUM_THREADS", "2")
BENCH = ROOT / "bench"
VOCAB = 512
GOALS = {"16 sequences": 1.03, "1,000 short items": 1.15, "10,000 short items": 1.15}
# The 16-sequence case's rounds per --pairs (see the module docstring).
SIXTEEN_ROUNDS_PER_PAIR = 3


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval of the median: the k-th smallest and k-th largest value
    for the largest k at which the median lies between them with at least `confidence`
    (the count of values under the median is Binomial(n, 1/2)); the whole range when n is
    too small for any narrower one."""
    ordered = sorted(values)
    n = len(ordered)
    k, tail = 1, 0.0
    while True:
        # P(fewer than k+1 values lie below the median) for the next k.
        tail += math.comb(n, k - 1) / 2**n
        if 2 * (tail + math.comb(n, k) / 2**n) > 1 - confidence or k + 1 > (n + 1) // 2:
            break
        k += 1
    return ordered[k - 1], ordered[n - k]


@dataclass
class Case:
    name: str
    lengths: list[int]
    grad: bool
    pairs: int
    # False when an earlier case already ran this signature (grad mode, outputs): its profile
    # is learned, and the first pair's trainer call is the one that chooses the micro-batches.
    warm_up: bool = True
    # The virtual limit of this case's trainer (None: the run's --limit-mib).
    limit_mib: int | None = None
    trainer_s: list[float] = field(default_factory=list)
    bare_s: list[float] = field(default_factory=list)
    # The bare loop inside the CPU memory meter at the trainer's limit: the virtual device
    # TrainerRank runs on here (on a GPU the allocator's own counters cost nothing).
    bare_metered_s: list[float] = field(default_factory=list)
    micro_batches: int = 0
    packed_tokens: int = 0

    @property
    def ratio(self) -> float:
        return statistics.median(t / b for t, b in zip(self.trainer_s, self.bare_s, strict=True))

    @property
    def ratio_to_metered(self) -> float | None:
        if not self.bare_metered_s:
            return None
        return statistics.median(t / b for t, b in zip(self.trainer_s, self.bare_metered_s,
                                                       strict=True))

    @property
    def trainer_median_s(self) -> float:
        return statistics.median(self.trainer_s)

    @property
    def bare_median_s(self) -> float:
        return statistics.median(self.bare_s)

    @property
    def items(self) -> int:
        return len(self.lengths)


def _provider(hidden: int, layers: int, attention: str) -> Any:
    from art.megatron.geometry import geometry_from_hf_dict
    from art.megatron.implementation import Implementation
    from art.megatron.provider import Provider
    from art.megatron.settings import load_settings

    geometry = geometry_from_hf_dict(
        dict(model_type="qwen3", num_hidden_layers=layers, hidden_size=hidden,
             intermediate_size=3 * hidden, num_attention_heads=8, num_key_value_heads=4,
             head_dim=hidden // 8, vocab_size=VOCAB, max_position_embeddings=16384,
             torch_dtype="float32"),
        name=f"qwen3-{layers}x{hidden}")
    from peft import LoraConfig

    return Provider(geometry,
                    settings=load_settings({"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective"}),
                    lora=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
                    dtype="float32", implementation=Implementation.cpu_local(attention))


def _inputs(lengths: Sequence[int], seed: int) -> list[Any]:
    import torch

    from art.trainer_rank import ForwardInput

    g = torch.Generator().manual_seed(seed)
    return [ForwardInput(input_tokens=torch.randint(0, VOCAB, (n,), generator=g),
                         target_tokens=torch.randint(0, VOCAB, (n,), generator=g))
            for n in lengths]


def _loss(picked: Any) -> Any:
    return -picked.sum()


def trainer_pass(trainer: Any, inputs: list[Any], grad: bool) -> tuple[float, list[list[int]]]:
    """One call of forward_micro_batches as a driver makes it; the micro-batches it chose."""
    chosen: list[list[int]] = []
    started = time.perf_counter()
    for mb in trainer.forward_micro_batches(inputs, no_grad=not grad):
        if grad:
            _loss(sum(out.target_logprobs.sum() for out in mb.outputs)).backward()
        chosen.append(list(mb.indices))
    return time.perf_counter() - started, chosen


def bare_pass(model: Any, provider: Any, inputs: list[Any], chosen: list[list[int]],
              grad: bool) -> float:
    """The same micro-batches through the Megatron-Core model with nothing of TrainerRank but
    its packing of the row: embedding, rotary table at the packed positions, decoder, output
    layer, log_softmax, gather; the same loss and backward."""
    import torch

    from art.trainer_rank.compute.forward import unwrap_model
    from art.trainer_rank.compute.packing import pack_sequences

    inner = unwrap_model(model)
    started = time.perf_counter()
    for indices in chosen:
        with torch.set_grad_enabled(grad):
            batch = pack_sequences([inputs[i].input_tokens for i in indices],
                                   implementation=provider.implementation,
                                   layout=provider.layout)
            embedded = inner.embedding(input_ids=batch.tokens, position_ids=batch.position_ids)
            positions = batch.position_ids[0]
            rotary = inner.rotary_pos_emb(int(positions.max()) + 1).index_select(0, positions)
            hidden = inner.decoder(hidden_states=embedded, attention_mask=batch.attention_mask,
                                   rotary_pos_emb=rotary,
                                   packed_seq_params=batch.packed_seq_params)
            weight = (inner.shared_embedding_or_output_weight()
                      if inner.share_embeddings_and_output_weights else None)
            logits, _ = inner.output_layer(hidden, weight=weight)
            logprobs = torch.log_softmax(logits[:, 0].float(), dim=-1)
            targets = torch.cat([inputs[i].target_tokens for i in indices])
            starts = torch.cat([torch.arange(s, s + n) for s, n in
                                zip(batch.offsets, batch.sequence_lengths_tokens, strict=True)])
            picked = logprobs[starts].gather(1, targets.view(-1, 1)).squeeze(1)
            if grad:
                _loss(picked).backward()
            del logits, logprobs, picked, hidden, embedded
    return time.perf_counter() - started


def _zero(trainer: Any) -> None:
    for p in trainer.model.parameters():
        p.grad = None


def run_case(case: Case, trainer: Any, provider: Any, seed: int,
             log: Callable[[str], None], limit_bytes: int) -> Case:
    from art.trainer_rank.measuring.meter import MemoryMeter

    inputs = _inputs(case.lengths, seed)
    # A warm-up call: the profile of this signature is learned, as in a job's steady state.
    chosen: list[list[int]] = []
    if case.warm_up:
        _, chosen = trainer_pass(trainer, inputs, case.grad)
        _zero(trainer)
    sides = ("trainer", "bare", "bare metered")
    for pair in range(case.pairs):
        # The order rotates from round to round, so a drift of the machine falls on all three.
        for side in sides[pair % 3:] + sides[:pair % 3]:
            if side == "trainer":
                seconds, chosen = trainer_pass(trainer, inputs, case.grad)
                case.trainer_s.append(seconds)
            elif side == "bare":
                case.bare_s.append(bare_pass(trainer.model, provider, inputs, chosen,
                                             case.grad))
            else:
                with MemoryMeter(limit_bytes=limit_bytes, device="cpu"):
                    case.bare_metered_s.append(bare_pass(trainer.model, provider, inputs,
                                                         chosen, case.grad))
            _zero(trainer)
        log(f"{case.name}: round {pair + 1}/{case.pairs}: trainer {case.trainer_s[-1]:.2f} s, "
            f"bare {case.bare_s[-1]:.2f} s, bare metered {case.bare_metered_s[-1]:.2f} s")
    case.micro_batches = len(chosen)
    case.packed_tokens = sum(s.packed_tokens for s in trainer.stats_history[-len(chosen):])
    return case


def short_lengths(n: int, rng: random.Random) -> list[int]:
    return [rng.randint(8, 32) for _ in range(n)]


def sixteen_lengths(rng: random.Random, total: int = 4589) -> list[int]:
    """16 seeded lengths summing to `total` (RL-like spread, none under 64)."""
    if total < 16 * 64:
        raise ValueError(f"16 sequences of at least 64 tokens need total >= 1024, got {total}")
    weights = [rng.lognormvariate(0.0, 0.6) for _ in range(16)]
    lengths = [64 + round((total - 16 * 64) * w / sum(weights)) for w in weights]
    lengths[max(range(16), key=lengths.__getitem__)] += total - sum(lengths)
    return lengths


@dataclass
class StartUp:
    uncached_s: list[float] = field(default_factory=list)
    cached_s: list[float] = field(default_factory=list)
    first_call_uncached_s: list[float] = field(default_factory=list)
    first_call_cached_s: list[float] = field(default_factory=list)
    steady_call_s: list[float] = field(default_factory=list)


def start_up(provider: Any, model: Any, pairs: int, lengths: list[int], seed: int,
             log: Callable[[str], None], limit_bytes: int) -> StartUp:
    """`TrainerRank(runtime)` with an empty cache folder, then with the probe it stored, each
    as a new job would (the in-process copy cleared); and each job's first call (the layers
    and the head probed on first use or read from the cache, a cold cap) against a steady
    call of the same items."""
    from art.megatron.train import TrainingRuntime
    from art.trainer_rank import TrainerRank, TrainerRankOptions
    from art.trainer_rank.measuring import probe as probe_module

    result = StartUp()
    inputs = _inputs(lengths, seed)
    for pair in range(pairs):
        folder = tempfile.mkdtemp(prefix="art-bench-probe-")
        options = TrainerRankOptions(probe_cache_dir=folder, test_memory_limit_bytes=limit_bytes)
        for cached in (False, True):
            probe_module.forget_in_process_probes()
            started = time.perf_counter()
            trainer = TrainerRank(TrainingRuntime.for_model(model, provider,
                                                            trainer_options=options))
            (result.cached_s if cached else result.uncached_s).append(
                time.perf_counter() - started)
            seconds, _ = trainer_pass(trainer, inputs, True)
            (result.first_call_cached_s if cached else result.first_call_uncached_s).append(
                seconds)
            _zero(trainer)
            if not cached:
                seconds, _ = trainer_pass(trainer, inputs, True)
                result.steady_call_s.append(seconds)
                _zero(trainer)
            del trainer
        log(f"start-up: pair {pair + 1}/{pairs}: uncached {result.uncached_s[-1]:.2f} s, "
            f"cached {result.cached_s[-1]:.2f} s, first call {result.first_call_uncached_s[-1]:.2f}"
            f" s (cached {result.first_call_cached_s[-1]:.2f} s), steady call "
            f"{result.steady_call_s[-1]:.2f} s")
    return result


def write_report(cases: list[Case], start: StartUp, meta: dict[str, Any], out: Path) -> str:
    lines = [
        "# Throughput: TrainerRank against a bare Megatron-Core loop (CPU)",
        "",
        f"Written by `{meta['command']}` on {meta['date']} ({meta['machine']}). Model "
        f"{meta['model']}; build {meta['build']}; rank-8 LoRA on every linear, fp32, selective "
        "recompute, TP=1. Each case: one warm-up call, then interleaved rounds (trainer, bare "
        "loop, and the bare loop inside the CPU memory meter at the trainer's limit; the order "
        "rotates), the bare loop running the micro-batches TrainerRank chose. Ratio: median "
        "over rounds of trainer / bare (the goal's), with a distribution-free 95% interval of "
        "that median (order statistics of the rounds' ratios); the 16-sequence case runs "
        f"{SIXTEEN_ROUNDS_PER_PAIR}x the rounds of the others, since its rounds take about a "
        "second and the machine's noise from round to round would otherwise leave an interval "
        "wider than its goal's margin. On CPU the trainer runs on a virtual "
        "device: the meter sees every op in Python to count the live bytes and raise at the "
        "limit, which a GPU's allocator does for nothing; the last ratio is the trainer against "
        "the bare loop on that same virtual device, what is left of the trainer's own cost.",
        "",
        "| case | items | tokens | grad | micro-batches | rounds | trainer median s | bare "
        "median s | ratio (median) | 95% interval of the median | ratio range | "
        "trainer ms/item | bare ms/item | goal | bare metered median s | ratio to the bare "
        "loop metered |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        if not c.trainer_s:
            continue
        ratios = [t / b for t, b in zip(c.trainer_s, c.bare_s, strict=True)]
        low, high = median_interval(ratios)
        goal = GOALS.get(c.name)
        limit = f" (limit {c.limit_mib:,} MiB)" if c.limit_mib else ""
        verdict = "" if goal is None else f"<= {goal:.2f}: " + (
            "met, by the whole interval" if high <= goal
            else "met by the median, not by the whole interval" if c.ratio <= goal
            else "NOT met")
        lines.append(
            f"| {c.name}{limit} | {c.items:,} | {sum(c.lengths):,} | {'yes' if c.grad else 'no'} | "
            f"{c.micro_batches} | {c.pairs} | {c.trainer_median_s:.2f} | "
            f"{c.bare_median_s:.2f} | {c.ratio:.3f} | {low:.3f}-{high:.3f} | "
            f"{min(ratios):.3f}-{max(ratios):.3f} | "
            f"{1e3 * c.trainer_median_s / c.items:.2f} | {1e3 * c.bare_median_s / c.items:.2f}"
            f" | {verdict} | "
            + (f"{statistics.median(c.bare_metered_s):.2f} | {c.ratio_to_metered:.3f} |"
               if c.ratio_to_metered is not None else "- | - |"))
    by_name = {c.name: c for c in cases}
    small, large = by_name.get("1,000 short items"), by_name.get("10,000 short items")
    if small and large:
        growth = (large.trainer_median_s / large.items) / (small.trainer_median_s / small.items)
        bare = (large.bare_median_s / large.items) / (small.bare_median_s / small.items)
        lines += ["", f"Linear in the item count: the trainer's time per item at "
                  f"{large.items:,} items is {growth:.2f}x its time per item at "
                  f"{small.items:,} (1.00 is linear); the bare loop's, on the same "
                  f"micro-batches, {bare:.2f}x (the model's own cost per token grows with "
                  "the rows' length)."]
    if start.uncached_s:
        steady = statistics.median(start.steady_call_s)
        first = statistics.median(start.first_call_uncached_s)
        uncached = statistics.median(start.uncached_s)
        cached = statistics.median(start.cached_s)
        first_cached = (statistics.median(start.first_call_cached_s)
                        if start.first_call_cached_s else None)
        lines += [
            "",
            "## Start-up",
            "",
            "`TrainerRank(runtime)` on the same model, as a new job (in-process copies "
            "cleared), with an empty probe cache folder and then with the probes the first "
            "job stored; and each job's first call (which probes the layers and the head of "
            "its output mix on first use, or reads them from the cache, and runs a "
            "cold-capped first wave) against a steady call of the same items "
            f"({meta['start_up_items']}).",
            "",
            "| measure | median s | runs |",
            "|---|---|---|",
            f"| start-up, probe not cached | {uncached:.2f} | {len(start.uncached_s)} |",
            f"| start-up, probe cached | {cached:.2f} | "
            f"{len(start.cached_s)} |",
            f"| first call of the uncached job | {first:.2f} | "
            f"{len(start.first_call_uncached_s)} |",
            *([f"| first call of the cached job | {first_cached:.2f} | "
               f"{len(start.first_call_cached_s)} |"] if first_cached is not None else []),
            f"| steady call | {steady:.2f} | {len(start.steady_call_s)} |",
            "",
            f"An uncached job reaches the end of its first call after "
            f"{(uncached + first) / steady:.1f} steady calls' time (start-up + first call); a "
            + (f"cached one after {(cached + first_cached) / steady:.1f}."
               if first_cached is not None else
               f"cached one starts in {cached / steady:.4f} of a steady call.")
            + (" A first call cheaper than a steady one is expected on this build (not "
               "measured apart here): its cold-capped first wave splits the sequences over "
               "shorter rows, and Megatron's unfused attention costs the square of a row's "
               "length." if first < steady and "unfused" in meta["build"] else ""),
        ]
    text = "\n".join(lines) + "\n"
    (out / "throughput.md").write_text(text)
    if out.resolve() == BENCH.resolve():
        update_readme(text)
    (out / "throughput.json").write_text(json.dumps(
        {"meta": meta, "cases": [asdict(c) | {"ratio": c.ratio,
                                               "ratio_to_metered": c.ratio_to_metered}
                                 for c in cases],
         "start_up": asdict(start)}, indent=1))
    return text


README_START = "<!-- bench_throughput.py: start -->"
README_END = "<!-- bench_throughput.py: end -->"


def update_readme(report: str, readme: Path = ROOT / "README.md") -> None:
    """Replace the README's throughput block (between its two markers) with this run's
    tables, so that the figures there are this script's and never typed by hand."""
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        return
    # Without the page title; its sections sit under README's own heading.
    body = report.split("\n", 2)[2].strip().replace("\n## ", "\n#### ")
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(f"{head}{README_START}\n{body}\n{README_END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one pair per case")
    parser.add_argument("--hidden", type=int, default=512,
                        help="the model's hidden size (default 512, the shape the "
                             "16-sequence goal is stated for; a smaller model pays the CPU "
                             "meter's fixed cost per op over less work per op)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--attention", choices=("unfused", "flash"), default="flash",
                        help="the CPU build's attention (default: the CPU default)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--limit-mib", type=int, default=4096,
                        help="the virtual memory limit that stands in for a GPU's (default 4096)")
    parser.add_argument("--cases", nargs="*", default=["16", "1000", "10000", "8k", "startup"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(BENCH))
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the page (and README's block) from <out>/throughput.json "
                             "without running anything")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.report_only:
        saved = json.loads((out / "throughput.json").read_text())
        names = {f.name for f in fields(Case)}
        cases = [Case(**{k: v for k, v in c.items() if k in names}) for c in saved["cases"]]
        print(write_report(cases, StartUp(**saved["start_up"]), saved["meta"], out))
        return 0
    warnings.filterwarnings("ignore")
    import torch

    from art.megatron.train import TrainingRuntime
    from art.trainer_rank import TrainerRank, TrainerRankOptions

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    hidden = min(128, args.hidden) if args.quick else args.hidden
    limit_bytes = args.limit_mib * 2**20
    provider = _provider(hidden, args.layers, args.attention)
    provider.initialize_distributed()
    model = provider.build_model(seed=args.seed)
    pairs = 1 if args.quick else args.pairs

    def log(message: str) -> None:
        print(message, flush=True)

    start = StartUp()
    start_lengths = sixteen_lengths(rng, 1600 if args.quick else 4589)
    if "startup" in args.cases:
        start = start_up(provider, model, min(pairs, 2), start_lengths, args.seed, log, limit_bytes)
    folder = tempfile.mkdtemp(prefix="art-bench-probe-")
    trainer = TrainerRank(TrainingRuntime.for_model(
        model, provider, trainer_options=TrainerRankOptions(
            probe_cache_dir=folder, test_memory_limit_bytes=limit_bytes)))
    plan: list[Case] = []
    if "16" in args.cases:
        plan.append(Case("16 sequences", sixteen_lengths(rng, 1600 if args.quick else 4589),
                         True, pairs * SIXTEEN_ROUNDS_PER_PAIR))
    if "1000" in args.cases:
        plan.append(Case("1,000 short items", short_lengths(100 if args.quick else 1000, rng),
                         False, pairs))
    if "10000" in args.cases:
        plan.append(Case("10,000 short items",
                         short_lengths(1000 if args.quick else 10000, rng), False,
                         1, warm_up="1000" not in args.cases))
    if "8k" in args.cases:
        # Megatron's unfused attention keeps the row's s^2 scores: the row needs a larger
        # limit than the other cases' (what a bigger GPU would give it).
        plan.append(Case("one 8k-token row", [2048 if args.quick else 8192], True,
                         min(pairs, 2), limit_mib=max(args.limit_mib, 16384)))
    trainers = {args.limit_mib: trainer}
    cases: list[Case] = []
    for case in plan:
        limit = case.limit_mib or args.limit_mib
        if limit not in trainers:
            trainers[limit] = TrainerRank(TrainingRuntime.for_model(
                model, provider, trainer_options=TrainerRankOptions(
                    probe_cache_dir=folder, test_memory_limit_bytes=limit * 2**20)))
        cases.append(run_case(case, trainers[limit], provider, args.seed, log, limit * 2**20))
    meta = {
        "command": "scripts/bench_throughput.py" + (" " + " ".join(argv or sys.argv[1:])
                                                    if (argv or sys.argv[1:]) else ""),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}, "
                   f"torch {torch.__version__}, {torch.get_num_threads()} threads",
        "model": f"Qwen3-shaped, {args.layers} layers, hidden {hidden}, vocab {VOCAB}",
        "build": f"local spec, {args.attention} attention (CPU); virtual limit "
                 f"{args.limit_mib:,} MiB standing in for a GPU's memory",
        "start_up_items": f"16 sequences, {sum(start_lengths):,} tokens, grad",
    }
    out.mkdir(parents=True, exist_ok=True)
    print(write_report(cases, start, meta, out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
