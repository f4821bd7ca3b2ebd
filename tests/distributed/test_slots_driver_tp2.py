"""A policy / reference-policy driver on checkpoint slots under torchrun TP=2 (one launch),
checked against the same driver at TP=1 in this process."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _torchrun import rank_records, run_torchrun

WORKER = Path(__file__).with_name("slots_driver_worker.py")
ENV = {"ART_TRAINER_RANK_PROBE_LAYERS": "false", "ART_MEGATRON_RANDOM_STATE": "3",
       "ART_MEGATRON_RECOMPUTE_GRANULARITY": "full"}


def _worker():
    spec = importlib.util.spec_from_file_location("slots_driver_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.torchrun
def test_policy_and_reference_scoring_with_steps_between_under_tp2(
        megatron_process, tmp_path, monkeypatch):
    from art.megatron.lora import lora_modules

    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    worker = _worker()
    rank = worker.trainer()
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for m in lora_modules(rank.model):
            for b in m.lora_B.values():
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    policy = str(tmp_path / "policy")
    rank.export_lora(policy)
    (tmp_path / "tp1").mkdir()
    (tmp_path / "tp2").mkdir()
    reference = worker.drive(rank, policy, str(tmp_path / "tp1"))
    run_torchrun(WORKER, str(tmp_path / "tp2"), policy, nproc=2, timeout_s=240,
                 env={"ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "2", **ENV})
    ranks = rank_records(tmp_path / "tp2")
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
    tp1 = load_file(tmp_path / "tp1" / "saved" / "adapter_model.safetensors")
    tp2 = load_file(tmp_path / "tp2" / "saved" / "adapter_model.safetensors")
    assert tp1.keys() == tp2.keys()
    for key in tp1:
        torch.testing.assert_close(tp2[key], tp1[key], rtol=1e-4, atol=1e-5, msg=key)
    moments = [load_file(tmp_path / d / "saved" / "optimizer" / "exp_avg.safetensors")
               for d in ("tp1", "tp2")]
    for key in moments[0]:
        torch.testing.assert_close(moments[1][key], moments[0][key], rtol=1e-3, atol=1e-7)
