"""Which adapter a forward or an optimizer step addresses (`checkpoint=` of calls and inputs).

A runtime is built with one adapter, named ACTIVE_CHECKPOINT (upstream's "active"). `Unset`
means "the enclosing call's choice, else the active adapter".
"""

from __future__ import annotations

from typing import Any

from art.trainer_rank._types import TrainerRankSlotStateError, Unset

ACTIVE_CHECKPOINT = "active"


def resolve_checkpoint(active: str | None, checkpoint: Any) -> str | None:
    """The adapter name a selection resolves to; only the runtime's own adapter exists here."""
    if checkpoint is Unset or checkpoint == active:
        return active
    raise TrainerRankSlotStateError(
        f"checkpoint={checkpoint!r}: this trainer holds only its runtime's adapter "
        f"({active!r}; pass Unset or that name). Loading other adapter checkpoints, and "
        "checkpoint=None for the base model, needs adapter slots"
    )
