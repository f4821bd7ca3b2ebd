"""Usable limit and allocator reserve.

The caching allocator on GPU cannot hand out every free byte: without expandable segments,
blocks in different segments never merge, so a large allocation late in a micro-batch can fail
with plenty of memory "free" (the seed's second report: 10.6 GiB failed with 30.5 GiB reserved
but unallocated). The reserve therefore is a fragmentation margin (a fraction of the dynamic
peak, larger without expandable segments) and is never smaller than the largest single
allocation the micro-batch will make: that allocation needs one contiguous block. On CPU there
is no caching allocator and the limit (the virtual limit) counts live tensor bytes, so every
allocation that fits under it succeeds: the reserve there is zero, and a margin would only
make micro-batches smaller than they need to be.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
# Fraction of the dynamic peak held back for fragmentation. Without expandable segments the
# seed observed ~30 GiB reserved-but-unallocated on a ~95 GiB workload (~1/3 of the dynamic
# part, on a pack that made ~10 GiB allocations); with them, cross-segment fragmentation is
# gone and only rounding (2 MiB pages, 512-byte blocks) remains.
FRAGMENTATION_FRACTION_SEGMENTED = 0.10
FRAGMENTATION_FRACTION_EXPANDABLE = 0.02


def expandable_segments(alloc_conf: str | None) -> bool:
    """True when PYTORCH_CUDA_ALLOC_CONF turns expandable_segments on."""
    if not alloc_conf:
        return False
    for part in alloc_conf.split(","):
        key, _, value = part.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() in ("true", "1")
    return False


@dataclass(frozen=True)
class AllocatorReserve:
    device: str  # "cpu" | "cuda"
    alloc_conf: str | None

    @classmethod
    def from_env(cls, device: str, env: dict[str, str] | None = None) -> AllocatorReserve:
        source = os.environ if env is None else env
        return cls(device=device, alloc_conf=source.get(ALLOC_CONF_ENV))

    @property
    def expandable(self) -> bool:
        return expandable_segments(self.alloc_conf)

    @property
    def fraction(self) -> float:
        if self.device != "cuda":
            return 0.0
        if self.expandable:
            return FRAGMENTATION_FRACTION_EXPANDABLE
        return FRAGMENTATION_FRACTION_SEGMENTED

    def reserve_bytes(self, dynamic_peak_bytes: int, largest_allocation_bytes: int) -> int:
        if self.device != "cuda":
            return 0
        return max(int(dynamic_peak_bytes * self.fraction), int(largest_allocation_bytes))

    def describe(self, dynamic_peak_bytes: int, largest_allocation_bytes: int) -> str:
        if self.device != "cuda":
            return "CPU: live-bytes limit, no caching allocator, no fragmentation = 0"
        margin = int(dynamic_peak_bytes * self.fraction)
        if self.expandable:
            basis = f"expandable_segments on: {self.fraction:.0%} of dynamic"
        else:
            basis = f"no expandable_segments: {self.fraction:.0%} of dynamic"
        which = "largest allocation" if largest_allocation_bytes >= margin else "margin"
        return f"max({basis}, largest single allocation) = {which}"


def usable_bytes(limit_bytes: int, live_before_bytes: int) -> int:
    """What a micro-batch may use: the limit minus what is live before it runs."""
    return max(0, int(limit_bytes) - int(live_before_bytes))
