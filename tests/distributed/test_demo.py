"""The demo's workload, shortened, through the real TrainerRank at TP=2 under torchrun: every
admitted item runs once with its outputs, no OOM escapes, one oversized group is escalated to
full recompute and one is declined with the recompute-aware message; exit status 0."""

from __future__ import annotations

import pytest

from _torchrun import ROOT, run_torchrun

pytestmark = pytest.mark.torchrun

DEMO_ENV = {
    "ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "2",
    "ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective",
    "PYTHONWARNINGS": "ignore",
}


def test_demo_short_workload_tp2() -> None:
    proc = run_torchrun(
        ROOT / "scripts" / "demo_worker.py",
        "--groups", "3", "--rollouts", "2", "--max-tokens", "320", "--median-completion", "60",
        "--lora-rank", "2",
        nproc=2, timeout_s=90, env=DEMO_ENV,
    )
    out = proc.stdout
    assert "OK: every admitted item ran once with its outputs; no OOM escaped." in out, out
    assert "PROBLEM" not in proc.stderr
    for decision in ("cold-capped", "escalated", "declined"):
        assert decision in out, (decision, out)
    # The closing message names the recompute in force and prices full recompute.
    message = out[out.index("TrainerRankMemoryError:"):]
    assert "selective recompute (core_attn)" in message
    assert "Under full recompute (uniform, 1 layer(s) per checkpoint) it would need" in message
    assert "Remedy:" in message
    assert "measured/predicted" in out
