"""TP=2 under torchrun (gloo, CPU) gives the same loss as TP=1 for the same weights."""

from __future__ import annotations

import pytest
from _launches import GRANULARITIES
from tp_loss_worker import loss_and_grad

from _tiny import tiny_dense
from _torchrun import rank_records


@pytest.fixture(scope="module")
def runs(two_rank_launch) -> dict[int, list[dict]]:
    """TP=1 in this process (as the worker runs it) and the TP=2 ranks' records (one model per
    granularity, in the launch conftest.py shares between modules)."""
    geometry = tiny_dense(num_layers=2)
    tp1 = {g: loss_and_grad(geometry, 1, g) for g in GRANULARITIES}
    return {1: [{"tp": 1, "by_granularity": tp1}],
            2: rank_records(two_rank_launch / "foundation", 2)}


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
