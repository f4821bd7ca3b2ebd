"""The memory meter: live, peak and largest-allocation bytes of what is allocated while it is
active, on CPU or CUDA, with an optional limit past which the allocating op raises
torch.OutOfMemoryError. The probe, the calibration harness and TrainerRank all measure with it.

One op classification for both backends (`output_kinds`), per output of an op's schema:
- FRESH: the output aliases no input, so its storage is new (counted once, until it dies);
  `lift_fresh` outputs too (torch.tensor(...) builds a storage outside the dispatcher and lifts
  it, behind an alias annotation);
- WRITTEN: the output is an input the op wrote to (in-place, out=, resize_) or a buffer a c10d
  collective filled (those carry no alias annotations, but write into the tensors they are
  given; their functional `_c10d_functional` variants do return new tensors and are FRESH by
  their schema). A written storage allocates nothing; if it is tracked its size is re-read,
  since resize_ may have changed it;
- VIEW: the output aliases an input and nothing was written: skipped.

On CPU a c10d collective over CPU tensors runs on copies of its tensors
(`_collective_on_copies`). Gloo's worker thread keeps references to the tensors it was given
for a while after the collective completes, and drops them only when the scheduler gets to it,
so a storage the model is done with would otherwise die at a time that varies from run to run
(and from rank to rank). The copies carry the worker's references instead, untracked; the
collective is waited for and the values it wrote are copied back into the caller's tensors, so
the live-bytes curve is the one the model's own references make, as it is on a GPU, where NCCL
works in place. Only collectives every rank of the group calls together are run this way (an
early wait is safe for them); point-to-point ops and ops issued while a group is coalescing
run as they are.

CPU backend: a TorchDispatchMode sees every op's outputs on the calling thread (forward,
autograd backward and checkpoint recompute all run their CPU kernels there); FRESH storages are
counted by `nbytes()` with a weakref finalizer that subtracts them when the storage dies, so the
live total after each op is the exact live-bytes curve. `UntypedStorage.resize_` is not an op
(Megatron's CheckpointWithoutOutput frees and regrows outputs with it), so it is wrapped while
a CPU meter is active. Storages that existed before the meter was entered are not counted.
Inside a CPU meter torch.compile'd functions run as written (the compiler's stance is forced
eager), as they would under any dispatch mode, so Dynamo never traces a frame there.
This is the storage-weakref bookkeeping of torch.distributed._tools.mem_tracker.MemTracker,
which a test cross-checks it against; MemTracker itself is not used because it registers a
gradient hook on every parameter and raises on frozen ones (the LoRA case).

CUDA backend: live and peak are the caching allocator's allocated bytes (current and peak)
net of what was allocated on entry; the largest allocation is the largest FRESH storage the
same dispatch classification saw (kernels that allocate outside the dispatcher, such as
Transformer Engine's extension calls, are invisible to it; the allocator totals are not). A
limit is applied with `torch.cuda.set_per_process_memory_fraction`, so the allocator itself
raises; that fraction bounds reserved memory, so it trips somewhat earlier than the count.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

from art.trainer_rank.measuring.virtual_limit import ENV_TEST_MEMORY_LIMIT

FRESH, WRITTEN, VIEW = 0, 1, 2
_KINDS: dict[Any, tuple[int, ...]] = {}
_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


def output_kinds(func: Any) -> tuple[int, ...]:
    """FRESH / WRITTEN / VIEW for each return of `func`'s schema (see the module docstring)."""
    kinds = _KINDS.get(func)
    if kinds is None:
        schema = getattr(func, "_schema", None)
        if func in _LIFTS:
            kinds = (FRESH,)
        elif schema is None or getattr(func, "namespace", "") == "c10d":
            kinds = (WRITTEN,)
        else:
            kinds = tuple(
                FRESH if r.alias_info is None
                else WRITTEN if r.alias_info.is_write or schema.is_mutable
                else VIEW
                for r in schema.returns
            ) or (VIEW,)
        _KINDS[func] = kinds
    return kinds


# c10d ops every rank of the group enters together: waiting for one inside the call cannot
# deadlock, since every rank has issued it.
_SYMMETRIC_COLLECTIVES = frozenset({
    "allreduce_", "allreduce_coalesced_", "_allgather_base_", "allgather_",
    "allgather_coalesced_", "allgather_into_tensor_coalesced_", "_reduce_scatter_base_",
    "reduce_scatter_", "reduce_scatter_tensor_coalesced_", "alltoall_base_", "alltoall_",
    "broadcast_", "reduce_", "gather_", "scatter_",
})


def _symmetric_collective(func: Any) -> bool:
    """A c10d collective every rank of its group enters together (see _SYMMETRIC_COLLECTIVES)."""
    return (getattr(func, "namespace", "") == "c10d"
            and func._schema.name.split("::")[-1] in _SYMMETRIC_COLLECTIVES)


# id(func) -> (func, output kinds, symmetric collective): what the observer needs of an op,
# read off its schema once. Keyed by identity: an OpOverload's own hash is a Python call on
# every op; the entry keeps its op, so the id is not reused while the entry exists.
_OP_INFO: dict[int, tuple[Any, tuple[int, ...], bool]] = {}


def _op_info(func: Any) -> tuple[Any, tuple[int, ...], bool]:
    info = _OP_INFO.get(id(func))
    if info is None or info[0] is not func:
        info = _OP_INFO[id(func)] = (func, output_kinds(func), _symmetric_collective(func))
    return info


def _runs_on_copies(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A symmetric c10d collective over CPU tensors, issued outside any coalescing block."""
    if not _op_info(func)[2]:
        return False
    if torch.distributed.distributed_c10d._world.pg_coalesce_state:
        return False
    return all(t.device.type == "cpu" for t in tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor))


def _collective_on_copies(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run a c10d collective on copies of its tensors, wait for it, and write back what it
    changed (see the module docstring); the result names the caller's tensors again."""
    copies: dict[int, torch.Tensor] = {}  # id(caller's tensor) -> its copy
    originals: dict[int, torch.Tensor] = {}  # the copy's TensorImpl -> the caller's tensor

    def to_copy(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        copy = copies.get(id(value))
        if copy is None:
            copy = copies[id(value)] = value.detach().clone()
            originals[copy._cdata] = value
        return copy

    def to_original(value: Any) -> Any:
        return originals.get(value._cdata, value) if isinstance(value, torch.Tensor) else value

    with _disable_current_modes(), torch.no_grad():
        # No mode sees the copies: no meter (this one or an outer one) counts them.
        result = func(*tree_map(to_copy, args), **tree_map(to_copy, kwargs))
        for leaf in tree_leaves(result):
            if isinstance(leaf, torch.ScriptObject):
                torch.distributed.distributed_c10d.Work.unbox(leaf).wait()
        for original in originals.values():
            copy = copies[id(original)]
            # Only the tensors the collective wrote: an input saved for backward keeps its
            # values and its version.
            if not torch.equal(copy, original):
                original.copy_(copy)
    return tree_map(to_original, result)


class _Observer(TorchDispatchMode):
    # A CPU meter runs with the compiler's stance forced eager (`MemoryMeter.__enter__`): no
    # frame inside it is ever traced, so its dispatch is not wrapped to turn Dynamo off again
    # on every op (a few microseconds an op, on CPU a few percent of a step).
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self, meter: MemoryMeter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        info = _OP_INFO.get(id(func))
        if info is None or info[0] is not func:
            info = _op_info(func)
        _, kinds, collective = info
        if collective and self.meter._cuda is None and _runs_on_copies(func, args, kwargs):
            return _collective_on_copies(func, args, kwargs)
        result = func(*args, **kwargs)
        if len(kinds) == 1:
            kind = kinds[0]
            if kind == VIEW:
                return result
            if type(result) is torch.Tensor:  # the common case, without flattening
                self.meter._observe(result, kind, func)
                return result
            outputs: tuple[Any, ...] = (result,)
        else:
            outputs = tuple(result)
        last = len(kinds) - 1
        observe = self.meter._observe
        for i, value in enumerate(outputs):
            kind = kinds[min(i, last)]
            if kind == VIEW:
                continue
            if type(value) is torch.Tensor:  # one tensor per return: no flattening
                observe(value, kind, func)
                continue
            for leaf in tree_leaves(value):
                if isinstance(leaf, torch.Tensor):
                    observe(leaf, kind, func)
        return result


class _CudaObserver(_Observer):
    """The observer of a CUDA meter that looks for the largest allocation: compiled code runs
    compiled inside it, so its dispatch keeps Dynamo out of its own frames."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return True

    __torch_dispatch__ = _Observer.__torch_dispatch__  # wrapped by __init_subclass__


class CudaAllocator(Protocol):
    """The caching allocator calls the CUDA backend makes (a test passes a scripted one)."""

    def synchronize(self) -> None: ...
    def memory_stats(self) -> Mapping[str, int]: ...
    def reset_peak_memory_stats(self) -> None: ...
    def total_memory(self) -> int: ...
    def set_memory_fraction(self, fraction: float) -> None: ...


class TorchCudaAllocator:
    """The current CUDA device's caching allocator."""

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def memory_stats(self) -> Mapping[str, int]:
        return torch.cuda.memory_stats()

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def total_memory(self) -> int:
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)

    def set_memory_fraction(self, fraction: float) -> None:
        torch.cuda.set_per_process_memory_fraction(fraction)


@dataclass(frozen=True)
class CudaReading:
    """The CUDA meter's fields from one allocator statistics snapshot."""

    live_bytes: int
    peak_bytes: int
    reserved_bytes: int
    inactive_split_bytes: int

    @classmethod
    def from_stats(cls, stats: Mapping[str, int], baseline_allocated_bytes: int) -> CudaReading:
        return cls(
            live_bytes=int(stats.get("allocated_bytes.all.current", 0))
            - baseline_allocated_bytes,
            peak_bytes=max(0, int(stats.get("allocated_bytes.all.peak", 0))
                           - baseline_allocated_bytes),
            reserved_bytes=int(stats.get("reserved_bytes.all.current", 0)),
            inactive_split_bytes=int(stats.get("inactive_split_bytes.all.current", 0)),
        )


_active_cpu_meters: list[MemoryMeter] = []
# resize_ as it was when the first CPU meter became active; another tool (MemTracker) may have
# wrapped it already, so the hook calls through to it instead of to the original.
_resize_below: Any = None


def _tracking_resize(storage: torch.UntypedStorage, size: int) -> Any:
    result = _resize_below(storage, size)
    for meter in list(_active_cpu_meters):
        meter._refresh(storage, "UntypedStorage.resize_")
    return result


class MemoryMeter:
    """Context manager: live / peak / largest-allocation bytes of what is allocated inside
    it, optionally with a limit (CPU: the op that crosses it raises; CUDA: the allocator)."""

    def __init__(self, limit_bytes: int | None = None, *, device: str | torch.device | None = None,
                 cuda_allocator: CudaAllocator | None = None,
                 largest_on_cuda: bool = True) -> None:
        """`largest_on_cuda=False`: on CUDA read the allocator only, without the dispatch
        observer over every op (largest_allocation_bytes stays 0); what TrainerRank does on
        a GPU, where only the peak is learned."""
        if limit_bytes is not None and limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be positive or None, got {limit_bytes}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device).type
        if device not in ("cpu", "cuda"):
            raise ValueError(f"MemoryMeter device must be 'cpu' or 'cuda', got {device!r}")
        self.limit_bytes = limit_bytes
        self.device = device
        self.allocations = 0
        self.largest_allocation_bytes = 0
        self._live_bytes = 0
        self._peak_bytes = 0
        # storage key (its C pointer) -> (weakref keeping the finalizer, bytes counted)
        self._storages: dict[int, tuple[weakref.ref, int]] = {}
        self._mode: _Observer | None = None
        self._cuda = cuda_allocator if cuda_allocator is not None else (
            TorchCudaAllocator() if device == "cuda" else None)
        self._cuda_baseline_bytes = 0
        self._cuda_fraction_set = False
        self._observe_cuda = largest_on_cuda
        self._eager: Any = None
        self._active = False

    # -- readings -----------------------------------------------------------------------------

    def cuda_reading(self) -> CudaReading:
        assert self._cuda is not None, "cuda_reading() on a CPU meter"
        return CudaReading.from_stats(self._cuda.memory_stats(), self._cuda_baseline_bytes)

    @property
    def live_bytes(self) -> int:
        return self.cuda_reading().live_bytes if self._cuda is not None else self._live_bytes

    @property
    def peak_bytes(self) -> int:
        return self.cuda_reading().peak_bytes if self._cuda is not None else self._peak_bytes

    @property
    def inactive_split_bytes(self) -> int:
        """Freed-but-split allocator blocks (fragmentation); 0 on CPU."""
        return self.cuda_reading().inactive_split_bytes if self._cuda is not None else 0

    @property
    def tracked_storages(self) -> int:
        return len(self._storages)

    def synchronize(self) -> None:
        """Wait for queued kernels, so the readings include them (no-op on CPU)."""
        if self._cuda is not None:
            self._cuda.synchronize()

    def reset_peak(self) -> None:
        """Restart the peak at the current live bytes (e.g. between forward and backward)."""
        if self._cuda is not None:
            self._cuda.synchronize()
            self._cuda.reset_peak_memory_stats()
        self._peak_bytes = self._live_bytes

    # -- entering and leaving -----------------------------------------------------------------

    def __enter__(self) -> MemoryMeter:
        if self._active:
            raise RuntimeError("this MemoryMeter is already active; use a second meter to nest")
        self._active = True
        if self._cuda is not None:
            self._enter_cuda()
            if not self._observe_cuda:
                return self
        else:
            global _resize_below
            if not _active_cpu_meters:
                _resize_below = torch.UntypedStorage.resize_
                torch.UntypedStorage.resize_ = _tracking_resize  # type: ignore[method-assign]
            _active_cpu_meters.append(self)
        if self._cuda is None:
            # torch.compile'd functions (Megatron's `jit_fuser`) run as written under the CPU
            # meter, as they do under any dispatch mode: the stance says so up front.
            self._eager = torch.compiler.set_stance("force_eager")
            self._mode = _Observer(self)
        else:
            self._mode = _CudaObserver(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._active = False
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(*exc)
        eager, self._eager = self._eager, None
        if eager is not None:
            eager.__exit__(None, None, None)
        if self._cuda is not None:
            self._cuda.synchronize()
            if self._cuda_fraction_set:
                self._cuda.set_memory_fraction(1.0)
                self._cuda_fraction_set = False
            return
        global _resize_below
        if self in _active_cpu_meters:
            _active_cpu_meters.remove(self)
        if not _active_cpu_meters:
            if torch.UntypedStorage.resize_ is _tracking_resize:
                torch.UntypedStorage.resize_ = _resize_below  # type: ignore[method-assign]
            _resize_below = None

    def _enter_cuda(self) -> None:
        cuda = self._cuda
        assert cuda is not None
        cuda.synchronize()
        self._cuda_baseline_bytes = int(cuda.memory_stats().get("allocated_bytes.all.current", 0))
        cuda.reset_peak_memory_stats()
        if self.limit_bytes is not None:
            fraction = min(1.0, (self._cuda_baseline_bytes + self.limit_bytes)
                           / cuda.total_memory())
            cuda.set_memory_fraction(fraction)
            self._cuda_fraction_set = True

    # -- what the observer reports ------------------------------------------------------------

    def _observe(self, tensor: torch.Tensor, kind: int, func: Any) -> None:
        if tensor.is_meta:
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return  # sparse and other storage-less layouts
        if self._cuda is not None:
            # Totals come from the allocator; only the largest allocation is seen here.
            if kind == FRESH:
                self._note_allocation(storage.nbytes())
            return
        key = storage._cdata
        known = self._storages.get(key)
        if known is not None:
            self._resize_to(key, known, storage.nbytes(), func)
        elif kind == FRESH:
            nbytes = storage.nbytes()
            self._storages[key] = (weakref.ref(storage, self._finalizer(key)), nbytes)
            self.allocations += 1
            self._note_allocation(nbytes)
            self._grow(nbytes, func)

    def _note_allocation(self, nbytes: int) -> None:
        if nbytes > self.largest_allocation_bytes:
            self.largest_allocation_bytes = nbytes

    def _refresh(self, storage: torch.UntypedStorage, func: Any) -> None:
        key = storage._cdata
        known = self._storages.get(key)
        if known is not None:
            self._resize_to(key, known, storage.nbytes(), func)

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
            self._note_allocation(nbytes)
            self._grow(delta, func)

    def _grow(self, nbytes: int, func: Any) -> None:
        self._live_bytes += nbytes
        if self._live_bytes > self._peak_bytes:
            self._peak_bytes = self._live_bytes
        if self.limit_bytes is not None and self._live_bytes > self.limit_bytes:
            raise torch.OutOfMemoryError(
                f"virtual memory limit exceeded: {self._live_bytes} live tensor bytes > limit "
                f"{self.limit_bytes} after {func} allocated {nbytes} bytes (the limit comes "
                f"from {ENV_TEST_MEMORY_LIMIT} or MemoryMeter(limit_bytes=...); raise it or "
                "make the micro-batch smaller)"
            )


def release_score_buffer() -> None:
    """Drop Megatron's global memory buffer (unfused attention's [heads, s, s] score buffer).

    It persists at the largest size seen; the memory model prices it inside every micro-batch,
    so it is released before each one: measured from the state before, it is then really
    allocated inside the micro-batch, and on GPU it is not also counted as live before."""
    from megatron.core import parallel_state

    buffer = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    if buffer is not None:
        buffer.buffer.clear()
