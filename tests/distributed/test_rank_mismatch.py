"""A rank that passes a different top-level list: a clear error on every rank, quickly, no
hang; and the ranks still work together afterwards."""

from __future__ import annotations

import pytest

from _torchrun import rank_records


@pytest.mark.torchrun
def test_mismatched_inputs_raise_on_every_rank(two_rank_launch):
    # TP=2 is the case that would hang: the two ranks of one replica planning different
    # micro-batches would wait in each other's TP collectives. (DP ranks take the same check,
    # one all_gather over the world.) The launch's timeout is the "no hang" bound;
    # rank_mismatch_worker.py runs after trainer_worker.py in a launch shared with other
    # modules (conftest.py).
    rows = rank_records(two_rank_launch / "rank_mismatch")
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
