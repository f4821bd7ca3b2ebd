"""`estimate` / `plan` name a CUDA build without Transformer Engine (--build local)."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout

import pytest

from art.megatron.implementation import Implementation
from art.trainer_rank.cli.main import main

CUDA_LOCAL = Implementation.cuda_local().key
SEED = ["--model", "Qwen3.5-27B", "--sequences", "19222,19221", "--shared-prefix", "5733",
        "--outputs", "hidden_states", "--lora-rank", "1"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("ART_MEGATRON_") or name == "PYTORCH_CUDA_ALLOC_CONF":
            monkeypatch.delenv(name, raising=False)


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_estimate_prices_the_cuda_local_build():
    """--build local is the segmented attention on CUDA: no dense mask or s^2 score buffer
    (those are --attention unfused's), priced apart from TE's build."""
    base = ["estimate", "--model", "Qwen3-8B", "--tokens", "8192", "--recompute", "selective",
            "--json"]
    rc, out, _ = _run([*base, "--build", "local"])
    local = json.loads(out)
    assert rc == 0 and local["implementation"] == CUDA_LOCAL
    assert "packed attention mask" not in local["terms"]
    te = json.loads(_run(base)[1])
    assert te["implementation"] == Implementation.gpu_te().key
    assert te["dynamic_bytes"] != local["dynamic_bytes"]
    unfused = json.loads(_run([*base, "--attention", "unfused"])[1])
    assert unfused["implementation"] == "local/unfused/torch-norm/swiglu-unfused/cuda"
    assert "packed attention mask" in unfused["terms"]
    rc, _, err = _run([*base, "--build", "te", "--attention", "unfused"])
    assert rc == 2 and "--build local" in err


def test_plan_names_the_cuda_local_build_and_shares_the_prefix_there():
    """`plan --build local` prices the CUDA-without-TE cluster; a --shared-prefix row is what
    that build runs, so only TE's build warns that it packs every rollout in full."""
    rc, out, err = _run(["plan", *SEED, "--gpu", "H200", "--gpus", "2", "--build", "local",
                         "--json"])
    assert rc in (0, 3) and json.loads(out)["implementation"] == CUDA_LOCAL
    assert "packs every rollout in full" not in err
    rc, out, err = _run(["plan", *SEED, "--gpu", "H200", "--gpus", "2", "--json"])
    assert json.loads(out)["implementation"] == Implementation.gpu_te().key
    assert "packs every rollout in full (38443 tokens)" in err
