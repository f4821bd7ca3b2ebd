"""setup.cfg's extras: the gpu extra brings the CUDA kernels, the test extra none of them."""

from __future__ import annotations

from pathlib import Path

from packaging.requirements import Requirement
from setuptools.config.setupcfg import read_configuration

EXTRAS = read_configuration(Path(__file__).parents[1] / "setup.cfg")["options"]["extras_require"]


def test_gpu_extra_brings_transformer_engine_and_the_fla_core_the_model_prices():
    """fla-core 0.6 (its chunk_gated_delta_rule takes cu_seqlens and initial_state, and its
    saved tensors are what layers_gdn prices), not a later one."""
    gpu = {Requirement(r).name: Requirement(r) for r in EXTRAS["gpu"]}
    assert {"transformer-engine", "fla-core"} <= set(gpu)
    assert "0.6.0" in gpu["fla-core"].specifier and "0.7.0" not in gpu["fla-core"].specifier


def test_cpu_ci_installs_neither():
    names = {Requirement(r).name for r in EXTRAS["test"]}
    assert not names & {"transformer-engine", "fla-core", "flash-linear-attention"}
