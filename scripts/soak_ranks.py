"""Rank soak: random workloads with OOMs injected on one rank, under torchrun with real ranks
(gloo): DP=2 (two model replicas) or TP=2 (one replica of both ranks, sequence parallel). The
worker (soak_ranks_worker.py) checks after every workload that each item ran once or was
declined and listed, that outputs equal the reference, and at TP=2 that a fault before any
collective is recovered and any other ends the call on both ranks with the same error; this
script adds the hang check (its own timeout) and writes the layout's entry of
bench/soak_ranks.json: workloads, faults injected, ranks, escaped OOMs, hangs, items lost and
duplicated (the other layout's entry is kept as its run wrote it).

    .venv/bin/python scripts/soak_ranks.py --layout dp2 --workloads 200
    .venv/bin/python scripts/soak_ranks.py --layout tp2 --workloads 200
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from art.megatron.distributed import free_port  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", choices=("dp2", "tp2"), default="dp2")
    parser.add_argument("--timeout-s", type=float, default=3600.0,
                        help="a run still going after this long counts as a hang")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "soak_ranks.json")
    args = parser.parse_args(argv)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory() as tmp:
        counts_file = Path(tmp) / "counts.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               f"--master_port={free_port()}", "--master_addr=127.0.0.1",
               str(ROOT / "scripts" / "soak_ranks_worker.py"), str(counts_file),
               str(args.workloads), str(args.seed), args.layout, str(free_port())]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                                  timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            summary = {"workloads": args.workloads, "ranks": 2, "hangs": 1, "seed": args.seed,
                       "layout": args.layout}
        else:
            if proc.returncode != 0 or not counts_file.exists():
                print(proc.stdout[-4000:], proc.stderr[-8000:], file=sys.stderr)
                print("soak run failed (an invariant broke or a rank crashed)", file=sys.stderr)
                return 1
            summary = json.loads(counts_file.read_text())
    summary["command"] = (f"scripts/soak_ranks.py --layout {args.layout} --workloads "
                          f"{args.workloads} --seed {args.seed}")
    print(json.dumps(summary, indent=1, sort_keys=True))
    entries = {}
    if args.out.exists():
        entries = json.loads(args.out.read_text())
        if "workloads" in entries:  # the file of one DP=2 run, before layouts had entries
            entries = {"dp2": entries}
    entries[args.layout] = summary
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
    bad = any(summary.get(key, 0) for key in (
        "hangs", "escaped OOMs", "items lost", "items duplicated",
        "items yielded twice on one rank", "workloads where ranks disagree",
        "fatal errors not naming the failing rank"))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
