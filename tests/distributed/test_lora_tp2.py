"""LoRA at TP=2 (sequence parallel on, expert TP 2) equals TP=1 for the same adapter."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from _torchrun import rank_records

WORKER = Path(__file__).with_name("lora_tp_worker.py")


def _worker_module():
    spec = importlib.util.spec_from_file_location("lora_tp_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.torchrun
def test_lora_tp2_matches_tp1(megatron_process, two_rank_launch):
    """The adapters conftest.py saved before the shared 2-rank launch (lora_tp_worker's
    `save_adapters`, TP=1), run at TP=1 here and at TP=2 in the launch (lora/)."""
    worker = _worker_module()
    specs = json.loads((two_rank_launch / "lora-adapters" / worker.SPECS).read_text())
    reference = {}
    for spec in specs:
        name, adapter = spec.split("=", 1)
        reference[name] = worker.run(worker.provider_for(name), adapter)  # TP=1, here
    assert sorted(reference) == sorted(worker.MODELS)
    ranks = rank_records(two_rank_launch / "lora")
    for name in worker.MODELS:
        ref = reference[name]
        assert any(v != 0.0 for vs in ref["grads"].values() for v in vs)
        for rank in ranks:
            got = rank[name]
            assert got["layout"] == "TP2 SP"
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
            assert got["grads"].keys() == ref["grads"].keys()
            for key, values in ref["grads"].items():
                torch.testing.assert_close(
                    torch.tensor(got["grads"][key]), torch.tensor(values),
                    rtol=1e-4, atol=1e-6, msg=f"{name} {key}")
