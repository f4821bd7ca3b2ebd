"""Workload soak: the reliability fuzzer (tests/reliability/_fuzz.py) for many calls.

Random forward_micro_batches calls on a tiny LoRA Megatron-Core model on CPU under virtual
memory limits; every call is checked against the invariants in _fuzz.py (no OOM escapes,
every item once or declined, outputs equal the unpacked reference, declines exactly the items
that cannot fit). Prints one JSON line of counts per seed and the totals; exits 1 on the first
broken invariant, with the seed and call number to reproduce it.

    .venv/bin/python scripts/soak_workload.py --calls 500 --seeds 0 1
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "reliability"), str(ROOT / "tests")]
os.environ.setdefault("OMP_NUM_THREADS", "1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=500, help="calls per seed")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--out", type=Path, default=None, help="write the totals as JSON here")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("art.trainer_rank").setLevel(logging.ERROR)

    from _fuzz import WorkloadFuzzer, fuzz_provider

    from art.megatron.distributed import initialize_distributed

    initialize_distributed()
    provider = fuzz_provider()
    model = provider.build_model(seed=0)
    totals: Counter = Counter()
    decisions: Counter = Counter()
    started = time.perf_counter()
    for seed in args.seeds:
        fuzzer = WorkloadFuzzer(model, provider, seed=seed)
        t0 = time.perf_counter()
        try:
            counts = fuzzer.run(args.calls)
        except AssertionError as exc:
            print(f"INVARIANT BROKEN (seed {seed}): {exc}", file=sys.stderr)
            return 1
        row = counts.as_dict()
        row.update(seed=seed, seconds=round(time.perf_counter() - t0, 1))
        print(json.dumps(row), flush=True)
        decisions.update(row.pop("decisions"))
        totals.update({k: v for k, v in row.items() if k not in ("seed", "seconds")})
    command = " ".join(["scripts/soak_workload.py", *(sys.argv[1:] if argv is None else argv)])
    summary = dict(totals, decisions=dict(decisions), seeds=args.seeds,
                   seconds=round(time.perf_counter() - started, 1), command=command)
    print("TOTAL " + json.dumps(summary))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
