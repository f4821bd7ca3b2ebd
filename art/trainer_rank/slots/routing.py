"""Routing a micro-batch's sequences to their adapters: sequences selecting different slots
never share a packed forward; each adapter group runs as its own sub-forward under that
adapter, and the outputs come back in the sequences' order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from art.megatron.lora_selection import use_adapter

T = TypeVar("T")


def adapter_groups(slots: Sequence[str | None]) -> list[tuple[str | None, list[int]]]:
    """Positions grouped by slot, groups in order of first appearance."""
    groups: dict[str | None, list[int]] = {}
    for position, slot in enumerate(slots):
        groups.setdefault(slot, []).append(position)
    return list(groups.items())


def run_by_adapter(leaves: Sequence[Any], slots: Sequence[str | None],
                   run: Callable[[list[Any], str | None], list[T]],
                   adapter_key: Callable[[str | None], str | None]) -> list[T]:
    """`run(group, slot)` once per slot group, under that slot's adapter (`adapter_key` maps
    a slot name to the LoRA adapter key); outputs in `leaves` order."""
    if len(leaves) != len(slots):
        raise ValueError(f"{len(leaves)} sequences but {len(slots)} slot selections")
    outputs: list[T | None] = [None] * len(leaves)
    for slot, positions in adapter_groups(slots):
        with use_adapter(adapter_key(slot)):
            results = run([leaves[i] for i in positions], slot)
        for position, result in zip(positions, results, strict=True):
            outputs[position] = result
    return outputs  # type: ignore[return-value]
