"""scripts/seed_call.py scaled down (torchrun, TP=2): the seed's group shape on the tiny
Qwen3.5 hybrid is packed with its prompt once, priced under selective and full recompute,
escalated under a limit between the two (as the seed's H200s stood), and runs with outputs and
LoRA gradients equal to the rollouts as separate items; its measured peak lies within the
planner's band. The head chunk is set below the row (128 tokens: the 982-token row spans 8
chunks, as the seed's 32,710-token row spans 16 of the default 2,048), where the head's
backward sets the peak: priced from tail rows measured past the chunk, and with only the
head's moment of the row's backward beside the per-sequence copies, it is within 2%."""

from __future__ import annotations

import json

import pytest

from _torchrun import ROOT, run_torchrun

pytestmark = pytest.mark.torchrun


def test_the_seed_call_scaled_down_runs_escalated_and_equals_separate_items(tmp_path):
    run_torchrun(ROOT / "scripts" / "seed_call.py", "--scale", "0.03", "--json",
                 str(tmp_path / "report.json"), "--md", str(tmp_path / "seed_call.md"),
                 env={"ART_TRAINER_RANK_HEAD_CHUNK_TOKENS": "128"}, timeout_s=400)
    report = json.loads((tmp_path / "report.json").read_text())
    # 577 + 577 sharing 172: the packer lays the prompt out once.
    assert report["logical_tokens"] == 1154 and report["shared_tokens"] == 172
    assert report["packed_tokens"] == report["stats_packed_tokens"] == 982
    assert report["full_bytes"] < report["limit_bytes"] < report["selective_bytes"]
    assert report["decision"] == "escalated" and report["recompute"].startswith("full")
    assert 1.0 <= report["predicted_bytes"] / report["measured_bytes"] <= 1.02, report
    assert "peak at backward: head backward" in (tmp_path / "seed_call.md").read_text()
    assert report["output_max_abs_diff"] < 1e-5 and report["grad_max_rel_diff"] < 1e-5
    assert report["grads_compared"] > 0
    page = (tmp_path / "seed_call.md").read_text()
    assert "decision: escalated" in page and "prefix-tree states handed on" in page
