"""Shared fixtures: one single-process Megatron state per test session, tiny geometries."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))  # the calibration harness lives beside its script
# torchrun workers inherit one thread each (two ranks on two cores); the suite's own process
# runs one test at a time and takes two threads where the machine has them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# TrainerRank caches its probe in the user cache folder by default: the suite (and the torchrun
# workers it starts, which inherit this) uses a folder of its own, shared by the session's
# processes and never the user's.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="art-test-cache-")


def pytest_sessionfinish(session, exitstatus) -> None:
    shutil.rmtree(os.environ["XDG_CACHE_HOME"], ignore_errors=True)


@pytest.fixture(scope="session")
def megatron_process():
    """Initialise torch.distributed (gloo, world size 1) and Megatron TP=1 state once."""
    from art.megatron.distributed import initialize_distributed

    return initialize_distributed()
