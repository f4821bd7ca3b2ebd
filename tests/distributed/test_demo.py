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
        nproc=2, timeout_s=240, env=DEMO_ENV,
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


def _demo_worker():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("demo_worker", ROOT / "scripts" /
                                                  "demo_worker.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["demo_worker"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_demo_checks_catch_missing_outputs_repeats_and_unhandled_oversized_items() -> None:
    """The checks behind the demo's exit status fail on what they exist to catch."""
    import torch

    from art.trainer_rank import (
        ForwardInput,
        ForwardOutput,
        MicroBatch,
        MicroBatchStats,
        TrainerRankMemoryError,
    )

    demo = _demo_worker()
    seq = ForwardInput(input_tokens=torch.tensor([1, 2, 3]), target_tokens=torch.tensor([2, 3,
                                                                                          -100]))
    stats = MicroBatchStats(global_start=0, global_stop=1, global_count=1, local_count=1,
                            packed_tokens=3, logical_tokens=3, estimated_required_bytes=10,
                            available_bytes=100, rejected_candidates=0, cold_start=False,
                            decision="admitted", predicted_peak_bytes=10,
                            recompute_summary="x", grad_enabled=True)
    good = ForwardOutput(target_logprobs=torch.tensor([-1.0, -2.0, 0.0]))
    ok = MicroBatch(inputs=[[seq]], outputs=[[good]], indices=[0], stats=stats)
    assert demo._check_outputs(ok) == []
    missing = MicroBatch(inputs=[[seq]], outputs=[[ForwardOutput()]], indices=[0], stats=stats)
    assert "missing" in demo._check_outputs(missing)[0]
    positive = MicroBatch(inputs=[[seq]], outputs=[[ForwardOutput(
        target_logprobs=torch.tensor([0.5, -1.0, 0.0]))]], indices=[0], stats=stats)
    assert "> 0" in demo._check_outputs(positive)[0]
    short = MicroBatch(inputs=[[seq, seq]], outputs=[[good]], indices=[0], stats=stats)
    assert "1 outputs for 2 inputs" in demo._check_outputs(short)[0]

    declined = TrainerRankMemoryError("m", predicted_peak_bytes=2, usable_limit_bytes=1,
                                      recompute_summary="s", suggestion="t",
                                      indices_not_run=(2,))
    assert demo._check_coverage(3, {0: 1, 1: 1}, declined, {2}) == []
    assert "ran 2 times" in demo._check_coverage(3, {0: 1, 1: 2}, declined, {2})[0]
    assert "ran 0 times" in demo._check_coverage(3, {0: 1}, declined, {2})[0]
    assert "declined but also ran" in demo._check_coverage(3, {0: 1, 1: 1, 2: 1}, declined,
                                                           {2})[0]
    assert "outputs are missing" in demo._check_coverage(3, {0: 1, 1: 1}, declined, set())[0]

    escalate = demo.Oversized(index=0, expect="escalated", tokens=10)
    decline = demo.Oversized(index=2, expect="declined", tokens=20)
    assert "expected escalated, got ['admitted']" in demo._check_oversized([escalate], [ok],
                                                                           None)[0]
    assert "was not declined" in demo._check_oversized([decline], [ok], None)[0]
    assert demo._check_oversized([decline], [ok], declined) == []
    assert demo._ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
