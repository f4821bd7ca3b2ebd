"""Which state each token of a packed row continues from: the row's recurrent layout.

A recurrent mixer (Gated DeltaNet: a causal conv and a gated delta rule) carries state along a
sequence. In a packed row every sequence starts from zero; in a group's prefix tree (a shared
prompt laid out once, completions after it) each child segment continues from its parent: its
recurrence from the parent's final state, its conv from the last kernel-1 inputs of its path
(the parent's, and the grandparent's when the parent is shorter). The segments are those of
the row's attention layout; a segment's parent is the one its attention context ends with.

With Megatron's unfused attention the layer sees only the dense mask. The tree is then read
from it token by token: each row continues from the last earlier row it may see, and a
segment starts wherever that is not the row before, or the row before has other children.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from art.megatron.attention_layout import AttentionLayout


@dataclass(frozen=True)
class RecurrentSegment:
    """Rows [start, start + length) of the row, continuing from segment `parent` (None: a
    sequence's first segment, from a zero state)."""

    start: int
    length: int
    parent: int | None
    depth: int

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class RecurrentLayout:
    total_tokens: int
    segments: tuple[RecurrentSegment, ...]

    def __post_init__(self) -> None:
        cursor = 0
        for index, segment in enumerate(self.segments):
            if segment.start != cursor or segment.length < 1:
                raise ValueError(f"recurrent layout: segment {index} starts at {segment.start}, "
                                 f"expected {cursor}; segments tile the row, each non-empty")
            if segment.parent is not None and not 0 <= segment.parent < index:
                raise ValueError(f"recurrent layout: segment {index} continues from "
                                 f"{segment.parent}; a parent comes earlier in the row")
            cursor = segment.end
        if cursor != self.total_tokens:
            raise ValueError(f"recurrent layout: segments cover {cursor} rows, the row has "
                             f"{self.total_tokens}")

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def sequences(cls, lengths: tuple[int, ...] | list[int]) -> RecurrentLayout:
        """Independent sequences side by side (a plain packed row)."""
        segments, cursor = [], 0
        for length in lengths:
            segments.append(RecurrentSegment(cursor, int(length), None, 0))
            cursor += int(length)
        return cls(cursor, tuple(segments))

    @classmethod
    def from_attention(cls, layout: AttentionLayout) -> RecurrentLayout:
        ends = {segment.end: index for index, segment in enumerate(layout.segments)}
        segments: list[RecurrentSegment] = []
        for index, segment in enumerate(layout.segments):
            parent = None
            if segment.context:
                parent = ends.get(segment.context[-1].end)
                if parent is None or parent >= index:
                    raise ValueError(
                        f"attention segment {index} (rows {segment.start}-{segment.end}) sees "
                        f"context ending at row {segment.context[-1].end}, where no earlier "
                        "segment ends: not a prefix tree a recurrence can follow")
            depth = 0 if parent is None else segments[parent].depth + 1
            segments.append(RecurrentSegment(segment.start, segment.length, parent, depth))
        return cls(layout.total_tokens, tuple(segments))

    @classmethod
    def from_mask(cls, mask: Tensor) -> RecurrentLayout:
        """From Megatron's dense bool mask [.., S, S] (True = masked). Reads the diagonal below
        the main one, and one row of the mask per row that does not see the row before: no
        [S, S] temporary."""
        masked = mask.reshape(mask.shape[-2], mask.shape[-1])
        rows = masked.shape[0]
        previous = list(range(-1, rows - 1))  # each row continues from the last it sees
        sees_previous = [True, *(~masked.diagonal(-1)).tolist()]
        for row in range(1, rows):
            if not sees_previous[row]:
                seen = torch.nonzero(~masked[row, :row]).flatten()
                previous[row] = int(seen[-1]) if seen.numel() else -1
        previous[0] = -1
        children = [0] * rows
        for before in previous:
            if before >= 0:
                children[before] += 1
        starts = [row for row in range(rows)
                  if row == 0 or previous[row] != row - 1 or children[row - 1] > 1]
        bounds = [*starts, rows]
        segment_of: dict[int, int] = {}
        segments: list[RecurrentSegment] = []
        for index, (a, b) in enumerate(zip(bounds, bounds[1:])):
            before = previous[a]
            parent = None
            if before >= 0:
                parent = segment_of[before]
                if segments[parent].end != before + 1:
                    raise ValueError(
                        f"attention mask: row {a} continues from row {before}, inside a "
                        "segment: not a prefix tree a recurrence can follow")
            depth = 0 if parent is None else segments[parent].depth + 1
            segments.append(RecurrentSegment(a, b - a, parent, depth))
            segment_of[b - 1] = index
        return cls(rows, tuple(segments))

    # -- reading ------------------------------------------------------------------------------

    @property
    def is_tree(self) -> bool:
        return any(segment.parent is not None for segment in self.segments)

    @cached_property
    def has_children(self) -> tuple[bool, ...]:
        flags = [False] * len(self.segments)
        for segment in self.segments:
            if segment.parent is not None:
                flags[segment.parent] = True
        return tuple(flags)

    @cached_property
    def calls(self) -> tuple[range, ...]:
        """The row cut into runs of consecutive segments, none of which continues from a
        segment of its own run: each run is one varlen call, started from states the runs
        before it ended with. A row laid out depth by depth gives one run per depth."""
        runs: list[range] = []
        start = 0
        for index, segment in enumerate(self.segments):
            if segment.parent is not None and segment.parent >= start:
                runs.append(range(start, index))
                start = index
        runs.append(range(start, len(self.segments)))
        return tuple(runs)

    def path_rows(self, index: int, width: int) -> list[int]:
        """The last `width` rows before segment `index` on its path (its ancestors' rows,
        nearest last); fewer when the path is shorter, none for a first segment."""
        rows: list[int] = []
        parent = self.segments[index].parent
        while parent is not None and len(rows) < width:
            segment = self.segments[parent]
            take = min(width - len(rows), segment.length)
            rows[:0] = range(segment.end - take, segment.end)
            parent = segment.parent
        return rows
