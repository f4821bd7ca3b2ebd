"""What admission is asked (PlanRequest: the pending items, grad, the usable limit, the
gradients not allocated yet, how to plan) and what it answers (Plan: the next micro-batch)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property

from art.megatron.recompute import EffectiveRecompute
from art.trainer_rank._request import MicroBatchShape
from art.trainer_rank._types import ForwardInput, TrainerRankMemoryError
from art.trainer_rank.compute.items import Item
from art.trainer_rank.decide.priced import Pricing
from art.trainer_rank.decide.step_time import StepTimeFit
from art.trainer_rank.measuring.device import UnallocatedGradients


class PlanMode(StrEnum):
    """How the trainer asks for its next plan: greedily from a queue (`next`), exactly a
    data-parallel wave's share (`wave`), or every grad item of one call at once (`call`)."""

    NEXT = "next"
    WAVE = "wave"
    CALL = "call"


@dataclass(frozen=True)
class PlanRequest:
    """One question to admission. `unallocated_gradients`: the trainable gradients not
    allocated yet, which a grad micro-batch's backward allocates (ignored without grad; None:
    all of them exist already). `step_time`: how long grad micro-batches took, as a line in
    their work (None: not known yet), which `adaptive` weighs its packings with."""

    pending: tuple[Item, ...]
    grad: bool
    usable_bytes: int
    mode: PlanMode = PlanMode.NEXT
    unallocated_gradients: UnallocatedGradients | None = None
    step_time: StepTimeFit | None = None

    def __post_init__(self) -> None:
        if not self.pending:
            raise ValueError("a PlanRequest needs at least one pending item")

    @property
    def gradients(self) -> UnallocatedGradients | None:
        """The gradients this request's pricing counts: none without grad."""
        return self.unallocated_gradients if self.grad else None


@dataclass(frozen=True)
class Plan:
    """The next micro-batch. sub_forwards: for each sub-forward, indices into `leaves` (the
    flattened sequences of `items`, in order); one sub-forward unless decision is split."""

    decision: str
    items: tuple[Item, ...]
    pricing: Pricing  # of the whole micro-batch (split: of its largest sub-forward)
    shape: MicroBatchShape
    sub_forwards: tuple[tuple[int, ...], ...]
    signature: str
    escalate: bool = False
    # The rung this plan runs when it is not the configured policy (escalated above it, or
    # adaptive below it); None: the configured policy.
    recompute: EffectiveRecompute | None = None
    error: TrainerRankMemoryError | None = None
    note: str = ""
    # Larger candidates admission priced and turned down on the way to this plan.
    rejected_candidates: int = 0

    @cached_property
    def leaves(self) -> tuple[ForwardInput, ...]:
        # Cached: the runtime reads it once per leaf.
        return tuple(leaf for item in self.items for leaf in item.leaves)

    @property
    def indices(self) -> list[int]:
        return [item.index for item in self.items]

    def group_indices(self, sub: Sequence[int]) -> list[list[int]]:
        """`sub`'s leaf indices cut where the owning item changes: the groups whose shared
        prefixes one packed row may lay out once."""
        owner = self._leaf_owners
        groups: list[list[int]] = []
        for i in sub:
            if groups and owner[groups[-1][-1]] == owner[i]:
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups

    @cached_property
    def _leaf_owners(self) -> tuple[int, ...]:
        return tuple(k for k, item in enumerate(self.items) for _ in item.leaves)

    def groups(self, sub: Sequence[int]) -> tuple[int, ...]:
        return tuple(len(group) for group in self.group_indices(sub))

    def agreement_key(self, usable_bytes: int) -> str:
        """What every rank of a replica must have decided alike before it runs this plan."""
        return (f"{self.decision} items={self.indices} subs={self.sub_forwards} "
                f"escalate={self.escalate} "
                f"recompute={self.recompute.key if self.recompute else '-'} "
                f"usable={usable_bytes}")
