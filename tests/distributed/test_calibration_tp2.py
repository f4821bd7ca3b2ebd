"""Memory model vs real TP=2 ranks (torchrun, gloo, CPU): predicted / measured in [1.00, 1.05].

Each rank probes its own TP-sharded layer and measures its own peak; both must agree.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _calibration_runs import assert_rows_reprice
from calibration_tp2_worker import PROBE_TOKENS

from _torchrun import rank_records


@pytest.fixture(scope="module")
def tp2_run(calibration_launch) -> Path:
    """rank<R>.json records and probes/rank<R>/ probes, from the launch test_calibration_tp2.py
    and test_calibration_cp2.py share (conftest.py)."""
    return calibration_launch / "tp2"


@pytest.mark.torchrun
def test_tp2_cells_within_target(tp2_run):
    ranks = rank_records(tp2_run)
    for rows in ranks:
        assert len(rows) == 5
        for row in rows:
            assert row["tensor_parallel"] == 2
            assert 1.0 <= row["ratio"] <= 1.05, row
            if row["outputs"] == "logits":  # the gather and the no-grad head, by formula too
                assert 1.0 <= row["default_ratio"] <= 1.05, row
            if row.get("shared_prefix"):
                # Priced with the gather beside the per-sequence copies it is 4% higher.
                assert row["ratio"] <= 1.03 and row["default_ratio"] <= 1.03, row
    # The two ranks of one cell hold the same shapes: their measured peaks agree closely.
    for a, b in zip(*ranks):
        assert abs(a["measured_bytes"] - b["measured_bytes"]) <= 0.05 * a["measured_bytes"]


@pytest.mark.torchrun
def test_tp2_rows_reprice_from_each_ranks_stored_probe(tp2_run, tmp_path):
    """`calibrate.py --reprice` on TP=2 rows: each rank's probe is stored in its own folder
    and the merged row (busiest rank's measurement, highest rank estimate) re-prices to the
    same bytes without a rank running."""
    from _calibration.reprice import reprice_rows

    probes = tmp_path / "probes"
    merged = assert_rows_reprice(tp2_run, probes, PROBE_TOKENS)
    assert sorted(p.parent.name for p in probes.glob("rank*/probe-*.json")) == [
        "rank0", "rank1"]
    # Without a rank's probe the rows cannot be priced: the error says how to get it.
    next((probes / "rank1").glob("probe-*.json")).unlink()
    with pytest.raises(ValueError, match="stored per rank"):
        reprice_rows(merged, str(probes), probe_tokens=PROBE_TOKENS)
