"""The virtual memory limit for CPU runs: ART_TRAINER_RANK_TEST_MEMORY_LIMIT_BYTES.

On CPU nothing runs out of memory at the sizes tests use, so the OOM, split and decline paths
of admission would never run for real. With this limit set, TrainerRank runs each micro-batch
inside a `measuring.meter.MemoryMeter` with that limit: every storage a tensor op creates is
counted from allocation until its last reference dies, and the op that crosses the limit
raises `torch.OutOfMemoryError`, as the CUDA allocator would.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ENV_TEST_MEMORY_LIMIT = "ART_TRAINER_RANK_TEST_MEMORY_LIMIT_BYTES"


def test_memory_limit_bytes(env: Mapping[str, str] | None = None) -> int | None:
    """The virtual limit from ART_TRAINER_RANK_TEST_MEMORY_LIMIT_BYTES, or None when unset."""
    environ = os.environ if env is None else env
    raw = environ.get(ENV_TEST_MEMORY_LIMIT, "").strip()
    if not raw:
        return None
    try:
        value = int(float(raw)) if any(c in raw for c in ".eE") else int(raw)
    except (ValueError, OverflowError):  # OverflowError: "1e999"
        raise ValueError(
            f"{ENV_TEST_MEMORY_LIMIT}={raw!r} is not a byte count; set a positive integer such "
            "as 268435456 (256 MiB) or unset it"
        ) from None
    if value <= 0:
        raise ValueError(f"{ENV_TEST_MEMORY_LIMIT}={raw!r} must be a positive byte count; set "
                         "one such as 268435456 (256 MiB) or unset it")
    return value


test_memory_limit_bytes.__test__ = False  # type: ignore[attr-defined]  # not a pytest test
