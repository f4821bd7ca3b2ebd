"""Memory model vs real TP=2 ranks (torchrun, gloo, CPU): predicted / measured in [1.00, 1.05].

Each rank probes its own TP-sharded layer and measures its own peak; both must agree.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _torchrun import rank_records, run_torchrun

WORKER = Path(__file__).with_name("calibration_tp2_worker.py")


@pytest.mark.torchrun
def test_tp2_cells_within_target(tmp_path):
    run_torchrun(WORKER, str(tmp_path), nproc=2, timeout_s=150)
    ranks = rank_records(tmp_path)
    for rows in ranks:
        assert len(rows) == 4
        for row in rows:
            assert row["tensor_parallel"] == 2
            assert 1.0 <= row["ratio"] <= 1.05, row
            if row["outputs"] == "logits":  # the gather and the no-grad head, by formula too
                assert 1.0 <= row["default_ratio"] <= 1.05, row
    # The two ranks of one cell hold the same shapes: their measured peaks agree closely.
    for a, b in zip(*ranks):
        assert abs(a["measured_bytes"] - b["measured_bytes"]) <= 0.05 * a["measured_bytes"]
