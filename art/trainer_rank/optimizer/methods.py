"""TrainerRank's optimizer-step methods (ART's names and arguments): dp_reduce, zero_grad and
optim_step, which steps the runtime's optimizer and each loaded slot's own Adam state.

`StepMethods` is mixed into TrainerRank, which provides `slots` (SlotStore), `graphs` (the
live-graph ledger), `chunks`, `optimizer`, `phases` (the per-phase agreement), `_steps` (steps
taken) and `_grad_slots` (the slots a grad forward ran through since the last step or
zero_grad).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from art.trainer_rank._types import AdamParams, TrainerRankSlotStateError
from art.trainer_rank.optimizer.step import check_step, dp_reduce, optim_step, zero_grad
from art.trainer_rank.slots.store import BUILTIN


def _any_rank(flags: list[bool]) -> list[bool]:
    """Element-wise OR over every rank (so all ranks step the same slots)."""
    if not flags or not (dist.is_initialized() and dist.get_world_size() > 1):
        return flags
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


class StepMethods:
    slots: Any
    graphs: Any
    chunks: list[Any]
    optimizer: Any
    phases: Any
    _steps: int
    _grad_slots: set[str]

    # -- the optimizer step ------------------------------------------------------------------

    def dp_reduce(self, tensor: torch.Tensor, *, op: Any = None) -> None:
        """All-reduce `tensor` in place over the data-parallel ranks only (default SUM)."""
        dp_reduce(tensor, torch.distributed.ReduceOp.SUM if op is None else op)

    def zero_grad(self) -> None:
        """Zero every trainable gradient (DDP buffers and optimizer state's grads)."""
        zero_grad(self.chunks, self.optimizer)
        self.slots.zero_grad()
        self._grad_slots.clear()
        self.graphs.clear()

    def optim_step(
        self,
        *,
        params: AdamParams,
        scale_grads: float = 1.0,
        checkpoints: Iterable[str] | None = None,
        on_live_graphs: str = "allow",
    ) -> dict[str, float]:
        """Finalise gradients over DP ranks, multiply them by `scale_grads`, clip to
        `params.grad_clip_norm` and take one Adam step with `params`; gradients are zeroed
        afterwards. Returns grad_norm, learning_rate, update_successful (1.0 / 0.0),
        num_zeros_in_grad and scale_grads. `on_live_graphs="error"` refuses, before changing
        anything, while a caller still holds an output no backward has reached."""
        names = self._slots_to_step(checkpoints)  # raises before anything changes
        live = self.graphs.live()
        if live and on_live_graphs == "error":
            raise TrainerRankSlotStateError(
                f"optim_step(on_live_graphs='error'): the caller still holds {len(live)} output "
                f"group(s) with a graph no backward has reached ({', '.join(live[:4])}); run "
                "their backward or drop them (del) before stepping. Nothing was changed")
        loaded = [n for n in names if n != BUILTIN]
        if BUILTIN in names:  # refusals before any collective, the same on every rank
            check_step(chunks=self.chunks, optimizer=self.optimizer, params=params,
                       scale_grads=scale_grads, on_live_graphs=on_live_graphs)
        self._steps += 1
        # A failure on one rank inside the step's collectives ends it on every rank.
        with self.phases.optimizer_step(self._steps):
            metrics = self._step_loaded_slots(loaded, params, scale_grads)
            if BUILTIN in names:
                metrics.update(optim_step(
                    chunks=self.chunks, optimizer=self.optimizer, params=params,
                    scale_grads=scale_grads, ledger=self.graphs, on_live_graphs=on_live_graphs,
                ))
                self._grad_slots.discard(BUILTIN)
        self.graphs.clear()
        return metrics

    # -- stepping ----------------------------------------------------------------------------

    def _slots_to_step(self, checkpoints: Iterable[str] | None) -> list[str]:
        """The slots this optim_step updates; raises (before any change) for unknown,
        forward-only or gradient-less named slots."""
        if checkpoints is not None:
            names = [str(c) for c in checkpoints]
            if not names:
                raise TrainerRankSlotStateError(
                    "optim_step(checkpoints=[]) names no slot; pass None to step every slot "
                    "holding gradients")
            names = [self.slots.active() if n == "active" and n not in self.slots.slots else n
                     for n in names]
            self.slots.check_steppable(names)
        else:
            names = self.slots.trainable()
        flags = _any_rank([self._slot_has_grads(n) for n in names])
        if checkpoints is not None:
            missing = [n for n, f in zip(names, flags) if not f]
            if missing:
                raise TrainerRankSlotStateError(
                    f"optim_step: checkpoint(s) {missing} hold no gradients on any rank; run "
                    "backward through outputs of those slots first, or leave them out")
            return list(dict.fromkeys(names))
        selected = [n for n, f in zip(names, flags) if f]
        if not selected and BUILTIN in self.slots.slots:
            return [BUILTIN]  # the runtime's optimizer steps as it always did
        if not selected:
            raise TrainerRankSlotStateError(
                "optim_step: no checkpoint slot holds gradients; run backward first")
        return selected

    def _slot_has_grads(self, name: str) -> bool:
        if name == BUILTIN:
            return name in self._grad_slots
        return self.slots.has_grads(name)

    def _step_loaded_slots(self, names: list[str], params: Any, scale_grads: float
                           ) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for name in names:
            norm = self.slots.step_slot(name, params, scale_grads)
            metrics[f"grad_norm/{name}"] = norm
            self._grad_slots.discard(name)
        if names:
            metrics.setdefault("grad_norm", metrics[f"grad_norm/{names[0]}"])
            metrics.setdefault("learning_rate", float(params.learning_rate))
            metrics.setdefault("update_successful", 1.0)
            metrics.setdefault("scale_grads", float(scale_grads))
        return metrics
