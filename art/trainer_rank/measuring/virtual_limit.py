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

from art.env_vars import UNSET, parse_byte_count

ENV_TEST_MEMORY_LIMIT = "ART_TRAINER_RANK_TEST_MEMORY_LIMIT_BYTES"


def test_memory_limit_bytes(env: Mapping[str, str] | None = None) -> int | None:
    """The virtual limit from ART_TRAINER_RANK_TEST_MEMORY_LIMIT_BYTES, or None when unset."""
    environ = os.environ if env is None else env
    raw = environ.get(ENV_TEST_MEMORY_LIMIT)
    value = UNSET if raw is None else parse_byte_count(ENV_TEST_MEMORY_LIMIT, raw)
    return None if value is UNSET else value


test_memory_limit_bytes.__test__ = False  # type: ignore[attr-defined]  # not a pytest test
