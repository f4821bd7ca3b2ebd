"""Shared fixtures: one single-process Megatron state per test session, tiny geometries."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))  # the calibration harness lives beside its script
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def megatron_process():
    """Initialise torch.distributed (gloo, world size 1) and Megatron TP=1 state once."""
    from art.megatron.distributed import initialize_distributed

    return initialize_distributed()
