"""One candidate priced: the memory model's estimate (named terms), the profile's correction,
what other sub-forwards of the same micro-batch hold beside it, the gradients its backward
allocates first; and the memory-model interface admission prices with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from art.megatron.recompute import EffectiveRecompute
from art.trainer_rank._request import MicroBatchShape, OutputRequest
from art.trainer_rank.pricing.estimate import Estimate


class MemoryModelLike(Protocol):
    def estimate(self, batch: MicroBatchShape) -> Estimate: ...
    def with_recompute(self, recompute: EffectiveRecompute) -> MemoryModelLike: ...
    def max_tokens_that_fit(
        self, usable_bytes: int, *, outputs: OutputRequest, grad_enabled: bool, sequences: int = 1
    ) -> int: ...
    def allocator_reserve_bytes(self, dynamic_peak_bytes: int, largest_allocation_bytes: int
                                ) -> int: ...


def gib(n: int) -> str:
    """Bytes for messages: GiB at real scale, MiB/KiB for the small models tests run."""
    if abs(n) >= 2**30:
        return f"{n / 2**30:.3f} GiB"
    if abs(n) >= 2**20:
        return f"{n / 2**20:.2f} MiB"
    return f"{n / 2**10:.1f} KiB"


@dataclass(frozen=True)
class Pricing:
    """One candidate priced: the memory model's estimate and the profile's prediction."""

    estimate: Estimate
    # The model's dynamic peak corrected by the profile + the allocator reserve; None when
    # the profile has nothing to say for this row.
    profile_dynamic_bytes: int | None
    recompute: EffectiveRecompute
    # What other sub-forwards of the same micro-batch hold while this one peaks: a no-grad
    # split's earlier outputs; a grad split's earlier graphs (and later outputs in backward).
    held_bytes: int = 0
    # The allocator reserve on what they hold (the reserve grows with the dynamic peak).
    held_reserve_bytes: int = 0
    held_note: str = "split"
    # Gradients of trainable parameters that are not allocated yet: the estimate prices them
    # as resident, but this micro-batch's backward allocates them (0 once they exist).
    first_gradient_allocation_bytes: int = 0

    @property
    def model_dynamic_bytes(self) -> int:
        return (int(self.estimate.dynamic_bytes) + self.held_bytes + self.held_reserve_bytes
                + self.first_gradient_allocation_bytes)

    @property
    def model_peak_bytes(self) -> int:
        """The model's dynamic peak without the allocator reserve: what a profile corrects."""
        return (int(self.estimate.dynamic_bytes) - int(self.estimate.reserve_bytes)
                + self.held_bytes + self.first_gradient_allocation_bytes)

    @property
    def dynamic_bytes(self) -> int:
        if self.profile_dynamic_bytes is None:
            return self.model_dynamic_bytes
        return (self.profile_dynamic_bytes + self.held_bytes + self.held_reserve_bytes
                + self.first_gradient_allocation_bytes)

    def table(self) -> str:
        """The estimate's term table, with the terms this pricing adds to it."""
        lines = [self.estimate.table()]
        for name, value, note in (
            ("held by the other sub-forwards", self.held_bytes, self.held_note),
            ("allocator reserve on what they hold", self.held_reserve_bytes, ""),
            ("first_gradient_allocation_bytes", self.first_gradient_allocation_bytes,
             "trainable gradients not allocated yet; this backward allocates them"),
        ):
            if value:
                lines.append(f"{'dynamic':<9} {name:<44} {gib(value):>10}  {note}")
        return "\n".join(lines)

    @property
    def source(self) -> str:
        return "model" if self.profile_dynamic_bytes is None else "model x profile correction"

    @property
    def peak_bytes(self) -> int:
        return int(self.estimate.resident_bytes) + self.dynamic_bytes
