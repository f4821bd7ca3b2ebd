"""The live-graph ledger: the output groups a caller still holds whose graph no backward has
reached yet, which an optimizer step may refuse to run under (`on_live_graphs="error"`)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

from art.trainer_rank._types import ForwardOutput


class GraphLedger:
    """Which grad-enabled outputs a caller still holds without having run backward through
    them. An output is settled once a gradient reached it or once the caller dropped it."""

    def __init__(self) -> None:
        self._pending: dict[int, str] = {}
        self._next = 0

    def register(self, tensors: Iterable[torch.Tensor], description: str) -> None:
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or not tensor.requires_grad:
                continue
            key = self._next
            self._next += 1
            self._pending[key] = description
            tensor.register_hook(self._settle_hook(key))
            weakref.finalize(tensor, self._pending.pop, key, None)

    def _settle_hook(self, key: int):
        pending = self._pending

        def hook(grad: torch.Tensor) -> None:
            pending.pop(key, None)

        return hook

    def live(self) -> list[str]:
        return sorted(set(self._pending.values()))

    def clear(self) -> None:
        self._pending.clear()


def output_tensors(outputs: Any) -> list[torch.Tensor]:
    """Every tensor of a (nested) list of ForwardOutputs."""
    if isinstance(outputs, ForwardOutput):
        found = [outputs.target_logprobs, outputs.logits, outputs.hidden_states]
        if outputs.top_k is not None:
            found.append(outputs.top_k.logprobs)
        return [t for t in found if isinstance(t, torch.Tensor)]
    if isinstance(outputs, (list, tuple)):
        return [t for child in outputs for t in output_tensors(child)]
    return []
