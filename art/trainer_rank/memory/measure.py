"""Measuring the real peak of a micro-batch: live tensor storages on CPU, allocator stats on GPU.

CPU has no allocator statistics, so `StorageMeter` is a TorchDispatchMode that sees every
tensor an op creates (forward, autograd backward and checkpoint recompute all run their CPU
kernels on the calling thread), records its *storage* once (a view shares its base's storage,
so it is never counted twice; outputs that alias an input by the op's schema are not
allocations at all), and drops it when the storage dies (weakref callback). The live
sum right after each op is the exact live-bytes curve; its maximum is the peak.

Why not `torch.distributed._tools.mem_tracker.MemTracker` directly: it registers a gradient
hook on every parameter of every module it sees and raises on frozen ones ("cannot register a
hook on a tensor that doesn't require gradient"), which is exactly the LoRA case (base
weights frozen). It uses the same storage-weakref bookkeeping as this meter.

Only storages created inside the meter count: what was live before (weights, optimizer state)
is the baseline, so `peak_bytes` is directly the dynamic peak of what ran inside. Storage
resizes (Megatron's CheckpointWithoutOutput frees and regrows outputs that way) are followed.
On CUDA, `CudaMeter` uses `torch.cuda.max_memory_allocated` relative to the entry value.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class StorageMeter(TorchDispatchMode):
    """Live and peak bytes of storages created while active (CPU and any device)."""

    def __init__(self) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.allocations = 0
        self.largest_allocation_bytes = 0

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def __enter__(self) -> StorageMeter:
        # Megatron's CheckpointWithoutOutput frees an output by resizing its storage to 0 and
        # regrows it in backward; storage resizes are not dispatched ops, so they are watched
        # here (only while this meter is active).
        original = torch.UntypedStorage.resize_
        meter = self

        def resize_(storage: torch.UntypedStorage, size: int):
            result = original(storage, size)
            meter._resized(storage)
            return result

        self._original_resize = original
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
        return super().__exit__(*exc)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        ref = self._refs.get(key)
        if ref is None or ref() is not storage:
            return  # not allocated inside the meter
        size = storage.nbytes()
        self.live_bytes += size - self._sizes[key]
        self._sizes[key] = size
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        self.largest_allocation_bytes = max(self.largest_allocation_bytes, size)

    def _release(self, key: int, _ref: Any = None) -> None:
        size = self._sizes.pop(key, None)
        self._refs.pop(key, None)
        if size is not None:
            self.live_bytes -= size

    def _record(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return  # tensors without storage (e.g. sparse or functional wrappers)
        size = storage.nbytes()
        if size == 0:
            return
        key = id(storage)
        ref = self._refs.get(key)
        if ref is not None and ref() is storage:
            return  # a view or an in-place result: same storage, already counted
        if ref is not None:
            self._release(key)  # id reused after an unnoticed death: drop the stale record
        self._sizes[key] = size
        self._refs[key] = weakref.ref(storage, lambda r, k=key: self._release(k, r))
        self.live_bytes += size
        self.allocations += 1
        self.largest_allocation_bytes = max(self.largest_allocation_bytes, size)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        for i, value in enumerate(outputs):
            # Outputs that alias an input (views, in-place and out= results) allocate
            # nothing: recording them would count a pre-existing storage (a weight, a
            # persistent buffer) as new.
            if i < len(returns) and returns[i].alias_info is not None:
                if func is torch.ops.aten.resize_.default and isinstance(value, torch.Tensor):
                    self._resized(value.untyped_storage())  # Tensor.resize_ may grow it
                continue
            for leaf in tree_leaves(value):
                if isinstance(leaf, torch.Tensor):
                    self._record(leaf)
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        return out


class CudaMeter:
    """Peak allocated bytes on the current CUDA device, relative to the value on entry."""

    def __enter__(self) -> CudaMeter:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self._base = torch.cuda.memory_allocated()
        self.peak_bytes = 0
        self.live_bytes = 0
        self.largest_allocation_bytes = 0
        return self

    def reset_peak(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.live_bytes = torch.cuda.memory_allocated() - self._base
        self.peak_bytes = self.live_bytes

    def _update(self) -> None:
        self.live_bytes = torch.cuda.memory_allocated() - self._base
        self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated() - self._base)

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.synchronize()
        self._update()
        stats = torch.cuda.memory_stats()
        self.inactive_split_bytes = int(stats.get("inactive_split_bytes.all.current", 0))


def meter_for(device: str | torch.device) -> StorageMeter | CudaMeter:
    return CudaMeter() if torch.device(device).type == "cuda" else StorageMeter()


def release_score_buffer() -> None:
    """Drop Megatron's global memory buffer (unfused attention's [heads, s, s] score buffer).

    It persists at the largest size seen; the memory model prices it inside every micro-batch,
    so it is released before each one: measured from the state before, it is then really
    allocated inside the micro-batch, and on GPU it is not also counted as live before."""
    from megatron.core import parallel_state

    buffer = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    if buffer is not None:
        buffer.buffer.clear()
