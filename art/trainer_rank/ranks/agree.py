"""Collectives that keep ranks in step: every DP rank got the same call, and every TP/CP rank
of one model replica takes the same decision (min of usable limits, max of measured peaks,
one plan fingerprint), so no rank ever enters a forward the others skip."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist


def _initialized() -> bool:
    from megatron.core import parallel_state

    return dist.is_available() and dist.is_initialized() and (
        parallel_state.model_parallel_is_initialized()
    )


def collective_device() -> torch.device:
    """Where this job's collectives take their tensors: the current GPU under NCCL, else CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _replica_group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_and_context_parallel_group()


def replica_group() -> Any:
    """The process group of this model replica's TP/CP ranks."""
    return _replica_group()


def _replica_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_and_context_parallel_world_size()


def data_parallel_rank_and_size() -> tuple[int, int]:
    if not _initialized():
        return 0, 1
    from megatron.core import parallel_state

    return (
        parallel_state.get_data_parallel_rank(with_context_parallel=False),
        parallel_state.get_data_parallel_world_size(with_context_parallel=False),
    )


def all_gather_over_data_parallel(obj: Any) -> list[Any]:
    """`obj` of every data-parallel rank (same TP/CP position), in DP rank order."""
    _, dp_size = data_parallel_rank_and_size()
    if dp_size == 1:
        return [obj]
    from megatron.core import parallel_state

    out: list[Any] = [None] * dp_size
    dist.all_gather_object(out, obj, group=parallel_state.get_data_parallel_group(
        with_context_parallel=False))
    return out


def check_same_call(what: str, values: tuple[int, ...]) -> None:
    """All ranks passed the same top-level list (counts compared); a mismatch raises on every
    rank, after the collective, so no rank waits for a peer that already left."""
    if not _initialized() or dist.get_world_size() == 1:
        return
    mine = torch.tensor(values, dtype=torch.int64, device=collective_device())
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    rows = [tuple(int(v) for v in t.tolist()) for t in gathered]
    if any(row != rows[0] for row in rows):
        listing = "; ".join(f"rank {r}: {row}" for r, row in enumerate(rows))
        raise ValueError(
            f"{what}: ranks passed different inputs (items, sequences, tokens, grad) = {listing}. "
            "Every rank must pass the same top-level list; DP dealing happens inside"
        )


def _all_reduce(value: int, op: Any, group: Any) -> int:
    t = torch.tensor([int(value)], dtype=torch.int64, device=collective_device())
    dist.all_reduce(t, op=op, group=group)
    return int(t.item())


def _reduce(value: int, op: Any) -> int:
    if not _initialized() or _replica_size() == 1:
        return int(value)
    return _all_reduce(value, op, _replica_group())


def min_over_replica(value: int) -> int:
    """The smallest value over the TP/CP ranks of this model replica."""
    return _reduce(value, dist.ReduceOp.MIN)


def max_over_replica(value: int) -> int:
    return _reduce(value, dist.ReduceOp.MAX)


def max_over_replica_of(values: tuple[int, ...]) -> tuple[int, ...]:
    """Each value's maximum over the TP/CP ranks of this model replica, in one collective."""
    if not _initialized() or _replica_size() == 1:
        return tuple(int(v) for v in values)
    t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_replica_group())
    return tuple(int(v) for v in t.tolist())


def check_same_plan(description: str) -> None:
    """Every TP/CP rank holds the same plan; otherwise raise on all of them (before any
    collective of the forward could hang)."""
    if not _initialized() or _replica_size() == 1:
        return
    digest = int.from_bytes(hashlib.sha256(description.encode()).digest()[:7], "big")
    high = max_over_replica(digest)
    low = min_over_replica(digest)
    if high != low:
        raise RuntimeError(
            "TP/CP ranks of one model replica planned different micro-batches (this rank: "
            f"{description}); check that every rank passed the same inputs and reads the same "
            "profile file"
        )


def broadcast_from_replica_root(obj: Any) -> Any:
    """The replica's first rank's object on every rank of the replica (e.g. loaded profiles,
    so a file replaced between two ranks' reads cannot split their decisions)."""
    if not _initialized() or _replica_size() == 1:
        return obj
    group = _replica_group()
    root = dist.get_global_rank(group, 0)
    box = [obj]
    dist.broadcast_object_list(box, src=root, group=group, device=collective_device())
    return box[0]


def experts_cross_replicas() -> bool:
    """Whether this rank's expert-parallel group holds ranks of other model replicas (EP
    carved from the data-parallel ranks), whose MoE layers then exchange tokens with ranks
    that plan their own items: every forward and backward of one needs its partners in one."""
    if not _initialized():
        return False
    from megatron.core import parallel_state

    if parallel_state.get_expert_model_parallel_world_size() == 1:
        return False
    experts = set(dist.get_process_group_ranks(
        parallel_state.get_expert_model_parallel_group()))
    replica = set(dist.get_process_group_ranks(_replica_group()))
    return not experts <= replica


def any_over_layer_ranks(flag: bool) -> bool:
    """Whether `flag` holds on any rank whose collectives one layer's run spans: this
    replica's TP/CP ranks and, when expert parallel crosses replicas, its expert-parallel
    group (the MoE layers' all-to-alls). Ranks that must run a layer the same number of times
    decide with it."""
    value = max_over_replica(int(flag))
    if experts_cross_replicas():
        from megatron.core import parallel_state

        value = _all_reduce(value, dist.ReduceOp.MAX,
                            parallel_state.get_expert_model_parallel_group())
    return bool(value)


def replica_size() -> int:
    """TP x CP ranks of this model replica (1 without Megatron's process groups)."""
    return _replica_size() if _initialized() else 1


def is_replica_root() -> bool:
    if not _initialized() or _replica_size() == 1:
        return True
    return dist.get_rank() == dist.get_global_rank(_replica_group(), 0)
