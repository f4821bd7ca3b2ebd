"""One packed row split over the context-parallel ranks, and the row gathered back.

The row is cut into 2 x CP equal chunks and rank r holds chunks r and 2CP-1-r, in that order:
Megatron's load-balanced order, which gives every rank one early and one late chunk so causal
attention costs each rank about the same. Every sequence keeps its positions (the rows carry
them), and every token-wise part of a layer (norms, projections, MLP, LoRA) runs on the local
rows only; attention is the one part that needs other ranks' rows (see packed_attention).

The row is split as a whole rather than sequence by sequence (what TE's THD kernels do): the
segmented flash attention computes any set of query rows against the gathered keys, so the
split needs no per-sequence padding, and a row that lays a shared prefix out once (a tree)
splits like any other.

Two gathers to the full row, differing only in backward:
- `gather_row(x, split, replicated_grad=True)`: the full row feeds work every CP rank repeats
  (the output heads), so each rank's gradient of it is the whole gradient and the backward
  keeps the local rows;
- `replicated_grad=False`: each rank's gradient is its own part (attention's keys and values
  seen by its own queries), so the backward sums over the CP ranks first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from art.megatron.attention_layout import AttentionLayout, KeySpan


@dataclass(frozen=True)
class ContextParallelSplit:
    """Which rows of a packed row of `total_tokens` CP rank `rank` (of `size`) holds."""

    total_tokens: int
    size: int
    rank: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(
                f"context parallel rank {self.rank} of {self.size}: the rank must be in "
                f"[0, {self.size})"
            )
        if self.total_tokens % (2 * self.size):
            raise ValueError(
                f"a packed row of {self.total_tokens} tokens cannot be split into 2 x CP = "
                f"{2 * self.size} equal chunks; pack it with the ParallelLayout the model was "
                "built with (it pads the row to a multiple of 2 x CP)"
            )

    @property
    def chunk_tokens(self) -> int:
        return self.total_tokens // (2 * self.size)

    @property
    def local_tokens(self) -> int:
        return 2 * self.chunk_tokens

    def runs(self, rank: int | None = None) -> tuple[KeySpan, KeySpan]:
        """The two row spans a rank holds, in its local order."""
        r = self.rank if rank is None else rank
        c = self.chunk_tokens
        return KeySpan(r * c, c), KeySpan((2 * self.size - 1 - r) * c, c)

    def local(self, values: Tensor, dim: int = 0) -> Tensor:
        """This rank's rows of a full-row tensor (a copy: the two chunks are not adjacent)."""
        first, second = self.runs()
        return torch.cat([values.narrow(dim, first.start, first.length),
                          values.narrow(dim, second.start, second.length)], dim=dim)

    def assemble(self, per_rank: list[Tensor]) -> Tensor:
        """Every rank's local rows (dim 0, rank order) -> the full row in row order."""
        c = self.chunk_tokens
        chunks: list[Tensor] = [per_rank[0]] * (2 * self.size)
        for r, part in enumerate(per_rank):
            chunks[r] = part[:c]
            chunks[2 * self.size - 1 - r] = part[c:]
        return torch.cat(chunks, dim=0)


@dataclass(frozen=True)
class SplitRowLayout:
    """A row's `AttentionLayout` (row coordinates) with the split of its query rows: what the
    segmented flash attention takes as `packed_seq_params` under context parallel."""

    layout: AttentionLayout
    split: ContextParallelSplit
    # Megatron's attention code reads this attribute of `packed_seq_params`; not "thd".
    qkv_format: str = "segments"


def context_parallel_group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


def split_for_this_rank(total_tokens: int) -> ContextParallelSplit:
    from megatron.core import parallel_state

    return ContextParallelSplit(total_tokens, parallel_state.get_context_parallel_world_size(),
                                parallel_state.get_context_parallel_rank())


def all_gather_rows(local: Tensor, split: ContextParallelSplit, group: Any) -> Tensor:
    """Every CP rank's local rows -> the full row (no autograd)."""
    local = local.contiguous()
    if dist.get_backend(group) == "gloo" and local.device.type != "cpu":
        staged = local.cpu()
        parts = [torch.empty_like(staged) for _ in range(split.size)]
        dist.all_gather(parts, staged, group=group)
        return split.assemble([p.to(local.device) for p in parts])
    parts = [torch.empty_like(local) for _ in range(split.size)]
    dist.all_gather(parts, local, group=group)
    return split.assemble(parts)


def sum_over_ranks(full: Tensor, group: Any) -> Tensor:
    """In-place sum of a full-row tensor over the CP ranks (gloo stages CUDA tensors)."""
    if dist.get_backend(group) == "gloo" and full.device.type != "cpu":
        staged = full.cpu()
        dist.all_reduce(staged, group=group)
        full.copy_(staged)
        return full
    dist.all_reduce(full, group=group)
    return full


class _GatherRow(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: Tensor, split: ContextParallelSplit, group: Any,  # type: ignore[override]
                replicated_grad: bool) -> Tensor:
        ctx.split, ctx.group, ctx.replicated_grad = split, group, replicated_grad
        return all_gather_rows(local, split, group)

    @staticmethod
    def backward(ctx: Any, grad_full: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grad_full = grad_full.contiguous()
        if not ctx.replicated_grad:
            grad_full = sum_over_ranks(grad_full.clone(), ctx.group)
        return ctx.split.local(grad_full), None, None, None


def gather_row(local: Tensor, split: ContextParallelSplit, *, replicated_grad: bool,
               group: Any = None) -> Tensor:
    """[S / CP, ...] local rows -> [S, ...] full row, differentiable (see the module
    docstring for `replicated_grad`)."""
    if local.shape[0] != split.local_tokens:
        raise ValueError(
            f"this CP rank holds {split.local_tokens} rows of the {split.total_tokens}-token "
            f"row, got a tensor of {local.shape[0]}"
        )
    return _GatherRow.apply(local, split, group if group is not None else
                            context_parallel_group(), replicated_grad)
