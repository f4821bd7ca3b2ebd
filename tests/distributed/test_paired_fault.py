"""An out-of-memory error in one rank's forward under expert parallel across data-parallel
ranks ends forward_micro_batches on both ranks with the same TrainerRankMemoryError within the
fault timeout: its partner waits in the MoE layer's all-to-all, so a local re-plan would leave
it there (paired_fault_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from paired_fault_worker import FAULT_TIMEOUT_S

from _torchrun import run_torchrun

WORKER = Path(__file__).with_name("paired_fault_worker.py")


@pytest.mark.torchrun
def test_an_oom_in_one_ranks_forward_ends_both_paired_ranks(tmp_path):
    run_torchrun(WORKER, str(tmp_path), nproc=2, timeout_s=300)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for record in records:
        assert record["paired_forwards"]
        assert record["error"] is not None and record["error"]["type"] == "TrainerRankMemoryError"
        assert "rank 1" in record["error"]["text"], record["error"]
        assert record["seconds"] < FAULT_TIMEOUT_S + 30, record
    assert records[0]["error"]["text"] == records[1]["error"]["text"]
