"""The checkpoint-slot store: which adapters are resident, which one a forward applies, and the
operations that change that (load, push/pop, snapshot, prefetch, step).

A slot is one resident LoRA adapter in the model (`LoraLinear.adapters[key]`), named by the
checkpoint path it came from. The runtime's own adapter is the built-in slot `BUILTIN`,
stepped by the runtime's optimizer; a loaded slot has its own `SlotOptimizer`; a snapshot is a
forward-only copy of another slot. The selection for a forward: the input's `checkpoint`, else
the call's, else the top of the pushed stack, else the loaded one. None selects no adapter.

Every operation checks everything first and raises `TrainerRankSlotStateError` (or the
reading error) before it changes any state: a failed call leaves the store as it was.
"""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from art.megatron.lora_peft import copy_adapter, load_adapter_state, remove_adapter
from art.megatron.lora_selection import DEFAULT_ADAPTER
from art.trainer_rank.slots.files import CheckpointContents, read_checkpoint
from art.trainer_rank.slots.optimizer import SlotOptimizer, factor_sites
from art.trainer_rank.slots.types import (
    MaterializedCheckpoint,
    TrainerRankSlotStateError,
    Unset,
)

# The runtime's own adapter (the one build_training_runtime applied) is the slot named "active".
BUILTIN = "active"
_READER = ThreadPoolExecutor(max_workers=2, thread_name_prefix="checkpoint-prefetch")


@dataclass
class Slot:
    name: str  # the public name: the checkpoint path (BUILTIN for the runtime's adapter)
    key: str  # the adapter key inside every LoraLinear
    r: int
    alpha: float
    use_rslora: bool
    base_model_name_or_path: str | None
    forward_only: bool = False
    optimizer: SlotOptimizer | None = None
    revision: int = 0
    extras: dict[str, Any] = field(default_factory=dict)


class PushedCheckpoint:
    """What `push_checkpoint` returns: the push is already done; as a context manager it pops
    on exit (and refuses if the stack top is no longer this push)."""

    def __init__(self, store: SlotStore, name: str | None, depth: int) -> None:
        self._store, self._name, self._depth = store, name, depth
        self._closed = False

    def __enter__(self) -> PushedCheckpoint:
        if self._closed:
            raise TrainerRankSlotStateError("this pushed checkpoint was already popped")
        return self

    def __exit__(self, *exc: object) -> bool:
        if self._closed:
            return False
        stack = self._store.stack
        if len(stack) != self._depth or stack[-1] != self._name:
            raise TrainerRankSlotStateError(
                f"the pushed checkpoint stack changed inside the 'with' block (expected "
                f"{self._name!r} at depth {self._depth}, found {stack[-1:]} at depth "
                f"{len(stack)}); pop what you pushed inside the block before leaving it"
            )
        self._store.pop()
        self._closed = True
        return False

    def __await__(self):  # `await rank.push_checkpoint(...)`: the push has happened
        return asyncio.sleep(0).__await__()


class SlotStore:
    def __init__(self, model: Any, *, has_builtin: bool,
                 base_model_name_or_path: str | None = None,
                 builtin_r: int = 0, builtin_alpha: float = 0.0) -> None:
        self.model = model
        self.base_model_name_or_path = base_model_name_or_path
        self.slots: dict[str, Slot] = {}
        if has_builtin:
            self.slots[BUILTIN] = Slot(BUILTIN, DEFAULT_ADAPTER, builtin_r, builtin_alpha,
                                       False, base_model_name_or_path)
        self.loaded: str | None = BUILTIN if has_builtin else None
        self.stack: list[str | None] = []
        self._prefetched: dict[str, Future[CheckpointContents]] = {}
        # The runtime's Megatron optimizer (it steps the built-in slot); saves read its state.
        self.builtin_optimizer: Any = None
        self._keys = itertools.count(1)

    # -- selection ---------------------------------------------------------------------------

    def active(self) -> str | None:
        """The slot a forward without an explicit selection uses (None: base model)."""
        return self.stack[-1] if self.stack else self.loaded

    def resolve(self, *selections: Any) -> str | None:
        """The first selection that is not Unset (input's, then call's), else the active
        one; a name must be resident (or prefetched: it is loaded forward-only then)."""
        for selection in selections:
            if selection is Unset:
                continue
            if selection is None:
                return None
            name = self._name_of(selection)
            if name not in self.slots:
                raise TrainerRankSlotStateError(
                    f"checkpoint={name!r} is not a resident slot (resident: "
                    f"{sorted(self.slots)}); load_checkpoint or push_checkpoint it first, or "
                    "pass None for the base model"
                )
            return name
        return self.active()

    def adapter_key(self, name: str | None) -> str | None:
        return None if name is None else self.slots[name].key

    @staticmethod
    def _name_of(checkpoint: Any) -> str:
        if isinstance(checkpoint, MaterializedCheckpoint):
            return checkpoint.path
        if isinstance(checkpoint, (str, Path)):
            return str(checkpoint)
        raise TypeError(f"a checkpoint is a path, a MaterializedCheckpoint or None, got "
                        f"{type(checkpoint).__name__}")

    # -- reading -----------------------------------------------------------------------------

    def prefetch(self, *checkpoints: str | MaterializedCheckpoint) -> asyncio.Task[None]:
        """Start reading checkpoints in the background; load/push then use what was read."""
        futures = []
        for checkpoint in checkpoints:
            name = self._name_of(checkpoint)
            directory = (checkpoint.directory if isinstance(checkpoint, MaterializedCheckpoint)
                         else name)
            future = self._prefetched.get(name)
            if future is None or (future.done() and future.exception() is not None):
                future = _READER.submit(read_checkpoint, directory)
                self._prefetched[name] = future
            futures.append(future)

        async def wait() -> None:
            for future in futures:
                await asyncio.wrap_future(future)

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = asyncio.new_event_loop()  # not running: reads proceed in threads anyway
        return loop.create_task(wait())

    def _read(self, checkpoint: str | MaterializedCheckpoint) -> CheckpointContents:
        name = self._name_of(checkpoint)
        future = self._prefetched.pop(name, None)
        if future is not None and not isinstance(checkpoint, MaterializedCheckpoint):
            return future.result()
        directory = (checkpoint.directory if isinstance(checkpoint, MaterializedCheckpoint)
                     else name)
        return read_checkpoint(directory)

    # -- load / push / pop / snapshot --------------------------------------------------------

    def load(self, checkpoint: str | MaterializedCheckpoint | None) -> None:
        """Make `checkpoint` the loaded (trainable) slot, reading it into a slot named by its
        path (replacing that slot's weights and optimizer state if it is resident)."""
        if self.stack:
            raise TrainerRankSlotStateError(
                f"load_checkpoint while {len(self.stack)} checkpoint(s) are pushed; pop them "
                "(or leave their 'with' blocks) first")
        if checkpoint is None:
            self.loaded = None
            return
        name = self._name_of(checkpoint)
        self._check_replaceable(name)
        contents = self._read(checkpoint)
        self._install(name, contents, forward_only=False)
        self.loaded = name

    def push(self, checkpoint: str | MaterializedCheckpoint | None) -> PushedCheckpoint:
        """Select `checkpoint` for forwards until the matching pop; a path not yet resident is
        read and kept resident as a trainable slot."""
        if checkpoint is None:
            name = None
        else:
            name = self._name_of(checkpoint)
            if name not in self.slots:
                self._install(name, self._read(checkpoint), forward_only=False)
        self.stack.append(name)
        return PushedCheckpoint(self, name, len(self.stack))

    def pop(self) -> None:
        if not self.stack:
            raise TrainerRankSlotStateError("pop_checkpoint with nothing pushed")
        self.stack.pop()

    def snapshot(self, source: str, destination: str) -> bool:
        """A forward-only resident copy of slot `source` named `destination`. False (and no
        change) when `destination` already is a snapshot."""
        if source not in self.slots:
            raise TrainerRankSlotStateError(
                f"snapshot_checkpoint: source {source!r} is not resident (resident: "
                f"{sorted(self.slots)})")
        existing = self.slots.get(destination)
        if existing is not None:
            if existing.forward_only:
                return False
            raise TrainerRankSlotStateError(
                f"snapshot_checkpoint: {destination!r} is a trainable checkpoint; choose "
                "another destination name")
        origin = self.slots[source]
        key = f"slot{next(self._keys)}"
        copy_adapter(self.model, origin.key, key, trainable=False)
        self.slots[destination] = Slot(destination, key, origin.r, origin.alpha,
                                       origin.use_rslora, origin.base_model_name_or_path,
                                       forward_only=True)
        return True

    def _check_replaceable(self, name: str) -> None:
        slot = self.slots.get(name)
        if slot is None:
            return
        if slot.forward_only:
            raise TrainerRankSlotStateError(
                f"load_checkpoint: {name!r} is a forward-only snapshot; load under another name")
        if name == BUILTIN:
            raise TrainerRankSlotStateError(f"{BUILTIN!r} names the runtime's own adapter")
        if self.has_grads(name):
            raise TrainerRankSlotStateError(
                f"load_checkpoint: slot {name!r} holds accumulated gradients; call optim_step "
                "or zero_grad before replacing it")

    def _install(self, name: str, contents: CheckpointContents, *, forward_only: bool) -> None:
        base = contents.base_model_name_or_path
        if (base and self.base_model_name_or_path
                and Path(base).name != Path(self.base_model_name_or_path).name):
            raise TrainerRankSlotStateError(
                f"checkpoint {name!r} was trained on {base!r}, this runtime runs "
                f"{self.base_model_name_or_path!r}")
        key = f"slot{next(self._keys)}"
        config = load_adapter_state(self.model, contents.config, contents.adapter,
                                    source=str(contents.directory), adapter=key,
                                    trainable=not forward_only)
        try:
            optimizer = None
            if not forward_only:
                optimizer = SlotOptimizer(factor_sites(self.model, key))
                if contents.optimizer is not None and contents.manifest is not None:
                    optimizer.restore(contents.optimizer, contents.manifest["steps"],
                                      contents.manifest["optimizer"])
        except BaseException:
            remove_adapter(self.model, key)
            raise
        previous = self.slots.get(name)
        self.slots[name] = Slot(
            name, key, int(config.r), float(config.lora_alpha),
            bool(getattr(config, "use_rslora", False)), base or self.base_model_name_or_path,
            forward_only=forward_only, optimizer=optimizer,
            revision=0 if previous is None else previous.revision + 1)
        if previous is not None:
            remove_adapter(self.model, previous.key)

    # -- gradients and steps -----------------------------------------------------------------

    def has_grads(self, name: str) -> bool:
        slot = self.slots[name]
        return any(site.param.grad is not None for site in factor_sites(self.model, slot.key))

    def trainable(self) -> list[str]:
        return [n for n, s in self.slots.items() if not s.forward_only]

    def check_steppable(self, names: list[str]) -> None:
        for name in names:
            if name not in self.slots:
                raise TrainerRankSlotStateError(
                    f"optim_step: checkpoint {name!r} is not resident (resident: "
                    f"{sorted(self.slots)})")
            if self.slots[name].forward_only:
                raise TrainerRankSlotStateError(
                    f"optim_step: {name!r} is a forward-only snapshot and cannot be stepped")

    def step_slot(self, name: str, params: Any, scale_grads: float) -> float:
        optimizer = self.slots[name].optimizer
        assert optimizer is not None, f"{name} is stepped by the runtime optimizer"
        return optimizer.step(params, scale_grads)

    def zero_grad(self) -> None:
        for slot in self.slots.values():
            if slot.key != DEFAULT_ADAPTER:
                for site in factor_sites(self.model, slot.key):
                    site.param.grad = None

    # -- memory ------------------------------------------------------------------------------

    def resident_bytes(self) -> int:
        """Bytes this rank holds for slots beyond the built-in one: parameters, gradients
        (trainable slots) and fp32 Adam state (masters + 2 moments)."""
        total = 0
        for slot in self.slots.values():
            if slot.key == DEFAULT_ADAPTER:
                continue
            sites = factor_sites(self.model, slot.key)
            params = sum(s.param.numel() * s.param.element_size() for s in sites)
            total += params
            if not slot.forward_only:
                total += params + (slot.optimizer.state_bytes() if slot.optimizer else 0)
        return total
