"""TP=2 under torchrun (gloo, CPU) gives the same loss as TP=1 for the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from _torchrun import rank_records, run_torchrun

WORKER = Path(__file__).with_name("tp_loss_worker.py")


GRANULARITIES = ("selective", "full")


def _results(nproc: int, out_dir: Path) -> list[dict]:
    run_dir = out_dir / f"tp{nproc}"
    run_dir.mkdir()
    run_torchrun(WORKER, ",".join(GRANULARITIES), str(run_dir), nproc=nproc, timeout_s=150)
    return rank_records(run_dir, nproc)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, list[dict]]:
    """One TP=1 and one TP=2 launch, each building one model per granularity."""
    out_dir = tmp_path_factory.mktemp("foundation")
    return {nproc: _results(nproc, out_dir) for nproc in (1, 2)}


@pytest.mark.torchrun
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_tp2_matches_tp1(granularity, runs):
    tp1 = runs[1][0]["by_granularity"][granularity]
    for row in runs[2]:
        assert row["tp"] == 2
        assert row["by_granularity"][granularity]["loss"] == pytest.approx(tp1["loss"], rel=1e-5)
    # The sharded weights' gradients, summed over ranks, equal the TP=1 gradients'.
    tp2 = runs[2][0]["by_granularity"][granularity]
    assert tp2["sharded_grad_sq"] == pytest.approx(tp1["sharded_grad_sq"], rel=1e-4)
