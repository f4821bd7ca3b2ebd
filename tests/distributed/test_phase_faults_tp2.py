"""Per-rank OOMs under torchrun, TP=2 with sequence parallel (gloo): an OOM injected on rank 1
only, in each phase of a micro-batch (phase_faults_worker.py). In a layer's forward, the heads
or the caller's backward, both ranks
leave the call with the same TrainerRankMemoryError naming rank 1, the micro-batch and the
phase, within the fault timeout of the fault: no hang, no rank carrying on alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from art.megatron.distributed import free_port

from _torchrun import run_torchrun

WORKER = Path(__file__).with_name("phase_faults_worker.py")
FAULT_TIMEOUT_S = 20.0
FATAL = {"forward layer": "in the forward of micro-batch",
         "heads": "in the heads of micro-batch",
         "caller backward": "in the caller backward of micro-batch"}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("phase_faults")
    ports = [str(free_port()) for _ in range(4)]
    # Its own hard timeout: a hang fails the test instead of stalling the suite.
    run_torchrun(WORKER, str(out), str(FAULT_TIMEOUT_S), *ports, nproc=2, timeout_s=240)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.torchrun
@pytest.mark.parametrize("scenario", list(FATAL))
def test_oom_inside_collectives_ends_every_rank_with_the_same_error(ranks, scenario):
    rows = [r[scenario] for r in ranks]
    fired_at = rows[1]["fired_at"]
    assert rows[1]["fired"] is not None and rows[0]["fired"] is None
    for row in rows:
        error = row["error"]
        assert error is not None and error["memory_error"], (scenario, error)
        assert f"rank 1 ran out of memory {FATAL[scenario]} 0" in error["text"]
        assert "items [0, 1, 2, 3]" in error["text"]
        assert row["ended_at"] - fired_at < FAULT_TIMEOUT_S, scenario
        assert row["seen"] == []  # nobody carried on with the micro-batch
    assert rows[0]["error"]["text"] == rows[1]["error"]["text"]
