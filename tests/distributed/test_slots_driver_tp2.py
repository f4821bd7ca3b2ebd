"""A policy / reference-policy driver on checkpoint slots under torchrun TP=2 (one launch),
checked against the same driver at TP=1 in this process."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _torchrun import rank_records

WORKER = Path(__file__).with_name("slots_driver_worker.py")


def _worker():
    spec = importlib.util.spec_from_file_location("slots_driver_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.torchrun
def test_policy_and_reference_scoring_with_steps_between_under_tp2(two_rank_launch):
    """The policy and the TP=1 record conftest.py made before the shared 2-rank launch
    (slots_driver_worker's `prepare`), against the driver at TP=2 in the launch (slots/)."""
    folder = two_rank_launch / "slots-tp1"
    reference = json.loads((folder / "tp1" / _worker().REFERENCE).read_text())
    tp1, tp2 = folder / "tp1", two_rank_launch / "slots"
    ranks = rank_records(tp2)
    for record in [reference, *ranks]:
        # The snapshot and the base model do not move while the policy trains.
        assert all(r == record["reference"][0] for r in record["reference"])
        assert all(r == record["base"][0] for r in record["base"])
        assert record["policy"][0] == pytest.approx(record["reference"][0], abs=1e-5)
        assert record["loss"][2] < record["loss"][1] < record["loss"][0]
        assert record["round_trip_identical"]
    for record in ranks:
        assert record["layout"] == "TP2 SP"
        for key in ("loss", "grad_norm"):
            assert record[key] == pytest.approx(reference[key], rel=1e-4), key
        for key in ("reference", "base", "policy"):
            for got, want in zip(record[key], reference[key]):
                torch.testing.assert_close(torch.tensor(got), torch.tensor(want),
                                           rtol=1e-4, atol=1e-5)
    saved = [load_file(d / "saved" / "adapter_model.safetensors") for d in (tp1, tp2)]
    assert saved[0].keys() == saved[1].keys()
    for key in saved[0]:
        torch.testing.assert_close(saved[1][key], saved[0][key], rtol=1e-4, atol=1e-5, msg=key)
    moments = [load_file(d / "saved" / "optimizer" / "exp_avg.safetensors")
               for d in (tp1, tp2)]
    for key in moments[0]:
        torch.testing.assert_close(moments[1][key], moments[0][key], rtol=1e-3, atol=1e-7)
