"""A no-grad group that does not fit whole, as consecutive sub-forwards that each fit: without
grad nothing is retained between them but their outputs, which stay alive until the item is
yielded, so each sub-forward is priced with the outputs of the ones before it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

from art.megatron.recompute import EffectiveRecompute
from art.trainer_rank._request import MicroBatchShape
from art.trainer_rank._types import ForwardInput
from art.trainer_rank.compute.items import Item
from art.trainer_rank.decide.priced import Pricing


class Splitter(Protocol):
    """What the split reads of the admission."""

    held_output_bytes: Callable[[MicroBatchShape], int] | None

    def price(self, leaves: Sequence[ForwardInput], grad: bool,
              recompute: EffectiveRecompute | None = None
              ) -> tuple[Pricing, MicroBatchShape, str]: ...


def split_no_grad(
    admission: Splitter, item: Item, usable_bytes: int
) -> tuple[tuple[tuple[int, ...], ...], Pricing, MicroBatchShape, str] | None:
    """Greedy consecutive sub-forwards that each fit. Without grad nothing is retained
    between them except their outputs, which stay alive until the item is yielded, so each
    sub-forward is priced with the outputs of the ones before it. None when one sequence
    cannot fit."""
    groups: list[tuple[int, ...]] = []
    current: list[int] = []
    held = 0
    worst: tuple[Pricing, MicroBatchShape, str] | None = None
    best_current: tuple[Pricing, MicroBatchShape, str] | None = None

    def priced_with_held(indices: list[int]) -> tuple[Pricing, MicroBatchShape, str]:
        pricing, shape, sig = admission.price([item.leaves[i] for i in indices], False)
        return replace(pricing, held_bytes=held), shape, sig

    def close_group() -> None:
        nonlocal held, worst
        assert best_current is not None
        groups.append(tuple(current))
        if worst is None or best_current[0].dynamic_bytes > worst[0].dynamic_bytes:
            worst = best_current
        if admission.held_output_bytes is not None:
            held += admission.held_output_bytes(best_current[1])

    for index in range(len(item.leaves)):
        trial = current + [index]
        priced = priced_with_held(trial)
        if priced[0].dynamic_bytes <= usable_bytes:
            current, best_current = trial, priced
            continue
        if not current:
            return None
        close_group()
        alone = priced_with_held([index])
        if alone[0].dynamic_bytes > usable_bytes:
            return None
        current, best_current = [index], alone
    close_group()
    assert worst is not None
    return (tuple(groups), *worst)
