"""A virtual memory limit for CPU runs: count live tensor bytes, raise OOM past a limit.

On CPU nothing runs out of memory at the sizes tests use, so the OOM, split and decline paths
of admission would never run for real. `LiveBytesMeter` makes them run: inside it every
storage created by a tensor op (forward, backward, collectives' output buffers) is counted
once, from allocation until its last reference dies, and the moment the live total exceeds
`limit_bytes` the op that crossed it raises `torch.OutOfMemoryError`, as the CUDA allocator
would. The same meter reports the live and peak bytes used as the "measured peak".

How the CPU count works (the mechanism torch.distributed._tools.mem_tracker uses, reduced to
what a limit needs): a TorchDispatchMode sees every op's outputs; outputs of ops whose schema
says they return a new tensor (no alias annotation) are new storages, counted by
`nbytes()` and given a weakref finalizer that subtracts them when the storage is freed.
Outputs that alias an input (in-place ops, views, out= variants, c10d collectives writing
into given buffers) allocate nothing; if their storage is tracked its size is re-read, which
covers `Tensor.resize_`. `UntypedStorage.resize_` does not go through the dispatcher, and
Megatron's CheckpointWithoutOutput frees and rebuilds outputs with it, so it is wrapped while
a meter is active. Storages that existed before the meter was entered are not counted.

On CUDA the meter reads the caching allocator instead (allocated bytes net of the bytes
allocated on entry, and the allocator's peak), and a limit is applied with
`torch.cuda.set_per_process_memory_fraction`, which makes the allocator itself raise
`torch.OutOfMemoryError`; that fraction bounds reserved memory, so it trips somewhat earlier
than the allocated count would.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ENV_TEST_MEMORY_LIMIT = "ART_TRAINER_RANK_TEST_MEMORY_LIMIT_BYTES"


def test_memory_limit_bytes(env: Mapping[str, str] | None = None) -> int | None:
    """The virtual limit from ART_TRAINER_RANK_TEST_MEMORY_LIMIT_BYTES, or None when unset."""
    environ = os.environ if env is None else env
    raw = environ.get(ENV_TEST_MEMORY_LIMIT, "").strip()
    if not raw:
        return None
    try:
        value = int(float(raw)) if any(c in raw for c in ".eE") else int(raw)
    except ValueError:
        raise ValueError(
            f"{ENV_TEST_MEMORY_LIMIT}={raw!r} is not a byte count; set a positive integer such "
            "as 268435456 (256 MiB) or unset it"
        ) from None
    if value <= 0:
        raise ValueError(f"{ENV_TEST_MEMORY_LIMIT} must be a positive byte count, got {value}")
    return value


test_memory_limit_bytes.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


_active_meters: list[LiveBytesMeter] = []
# resize_ as it was when the first meter became active; other tools (MemTracker) may have
# wrapped it already, so the hook calls through to it instead of to the original.
_resize_below_hook: Any = None


def _tracking_storage_resize(storage: torch.UntypedStorage, size: int) -> Any:
    result = _resize_below_hook(storage, size)
    for meter in list(_active_meters):
        meter._refresh(storage)
    return result


def _install_resize_hook() -> None:
    global _resize_below_hook
    _resize_below_hook = torch.UntypedStorage.resize_
    torch.UntypedStorage.resize_ = _tracking_storage_resize  # type: ignore[method-assign]


def _remove_resize_hook() -> None:
    global _resize_below_hook
    if torch.UntypedStorage.resize_ is _tracking_storage_resize:
        torch.UntypedStorage.resize_ = _resize_below_hook  # type: ignore[method-assign]
    _resize_below_hook = None


_FRESH, _MUTATING, _VIEW = 0, 1, 2
_OP_KINDS: dict[Any, int] = {}
_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


def _op_kind(func: Any) -> int:
    """_FRESH: the schema says the outputs are new tensors. _MUTATING: they alias an input the
    op wrote to (in-place, out=, resize_; such an op may have resized that storage). _VIEW:
    they alias an input and nothing was written, so no storage changed size (skipped)."""
    kind = _OP_KINDS.get(func)
    if kind is None:
        schema = getattr(func, "_schema", None)
        if func in _LIFTS:
            # torch.tensor(...) builds its storage outside the dispatcher and then "lifts" it:
            # the alias annotation hides a storage that is new.
            kind = _FRESH
        elif schema is None or getattr(func, "namespace", "") == "c10d":
            # c10d collectives write into the buffers they are given but carry no alias
            # annotations; their functional variants (_c10d_functional) do allocate.
            kind = _MUTATING
        elif any(r.alias_info is None for r in schema.returns):
            kind = _FRESH
        elif schema.is_mutable:
            kind = _MUTATING
        else:
            kind = _VIEW
        _OP_KINDS[func] = kind
    return kind


class _StorageCounter(TorchDispatchMode):
    def __init__(self, meter: LiveBytesMeter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        result = func(*args, **(kwargs or {}))
        kind = _op_kind(func)
        if kind == _VIEW:
            return result
        fresh = kind == _FRESH
        meter = self.meter
        if type(result) is torch.Tensor:  # the common case, without flattening
            meter._observe(result, fresh, func)
            return result
        for leaf in tree_leaves(result):
            if isinstance(leaf, torch.Tensor):
                meter._observe(leaf, fresh, func)
        return result


class LiveBytesMeter:
    """Context manager: live/peak bytes of tensors created inside it; optional hard limit."""

    def __init__(self, limit_bytes: int | None = None, *, device: str | None = None) -> None:
        if limit_bytes is not None and limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be positive or None, got {limit_bytes}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda"):
            raise ValueError(f"LiveBytesMeter device must be 'cpu' or 'cuda', got {device!r}")
        self.limit_bytes = limit_bytes
        self.device = device
        self._live_bytes = 0
        self._peak_bytes = 0
        # storage key (its C pointer) -> (weakref keeping the finalizer, bytes counted)
        self._storages: dict[int, tuple[weakref.ref, int]] = {}
        self._mode: _StorageCounter | None = None
        self._cuda_baseline_bytes = 0
        self._cuda_fraction_set = False

    # -- public ------------------------------------------------------------------------------

    @property
    def live_bytes(self) -> int:
        if self.device == "cuda":
            return torch.cuda.memory_allocated() - self._cuda_baseline_bytes
        return self._live_bytes

    @property
    def peak_bytes(self) -> int:
        if self.device == "cuda":
            return max(0, torch.cuda.max_memory_allocated() - self._cuda_baseline_bytes)
        return self._peak_bytes

    def reset_peak(self) -> None:
        """Restart the peak at the current live bytes (e.g. between forward and backward)."""
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self._peak_bytes = self._live_bytes

    @property
    def tracked_storages(self) -> int:
        return len(self._storages)

    def __enter__(self) -> LiveBytesMeter:
        if self._mode is not None:
            raise RuntimeError("this LiveBytesMeter is already active; use a second meter to nest")
        if self.device == "cuda":
            self._enter_cuda()
            self._mode = _StorageCounter(self)  # marks the meter active; not pushed on CUDA
            return self
        if not _active_meters:
            _install_resize_hook()
        _active_meters.append(self)
        self._mode = _StorageCounter(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        mode, self._mode = self._mode, None
        if self.device == "cuda":
            self._exit_cuda()
            return
        if mode is not None:
            mode.__exit__(*exc)
        if self in _active_meters:
            _active_meters.remove(self)
        if not _active_meters:
            _remove_resize_hook()

    # -- CPU accounting ----------------------------------------------------------------------

    def _observe(self, tensor: torch.Tensor, fresh: bool, func: Any) -> None:
        if tensor.device.type == "meta":
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return  # sparse and other storage-less layouts
        key = storage._cdata
        known = self._storages.get(key)
        if known is not None:
            self._resize_to(key, known, storage.nbytes(), func)
        elif fresh:
            self._add(key, storage, func)

    def _refresh(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        known = self._storages.get(key)
        if known is not None:
            self._resize_to(key, known, storage.nbytes(), "UntypedStorage.resize_")

    def _add(self, key: int, storage: torch.UntypedStorage, func: Any) -> None:
        nbytes = storage.nbytes()
        ref = weakref.ref(storage, self._finalizer(key))
        self._storages[key] = (ref, nbytes)
        self._grow(nbytes, func)

    def _finalizer(self, key: int):
        meter_ref = weakref.ref(self)

        def release(_: weakref.ref) -> None:
            meter = meter_ref()
            if meter is None:
                return
            known = meter._storages.pop(key, None)
            if known is not None:
                meter._live_bytes -= known[1]

        return release

    def _resize_to(self, key: int, known: tuple[weakref.ref, int], nbytes: int, func: Any) -> None:
        if nbytes == known[1]:
            return
        self._storages[key] = (known[0], nbytes)
        delta = nbytes - known[1]
        if delta < 0:
            self._live_bytes += delta
        else:
            self._grow(delta, func)

    def _grow(self, nbytes: int, func: Any) -> None:
        self._live_bytes += nbytes
        if self._live_bytes > self._peak_bytes:
            self._peak_bytes = self._live_bytes
        if self.limit_bytes is not None and self._live_bytes > self.limit_bytes:
            raise torch.OutOfMemoryError(
                f"virtual memory limit exceeded: {self._live_bytes} live tensor bytes > limit "
                f"{self.limit_bytes} after {func} allocated {nbytes} bytes (the limit comes "
                f"from {ENV_TEST_MEMORY_LIMIT} or LiveBytesMeter(limit_bytes=...); raise it or "
                "make the micro-batch smaller)"
            )

    # -- CUDA --------------------------------------------------------------------------------

    def _enter_cuda(self) -> None:
        torch.cuda.synchronize()
        self._cuda_baseline_bytes = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        if self.limit_bytes is not None:
            total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            fraction = min(1.0, (self._cuda_baseline_bytes + self.limit_bytes) / total)
            torch.cuda.set_per_process_memory_fraction(fraction)
            self._cuda_fraction_set = True

    def _exit_cuda(self) -> None:
        if self._cuda_fraction_set:
            torch.cuda.set_per_process_memory_fraction(1.0)
            self._cuda_fraction_set = False
