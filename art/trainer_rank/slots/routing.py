"""Routing a micro-batch's sequences to their adapters: sequences selecting different slots
never share a packed forward; each adapter group runs as its own sub-forward under that
adapter, and the outputs come back in the sequences' order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from art.megatron.lora_selection import use_adapter

T = TypeVar("T")


def adapter_groups(keys: Sequence[str | None]) -> list[tuple[str | None, list[int]]]:
    """Positions grouped by adapter key, groups in order of first appearance."""
    groups: dict[str | None, list[int]] = {}
    for position, key in enumerate(keys):
        groups.setdefault(key, []).append(position)
    return list(groups.items())


def run_by_adapter(leaves: Sequence[Any], keys: Sequence[str | None],
                   run: Callable[[list[Any]], list[T]]) -> list[T]:
    """`run` once per adapter group (under that adapter); outputs in `leaves` order."""
    if len(leaves) != len(keys):
        raise ValueError(f"{len(leaves)} sequences but {len(keys)} adapter keys")
    outputs: list[T | None] = [None] * len(leaves)
    for key, positions in adapter_groups(keys):
        with use_adapter(key):
            results = run([leaves[i] for i in positions])
        for position, result in zip(positions, results, strict=True):
            outputs[position] = result
    return outputs  # type: ignore[return-value]
