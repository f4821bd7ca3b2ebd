"""The prefix tree of one indivisible group: which token spans its sequences share.

A GRPO group is N rollouts of one prompt: their longest common prefix is computed once and each
completion attends to it. Deeper shared parts (rollouts that agree on their first completion
tokens, a multi-turn history shared by a subset) become deeper nodes. The tree is a radix tree
over the token ids: a node is a span of positions [depth, depth + length) that all its members
hold identically; members diverge (or end) right after it.

Sharing is decided from the data alone: every node with two or more members is laid out once.
A node costs one more key span for the segments below it (one more flash-kernel call per query
segment); sharing L tokens among k sequences saves (k - 1) x L rows of every activation.
Nesting stops at MAX_SHARED_DEPTH levels: below it every member gets its own copy of the rest,
which bounds the key spans per segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

MAX_SHARED_DEPTH = 8


@dataclass
class TreeNode:
    """Positions [depth, depth + length) of every member, held once in the packed row."""

    depth: int
    length: int
    members: tuple[int, ...]  # indices into the group's sequences
    children: list[TreeNode] = field(default_factory=list)

    @property
    def source(self) -> int:
        return self.members[0]


def _common_prefix_end(sequences: Sequence[Tensor], members: Sequence[int], depth: int) -> int:
    """First position >= depth where the members differ or one of them ends."""
    end = min(int(sequences[m].numel()) for m in members)
    if end <= depth:
        return end
    first = sequences[members[0]][depth:end]
    for m in members[1:]:
        differ = (sequences[m][depth:end] != first).nonzero()
        if differ.numel():
            end = depth + int(differ[0, 0])
            first = first[: end - depth]
            if end == depth:
                break
    return end


def _build(sequences: Sequence[Tensor], members: tuple[int, ...], depth: int,
           level: int) -> list[TreeNode]:
    """The nodes covering positions >= depth of `members` (who agree on positions < depth)."""
    if len(members) == 1 or level >= MAX_SHARED_DEPTH:
        return [
            TreeNode(depth, int(sequences[m].numel()) - depth, (m,))
            for m in members
            if int(sequences[m].numel()) > depth
        ]
    end = _common_prefix_end(sequences, members, depth)
    groups: dict[int, list[int]] = {}
    for m in members:
        if int(sequences[m].numel()) > end:
            groups.setdefault(int(sequences[m][end]), []).append(m)
    children: list[TreeNode] = []
    for group in groups.values():
        children.extend(_build(sequences, tuple(group), end, level + (end > depth)))
    if end == depth:
        return children
    return [TreeNode(depth, end - depth, members, children)]


def build_prefix_tree(sequences: Sequence[Tensor]) -> list[TreeNode]:
    """Roots of the group's tree, in the order of their first member."""
    return _build(sequences, tuple(range(len(sequences))), 0, 0)


def shared_tokens(sequences: Sequence[Tensor]) -> int:
    """Logical tokens minus the tree's rows: what sharing saves for this group."""
    logical = sum(int(s.numel()) for s in sequences)
    return logical - sum(node.length for node in walk(build_prefix_tree(sequences)))


@dataclass(frozen=True)
class TreeShape:
    """A group's tree as the packer lays it out, depth by depth: the lengths of the nodes at
    each depth (a sequence alone: one root)."""

    levels: tuple[tuple[int, ...], ...]

    @property
    def segment_lengths_tokens(self) -> tuple[int, ...]:
        return tuple(n for level in self.levels for n in level)

    @property
    def continued_segments(self) -> int:
        """Nodes that continue from a parent (every node below the roots)."""
        return sum(len(level) for level in self.levels[1:])

    @classmethod
    def sequences(cls, lengths: Sequence[int]) -> TreeShape:
        """Sequences that share nothing: all roots."""
        return cls((tuple(int(n) for n in lengths),))


def tree_shape(sequences: Sequence[Tensor]) -> TreeShape:
    if len(sequences) == 1:
        return TreeShape.sequences([int(sequences[0].numel())])
    level, levels = build_prefix_tree(sequences), []
    while level:
        levels.append(tuple(node.length for node in level))
        level = [child for node in level for child in node.children]
    return TreeShape(tuple(levels))


def row_levels(shapes: Sequence[TreeShape]) -> tuple[tuple[int, ...], ...]:
    """The segment lengths at each depth of a row holding these trees: the packer lays the
    row out depth by depth, and a recurrent layer runs each depth as one varlen call."""
    depth = max(len(shape.levels) for shape in shapes)
    return tuple(tuple(n for shape in shapes if d < len(shape.levels) for n in shape.levels[d])
                 for d in range(depth))


def walk(roots: Sequence[TreeNode]) -> list[TreeNode]:
    """Preorder: a node, then its subtrees in order (the packed row's order)."""
    out: list[TreeNode] = []
    stack = list(reversed(roots))
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(reversed(node.children))
    return out


def validate_group(sequences: Sequence[Tensor]) -> None:
    for index, sequence in enumerate(sequences):
        if sequence.dim() != 1 or sequence.numel() == 0:
            raise ValueError(
                f"sequence {index} must be a non-empty 1-D token tensor, got shape "
                f"{tuple(sequence.shape)}"
            )
        if sequence.dtype.is_floating_point or sequence.dtype == torch.bool:
            raise ValueError(f"sequence {index} must hold integer token ids, got {sequence.dtype}")
