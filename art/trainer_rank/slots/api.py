"""TrainerRank's checkpoint-slot methods (ART's names and arguments), on top of the slot store:
load, prefetch, push/pop, snapshot, save, export, and per-slot extra modules and tensors.

`SlotMethods` is mixed into TrainerRank, which provides `slots` (SlotStore), `saves`
(SaveQueue) and `device`. The optimizer-step methods are optimizer/methods.py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch

from art.trainer_rank.slots.saving import SaveQueue, export_lora
from art.trainer_rank.slots.store import PushedCheckpoint, SlotStore
from art.trainer_rank.slots.types import (
    MaterializedCheckpoint,
    TrainerRankSlotStateError,
    Unset,
)


class SlotMethods:
    slots: SlotStore
    saves: SaveQueue
    device: torch.device

    # -- selection and loading ---------------------------------------------------------------

    def load_checkpoint(self, checkpoint: str | MaterializedCheckpoint | None) -> None:
        """Load `checkpoint` (a peft adapter or a saved checkpoint, optimizer state included)
        into a slot named by its path and select it for forwards and optim_step; None selects
        the base model without adapter."""
        self.slots.load(checkpoint)

    def prefetch_checkpoints(self, *checkpoints: str | MaterializedCheckpoint
                             ) -> asyncio.Task[None]:
        """Start reading checkpoints in the background; a later load/push uses what was read."""
        return self.slots.prefetch(*checkpoints)

    def push_checkpoint(self, checkpoint: str | MaterializedCheckpoint | None
                        ) -> PushedCheckpoint:
        """Select `checkpoint` for forwards until `pop_checkpoint` (or the end of the returned
        context); a path not yet resident is loaded into its own slot."""
        return self.slots.push(checkpoint)

    def pop_checkpoint(self) -> None:
        self.slots.pop()

    def snapshot_checkpoint(self, source: str, destination: str) -> bool:
        """A forward-only resident copy of slot `source` named `destination` (e.g. a frozen
        reference policy); False when `destination` already is a snapshot."""
        return self.slots.snapshot(str(source), str(destination))

    # -- saving ------------------------------------------------------------------------------

    def save_checkpoint(self, output_dir: str, checkpoint_path: str = "active") -> None:
        """Write a slot (adapter + its optimizer state + manifest) into `output_dir`."""
        self.saves.prepare(str(output_dir), checkpoint_path)
        self.saves.finish(str(output_dir))

    def prepare_checkpoint_save(self, output_dir: str, checkpoint_path: str = "active") -> None:
        """Capture a slot's state for a save into `output_dir`; training may go on before
        `finish_checkpoint_save` writes it (or `abort_checkpoint_save` drops it)."""
        self.saves.prepare(str(output_dir), checkpoint_path)

    def finish_checkpoint_save(self, output_dir: str) -> None:
        self.saves.finish(str(output_dir))

    def abort_checkpoint_save(self, output_dir: str) -> None:
        self.saves.abort(str(output_dir))

    def export_lora(self, output_dir: str, checkpoint_path: str = "active") -> int:
        """Write a slot's adapter as a plain peft directory; returns the tensors written."""
        return export_lora(self.slots, str(output_dir), checkpoint_path)

    # -- checkpoint-owned extra objects ------------------------------------------------------

    def _owner(self, checkpoint: Any) -> Any:
        name = self.slots.resolve(checkpoint)
        if name is None:
            raise TrainerRankSlotStateError(
                "checkpoint-owned objects need a checkpoint; the base model (None) is selected")
        return self.slots.slots[name]

    def module(self, name: str, factory: Callable[[], torch.nn.Module], *,
               checkpoint: Any = Unset) -> torch.nn.Module:
        """The checkpoint's module `name`, made by `factory` on first use."""
        return self._extra(name, factory, checkpoint, torch.nn.Module)

    def parameter(self, name: str, factory: Callable[[], torch.Tensor], *,
                  checkpoint: Any = Unset) -> torch.nn.Parameter:
        """The checkpoint's parameter `name`, made by `factory` on first use."""
        def make() -> torch.nn.Parameter:
            value = factory()
            return value if isinstance(value, torch.nn.Parameter) else torch.nn.Parameter(value)
        return self._extra(name, make, checkpoint, torch.nn.Parameter)

    def buffer(self, name: str, factory: Callable[[], torch.Tensor], *,
               checkpoint: Any = Unset) -> torch.Tensor:
        """The checkpoint's persistent tensor `name`, made by `factory` on first use."""
        return self._extra(name, factory, checkpoint, torch.Tensor)

    def _extra(self, name: str, factory: Callable[[], Any], checkpoint: Any, kind: type) -> Any:
        slot = self._owner(checkpoint)
        existing = slot.extras.get(name)
        if existing is not None:
            if not isinstance(existing, kind) or (
                    kind is torch.Tensor and isinstance(existing, torch.nn.Parameter)):
                raise TrainerRankSlotStateError(
                    f"{name!r} of checkpoint {slot.name!r} is a {type(existing).__name__}, "
                    f"not a {kind.__name__}")
            return existing
        value = factory()
        if not isinstance(value, kind):
            raise TypeError(f"the factory for {name!r} returned a {type(value).__name__}, "
                            f"not a {kind.__name__}")
        slot.extras[name] = value.to(self.device) if hasattr(value, "to") else value
        return slot.extras[name]
