"""Launch a worker script under torchrun on a free port, bounded in time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from art.megatron.distributed import free_port

ROOT = Path(__file__).resolve().parents[1]


def run_torchrun(
    script: Path, *args: str, nproc: int = 2, timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `torchrun --nproc_per_node=nproc script args`; raise with the output on failure."""
    # A shared, loaded machine runs every launch slower: ART_TEST_TIMEOUT_SCALE stretches the
    # bounds without touching what they guard (per-phase timings are asserted separately).
    timeout_s *= float(os.environ.get("ART_TEST_TIMEOUT_SCALE", "1"))
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "tests"), full_env.get("PYTHONPATH", "")]
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc_per_node={nproc}", f"--master_port={free_port()}", "--master_addr=127.0.0.1",
        str(script), *args,
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout_s, env=full_env, cwd=ROOT
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun failed with exit code {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc


def rank_records(out_dir: Path, nproc: int = 2) -> list[dict]:
    """The JSON record each rank's worker wrote to `out_dir/rank<R>.json`, in rank order."""
    paths = [Path(out_dir) / f"rank{rank}.json" for rank in range(nproc)]
    missing = [p.name for p in paths if not p.is_file()]
    assert not missing, f"ranks wrote no record: {missing} in {out_dir}"
    return [json.loads(p.read_text()) for p in paths]
