"""Launches shared by several modules of this folder: a torchrun start (every rank importing
torch and Megatron) costs more than most of these workers' runs on the CI's 2 cores, so one
launch per number of ranks runs the workers of several modules one after the other, each
writing its records to a folder of its own that its module reads (_launches.py says what each
runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from _torchrun import run_torchrun

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def two_rank_launch(tmp_path_factory, megatron_process) -> Path:
    """two_ranks_worker.py: trainer/ and rank_mismatch/ (test_trainer_tp2.py,
    test_rank_mismatch.py), foundation/, shared_prefix/, hybrid/, heads/ (against the TP=1
    reference saved here first), context_parallel/, expert_parallel/ (the 2-rank layouts)
    paired_forwards/ (test_paired_forwards.py), meter/ (test_meter_tp2.py), and lora/,
    weights/ and slots/ (test_lora_tp2.py, test_weights_tp2.py, test_slots_driver_tp2.py) on
    the adapters, checkpoints and policy made here first (lora-adapters/, weights-cases/,
    slots-tp1/, with the slots driver's TP=1 record)."""
    import heads_tp_worker
    import lora_tp_worker
    import slots_driver_worker
    import weights_worker

    out = tmp_path_factory.mktemp("two-ranks")
    reference = out / "heads-reference.pt"
    heads_tp_worker.save_reference(str(reference))
    for folder in ("lora-adapters", "weights-cases", "slots-tp1"):
        (out / folder).mkdir()
    lora_tp_worker.save_adapters(str(out / "lora-adapters"))
    weights_worker.prepare_cases(out / "weights-cases")
    slots_driver_worker.prepare(str(out / "slots-tp1"))
    run_torchrun(HERE / "two_ranks_worker.py", str(out), str(reference), nproc=2,
                 timeout_s=900)
    return out


@pytest.fixture(scope="session")
def four_rank_launch(tmp_path_factory) -> Path:
    """four_ranks_worker.py: context_parallel/ (TP=2 x CP=2), expert_parallel/ (TP=2 x EP=2)
    and phase_faults/ (TP=2 x DP=2)."""
    out = tmp_path_factory.mktemp("four-ranks")
    run_torchrun(HERE / "four_ranks_worker.py", str(out), nproc=4, timeout_s=900)
    return out


@pytest.fixture(scope="session")
def calibration_launch(tmp_path_factory) -> Path:
    """calibration_tp2_worker.py (2 ranks), then calibration_cp2_worker.py's cells in the same
    processes: tp2/ (test_calibration_tp2.py) and cp2/ (test_calibration_cp2.py), each with
    rank<R>.json and probes/rank<R>/."""
    out = tmp_path_factory.mktemp("calibration")
    for name in ("tp2", "cp2"):
        (out / name).mkdir()
    run_torchrun(HERE / "calibration_tp2_worker.py", str(out / "tp2"), str(out / "cp2"),
                 nproc=2, timeout_s=350)
    return out
