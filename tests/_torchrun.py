"""Launch a worker script under torchrun on a free port, bounded in time."""

from __future__ import annotations

import json
import os
import signal
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
    # Its own session, and on a timeout every process of the launch is killed: torchrun
    # starts each worker in a session of its own, so killing torchrun alone (what
    # subprocess.run does) would leave the workers running.
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=full_env, cwd=ROOT, start_new_session=True) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_launch(popen.pid)
            stdout, stderr = popen.communicate()
            raise AssertionError(
                f"torchrun did not finish within {timeout_s:g} s; it and its workers were "
                f"killed\n--- stdout ---\n{stdout[-4000:]}\n--- stderr ---\n{stderr[-6000:]}"
            ) from None
    proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun failed with exit code {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")".
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_launch(pid: int) -> None:
    """SIGKILL the process group of `pid` and the group of every process below it (torchrun's
    workers lead groups of their own). The tree is read before anything is killed, while the
    workers are still torchrun's children."""
    groups = set()
    for member in (pid, *descendants(pid)):
        try:
            groups.add(os.getpgid(member))
        except ProcessLookupError:
            pass
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass


def rank_records(out_dir: Path, nproc: int = 2) -> list[dict]:
    """The JSON record each rank's worker wrote to `out_dir/rank<R>.json`, in rank order."""
    paths = [Path(out_dir) / f"rank{rank}.json" for rank in range(nproc)]
    missing = [p.name for p in paths if not p.is_file()]
    assert not missing, f"ranks wrote no record: {missing} in {out_dir}"
    return [json.loads(p.read_text()) for p in paths]
