"""A rank that passes a different top-level list: a clear error on every rank, quickly, no
hang; and the ranks still work together afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from _torchrun import rank_records, run_torchrun

WORKER = Path(__file__).with_name("rank_mismatch_worker.py")


@pytest.mark.torchrun
def test_mismatched_inputs_raise_on_every_rank(tmp_path):
    # TP=2 is the case that would hang: the two ranks of one replica planning different
    # micro-batches would wait in each other's TP collectives. (DP ranks take the same check,
    # one all_gather over the world.) The subprocess timeout is the "no hang" bound.
    run_torchrun(WORKER, "2", str(tmp_path), nproc=2, timeout_s=240)
    rows = rank_records(tmp_path)
    assert [r["rank"] for r in rows] == [0, 1]
    for row in rows:
        for phase in ("count_mismatch", "token_mismatch"):
            seen = row[phase]
            assert seen["error"] == "ValueError", (row["rank"], phase, seen)
            assert "ranks passed different inputs" in seen["message"]
            assert "rank 0:" in seen["message"] and "rank 1:" in seen["message"]
            assert seen["seconds"] < 10.0
        assert row["agreed"]["error"] is None, row["agreed"]
    assert [r["agreed"]["yielded"] for r in rows] == [3, 3]  # one replica: both ranks run all
