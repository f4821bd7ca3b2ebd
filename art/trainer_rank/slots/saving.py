"""Saving a slot: prepare (validate and capture its state, a collective), then finish (write
and publish atomically) or abort (drop the capture). `save` is both; `export` writes only the
peft adapter.

prepare captures the unsharded adapter and Adam state on global rank 0 (CPU copies), so the
caller may go on training while finish writes; finish writes into a hidden sibling directory
and renames it into place, so `output_dir` is either absent or complete.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from art.megatron.lora_peft import adapter_state_dict, gather_to_rank0, write_adapter_files
from art.megatron.lora_selection import DEFAULT_ADAPTER
from art.trainer_rank.slots.files import validate_checkpoint, write_checkpoint
from art.trainer_rank.slots.optimizer import factor_sites, runtime_adam_state
from art.trainer_rank.slots.store import SlotStore
from art.trainer_rank.slots.types import OptimizerConfig, TrainerRankSlotStateError


@dataclass
class PreparedSave:
    name: str
    destination: Path
    adapter: dict[str, torch.Tensor] | None  # rank 0 only
    optimizer: dict[str, dict[str, torch.Tensor]] | None
    steps: dict[str, float]
    optimizer_config: OptimizerConfig | None
    r: int
    alpha: float
    use_rslora: bool
    base_model_name_or_path: str


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _raise_everywhere(error: BaseException | None, what: str) -> None:
    """Collective: every rank raises when any rank failed (the failing rank its own error)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, None if error is None else repr(error))
        if error is None and any(errors):
            raise RuntimeError(f"another rank failed to {what}: {next(e for e in errors if e)}")
    if error is not None:
        raise error


def resolve_saved_slot(store: SlotStore, checkpoint_path: str, action: str) -> str:
    if checkpoint_path == "active":
        name = store.active()
        if name is None:
            raise TrainerRankSlotStateError(
                f"{action}: no checkpoint is active (the base model is selected); load or push "
                "one, or name it with checkpoint_path=")
        return name
    if checkpoint_path not in store.slots:
        raise TrainerRankSlotStateError(
            f"{action}: checkpoint {checkpoint_path!r} is not resident (resident: "
            f"{sorted(store.slots)})")
    return checkpoint_path


class SaveQueue:
    """Prepared saves by output directory."""

    def __init__(self, store: SlotStore) -> None:
        self.store = store
        self.pending: dict[str, PreparedSave] = {}

    def prepare(self, output_dir: str, checkpoint_path: str = "active") -> None:
        key = str(output_dir)
        name = resolve_saved_slot(self.store, checkpoint_path, "prepare_checkpoint_save")
        slot = self.store.slots[name]
        if key in self.pending:
            raise TrainerRankSlotStateError(
                f"prepare_checkpoint_save: a save into {key!r} is already prepared; finish or "
                "abort it first")
        if self.store.has_grads(name):
            raise TrainerRankSlotStateError(
                f"prepare_checkpoint_save: slot {name!r} holds accumulated gradients; call "
                "optim_step or zero_grad first (a save holds weights and optimizer state only)")
        state = gather_to_rank0(adapter_state_dict(self.store.model, slot.key))
        optimizer = steps = None
        config: OptimizerConfig | None = None
        runtime_state = None
        if slot.optimizer is None and slot.key == DEFAULT_ADAPTER:
            # The runtime's own adapter: its Adam state lives in the Megatron optimizer.
            runtime_state = runtime_adam_state(
                self.store.builtin_optimizer, factor_sites(self.store.model, slot.key))
        if runtime_state is not None:
            components, steps, runtime_config = runtime_state
            gathered = {c: gather_to_rank0(t) for c, t in components.items()}
            optimizer = None if state is None else gathered  # type: ignore[assignment]
            config = runtime_config  # type: ignore[assignment]
        elif slot.optimizer is not None and slot.optimizer.config is not None:
            components, steps = slot.optimizer.state_tensors()
            gathered = {c: gather_to_rank0(t) for c, t in components.items()}
            optimizer = None if state is None else gathered  # type: ignore[assignment]
            config = slot.optimizer.config  # type: ignore[assignment]
        if steps is not None and dist.is_initialized() and dist.get_world_size() > 1:
            everything: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everything, steps)
            steps = {k: v for part in everything for k, v in part.items()}
        self.pending[key] = PreparedSave(
            name, Path(output_dir), state, optimizer, steps or {}, config, slot.r, slot.alpha,
            slot.use_rslora, slot.base_model_name_or_path or "")

    def finish(self, output_dir: str) -> None:
        key = str(output_dir)
        prepared = self.pending.get(key)
        if prepared is None:
            raise TrainerRankSlotStateError(
                f"finish_checkpoint_save: no save into {key!r} was prepared")
        error: BaseException | None = None
        if _rank() == 0:
            try:
                _publish(prepared)
            except BaseException as exc:  # reported on every rank below
                error = exc
        del self.pending[key]
        _raise_everywhere(error, "finish the checkpoint save")

    def abort(self, output_dir: str) -> None:
        self.pending.pop(str(output_dir), None)


def _publish(prepared: PreparedSave) -> None:
    assert prepared.adapter is not None
    destination = prepared.destination
    temporary = destination.with_name(f".{destination.name}.tmp-{uuid.uuid4().hex}")
    temporary.parent.mkdir(parents=True, exist_ok=True)
    try:
        temporary.mkdir()
        digest = write_checkpoint(
            temporary, adapter=prepared.adapter, r=prepared.r, alpha=prepared.alpha,
            use_rslora=prepared.use_rslora,
            base_model_name_or_path=prepared.base_model_name_or_path,
            optimizer=prepared.optimizer, steps=prepared.steps,
            optimizer_config=prepared.optimizer_config)
        if destination.exists() and any(destination.iterdir()):
            existing = validate_checkpoint(destination)
            if existing is None or existing["digest"] != digest:
                raise FileExistsError(
                    f"{destination} already holds a different checkpoint; save into a new "
                    "directory")
            shutil.rmtree(temporary)
            return
        if destination.exists():
            destination.rmdir()
        os.replace(temporary, destination)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def export_lora(store: SlotStore, output_dir: str, checkpoint_path: str = "active") -> int:
    """Write a slot's adapter as a plain peft directory (rank 0); returns its tensor count."""
    name = resolve_saved_slot(store, checkpoint_path, "export_lora")
    slot = store.slots[name]
    state = gather_to_rank0(adapter_state_dict(store.model, slot.key))
    error: BaseException | None = None
    count = 0
    if state is not None:
        try:
            write_adapter_files(Path(output_dir), state, r=slot.r, alpha=slot.alpha,
                                use_rslora=slot.use_rslora,
                                base_model_name_or_path=slot.base_model_name_or_path)
            count = len(state)
        except BaseException as exc:
            error = exc
    _raise_everywhere(error, "export the adapter")
    if dist.is_initialized() and dist.get_world_size() > 1:
        counts = torch.tensor([count])
        dist.broadcast(counts, src=0)
        count = int(counts.item())
    return count
