"""A torchrun launch that runs past its timeout is killed whole: torchrun and every worker it
started (each in a session of its own), so a hung launch leaves nothing running."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from _torchrun import run_torchrun

WORKER = Path(__file__).with_name("hang_worker.py")


def _alive(pid: int) -> bool:
    """Running or sleeping, not gone and not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.torchrun
def test_a_launch_that_times_out_leaves_no_worker_running(tmp_path):
    with pytest.raises(AssertionError, match="did not finish within"):
        run_torchrun(WORKER, str(tmp_path), nproc=2, timeout_s=15)
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("rank*.pid"))]
    assert len(pids) == 2, f"the workers did not start within the timeout: {pids}"
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), f"workers still running: {pids}"
