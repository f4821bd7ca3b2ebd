"""Whether fla's gated delta rule can run its backward on this machine.

fla-core 0.6 refuses the backward of its gated chunk kernels (`chunk_bwd_dqkwg` with a decay)
on Hopper GPUs under Triton >= 3.4.0 and < 3.7.1, where Triton miscompiles them, unless a
tilelang backend takes the call (`fla/ops/common/chunk_o.py`). It raises at the first
backward, after the model is built and its forward ran. Here the same condition is read from
fla's own flags before anything is built, so the runtime can use the pure-torch rule instead
(`cpu_gated_delta`, the same contract and saved set) or refuse with the remedies.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util


def fla_delta_rule_refusal() -> str | None:
    """Why fla's gated delta rule would refuse its backward here, or None when it runs (or
    when fla is absent or of a version without the refusal: the build then says so itself)."""
    try:
        chunk_o = importlib.import_module("fla.ops.common.chunk_o")
    except Exception:  # fla absent, or it cannot import here: nothing of it would run
        return None
    hopper = bool(getattr(chunk_o, "IS_NVIDIA_HOPPER", False))
    miscompiling = (bool(getattr(chunk_o, "TRITON_ABOVE_3_4_0", False))
                    and not bool(getattr(chunk_o, "TRITON_ABOVE_3_7_1", True)))
    if not (hopper and miscompiling) or importlib.util.find_spec("tilelang") is not None:
        return None
    return (f"fla-core {_version('fla-core')} refuses the backward of its gated delta rule on "
            f"Hopper GPUs under Triton {_version('triton')} (>= 3.4.0 and < 3.7.1 miscompile "
            "it); upgrade Triton to 3.7.1 or later, or install tilelang, for fla's kernels")


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"
