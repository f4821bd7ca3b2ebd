"""The optimizer step of a TrainerRank: gradient finalisation over data-parallel ranks, the
caller's gradient scale, Adam with this step's hyper-parameters, and zeroing.

Gradients live in Megatron's DDP buffers (`main_grad`). Megatron's DDP averages them over the
data-parallel x context-parallel ranks; upstream's drivers instead SUM their loss and token
count with `dp_reduce` and pass `scale_grads = 1 / global tokens`, so the step multiplies the
averaged gradients back by the DP x CP size before applying `scale_grads`: DP=2 then steps
exactly like DP=1 on the same global batch, and CP=2 like CP=1 (each CP rank's gradient is
its rows' part of the whole).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from art.megatron import cpu_runtime
from art.trainer_rank._types import (
    AdamParams,
    TrainerRankRuntimeSupportError,
    TrainerRankSlotStateError,
)
from art.trainer_rank.optimizer.graphs import GraphLedger

ON_LIVE_GRAPHS: tuple[str, ...] = ("allow", "error")


def data_parallel_group() -> Any | None:
    from megatron.core import parallel_state

    if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return None
    return parallel_state.get_data_parallel_group(with_context_parallel=False)


def ddp_average_ranks() -> int:
    """How many ranks Megatron's DDP averages the gradients over: data parallel x context
    parallel. Each CP rank's gradient is the part its own rows contribute, so the sum over CP
    (and over DP, where the caller normalises by global tokens) is the gradient."""
    from megatron.core import parallel_state

    if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return 1
    return dist.get_world_size(parallel_state.get_data_parallel_group(
        with_context_parallel=True))


def dp_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> None:
    """In-place all-reduce over this replica's data-parallel ranks only (TP/CP ranks of one
    replica hold the same value and are not summed)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"dp_reduce needs a tensor, got {type(tensor).__name__}")
    group = data_parallel_group()
    if group is None or dist.get_world_size(group) == 1:
        return
    if dist.get_backend(group) == "gloo" and tensor.device.type != "cpu":
        staged = tensor.detach().cpu()
        dist.all_reduce(staged, op=op, group=group)
        tensor.copy_(staged)
        return
    dist.all_reduce(tensor, op=op, group=group)


def zero_grad(chunks: list[Any], optimizer: Any | None) -> None:
    for chunk in chunks:
        zero_grad_buffer = getattr(chunk, "zero_grad_buffer", None)
        if callable(zero_grad_buffer):
            zero_grad_buffer()
        else:
            for p in chunk.parameters():
                p.grad = None
    if optimizer is not None:
        optimizer.zero_grad()


def _param_groups(optimizer: Any) -> list[dict]:
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [g for o in chained for g in o.optimizer.param_groups]
    return list(optimizer.optimizer.param_groups)


def _configs(optimizer: Any) -> list[Any]:
    chained = getattr(optimizer, "chained_optimizers", None)
    optimizers = chained if chained is not None else [optimizer]
    return list({id(o.config): o.config for o in optimizers}.values())


def check_step(
    *,
    chunks: list[Any],
    optimizer: Any | None,
    params: AdamParams,
    scale_grads: float,
    on_live_graphs: str,
) -> None:
    """The step's refusals (bad arguments, no optimizer, no DDP wrapping), raised before any
    collective: every rank raises the same and nothing is changed."""
    if not isinstance(params, AdamParams):
        raise TypeError(f"optim_step(params=...) needs an AdamParams, got {type(params).__name__}")
    if on_live_graphs not in ON_LIVE_GRAPHS:
        raise ValueError(f"on_live_graphs={on_live_graphs!r} is not one of {ON_LIVE_GRAPHS}")
    scale = float(scale_grads)
    if not math.isfinite(scale):
        raise ValueError(f"scale_grads={scale_grads!r} is not finite")
    if optimizer is None:
        raise TrainerRankRuntimeSupportError(
            "optim_step: this runtime has no optimizer; build it with "
            "build_training_runtime(build_optimizer=True)"
        )
    if not all(callable(getattr(c, "scale_gradients", None)) for c in chunks):
        raise TrainerRankRuntimeSupportError(
            "optim_step: the model chunks are not wrapped in Megatron's DistributedDataParallel "
            "(build the runtime with build_training_runtime)"
        )


def optim_step(
    *,
    chunks: list[Any],
    optimizer: Any | None,
    params: AdamParams,
    scale_grads: float,
    ledger: GraphLedger,
    on_live_graphs: str,
) -> dict[str, float]:
    """One optimizer step over the trainable parameters; returns grad norm, learning rate,
    whether the update was applied, and the count of zero gradients."""
    check_step(chunks=chunks, optimizer=optimizer, params=params, scale_grads=scale_grads,
               on_live_graphs=on_live_graphs)
    scale = float(scale_grads)
    live = ledger.live()
    if live and on_live_graphs == "error":
        raise TrainerRankSlotStateError(
            f"optim_step(on_live_graphs='error'): the caller still holds {len(live)} output "
            f"group(s) with a graph no backward has reached ({', '.join(live[:4])}); run their "
            "backward or drop them (del) before stepping. Nothing was changed"
        )
    from megatron.core.distributed import finalize_model_grads

    averaged_over = ddp_average_ranks()
    with cpu_runtime.cuda_calls_on_cpu():
        finalize_model_grads(chunks)
        factor = scale * averaged_over
        if factor != 1.0:
            for chunk in chunks:
                chunk.scale_gradients(factor)
        for config in _configs(optimizer):
            config.clip_grad = float(params.grad_clip_norm)
        for group_ in _param_groups(optimizer):
            group_["lr"] = float(params.learning_rate) * float(group_.get("lr_mult", 1.0))
            group_["weight_decay"] = float(params.weight_decay) * float(
                group_.get("wd_mult", 1.0))
            if "betas" in group_:
                group_["betas"] = (float(params.beta1), float(params.beta2))
            if "eps" in group_:
                group_["eps"] = float(params.eps)
        applied, grad_norm, num_zeros = optimizer.step()
    zero_grad(chunks, optimizer)
    ledger.clear()
    return {
        "grad_norm": float("nan") if grad_norm is None else float(grad_norm),
        "learning_rate": float(params.learning_rate),
        "update_successful": 1.0 if applied else 0.0,
        "num_zeros_in_grad": 0.0 if num_zeros is None else float(num_zeros),
        "scale_grads": scale,
    }
