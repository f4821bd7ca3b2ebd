"""TP=2 under torchrun (gloo, CPU) gives the same loss as TP=1 for the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from _torchrun import rank_records, run_torchrun

WORKER = Path(__file__).with_name("tp_loss_worker.py")


def _results(nproc: int, granularity: str, out_dir: Path) -> list[dict]:
    run_dir = out_dir / f"tp{nproc}-{granularity}"
    run_dir.mkdir()
    run_torchrun(WORKER, granularity, str(run_dir), nproc=nproc, timeout_s=150)
    return rank_records(run_dir, nproc)


@pytest.mark.torchrun
@pytest.mark.parametrize("granularity", ["selective", "full"])
def test_tp2_matches_tp1(granularity, tmp_path):
    tp1 = _results(1, granularity, tmp_path)[0]
    tp2 = _results(2, granularity, tmp_path)
    for row in tp2:
        assert row["tp"] == 2
        assert row["loss"] == pytest.approx(tp1["loss"], rel=1e-5)
    # The sharded weights' gradients, summed over ranks, equal the TP=1 gradients'.
    assert tp2[0]["sharded_grad_sq"] == pytest.approx(tp1["sharded_grad_sq"], rel=1e-4)
