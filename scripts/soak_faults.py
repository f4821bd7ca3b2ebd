"""Fault soak: many injected OOMs (tests/reliability/_faults.py) on the tiny LoRA model.

Each trial runs a random small workload, injects one OOM at a random allocation inside a
transformer layer's forward, the output head, or the caller's backward, and checks that
nothing escaped, every item ran once (or was declined and listed), outputs equal the unpacked
reference and, with grad, the LoRA gradients equal a fault-free run. Prints the counts as JSON;
exits 1 on the first broken invariant.

    .venv/bin/python scripts/soak_faults.py --trials 60
"""

from __future__ import annotations

import argparse
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
sys.path[:0] = [str(ROOT / "tests" / "reliability"), str(ROOT / "tests")]
os.environ.setdefault("OMP_NUM_THREADS", "1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the counts as JSON here")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("art.trainer_rank").setLevel(logging.ERROR)

    from _faults import fault_trial, locations
    from _fuzz import ReferencePool, fuzz_provider

    from art.megatron.distributed import initialize_distributed

    initialize_distributed()
    provider = fuzz_provider()
    model = provider.build_model(seed=0)
    rng = random.Random(args.seed)
    pool = ReferencePool(model, rng)
    pool.draw_length = lambda: rng.randint(1, 256)
    counts: Counter = Counter()
    started = time.perf_counter()
    for trial in range(args.trials):
        grad = trial % 3 != 2
        where = locations(grad)
        location = where[(trial // 3) % len(where)]
        try:
            fault_trial(provider, model, rng, pool, grad=grad, location=location, counts=counts)
        except AssertionError as exc:
            print(f"INVARIANT BROKEN (seed {args.seed}, trial {trial}, {location}, grad "
                  f"{grad}): {exc}", file=sys.stderr)
            return 1
    summary = dict(counts, trials=args.trials, seed=args.seed,
                   seconds=round(time.perf_counter() - started, 1))
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
