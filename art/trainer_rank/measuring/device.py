"""Device-memory helpers for TrainerRank: the usable limit on this rank, what outputs keep
alive, gradient snapshots for retrying after a caller-backward OOM, and releasing memory."""

from __future__ import annotations

import gc
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from art.megatron.geometry import ModelGeometry
from art.megatron.model_builder import DTYPES
from art.trainer_rank._request import MicroBatchShape

# Gradients are snapshotted before a grad micro-batch is yielded (so a caller-backward OOM can
# be retried without double-counting) only when the trainable parameters are this small,
# i.e. adapters, not full fine-tuning.
GRAD_SNAPSHOT_MAX_BYTES = 256 * 2**20


def device_usable_bytes(device: torch.device, test_memory_limit_bytes: int | None) -> int:
    """Device memory minus what is live on this rank (the virtual limit on CPU when set).
    The allocator reserve is not subtracted here: it is a term of every estimate."""
    if test_memory_limit_bytes is not None:
        return test_memory_limit_bytes
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        # Blocks the caching allocator holds but nobody uses are ours to reuse.
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + cached
    return cpu_available_bytes()


def cpu_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what the kernel can give without swapping)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def held_output_bytes(shape: MicroBatchShape, geometry: ModelGeometry, dtype: str) -> int:
    """What one sub-forward's outputs keep alive after it ran: per-sequence outputs are views
    of the packed tensors, so the whole packed row of each requested output."""
    tokens, wanted = shape.packed_tokens, shape.outputs
    per_token = 0
    if wanted.target_logprobs:
        per_token += 4
    if wanted.top_k:
        per_token += wanted.top_k * (4 + 8)
    if wanted.logits:
        per_token += geometry.vocab_size * 4
    if wanted.hidden_states:
        per_token += geometry.hidden_size * DTYPES[dtype].itemsize
    return tokens * per_token


@dataclass(frozen=True)
class UnallocatedGradients:
    """Bytes of trainable gradients not allocated yet, per decoder layer and outside them."""

    per_layer: tuple[int, ...]
    outside_layers: int

    @property
    def total_bytes(self) -> int:
        return sum(self.per_layer) + self.outside_layers

    def allocated_down_to(self, layer: int | None) -> int:
        """What a backward allocates by the time it runs layer `layer`'s backward (index;
        None: the head's): the backward runs top-down, so layers below it have allocated
        nothing yet. Parameters outside the layers count in full (an upper bound)."""
        if layer is None:
            return self.outside_layers
        return sum(self.per_layer[layer:]) + self.outside_layers


_LAYER = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.")


def unallocated_gradients(model: Any, num_layers: int) -> UnallocatedGradients:
    """`unallocated_gradient_bytes` split by decoder layer (from the parameter names)."""
    per_layer = [0] * num_layers
    outside = 0
    for name, p in model.named_parameters():
        if not p.requires_grad or p.grad is not None or getattr(p, "main_grad", None) is not None:
            continue
        nbytes = p.numel() * p.element_size()
        match = _LAYER.search(name)
        if match and int(match.group(1)) < num_layers:
            per_layer[int(match.group(1))] += nbytes
        else:
            outside += nbytes
    return UnallocatedGradients(tuple(per_layer), outside)


def unallocated_gradient_bytes(model: Any) -> int:
    """Bytes of the trainable parameters' gradients that are not allocated yet (neither a
    `.grad` nor a Megatron DDP `main_grad` buffer): resident pricing counts them, but the next
    grad micro-batch's backward is what allocates them."""
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if p.requires_grad and p.grad is None
               and getattr(p, "main_grad", None) is None)


class GradSnapshot:
    """Copies of the trainable parameters' gradients (and Megatron's main_grad buffers),
    taken before a grad micro-batch is yielded, so a backward that ran out of memory halfway
    can be undone before its items run again."""

    def __init__(self, model: Any) -> None:
        self.saved: list[tuple[torch.Tensor, str, torch.Tensor | None]] = []
        for p in model.parameters():
            if not p.requires_grad:
                continue
            for name in ("grad", "main_grad"):
                g = getattr(p, name, None)
                self.saved.append((p, name, None if g is None else g.detach().clone()))

    @property
    def nbytes(self) -> int:
        """What the copies hold (the trainer lowers a fixed limit by it)."""
        return sum(g.untyped_storage().nbytes() for _, _, g in self.saved if g is not None)

    @staticmethod
    def expected_bytes(model: Any) -> int:
        """What a snapshot taken now would hold (0 when the gradients are too large to
        snapshot), without taking it."""
        if not GradSnapshot.affordable(model):
            return 0
        return sum(g.untyped_storage().nbytes() for p in model.parameters() if p.requires_grad
                   for g in (getattr(p, "grad", None), getattr(p, "main_grad", None))
                   if g is not None)

    @staticmethod
    def affordable(model: Any) -> bool:
        total = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        return total <= GRAD_SNAPSHOT_MAX_BYTES

    def restore(self) -> None:
        for p, name, g in self.saved:
            if name == "grad":
                p.grad = g
            elif g is not None:
                getattr(p, name).copy_(g)


def cuda_oom_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory_stats(device).get("num_ooms", 0))


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
