"""Rank soak: random workloads with OOMs injected, under torchrun with real ranks (gloo):
DP=2 (two model replicas, faults on one rank), TP=2 (one replica of both ranks, sequence
parallel, faults on one rank) or TP=2 x DP=2 (four ranks, two replicas, faults on two ranks
at once). The worker (soak_ranks_worker.py) checks after every workload that each item ran
once or was declined and listed, that outputs equal the reference, and on TP layouts that a
fault before any collective is recovered and any other ends the call on every rank with the
same error; this script adds the hang check (its own timeout: the whole launch is killed
then, and counted as a hang) and writes the layout's entry of bench/soak_ranks.json:
workloads, faults injected, ranks, escaped OOMs, hangs, items lost and duplicated (the other
layouts' entries are kept as their runs wrote them).

    .venv/bin/python scripts/soak_ranks.py --layout dp2 --workloads 1000
    .venv/bin/python scripts/soak_ranks.py --layout tp2 --workloads 1000
    .venv/bin/python scripts/soak_ranks.py --layout tp2dp2 --workloads 1000
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
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from art.megatron.distributed import free_port  # noqa: E402

from _torchrun import kill_launch  # noqa: E402

RANKS = {"dp2": 2, "tp2": 2, "tp2dp2": 4}
# Seconds per workload allowed before a run counts as a hang (plus 600 s for start-up): on
# two cores a workload took 0.34 s at DP=2 and 0.84 s at TP=2 (the 200-workload runs) and
# 1.8 s at TP=2 x DP=2 (a 10-workload run), so about 5-10 times that, for a loaded machine.
SECONDS_PER_WORKLOAD = {"dp2": 3.0, "tp2": 6.0, "tp2dp2": 12.0}


def _keep_log(path: Path | None, stdout: str, stderr: str) -> None:
    if path is not None:
        path.write_text(f"--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}")
        print(f"the launch's whole output: {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", choices=tuple(RANKS), default="dp2")
    parser.add_argument("--timeout-s", type=float, default=None,
                        help="a run still going after this long counts as a hang (default: "
                             "600 s plus a per-workload allowance of the layout)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "soak_ranks.json")
    parser.add_argument("--log", type=Path, default=None,
                        help="write a failed or hung launch's whole output here (only its "
                             "tail is printed)")
    args = parser.parse_args(argv)
    if args.workloads < 1:
        parser.error(f"--workloads {args.workloads}: must be 1 or more")
    timeout_s = args.timeout_s or 600 + SECONDS_PER_WORKLOAD[args.layout] * args.workloads
    ranks = RANKS[args.layout]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if args.log is not None:
        env["ART_SOAK_VERBOSE"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        counts_file = Path(tmp) / "counts.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
               f"--master_port={free_port()}", "--master_addr=127.0.0.1",
               str(ROOT / "scripts" / "soak_ranks_worker.py"), str(counts_file),
               str(args.workloads), str(args.seed), args.layout, str(free_port())]
        # Its own session, so that a hang is ended whole: torchrun and every worker.
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=ROOT, start_new_session=True) as proc:
            try:
                stdout, stderr = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                kill_launch(proc.pid)
                stdout, stderr = proc.communicate()
                _keep_log(args.log, stdout, stderr)
                print(stdout[-4000:], stderr[-8000:], file=sys.stderr)
                summary = {"workloads": args.workloads, "ranks": ranks, "hangs": 1,
                           "seed": args.seed, "layout": args.layout,
                           "timeout_s": round(timeout_s)}
            else:
                if proc.returncode != 0 or not counts_file.exists():
                    _keep_log(args.log, stdout, stderr)
                    print(stdout[-4000:], stderr[-8000:], file=sys.stderr)
                    print("soak run failed (an invariant broke or a rank crashed)",
                          file=sys.stderr)
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
