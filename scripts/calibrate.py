#!/usr/bin/env python
"""Calibrate the memory model against real Megatron-Core runs on this machine's device.

    .venv/bin/python scripts/calibrate.py                 # full TP=1 matrix + TP=2 subset
    .venv/bin/python scripts/calibrate.py --quick         # a few cells, seconds
    .venv/bin/python scripts/calibrate.py --tp 2 --out bench/calibration/tp2  # TP=2 only
    .venv/bin/python scripts/calibrate.py --build gpu-shaped --tp 1 \
        --out bench/calibration/gpu-shaped
    .venv/bin/python scripts/calibrate.py --geometries hybrid-128 hybrid-moe-128 --tp 1 \
        --out bench/calibration/hybrid  # Gated DeltaNet + attention, dense and MoE
    .venv/bin/python scripts/calibrate.py --tp 2 --geometries hybrid-128 hybrid-moe-128 \
        --out bench/calibration/hybrid-tp2  # the hybrids on two torchrun ranks
    .venv/bin/python scripts/calibrate.py --geometries moe-128 --tp 1 \
        --out bench/calibration/moe  # attention + routed experts in every layer (Qwen3-MoE)
    .venv/bin/python scripts/calibrate.py --tp 2 --geometries moe-128 \
        --out bench/calibration/moe-tp2  # the MoE model on two torchrun ranks
    .venv/bin/python scripts/calibrate.py --rungs --out bench/calibration/rungs  # recompute
        # rungs switched at run time on models built with another policy, dense and hybrid,
        # TP=1 and TP=2
    .venv/bin/python scripts/calibrate.py --cp 2 --out bench/calibration/cp2  # TP=1 x CP=2,
        # dense models on two torchrun ranks (independent sequences and shared prompts)
    .venv/bin/python scripts/calibrate.py --cp 2 --geometries hybrid-128 --rows-per-model 3 \
        --out bench/calibration/hybrid-cp2  # the hybrid at CP=2
    .venv/bin/python scripts/calibrate.py --reprice bench/calibration/calibration.csv \
        --out bench/calibration [--reprobe]  # re-price measured rows, no cell re-run

Every cell runs the trainer's compute path (pack -> decoder -> chunked head -> caller loss ->
backward) and compares the measured dynamic peak (bytes allocated inside the micro-batch)
with the estimate's max(forward peak, backward peak), with probe coefficients (target
[1.00, 1.05]) and with the default formulas (reported alongside). `--build gpu-shaped` runs the
same matrix on the CPU stand-ins of the GPU build's fused kernels (art/megatron/cpu_fused.py:
RMSNorm, SwiGLU, RoPE; segmented flash attention), so the pricing of those kernels is
measured. The hybrid geometries (Qwen3.5-style: three Gated DeltaNet layers and one gated
attention layer, dense and MoE) are a seeded matrix of their own, every recompute policy, and
so is the MoE one (Qwen3-MoE-style: attention and routed experts in every layer);
`--tp 2 --geometries ...` measures them on two torchrun ranks (five policies, the MoE one with
sequence parallel, which Megatron-Core's MoE layer needs at TP > 1).
Writes calibration.csv, calibration.md and calibration.png to --out (default
bench/calibration; TP=1 and TP=2 rows into one --out share one CSV, so keep separate folders
when running them separately). `--reprice` re-prices both columns of a measured CSV with the
current memory model and the probes stored in <out>/probes under the current probe's key
(TP=2 rows: each rank's probe in <out>/probes/rank<R>, the row priced by the highest of
them); `--reprobe` measures again the TP=1 probes stored under another key (another probe
version).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
TP2_GEOMETRY = "gqa-128"  # the TP=2 subset's model


RUNG_GEOMETRIES = ("gqa-128", "hybrid-128", "hybrid-moe-128")


def rung_matrix(args: argparse.Namespace, tensor_parallel: int) -> list:
    """`--rungs`: each recompute rung switched at run time on a model built with selective
    core_attn or with full recompute (`_calibration.cells.RUNGS_BY_BUILT`), a dense and a
    hybrid model, seeded grad rows."""
    from _calibration.cells import rung_cells

    geometries = tuple(args.geometries or RUNG_GEOMETRIES)
    rows = args.rows_per_model or (1 if args.quick else 3 if tensor_parallel == 1 else 2)
    return rung_cells(args.seed + tensor_parallel - 1, geometries=geometries, rows=rows,
                      tensor_parallel=tensor_parallel,
                      max_tokens=1500 if args.quick else min(args.max_tokens, 3000
                                                             if tensor_parallel > 1 else 4096))


def tp1_cells(args: argparse.Namespace) -> list:
    if args.rungs:
        return rung_matrix(args, 1)
    from _calibration.cells import (
        DENSE_GEOMETRIES,
        HYBRID_GEOMETRIES,
        MOE_GEOMETRIES,
        POLICY_BY_NAME,
        off_grid_matrix,
        shared_prefix_cells,
    )

    if args.quick:
        return off_grid_matrix(args.seed, rows_per_model=2, geometries=("gqa-128",),
                               policies=("none", "selective core_attn+mlp", "full uniform 2"),
                               max_tokens=1500, build=args.build)
    # Each family is its own seeded matrix (the dense one as it always was); without
    # --geometries the dense one runs, the hybrids measure into their own --out.
    wanted = set(args.geometries or DENSE_GEOMETRIES)
    cells = []
    for family in (DENSE_GEOMETRIES, HYBRID_GEOMETRIES, MOE_GEOMETRIES):
        if wanted & set(family):
            cells += off_grid_matrix(args.seed, rows_per_model=args.rows_per_model or 5,
                                     max_tokens=args.max_tokens, build=args.build,
                                     geometries=family)
    if wanted & set(HYBRID_GEOMETRIES):
        # Groups sharing a prompt through the Gated DeltaNet layers' prefix-tree path.
        cells += shared_prefix_cells(args.seed, geometries=HYBRID_GEOMETRIES,
                                     policies=tuple(POLICY_BY_NAME), rows=2,
                                     max_tokens=args.max_tokens, build=args.build)
    if args.geometries:
        cells = [c for c in cells if c.geometry in args.geometries]
    if args.policies:
        cells = [c for c in cells if c.policy in args.policies]
    return cells


TP2_POLICIES = ("none", "selective default", "selective core_attn+mlp", "full uniform 1",
                "full uniform 2")
TP2_HYBRID_ROWS = 3  # rows with grad per hybrid model at TP=2 (two shared cores, ~10 min)


def tp2_cells(quick: bool, seed: int, build: str = "local",
              geometries: Sequence[str] | None = None,
              rows_per_model: int | None = None) -> list:
    """The TP=2 matrix: the dense subset (TP2_GEOMETRY) without `geometries` or when they
    name it, and the hybrids and MoE models they name. Each family is its own seeded matrix,
    so the dense rows stay those of earlier runs whatever else is measured."""
    from _calibration.cells import (
        HYBRID_GEOMETRIES,
        MOE_GEOMETRIES,
        off_grid_matrix,
        shared_prefix_cells,
    )

    policies = ("none", "selective default", "full uniform 1") if quick else TP2_POLICIES
    cells = []
    if not geometries or TP2_GEOMETRY in geometries:
        cells += off_grid_matrix(seed + 1, rows_per_model=2 if quick else 4,
                                 tensor_parallel=2, geometries=(TP2_GEOMETRY,),
                                 policies=policies, max_tokens=1500 if quick else 3000,
                                 build=build)
    rows = 2 if quick else rows_per_model or TP2_HYBRID_ROWS
    hybrids = [g for g in HYBRID_GEOMETRIES if g in (geometries or ())]
    if hybrids:
        cells += [c for c in off_grid_matrix(seed + 1, rows_per_model=rows, tensor_parallel=2,
                                             geometries=HYBRID_GEOMETRIES, policies=policies,
                                             max_tokens=1500 if quick else 3000, build=build)
                  if c.geometry in hybrids]
        # Groups sharing a prompt: the prefix-tree path with the Gated DeltaNet heads split.
        cells += [c for c in shared_prefix_cells(seed + 1, geometries=HYBRID_GEOMETRIES,
                                                 policies=policies, rows=1, tensor_parallel=2,
                                                 max_tokens=1500 if quick else 3000,
                                                 build=build)
                  if c.geometry in hybrids]
    moes = [g for g in MOE_GEOMETRIES if g in (geometries or ())]
    if moes:
        cells += [c for c in off_grid_matrix(seed + 1, rows_per_model=rows,
                                             tensor_parallel=2, geometries=MOE_GEOMETRIES,
                                             policies=policies,
                                             max_tokens=1500 if quick else 3000, build=build)
                  if c.geometry in moes]
    return cells


# The CP=2 matrix's models: dense (Gated DeltaNet has no CP here), GQA and MQA.
CP2_GEOMETRIES = ("gqa-128", "mqa-192")


def cp2_cells(quick: bool, seed: int, build: str = "local",
              rows_per_model: int | None = None,
              geometries: Sequence[str] | None = None) -> list:
    """The CP=2 matrix: the dense models (or `geometries`, e.g. the hybrid) at TP=1 x CP=2,
    seeded rows of independent sequences and groups sharing a prompt (the segmented flash
    attention over the split row)."""
    from dataclasses import replace

    from _calibration.cells import off_grid_matrix, shared_prefix_cells

    policies = ("none", "selective default", "full uniform 1") if quick else TP2_POLICIES
    top = 1500 if quick else 3000
    chosen = tuple(geometries or (CP2_GEOMETRIES[:1] if quick else CP2_GEOMETRIES))
    cells = off_grid_matrix(seed + 2, rows_per_model=2 if quick else rows_per_model or 4,
                            geometries=chosen, policies=policies, max_tokens=top,
                            build=build)
    cells += shared_prefix_cells(seed + 2, geometries=chosen, policies=policies,
                                 rows=1 if quick else 2, max_tokens=top, build=build)
    return [replace(c, context_parallel=2) for c in cells]


EP2_GEOMETRIES = ("hybrid-moe-128",)


def ep2_cells(quick: bool, seed: int, build: str = "local",
              rows_per_model: int | None = None,
              geometries: Sequence[str] | None = None, tensor_parallel: int = 1) -> list:
    """The MoE matrix at EP=2 on two ranks: each rank holds half the experts (whole: expert
    TP 1). At TP=1 both feed the same seeded row, so every rank's experts take both ranks'
    tokens routed to them; at TP=2 (sequence parallel) the two ranks are one TP group, each
    holding half the row's tokens, and the experts take the pairs of both halves."""
    from dataclasses import replace

    from _calibration.cells import off_grid_matrix, shared_prefix_cells

    policies = ("none", "selective default", "full uniform 1") if quick else TP2_POLICIES
    top = 1500 if quick else 3000
    chosen = tuple(geometries or EP2_GEOMETRIES)
    cells = off_grid_matrix(seed + 3, rows_per_model=2 if quick else rows_per_model or 3,
                            geometries=chosen, policies=policies, max_tokens=top,
                            build=build)
    cells += shared_prefix_cells(seed + 3, geometries=chosen, policies=policies,
                                 rows=1, max_tokens=top, build=build)
    return [replace(c, expert_parallel=2, tensor_parallel=tensor_parallel) for c in cells]


def ep_tensor_parallel(args: argparse.Namespace) -> int:
    """The EP matrix's TP size: 2 only when asked for alone (`--ep 2 --tp 2`)."""
    return 2 if args.ep > 1 and args.tp == [2] else 1


def tp2_wanted(geometries: Sequence[str] | None) -> bool:
    """Whether the geometries asked for have TP=2 cells (all but the dense ones TP=1 only)."""
    from _calibration.cells import HYBRID_GEOMETRIES, MOE_GEOMETRIES

    return not geometries or bool({TP2_GEOMETRY, *HYBRID_GEOMETRIES, *MOE_GEOMETRIES}
                                  & set(geometries))


def worker(args: argparse.Namespace) -> int:
    """Inside torchrun: every rank measures (and stores its probes); rank 0 writes one row
    per cell (`merge_rank_rows`)."""
    import torch.distributed as dist
    from _calibration.harness import merge_rank_rows, run_cells

    cp, ep = args.cp, args.ep
    if ep > 1:
        cells = ep2_cells(args.quick, args.seed, args.build, args.rows_per_model,
                          args.geometries, tensor_parallel=ep_tensor_parallel(args))
    elif cp > 1:
        cells = cp2_cells(args.quick, args.seed, args.build, args.rows_per_model,
                          args.geometries)
    elif args.rungs:
        cells = rung_matrix(args, 2)
    else:
        cells = tp2_cells(args.quick, args.seed, args.build, args.geometries,
                          args.rows_per_model)
    rank = int(os.environ.get("RANK", "0"))
    results = run_cells(cells, tensor_parallel=(ep_tensor_parallel(args) if ep > 1 else
                                                1 if cp > 1 else 2),
                        context_parallel=cp, expert_parallel=ep,
                        progress=(lambda m: print(m, flush=True)) if rank == 0 else None,
                        store_probe_dir=(str(Path(args.worker_probes) / f"rank{rank}")
                                         if args.worker_probes else None))
    rows = [r.row() for r in results]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        Path(args.worker_out).write_text(json.dumps(merge_rank_rows(gathered)))
    return 0


def run_tp2(quick: bool, seed: int, build: str = "local",
            geometries: Sequence[str] | None = None,
            rows_per_model: int | None = None, probe_dir: str | None = None,
            rungs: bool = False, max_tokens: int = 4096, context_parallel: int = 1,
            expert_parallel: int = 1, tensor_parallel: int = 1) -> list[dict]:
    """The TP=2 cells (or with `context_parallel` 2 the TP=1 x CP=2 cells, with
    `expert_parallel` 2 the MoE cells at EP=2 and `tensor_parallel`) on two torchrun ranks;
    each rank's probes are stored under `probe_dir`/rank<R> (for `--reprice`)."""
    from art.megatron.distributed import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tp2.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               f"--master_port={free_port()}", "--master_addr=127.0.0.1", __file__,
               "--worker-out", str(out), "--seed", str(seed), "--build", build] + (
                   ["--quick"] if quick else []) + (
                   ["--geometries", *geometries] if geometries else []) + (
                   ["--rows-per-model", str(rows_per_model)] if rows_per_model else []) + (
                   ["--worker-probes", probe_dir] if probe_dir else []) + (
                   ["--rungs", "--max-tokens", str(max_tokens)] if rungs else []) + (
                   ["--cp", str(context_parallel)] if context_parallel > 1 else []) + (
                   ["--ep", str(expert_parallel), "--tp", str(tensor_parallel)]
                   if expert_parallel > 1 else [])
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=3600)
        if proc.returncode != 0:
            what = ("CP" if context_parallel > 1 else
                    "EP" if expert_parallel > 1 else "TP")
            raise SystemExit(f"{what}=2 calibration failed:\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
        return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random packed lengths")
    parser.add_argument("--rows-per-model", type=int,
                        help="seeded rows with grad per model (half as many without); "
                             "default 5 at TP=1 and TP2_HYBRID_ROWS for the TP=2 hybrids "
                             "(the dense TP=2 subset keeps its 4)")
    parser.add_argument("--max-tokens", type=int, default=4096, help="largest packed row")
    parser.add_argument("--geometries", nargs="*",
                        help="only these geometries (TP=2: gqa-128 and the hybrids)")
    parser.add_argument("--policies", nargs="*", help="only these recompute policies (TP=1)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "calibration"))
    parser.add_argument("--tp", type=int, choices=(1, 2), nargs="*", default=[1, 2])
    parser.add_argument("--cp", type=int, choices=(1, 2), default=1,
                        help="2: the dense matrix at TP=1 x CP=2 on two torchrun ranks only")
    parser.add_argument("--ep", type=int, choices=(1, 2), default=1,
                        help="2: the MoE matrix at EP=2 on two torchrun ranks only, at TP=1, "
                             "or with --tp 2 at TP=2 x EP=2 (expert TP 1)")
    parser.add_argument("--build", choices=("local", "local-unfused", "gpu-shaped"),
                        default="local",
                        help="local: the CPU's local spec (segmented flash attention); "
                             "local-unfused: the same with Megatron's unfused attention; "
                             "gpu-shaped: CPU stand-ins keeping what the GPU build's fused "
                             "kernels keep")
    parser.add_argument("--reprice", metavar="CSV",
                        help="re-price a measured CSV with the current memory model (both "
                             "columns; the probe's from <out>/probes) and rewrite the "
                             "outputs (no cell runs)")
    parser.add_argument("--reprobe", action="store_true",
                        help="with --reprice: probe again (TP=1) each model whose probe is "
                             "not stored under the current probe's key, e.g. after a change "
                             "to what the probe measures")
    parser.add_argument("--rungs", action="store_true",
                        help="the recompute rungs switched at run time (RUNGS_BY_BUILT) on "
                             "gqa-128, hybrid-128 and hybrid-moe-128 instead of the policy "
                             "matrix")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--worker-probes", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.worker_out:
        return worker(args)
    probe_dir = str(Path(args.out) / "probes")
    if args.geometries:
        from _calibration.cells import calibration_geometries

        unknown = sorted(set(args.geometries) - set(calibration_geometries()))
        if unknown:
            parser.error(f"unknown calibration geometries {unknown}; known: "
                         f"{sorted(calibration_geometries())}")
    if args.reprice:
        from _calibration.reprice import reprice_rows

        if args.reprobe:
            from art.megatron.distributed import initialize_distributed

            initialize_distributed()
        with open(args.reprice, newline="") as f:
            measured = [_typed(r) for r in csv.DictReader(f)]
        try:
            rows = reprice_rows(measured, probe_dir, reprobe=args.reprobe,
                                progress=lambda m: print(m, flush=True))
        except ValueError as exc:
            raise SystemExit(f"calibrate.py --reprice: {exc}") from None
        write_outputs(rows, Path(args.out), None, args.quick)
        return 0

    from _calibration.harness import run_cells

    from art.megatron.distributed import initialize_distributed

    start = time.time()
    rows: list[dict] = []
    if args.cp > 1 or args.ep > 1:
        rows = run_tp2(args.quick, args.seed, args.build, geometries=args.geometries,
                       rows_per_model=args.rows_per_model,
                       probe_dir=str(Path(probe_dir).resolve()), context_parallel=args.cp,
                       expert_parallel=args.ep,
                       tensor_parallel=ep_tensor_parallel(args))
        write_outputs(rows, Path(args.out), time.time() - start, args.quick)
        return 0
    if 2 in args.tp and (args.rungs or tp2_wanted(args.geometries)):
        rows += run_tp2(args.quick, args.seed, args.build, args.geometries,
                        args.rows_per_model, probe_dir=str(Path(probe_dir).resolve()),
                        rungs=args.rungs, max_tokens=args.max_tokens)
        print(f"TP=2: {len(rows)} cells in {time.time() - start:.0f} s", flush=True)
    if 1 in args.tp:
        initialize_distributed()
        partial = Path(args.out) / "calibration.partial.jsonl"
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text("")

        def keep(result) -> None:  # rows so far, for a look while the matrix runs
            with partial.open("a") as f:
                f.write(json.dumps(result.row()) + "\n")

        results = run_cells(tp1_cells(args), probe_dir=probe_dir,
                            on_result=keep,
                            progress=lambda m: print(m, flush=True))
        rows = [r.row() for r in results] + rows
    write_outputs(rows, Path(args.out), time.time() - start, args.quick)
    return 0


def _typed(row: dict) -> dict:
    ints = ("lora_rank", "tensor_parallel", "context_parallel", "expert_parallel",
            "packed_tokens", "measured_bytes",
            "measured_forward_bytes", "predicted_bytes", "predicted_default_bytes",
            "reserve_bytes")
    out = dict(row)
    out.setdefault("context_parallel", 1)  # rows measured before CP cells existed
    out.setdefault("expert_parallel", 1)  # and before EP cells
    for key in ints:
        out[key] = int(out[key])
    for key in ("ratio", "default_ratio", "seconds"):
        out[key] = float(out[key])
    for column in ("own_routing", "own_routing_default"):
        if out.get(f"{column}_bytes") not in (None, ""):
            out[f"{column}_bytes"] = int(out[f"{column}_bytes"])
            out[f"{column}_ratio"] = float(out[f"{column}_ratio"])
    out["grad"] = out["grad"] in ("True", "true", "1")
    return out


def write_outputs(rows: list[dict], out: Path, seconds: float | None, quick: bool) -> None:
    from _calibration.report import plot, summarize

    out.mkdir(parents=True, exist_ok=True)
    with (out / "calibration.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    summary = summarize(rows)
    wall = f"wall time: {seconds:.0f} s; " if seconds is not None else ""
    if seconds is None and (out / "calibration.md").is_file():
        # Re-priced, not re-measured: keep naming the run that measured the rows.
        lines = (out / "calibration.md").read_text().splitlines()
        earlier = [line.split("rows measured by ", 1)[1].split("; re-priced: ", 1)[0]
                   for line in lines if "rows measured by `" in line]
        measured = earlier or [line.split("command: ", 1)[1] for line in lines
                               if "command: `" in line and "--reprice" not in line]
        if measured:
            wall = "rows measured by " + measured[0] + "; re-priced: "
    (out / "calibration.md").write_text(
        summary.replace("\n\n## Per policy", f"\n- {wall}command: `.venv/bin/python "
                        f"scripts/calibrate.py {shlex.join(sys.argv[1:])}`\n\n## Per policy",
                        1))
    plot(rows, out / "calibration.png")
    print(summary.split("## Per policy")[0])


if __name__ == "__main__":
    sys.exit(main())
