"""Which keys each query of a packed row may see: per-sequence causal blocks or a prefix tree.

A packed row is cut into segments (contiguous spans of rows). A segment attends causally to
itself and fully to its context: the spans of its ancestors in a prefix tree (a shared prompt,
deeper shared parts). A plain packed batch is the tree of depth one: every sequence is one
segment with no context. A completion therefore sees the prefix and itself, never a sibling.

The layout is handed to the core-attention module through Megatron's `packed_seq_params`
argument (it reaches core attention by closure, also inside recompute checkpoints, and
Megatron reads only its `qkv_format`, which is not "thd"). The dense [S, S] mask of the same
layout is what Megatron's unfused DotProductAttention takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class KeySpan:
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class AttentionSegment:
    """Rows [start, start + length) of the row: causal to themselves, fully to `context`."""

    start: int
    length: int
    context: tuple[KeySpan, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def visible_keys_tokens(self) -> int:
        return sum(span.length for span in self.context) + self.length


@dataclass(frozen=True)
class AttentionLayout:
    total_tokens: int
    segments: tuple[AttentionSegment, ...]
    # Megatron's attention code reads this attribute of `packed_seq_params`; not "thd".
    qkv_format: str = "segments"

    def __post_init__(self) -> None:
        cursor = 0
        for index, segment in enumerate(self.segments):
            if segment.start != cursor or segment.length < 1:
                raise ValueError(
                    f"attention layout: segment {index} covers rows [{segment.start}, "
                    f"{segment.end}) but the previous one ended at {cursor}; segments must tile "
                    "the row in order, each non-empty"
                )
            for span in segment.context:
                if span.length < 1 or span.end > segment.start:
                    raise ValueError(
                        f"attention layout: segment {index} (rows {segment.start}-{segment.end}) "
                        f"has context rows [{span.start}, {span.end}); context must be earlier, "
                        "non-empty rows"
                    )
            cursor = segment.end
        if cursor != self.total_tokens:
            raise ValueError(
                f"attention layout: segments cover {cursor} rows, the row has {self.total_tokens}"
            )

    @property
    def is_tree(self) -> bool:
        return any(segment.context for segment in self.segments)

    @property
    def attended_pairs(self) -> int:
        """(query, key) pairs that are computed: what attention's FLOPs scale with."""
        return sum(
            s.length * sum(c.length for c in s.context) + s.length * (s.length + 1) // 2
            for s in self.segments
        )

    @property
    def largest_segment_tokens(self) -> int:
        return max(segment.length for segment in self.segments)

    @property
    def largest_visible_keys_tokens(self) -> int:
        return max(segment.visible_keys_tokens for segment in self.segments)

    @classmethod
    def causal_blocks(cls, lengths: tuple[int, ...] | list[int]) -> AttentionLayout:
        """Independent sequences side by side: each attends causally to itself only."""
        segments = []
        cursor = 0
        for length in lengths:
            segments.append(AttentionSegment(cursor, int(length)))
            cursor += int(length)
        return cls(cursor, tuple(segments))

    def dense_mask(self, device: torch.device | str = "cpu") -> Tensor:
        """bool [1, 1, S, S], True = masked (Megatron's convention), for unfused attention."""
        S = self.total_tokens
        allowed = torch.zeros(S, S, dtype=torch.bool, device=device)
        for segment in self.segments:
            rows = slice(segment.start, segment.end)
            allowed[rows, rows] = torch.ones(
                segment.length, segment.length, dtype=torch.bool, device=device
            ).tril_()
            for span in segment.context:
                allowed[rows, span.start : span.end] = True
        return (~allowed).view(1, 1, S, S)
