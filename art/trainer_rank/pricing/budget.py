"""The allocator reserve: what a micro-batch's estimate holds back above its dynamic peak.

The caching allocator on GPU cannot hand out every free byte: without expandable segments,
blocks in different segments never merge, so a large allocation late in a micro-batch can fail
while many GiB are reserved but unallocated. The reserve therefore is a fragmentation margin
(a fraction of the dynamic peak, larger without expandable segments) and is never smaller than
the largest single allocation the micro-batch will make: that allocation needs one contiguous
block. On CPU there is no caching allocator and the limit (the virtual limit) counts live
tensor bytes, so every allocation that fits under it succeeds: the reserve there is zero, and a
margin would only make micro-batches smaller than they need to be.
"""

from __future__ import annotations

from dataclasses import dataclass

# Fraction of the dynamic peak held back for fragmentation. Without expandable segments,
# blocks of different segments never merge, so reserved-but-unallocated memory grows with the
# size of the allocations; with them, cross-segment fragmentation is gone and only rounding
# (2 MiB pages, 512-byte blocks) remains.
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
