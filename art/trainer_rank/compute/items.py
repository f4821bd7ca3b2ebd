"""Top-level items: flattening nested groups of ForwardInputs and rebuilding the nesting (the
data-parallel waves that deal them are ranks/lockstep.py's)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from art.trainer_rank._request import OutputRequest, output_request_problem
from art.trainer_rank._types import ForwardInput
from art.trainer_rank.compute.packing import IGNORE_INDEX
from art.trainer_rank.compute.prefix_tree import TreeShape, shared_tokens, tree_shape

MAX_NESTING_LEVELS = 4  # the top-level list plus up to three levels of groups, as upstream


@dataclass(frozen=True)
class Item:
    """One top-level item: its index in the caller's list and its sequences, in order."""

    index: int
    value: Any  # the caller's object: a ForwardInput or a nested list of them
    leaves: tuple[ForwardInput, ...]
    # Per leaf: runs without grad (its own no_grad, else the call's). Default: all with grad.
    no_grad_leaves: tuple[bool, ...] = ()
    # Per leaf: the checkpoint slot it runs with (None: the base model); () until resolved.
    checkpoints: tuple[str | None, ...] = ()
    # Computed once: admission reads them for every candidate of every decision, and summing
    # tensor sizes each time would dominate a decision's cost when many items are pending.
    sequence_lengths_tokens: tuple[int, ...] = field(init=False, repr=False, compare=False)
    num_tokens: int = field(init=False, repr=False, compare=False)
    outputs: OutputRequest = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        lengths = tuple(leaf.num_tokens for leaf in self.leaves)
        object.__setattr__(self, "sequence_lengths_tokens", lengths)
        object.__setattr__(self, "num_tokens", sum(lengths))
        object.__setattr__(self, "outputs", outputs_union(self.leaves))
        if not self.no_grad_leaves:
            object.__setattr__(self, "no_grad_leaves", (False,) * len(self.leaves))

    @property
    def shared_tokens(self) -> int:
        """Tokens its sequences share as prefixes (laid out once where attention takes a
        tree); computed from the token ids on first use."""
        cached = self.__dict__.get("_shared_tokens")
        if cached is None:
            cached = shared_tokens([leaf.input_tokens for leaf in self.leaves]) if len(
                self.leaves) > 1 else 0
            object.__setattr__(self, "_shared_tokens", cached)
        return cached

    @property
    def tree(self) -> TreeShape:
        """Its sequences' prefix tree as the packer lays it out (computed on first use)."""
        cached = self.__dict__.get("_tree")
        if cached is None:
            cached = tree_shape([leaf.input_tokens for leaf in self.leaves])
            object.__setattr__(self, "_tree", cached)
        return cached

    @property
    def is_group(self) -> bool:
        return not isinstance(self.value, ForwardInput)

    @property
    def grad(self) -> bool:
        """The item runs with grad when any of its sequences needs it (a group is one run)."""
        return not all(self.no_grad_leaves)


def _is_group(value: Any) -> bool:
    return isinstance(value, Iterable) and not isinstance(
        value, (ForwardInput, torch.Tensor, str, bytes, Mapping))


def _materialise(value: Any, path: str, level: int) -> Any:
    """The item with every group read once into a list (generators are consumed here)."""
    if isinstance(value, ForwardInput):
        return value
    if not _is_group(value):
        raise TypeError(
            f"inputs{path} is a {type(value).__name__}; an item must be a ForwardInput or a "
            "(nested) group of ForwardInputs"
        )
    if level >= MAX_NESTING_LEVELS:
        raise ValueError(
            f"inputs{path} nests groups deeper than {MAX_NESTING_LEVELS} levels (counting the "
            "top-level list); flatten it"
        )
    return [_materialise(child, f"{path}[{i}]", level + 1) for i, child in enumerate(value)]


def _leaves(value: Any) -> list[ForwardInput]:
    if isinstance(value, ForwardInput):
        return [value]
    return [leaf for child in value for leaf in _leaves(child)]


def make_items(inputs: Iterable[Any], *, call_no_grad: bool = False) -> list[Item]:
    """Read the caller's top-level iterable once and flatten every item. A leaf's own
    `no_grad` wins over the call's."""
    if isinstance(inputs, ForwardInput) or not _is_group(inputs):
        raise TypeError(
            f"inputs must be an iterable of top-level items, got {type(inputs).__name__}; wrap "
            "a single ForwardInput in a list"
        )
    items = []
    for i, value in enumerate(inputs):
        value = _materialise(value, f"[{i}]", 1)
        leaves = _leaves(value)
        if not leaves:
            raise ValueError(f"inputs[{i}] is an empty group; every item needs >= 1 sequence")
        flags = tuple(call_no_grad if leaf.no_grad is None else leaf.no_grad for leaf in leaves)
        items.append(Item(index=i, value=value, leaves=tuple(leaves), no_grad_leaves=flags))
    return items


def validate_items(items: Sequence[Item], vocab_size: int) -> None:
    """Check every item against the model before anything is priced or run: token ids and
    targets inside the vocabulary, top_k no larger than it, and something to differentiate in
    a grad item (an item without any output, with grad, is refused here: its head would
    have nothing to run backward through). Errors name the item by its place in the inputs."""
    paths = [(item, list(_leaf_paths(item.value, f"[{item.index}]"))) for item in items]
    ids_checked = _every_id_in_vocabulary([leaf for _, leaves in paths for _, leaf in leaves],
                                          vocab_size)
    for item, leaves in paths:
        for path, leaf in leaves:
            if not ids_checked:
                _check_ids(leaf.input_tokens, f"inputs{path}.input_tokens", vocab_size,
                           ignore=None)
                if leaf.target_tokens is not None:
                    _check_ids(leaf.target_tokens, f"inputs{path}.target_tokens", vocab_size,
                               ignore=IGNORE_INDEX)
            problem = output_request_problem(leaf.outputs, grad=False, vocab_size=vocab_size)
            if problem is not None:
                raise ValueError(f"inputs{path} {problem}")
        problem = output_request_problem(item.outputs, grad=item.grad, vocab_size=vocab_size)
        if problem is not None:
            what = "every sequence of the group" if item.is_group else "the sequence"
            raise ValueError(f"inputs[{item.index}] ({what}) {problem}")


def _every_id_in_vocabulary(leaves: Sequence[ForwardInput], vocab_size: int) -> bool:
    """True when every input id and target (IGNORE_INDEX aside) of `leaves` is inside the
    vocabulary, in a fixed number of ops whatever the number of sequences; False when one is
    not, or the tensors sit on several devices: the per-sequence checks then name it."""
    def flat(ids: torch.Tensor) -> torch.Tensor:
        return ids if ids.dim() == 1 else ids.reshape(-1)

    inputs = [flat(leaf.input_tokens) for leaf in leaves]
    targets = [flat(leaf.target_tokens) for leaf in leaves if leaf.target_tokens is not None]
    for ids, ignore in ((inputs, None), (targets, IGNORE_INDEX)):
        if not ids:
            continue
        if len({t.device for t in ids}) > 1:
            return False
        row = torch.cat(ids)
        if ignore is not None:
            row = row[row != ignore]
        if row.numel() == 0:
            continue
        low, high = torch.aminmax(row)
        if int(low) < 0 or int(high) >= vocab_size:
            return False
    return True


def _leaf_paths(value: Any, path: str) -> Iterable[tuple[str, ForwardInput]]:
    if isinstance(value, ForwardInput):
        yield path, value
        return
    for i, child in enumerate(value):
        yield from _leaf_paths(child, f"{path}[{i}]")


def _check_ids(ids: torch.Tensor, what: str, vocab_size: int, *, ignore: int | None) -> None:
    bad = (ids < 0) | (ids >= vocab_size)
    if ignore is not None:
        bad &= ids != ignore
    if not bool(bad.any()):
        return
    position = int(bad.reshape(-1).nonzero()[0, 0])
    value = int(ids.reshape(-1)[position])
    at = (f"position {position}" if ids.dim() == 1 else
          f"position {position // ids.shape[1]}, target {position % ids.shape[1]}")
    allowed = f"ids 0-{vocab_size - 1}" + (f", or {ignore} to skip a position"
                                            if ignore is not None else "")
    raise ValueError(
        f"{what} holds {value} at {at} ({int(bad.sum())} such value(s)); the model's "
        f"vocabulary has {vocab_size} ids, so it takes {allowed}: check the tokenizer the "
        "ids came from")


def group_shared_tokens(leaves: Sequence[ForwardInput]) -> int:
    """Tokens the sequences of one group share as prefixes (see compute/prefix_tree.py)."""
    if len(leaves) < 2:
        return 0
    return shared_tokens([leaf.input_tokens for leaf in leaves])


def outputs_union(leaves: Sequence[ForwardInput]) -> OutputRequest:
    """The outputs the heads must compute for a set of sequences (the union of requests)."""
    return OutputRequest.union(
        OutputRequest(target_logprobs=leaf.target_tokens is not None, top_k=leaf.top_k or 0,
                      logits=leaf.logits, hidden_states=leaf.hidden_states)
        for leaf in leaves)


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


def fingerprint(items: Sequence[Item]) -> tuple[int, int, int]:
    """(items, sequences, tokens): compared across ranks to catch mismatched calls."""
    return (
        len(items),
        sum(len(item.leaves) for item in items),
        sum(item.num_tokens for item in items),
    )
