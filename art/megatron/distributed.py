"""Distributed start-up from the torchrun environment: torch.distributed + Megatron state."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from art.megatron import cpu_runtime


@dataclass(frozen=True)
class DistributedState:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    launched_by_torchrun: bool
    device: torch.device


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer (set by torchrun)") from None


def initialize_distributed(
    *,
    tensor_parallel: int = 1,
    context_parallel: int = 1,
    pipeline_parallel: int = 1,
    virtual_pipeline_parallel: int | None = None,
    expert_parallel: int = 1,
    expert_tensor_parallel: int | None = None,
    seed: int = 1234,
    timeout_s: float = 120.0,
) -> DistributedState:
    """Initialise torch.distributed and Megatron's parallel state; idempotent.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT as torchrun sets them.
    Without them it starts a single-process group on an in-memory store. gloo on CPU, nccl
    on GPU.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    cpu_runtime.install()
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = _int_env("RANK", 0)
    world_size = _int_env("WORLD_SIZE", 1)
    local_rank = _int_env("LOCAL_RANK", 0)
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    model_parallel = tensor_parallel * context_parallel * pipeline_parallel
    if world_size % model_parallel:
        raise ValueError(
            f"WORLD_SIZE={world_size} is not divisible by TP {tensor_parallel} x CP "
            f"{context_parallel} x PP {pipeline_parallel} = {model_parallel}; launch a multiple "
            f"of {model_parallel} processes or change the ART_MEGATRON_*_PARALLEL_SIZE settings"
        )
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")

    if not dist.is_initialized():
        # A single process needs no rendezvous: an in-memory store, so no port is picked
        # (a free port picked here can be taken by another process before it is bound).
        store = None if launched else dist.HashStore()
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel,
            pipeline_model_parallel_size=pipeline_parallel,
            virtual_pipeline_model_parallel_size=virtual_pipeline_parallel,
            context_parallel_size=context_parallel,
            expert_model_parallel_size=expert_parallel,
            expert_tensor_parallel_size=expert_tensor_parallel,
        )
        model_parallel_cuda_manual_seed(seed)
    return DistributedState(rank, world_size, local_rank, backend, launched, device)


def shutdown_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
