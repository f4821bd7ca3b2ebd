"""MemoryMeter: exact live-byte accounting on CPU (cross-checked against MemTracker), one op
classification (c10d collectives included), a limit that raises a real OOM, and the CUDA
backend's fields built from allocator statistics."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from art.megatron.layout import ParallelLayout
from art.megatron.model_builder import RecomputeConfig, build_gpt_model, build_transformer_config
from art.trainer_rank.measuring.meter import (
    FRESH,
    VIEW,
    WRITTEN,
    CudaReading,
    MemoryMeter,
    output_kinds,
)
from art.trainer_rank.measuring.virtual_limit import ENV_TEST_MEMORY_LIMIT, test_memory_limit_bytes

from _tiny import tiny_dense

MODES = {
    "none": RecomputeConfig(),
    "selective-default": RecomputeConfig("selective"),
    # layernorm recompute frees outputs with untyped_storage().resize_(0) and rebuilds them in
    # backward (CheckpointWithoutOutput): the case MemTracker patches resize_ for.
    "selective-layernorm+mlp": RecomputeConfig("selective", modules=("layernorm", "mlp")),
    "full-uniform-1": RecomputeConfig("full", "uniform", 1),
}


def _model(recompute: RecomputeConfig):
    geometry = tiny_dense(num_layers=2)
    config = build_transformer_config(
        geometry, layout=ParallelLayout(), recompute=recompute, dtype="float32"
    )
    return build_gpt_model(geometry, config, seed=0)


def _fresh_megatron_buffer() -> None:
    """Megatron keeps a process-wide scratch buffer for attention scores. Start each measured
    step without it, so it is allocated inside the measurement in both trackers (MemTracker
    would otherwise count a buffer allocated before it started, the meter would not)."""
    from megatron.core import parallel_state

    parallel_state.destroy_global_memory_buffer()
    parallel_state._set_global_memory_buffer()


def _step(model, tokens):
    logits = model(tokens, torch.arange(tokens.shape[1])[None], attention_mask=None)
    logits.float().pow(2).mean().backward()


@pytest.mark.parametrize("mode", list(MODES))
def test_peak_equals_memtracker_over_forward_and_backward(megatron_process, mode):
    model = _model(MODES[mode])
    tokens = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(0))
    _fresh_megatron_buffer()
    tracker = MemTracker()
    with tracker, MemoryMeter(device="cpu") as meter:
        _step(model, tokens)
    snapshot = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    params_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # MemTracker also counts the parameters, which existed before; the meter counts only what
    # the step created (activations, temporaries, recomputed outputs, gradients).
    assert meter.peak_bytes == snapshot["Total"] - params_bytes
    grads_bytes = sum(p.grad.numel() * 4 for p in model.parameters() if p.grad is not None)
    scratch_bytes = meter.live_bytes - grads_bytes
    model.zero_grad(set_to_none=True)
    assert meter.live_bytes == scratch_bytes  # what remains: the rotary table and scratch buffer
    assert 0 <= scratch_bytes < meter.peak_bytes / 2


def test_resize_views_in_place_and_preexisting_storages():
    before = torch.zeros(1000)
    with MemoryMeter(device="cpu") as meter:
        before.add_(1.0)  # in place on a storage that existed before: nothing new
        assert meter.live_bytes == 0
        x = torch.empty(1000)
        view = x[10:20].view(2, 5)
        x.mul_(0.0)
        assert meter.live_bytes == 4000 and meter.tracked_storages == 1
        storage = x.untyped_storage()
        storage.resize_(0)  # how CheckpointWithoutOutput frees its output
        assert meter.live_bytes == 0
        storage.resize_(8000)
        assert meter.live_bytes == 8000 and meter.peak_bytes == 8000
        del x, view, storage
        assert meter.live_bytes == 0
        meter.reset_peak()
        assert meter.peak_bytes == 0
        y = torch.ones(10)
        y.resize_(100)  # through the dispatcher this time
        assert meter.live_bytes == 400


def test_nested_meters_both_count_and_an_active_meter_cannot_reenter():
    outer = MemoryMeter(device="cpu")
    with outer:
        a = torch.ones(100)
        with MemoryMeter(device="cpu") as inner:
            b = torch.ones(50)
            with pytest.raises(RuntimeError, match="already active"):
                inner.__enter__()
        assert inner.live_bytes == 200 and outer.live_bytes == 600
    del a, b
    assert outer.live_bytes == 0
    # The storage resize_ hook is removed once no meter is active.
    assert torch.UntypedStorage.resize_.__name__ == "resize_"


def test_limit_raises_out_of_memory_in_forward_and_in_backward(megatron_process):
    model = _model(MODES["full-uniform-1"])
    tokens = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(1))
    _step(model, tokens)  # allocate the persistent scratch (rotary table, score buffer) first
    model.zero_grad(set_to_none=True)
    with MemoryMeter(device="cpu") as meter:
        logits = model(tokens, torch.arange(48)[None], attention_mask=None)
        forward_peak = meter.peak_bytes
        logits.float().pow(2).mean().backward()
        total_peak = meter.peak_bytes
    del logits
    model.zero_grad(set_to_none=True)
    assert total_peak > forward_peak  # full recompute: backward rebuilds a layer, adds grads

    between = (forward_peak + total_peak) // 2
    with MemoryMeter(limit_bytes=between, device="cpu") as meter:
        logits = model(tokens, torch.arange(48)[None], attention_mask=None)
        loss = logits.float().pow(2).mean()
        with pytest.raises(torch.OutOfMemoryError, match="virtual memory limit exceeded"):
            loss.backward()  # raised inside the autograd engine, surfaces with its type
    del logits, loss
    model.zero_grad(set_to_none=True)
    gc.collect()
    assert meter.live_bytes == 0

    with MemoryMeter(limit_bytes=forward_peak // 2, device="cpu") as meter:
        with pytest.raises(torch.OutOfMemoryError, match=ENV_TEST_MEMORY_LIMIT):
            model(tokens, torch.arange(48)[None], attention_mask=None)
    gc.collect()
    assert meter.live_bytes == 0
    assert meter.peak_bytes > forward_peak // 2


def test_limit_from_environment():
    assert test_memory_limit_bytes({}) is None
    assert test_memory_limit_bytes({ENV_TEST_MEMORY_LIMIT: " 4096 "}) == 4096
    assert test_memory_limit_bytes({ENV_TEST_MEMORY_LIMIT: "2.5e6"}) == 2_500_000
    with pytest.raises(ValueError, match=ENV_TEST_MEMORY_LIMIT):
        test_memory_limit_bytes({ENV_TEST_MEMORY_LIMIT: "lots"})
    with pytest.raises(ValueError, match="positive"):
        test_memory_limit_bytes({ENV_TEST_MEMORY_LIMIT: "0"})
    with pytest.raises(ValueError, match="positive"):
        MemoryMeter(limit_bytes=0)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device here: the CUDA path (memory_allocated / max_memory_allocated, limit "
    "via set_per_process_memory_fraction) can only run on a GPU machine",
)
def test_cuda_path_reads_the_allocator():
    with MemoryMeter(device="cuda") as meter:
        x = torch.empty(1 << 20, device="cuda")
        assert meter.live_bytes >= 4 << 20
        del x
    assert meter.peak_bytes >= 4 << 20


def test_one_classification_for_every_op_c10d_collectives_included(megatron_process):
    assert output_kinds(torch.ops.aten.add.Tensor) == (FRESH,)
    assert output_kinds(torch.ops.aten.add_.Tensor) == (WRITTEN,)
    assert output_kinds(torch.ops.aten.view.default) == (VIEW,)
    assert output_kinds(torch.ops.aten.lift_fresh.default) == (FRESH,)
    # c10d collectives fill the buffers they are given; the functional ones return new ones.
    assert output_kinds(torch.ops.c10d.allreduce_.default) == (WRITTEN,)
    assert output_kinds(torch.ops._c10d_functional.all_reduce.default) == (FRESH,)
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as functional

    given = torch.ones(1000)
    with MemoryMeter(device="cpu") as meter:
        dist.all_reduce(given)  # into a buffer that existed before: nothing new
        assert meter.live_bytes == 0
        out, src = torch.empty(2000), torch.ones(2000)  # 8000 bytes each
        dist.all_gather_into_tensor(out, src)  # writes into `out`: counted once
        assert meter.live_bytes == 16000 and meter.allocations == 2
        reduced = functional.all_reduce(given, "sum", dist.group.WORLD).wait()  # a new tensor
        assert meter.live_bytes == 20000 and meter.largest_allocation_bytes == 8000
        del out, src, reduced
    assert meter.live_bytes == 0


class ScriptedAllocator:
    """Stands in for the CUDA caching allocator (no GPU here): returns the statistics a test
    scripts, and records what the meter asks of it."""

    def __init__(self) -> None:
        self.stats = {"allocated_bytes.all.current": 1000, "allocated_bytes.all.peak": 1000,
                      "reserved_bytes.all.current": 4096,
                      "inactive_split_bytes.all.current": 0}
        self.calls: list[str] = []

    def synchronize(self) -> None:
        self.calls.append("synchronize")

    def memory_stats(self):
        return dict(self.stats)

    def reset_peak_memory_stats(self) -> None:
        self.calls.append("reset_peak")
        self.stats["allocated_bytes.all.peak"] = self.stats["allocated_bytes.all.current"]

    def total_memory(self) -> int:
        return 100_000

    def set_memory_fraction(self, fraction: float) -> None:
        self.calls.append(f"fraction={fraction:g}")


def test_cuda_meter_fields_from_allocator_statistics_without_a_gpu():
    reading = CudaReading.from_stats({"allocated_bytes.all.current": 7000,
                                      "allocated_bytes.all.peak": 9000,
                                      "reserved_bytes.all.current": 16000,
                                      "inactive_split_bytes.all.current": 512}, 1000)
    assert reading == CudaReading(live_bytes=6000, peak_bytes=8000, reserved_bytes=16000,
                                  inactive_split_bytes=512)
    allocator = ScriptedAllocator()
    with MemoryMeter(limit_bytes=49_000, device="cuda", cuda_allocator=allocator) as meter:
        # The tensors are CPU ones (no GPU); the largest allocation is seen by the same
        # dispatch classification whatever the device, the totals come from the allocator.
        a = torch.empty(3000)  # 12000 bytes: the largest
        a.add_(1.0)  # written, not allocated
        b = a[:10]  # a view
        c = torch.empty(100)
        allocator.stats.update({"allocated_bytes.all.current": 13400,
                                "allocated_bytes.all.peak": 25000,
                                "inactive_split_bytes.all.current": 2048})
        assert meter.live_bytes == 12400 and meter.peak_bytes == 24000
        assert meter.inactive_split_bytes == 2048
        meter.reset_peak()
        assert meter.peak_bytes == 12400
        del a, b, c
    assert meter.largest_allocation_bytes == 12000
    assert meter.tracked_storages == 0  # the CUDA backend keeps no per-storage records
    # The limit sits on top of what was live on entry, as a fraction of the device.
    assert allocator.calls[1:3] == ["reset_peak", "fraction=0.5"]
    assert allocator.calls[-1] == "fraction=1"
    # Allocator totals only: no dispatch observer over the ops (TrainerRank on a GPU).
    allocator = ScriptedAllocator()
    with MemoryMeter(device="cuda", cuda_allocator=allocator, largest_on_cuda=False) as meter:
        assert meter._mode is None
        big = torch.empty(3000)
        allocator.stats["allocated_bytes.all.current"] = 13000
        assert meter.live_bytes == 12000
        del big
    assert meter.largest_allocation_bytes == 0


def test_a_cpu_meter_runs_compiled_functions_as_written_and_is_never_traced():
    """Megatron compiles a few small functions (`jit_fuser` is torch.compile). Inside a CPU
    meter they run as written, with the compiler's stance forced eager, so Dynamo never
    traces a frame there, the meter's own dispatch included (which is why that dispatch
    need not turn Dynamo off on every op). Outside the meter they compile as usual."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    @torch.compile(backend="eager")
    def gate(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(g)

    torch._dynamo.reset()
    counters.clear()
    x, g = torch.randn(64, 32), torch.randn(64, 32)
    with MemoryMeter(device="cpu") as meter:
        out = gate(x, g)
    assert not counters["frames"], dict(counters["frames"])
    assert meter.peak_bytes >= 2 * x.nbytes  # sigmoid(g), then the product beside it
    assert torch.equal(out, x * torch.sigmoid(g))
    gate(x, g)
    assert counters["frames"]["ok"] >= 1
