"""Top-level items: flattening nested groups of ForwardInputs, rebuilding the nesting, and
dealing items to data-parallel ranks deterministically."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from art.trainer_rank._memory.request import OutputRequest
from art.trainer_rank._types import ForwardInput


@dataclass(frozen=True)
class Item:
    """One top-level item: its index in the caller's list and its sequences, in order."""

    index: int
    value: Any  # the caller's object: a ForwardInput or a nested list of them
    leaves: tuple[ForwardInput, ...]
    # Computed once: admission reads them for every candidate of every decision (summing
    # tensor sizes each time cost ~30 ms per decision at 10,000 pending items).
    sequence_lengths_tokens: tuple[int, ...] = field(init=False, repr=False, compare=False)
    num_tokens: int = field(init=False, repr=False, compare=False)
    outputs: OutputRequest = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        lengths = tuple(leaf.num_tokens for leaf in self.leaves)
        object.__setattr__(self, "sequence_lengths_tokens", lengths)
        object.__setattr__(self, "num_tokens", sum(lengths))
        object.__setattr__(self, "outputs", outputs_union(self.leaves))

    @property
    def is_group(self) -> bool:
        return not isinstance(self.value, ForwardInput)


def _leaves(value: Any, path: str) -> list[ForwardInput]:
    if isinstance(value, ForwardInput):
        return [value]
    if isinstance(value, (list, tuple)):
        out: list[ForwardInput] = []
        for i, child in enumerate(value):
            out.extend(_leaves(child, f"{path}[{i}]"))
        return out
    raise TypeError(
        f"inputs{path} is a {type(value).__name__}; an item must be a ForwardInput or a (nested) "
        "list of ForwardInputs"
    )


def make_items(inputs: Sequence[Any]) -> list[Item]:
    """Validate the caller's top-level list and flatten every item."""
    if isinstance(inputs, ForwardInput) or not isinstance(inputs, (list, tuple)):
        raise TypeError(
            f"inputs must be a list of top-level items, got {type(inputs).__name__}; wrap a single "
            "ForwardInput in a list"
        )
    items = []
    for i, value in enumerate(inputs):
        leaves = _leaves(value, f"[{i}]")
        if not leaves:
            raise ValueError(f"inputs[{i}] is an empty group; every item needs >= 1 sequence")
        items.append(Item(index=i, value=value, leaves=tuple(leaves)))
    return items


def grad_mode(items: Sequence[Item], no_grad: bool | None) -> bool:
    """True when the call runs with grad. The call-level no_grad wins; otherwise the
    sequences' own no_grad flags, which must agree (one call is one autograd mode)."""
    if no_grad is not None:
        return not no_grad
    flags = {leaf.no_grad for item in items for leaf in item.leaves}
    if len(flags) > 1:
        mixed = [item.index for item in items if any(leaf.no_grad for leaf in item.leaves)]
        raise ValueError(
            f"inputs mix no_grad=True (items {mixed[:8]}) with grad-enabled sequences; pass "
            "no_grad= to the call or split the call in two"
        )
    return not (flags and flags.pop())


def outputs_union(leaves: Sequence[ForwardInput]) -> OutputRequest:
    """The outputs the heads must compute for a set of sequences (the union of requests)."""
    top_k = max((leaf.top_k or 0 for leaf in leaves), default=0)
    return OutputRequest(
        target_logprobs=any(leaf.target_tokens is not None for leaf in leaves),
        top_k=top_k,
        logits=any(leaf.logits for leaf in leaves),
        hidden_states=any(leaf.hidden_states for leaf in leaves),
    )


def rebuild(value: Any, leaf_outputs: Sequence[Any]) -> Any:
    """Mirror the nesting of `value` with leaf_outputs (consumed in flatten order)."""
    it = iter(leaf_outputs)

    def walk(node: Any) -> Any:
        if isinstance(node, ForwardInput):
            return next(it)
        return [walk(child) for child in node]

    out = walk(value)
    if next(it, None) is not None:
        raise ValueError("rebuild: more outputs than sequences in the item")
    return out


def deal_to_ranks(
    items: Sequence[Item], data_parallel_size: int, cost: Callable[[Item], int] | None = None
) -> list[list[Item]]:
    """Deal whole items to DP ranks: largest first, each to the least-loaded rank (ties to the
    lower rank). Deterministic from the items alone, so every rank computes the same deal.
    Each rank's items keep the caller's order."""
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
    cost = cost or (lambda item: item.num_tokens)
    loads = [0] * data_parallel_size
    dealt: list[list[Item]] = [[] for _ in range(data_parallel_size)]
    for item in sorted(items, key=lambda it: (-cost(it), it.index)):
        rank = min(range(data_parallel_size), key=lambda r: (loads[r], r))
        loads[rank] += cost(item)
        dealt[rank].append(item)
    for bucket in dealt:
        bucket.sort(key=lambda it: it.index)
    return dealt


def fingerprint(items: Sequence[Item]) -> tuple[int, int, int]:
    """(items, sequences, tokens): compared across ranks to catch mismatched calls."""
    return (
        len(items),
        sum(len(item.leaves) for item in items),
        sum(item.num_tokens for item in items),
    )
