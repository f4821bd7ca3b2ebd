"""The default formulas' Gated DeltaNet blocks equal what the real layer keeps, block by block
(scripts/gdn_blocks.py's measurement: storages saved for backward, by the block that created
them), in bf16 at an off-grid token count."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gdn_blocks.py"
MIXER_BLOCKS = ("input norm + in_proj", "split, qkv transpose copy", "causal conv1d + silu",
                "q/k l2norm", "q/k repeat, gates (g, beta)", "gated delta rule",
                "gated output norm", "out_proj")
# The rows every layer kind shares: the bf16 residual is not kept (the frozen torch pre-MLP
# norm keeps its fp32 upcast), SwiGLU keeps what torch's unfused one keeps.
SHARED_BLOCKS = ("residual add", "pre-MLP norm", "fc1", "swiglu", "fc2")


def test_gated_delta_net_blocks_are_priced_as_measured(megatron_process):
    spec = importlib.util.spec_from_file_location("gdn_blocks", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    measured, provider, _ = script.measure(333, "bfloat16")
    priced = dict(script.priced(provider, 333))
    got = dict(measured)
    assert "layer input" not in priced  # bf16: the frozen in_proj norm keeps its fp32 upcast
    for block in MIXER_BLOCKS + SHARED_BLOCKS:
        assert priced[block] == pytest.approx(got.get(block, 0), rel=0.01, abs=64), block
    assert sum(priced.values()) == pytest.approx(sum(got.values()), rel=0.01)
