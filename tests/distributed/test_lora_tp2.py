"""LoRA at TP=2 (sequence parallel on, expert TP 2) equals TP=1 for the same adapter."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from peft import LoraConfig

from art.megatron.lora import lora_modules
from art.megatron.lora_peft import export_adapter
from art.megatron.provider import Provider
from art.megatron.settings import load_settings

from _torchrun import rank_records, run_torchrun

WORKER = Path(__file__).with_name("lora_tp_worker.py")
MODELS = ("tiny-qwen3", "tiny-qwen3-moe")
ENV = {"ART_MEGATRON_RECOMPUTE_GRANULARITY": "full"}


def _worker_module():
    spec = importlib.util.spec_from_file_location("lora_tp_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.torchrun
def test_lora_tp2_matches_tp1(megatron_process, tmp_path):
    worker = _worker_module()
    specs, reference = [], {}
    for name in MODELS:
        provider = Provider(name, settings=load_settings(ENV), dtype="float32",
                            lora=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        model = provider.build_model(seed=0)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():  # a non-trivial adapter: B random, not zero
            for module in lora_modules(model):
                for b in module.lora_B.values():
                    b.copy_(torch.randn(b.shape, generator=g) * 0.2)
        adapter = tmp_path / f"adapter-{name}"
        export_adapter(model, adapter)
        specs.append(f"{name}={adapter}")
        reference[name] = worker.run(provider, str(adapter))  # TP=1, this process
    out = tmp_path / "tp2"
    out.mkdir()
    run_torchrun(WORKER, str(out), *specs, nproc=2, timeout_s=150,
                 env={"ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "2", **ENV})
    ranks = rank_records(out)
    for name in MODELS:
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
