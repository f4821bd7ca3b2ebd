#!/usr/bin/env python
"""Wall time of one RL step under the three recompute settings -> bench/recompute.md.

    .venv/bin/python scripts/bench_recompute.py            # the benchmark (minutes)
    .venv/bin/python scripts/bench_recompute.py --quick    # small sizes, one round

One fixed RL-shaped workload (seeded groups of rollouts sharing their prompt, long-tailed
lengths, target logprobs, a policy-gradient loss and backward per micro-batch) under virtual
memory limits at which selective recompute does not fit the longest group: a fraction of the
way from what that group needs under full recompute to what it needs under selective
core_attn (`--fractions`, default 0.8 and 0.4: a limit just under selective's need and a tight
one). Three settings,
each on a model built from the same weights:
- always full: built with full recompute (uniform, 1), ART_TRAINER_RANK_RECOMPUTE=configured
  (ART's default policy, run as it is);
- escalate from selective: built with selective core_attn, RECOMPUTE=escalate;
- adaptive from full: built with full recompute, RECOMPUTE=adaptive;
and, for reference, adaptive from full with the limit raised to what the longest group needs
without recompute (no micro-batch recomputes anything). It is not a floor: its micro-batches
are larger, and where attention runs over the whole packed row (the unfused CPU build) a
larger row costs more per token.
Each runs the workload once to learn its profiles (not timed), then the rounds interleave the
three (the order rotates from round to round). The table gives the median wall time of each
and the median over rounds of its time over always full's in the same round, the rungs that
ran, OOMs, and whether every output came back.
Timings are benchmarks, not tests. Goal: both ratios <= 0.80.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
os.environ.setdefault("OMP_NUM_THREADS", "2")
BENCH = ROOT / "bench"
README_START = "<!-- bench_recompute.py: start -->"
README_END = "<!-- bench_recompute.py: end -->"
GOAL = 0.80
FLOOR = "no recompute (limit raised to fit it)"
FULL_ENV = {"ART_MEGATRON_RECOMPUTE_GRANULARITY": "full",
            "ART_MEGATRON_RECOMPUTE_METHOD": "uniform",
            "ART_MEGATRON_RECOMPUTE_NUM_LAYERS": "1"}
SELECTIVE_ENV = {"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective"}


@dataclass
class Setting:
    name: str
    built_with: str  # "full" or "selective"
    recompute: str  # ART_TRAINER_RANK_RECOMPUTE
    seconds: list[float] = field(default_factory=list)
    micro_batches: int = 0
    rungs: dict[str, int] = field(default_factory=dict)  # recompute summary -> micro-batches
    ooms: int = 0
    declined: int = 0
    outputs_missing: int = 0

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)


def _provider(env: dict[str, str], hidden: int, layers: int, vocab: int,
              attention: str = "flash") -> Any:
    from peft import LoraConfig

    from art.megatron.geometry import geometry_from_hf_dict
    from art.megatron.implementation import Implementation
    from art.megatron.provider import Provider
    from art.megatron.settings import load_settings

    geometry = geometry_from_hf_dict(
        dict(model_type="qwen3", num_hidden_layers=layers, hidden_size=hidden,
             intermediate_size=3 * hidden, num_attention_heads=8, num_key_value_heads=4,
             head_dim=hidden // 8, vocab_size=vocab, max_position_embeddings=16384,
             torch_dtype="float32"),
        name=f"qwen3-{layers}x{hidden}")
    return Provider(geometry, settings=load_settings(env),
                    lora=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
                    dtype="float32", implementation=Implementation.cpu_local(attention))


def one_pass(trainer: Any, inputs: list[Any]) -> tuple[float, list[Any], int]:
    """One call as an RL driver makes it: (seconds, the micro-batches' stats, outputs)."""
    from art.trainer_rank import TrainerRankMemoryError

    before = len(trainer.stats_history)
    outputs = 0
    started = time.perf_counter()
    try:
        for mb in trainer.forward_micro_batches(inputs):
            loss = -sum(out.target_logprobs.sum() for group in mb.outputs for out in group)
            loss.backward()
            outputs += sum(len(group) for group in mb.outputs)
    except TrainerRankMemoryError:
        pass  # declined items: counted from the stats below
    seconds = time.perf_counter() - started
    trainer.zero_grad()
    return seconds, trainer.stats_history[before:], outputs


def record(setting: Setting, stats: list[Any], outputs: int, sequences: int) -> None:
    setting.micro_batches = len([s for s in stats if s.decision != "declined"])
    setting.rungs = dict(Counter(s.recompute_summary for s in stats))
    setting.ooms += sum(s.retries for s in stats)
    setting.declined += sum(1 for s in stats if s.decision == "declined")
    setting.outputs_missing += sequences - outputs


def chosen_limit(trainer: Any, items: list[Any], selective: Any, none_recompute: Any,
                 fraction: float) -> tuple[int, dict[str, int]]:
    """The usable bytes at which the longest group fits under full recompute but not under
    selective core_attn: `fraction` of the way from the first to the second."""
    from art.trainer_rank.compute.items import make_items

    largest = max(make_items(items), key=lambda it: it.num_tokens)
    admission = trainer.admission
    full = admission.price(largest.leaves, True)[0].dynamic_bytes
    sel = admission.price(largest.leaves, True, selective)[0].dynamic_bytes
    none = admission.price(largest.leaves, True, none_recompute)[0].dynamic_bytes
    return int(full + fraction * (sel - full)), {"largest_group_tokens": largest.num_tokens,
                                            "full_bytes": int(full), "selective_bytes": int(sel),
                                            "none_bytes": int(none)}


def round_ratios(setting: Setting, base: Setting) -> list[float]:
    """The setting's time over always full's, round by round: both ran in the same round, so
    a drift of the machine between rounds falls on both."""
    return [t / b for t, b in zip(setting.seconds, base.seconds, strict=True)]


def _run_lines(settings: list[Setting], run: dict[str, Any]) -> list[str]:
    base = next(s for s in settings if s.name == "always full")
    lines = [
        f"### Limit {run['limit_mib']:.1f} MiB usable per micro-batch ({run['fraction']:g} of "
        "the way from full to selective for the longest group)",
        "",
        "| setting | built with | RECOMPUTE | median s | ratio to always full (median over "
        "rounds) | ratio range | goal | micro-batches | OOMs | declined | outputs missing |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in settings:
        ratios = round_ratios(s, base)
        ratio = statistics.median(ratios)
        goal = "-" if s.name in ("always full", FLOOR) else (
            f"<= {GOAL:.2f} {'met' if ratio <= GOAL else 'missed'}")
        lines.append(f"| {s.name} | {s.built_with} | {s.recompute} | {s.median_s:.2f} | "
                     f"{ratio:.3f} | {min(ratios):.3f}-{max(ratios):.3f} | {goal} | "
                     f"{s.micro_batches} | {s.ooms} | {s.declined} | {s.outputs_missing} |")
    lines += ["", "Rungs that ran (micro-batches per rung, last round):", ""]
    for s in settings:
        rungs = "; ".join(f"{name}: {n}" for name, n in sorted(s.rungs.items()))
        lines.append(f"- {s.name}: {rungs}")
    lines += ["", "Every round: " + ", ".join(
        f"{s.name} " + " / ".join(f"{t:.2f}" for t in s.seconds) for s in settings) + " s.", ""]
    return lines


def write_report(runs: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> str:
    lines = [
        "# Recompute: always full against escalate and adaptive (CPU)",
        "",
        f"Command: `{meta['command']}` on {meta['machine']}, {meta['date']}. Model: "
        f"{meta['model']}, rank-8 LoRA on every linear, fp32, "
        f"{meta.get('build', 'default CPU build')}. Workload: "
        f"{meta['workload']}. The longest group ({meta['largest_group_tokens']:,} tokens) "
        f"needs {meta['selective_mib']:.1f} MiB under selective core_attn and "
        f"{meta['full_mib']:.1f} MiB under full recompute. {meta['rounds']} timed round(s) "
        "per setting after one warm-up call each, interleaved. The last row of each table "
        "is a reference, not a floor: its limit is raised until no recompute fits, so the "
        "workload packs into other micro-batches"
        + (", and on the unfused CPU build attention runs over the whole packed row, so a "
           "larger row costs more per token." if "unfused" in meta.get("build", "unfused")
           else "."),
        "",
    ]
    for run in runs:
        lines += _run_lines([Setting(**s) for s in run["settings"]], run)
    report = "\n".join(lines).rstrip() + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "recompute.md").write_text(report)
    (out / "recompute.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=2)
                                        + "\n")
    return report


def update_readme(report: str, readme: Path = ROOT / "README.md") -> None:
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        return
    body = report.split("\n", 2)[2].strip().replace("\n### ", "\n#### ")
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(f"{head}{README_START}\n{body}\n{README_END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one round")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--attention", choices=("unfused", "flash"), default="flash",
                        help="the CPU build's attention (default: the CPU default)")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.8, 0.4],
                        help="limits, as fractions of the way from full recompute's to "
                             "selective's need for the longest group (each < 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(BENCH))
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the page (and README's block) from <out>/recompute.json")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.report_only:
        saved = json.loads((out / "recompute.json").read_text())
        report = write_report(saved["runs"], saved["meta"], out)
        if out == BENCH:
            update_readme(report)
        print(report)
        return 0
    warnings.filterwarnings("ignore")
    import torch

    from art.megatron.train import TrainingRuntime
    from art.trainer_rank import TrainerRank, TrainerRankOptions

    from _workload import WorkloadSpec, forward_inputs, rl_groups

    torch.manual_seed(args.seed)
    vocab = 512
    spec = WorkloadSpec(groups=4 if args.quick else args.groups,
                        rollouts_per_group=args.rollouts, max_tokens=1500, vocab_size=vocab,
                        seed=args.seed)
    groups = rl_groups(spec)
    inputs = forward_inputs(groups)
    sequences = sum(len(g) for g in inputs)
    hidden = 64 if args.quick else args.hidden
    layers = 4 if args.quick else args.layers
    providers = {"full": _provider(FULL_ENV, hidden, layers, vocab, args.attention),
                 "selective": _provider(SELECTIVE_ENV, hidden, layers, vocab, args.attention)}
    providers["full"].initialize_distributed()
    models = {kind: p.build_model(seed=args.seed) for kind, p in providers.items()}
    folder = tempfile.mkdtemp(prefix="art-bench-probe-")

    def trainer(kind: str, recompute: str, limit: int) -> Any:
        return TrainerRank(TrainingRuntime.for_model(
            models[kind], providers[kind], trainer_options=TrainerRankOptions(
                probe_cache_dir=folder, test_memory_limit_bytes=limit, recompute=recompute)))

    # The limit: priced by an always-full trainer with room, offset by what the trainer
    # holds beside the micro-batch (the gradient snapshot) as its first call shows.
    roomy_limit = 16 * 2**30
    roomy = trainer("full", "configured", roomy_limit)
    _, stats, _ = one_pass(roomy, inputs)
    offset = roomy_limit - min(s.available_bytes for s in stats)
    rounds = 1 if args.quick else args.rounds
    runs: list[dict[str, Any]] = []
    bad: list[str] = []
    for fraction in args.fractions:
        if not 0 <= fraction < 1:
            raise SystemExit(f"--fractions {fraction}: each must be in [0, 1)")
        usable, priced = chosen_limit(roomy, inputs, providers["selective"].effective_recompute,
                                      providers["full"].recompute_as(None), fraction)
        floor = int(priced["none_bytes"] * 1.1)
        settings = [Setting("always full", "full", "configured"),
                    Setting("escalate from selective", "selective", "escalate"),
                    Setting("adaptive from full", "full", "adaptive"),
                    Setting(FLOOR, "full", "adaptive")]
        trainers = {s.name: trainer(s.built_with, s.recompute,
                                    (floor if s.name == FLOOR else usable) + offset)
                    for s in settings}
        for s in settings:  # warm-up: the profiles of every rung this setting runs
            _, stats, _ = one_pass(trainers[s.name], inputs)
            print(f"{s.name}: warm-up, {len(stats)} micro-batches", flush=True)
        for r in range(rounds):
            order = settings[r % len(settings):] + settings[:r % len(settings)]
            for s in order:
                seconds, stats, outputs = one_pass(trainers[s.name], inputs)
                s.seconds.append(seconds)
                s.ooms = s.declined = s.outputs_missing = 0
                record(s, stats, outputs, sequences)
                print(f"limit {usable / 2**20:.1f} MiB, round {r + 1}/{rounds}: {s.name} "
                      f"{seconds:.2f} s ({s.rungs})", flush=True)
        runs.append({"fraction": fraction, "limit_mib": usable / 2**20,
                     "settings": [asdict(s) for s in settings]})
        bad += [s.name for s in settings if s.ooms or s.outputs_missing or s.declined]
        del trainers
    tokens = sum(g.num_tokens for g in groups)
    meta = {
        "command": "scripts/bench_recompute.py" + (" " + " ".join(argv or sys.argv[1:])
                                                   if (argv or sys.argv[1:]) else ""),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}, "
                   f"torch {torch.__version__}",
        "model": f"Qwen3-shaped, {layers} layers, hidden {hidden}",
        "build": ("default CPU build (segmented flash attention)" if args.attention == "flash"
                  else "CPU build with Megatron's unfused attention"),
        "workload": f"{spec.groups} prompts x {spec.rollouts_per_group} rollouts sharing their "
                    f"prompt, {spec.min_tokens}-{spec.max_tokens} tokens each (seed "
                    f"{args.seed}), {tokens:,} tokens",
        "largest_group_tokens": priced["largest_group_tokens"],
        "selective_mib": priced["selective_bytes"] / 2**20,
        "full_mib": priced["full_bytes"] / 2**20,
        "rounds": rounds,
    }
    report = write_report(runs, meta, out)
    # README shows the default build's figures; other builds and sizes keep their own page.
    if not args.quick and args.attention == "flash" and out == BENCH:
        update_readme(report)
    print(report)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
