"""LiveBytesMeter: exact live-byte accounting on CPU, and a limit that raises a real OOM."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from art.megatron.layout import ParallelLayout
from art.megatron.model_builder import RecomputeConfig, build_gpt_model, build_transformer_config
from art.trainer_rank.memory.virtual_limit import (
    ENV_TEST_MEMORY_LIMIT,
    LiveBytesMeter,
    test_memory_limit_bytes,
)

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
    with tracker, LiveBytesMeter(device="cpu") as meter:
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
    with LiveBytesMeter(device="cpu") as meter:
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
    outer = LiveBytesMeter(device="cpu")
    with outer:
        a = torch.ones(100)
        with LiveBytesMeter(device="cpu") as inner:
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
    with LiveBytesMeter(device="cpu") as meter:
        logits = model(tokens, torch.arange(48)[None], attention_mask=None)
        forward_peak = meter.peak_bytes
        logits.float().pow(2).mean().backward()
        total_peak = meter.peak_bytes
    del logits
    model.zero_grad(set_to_none=True)
    assert total_peak > forward_peak  # full recompute: backward rebuilds a layer, adds grads

    between = (forward_peak + total_peak) // 2
    with LiveBytesMeter(limit_bytes=between, device="cpu") as meter:
        logits = model(tokens, torch.arange(48)[None], attention_mask=None)
        loss = logits.float().pow(2).mean()
        with pytest.raises(torch.OutOfMemoryError, match="virtual memory limit exceeded"):
            loss.backward()  # raised inside the autograd engine, surfaces with its type
    del logits, loss
    model.zero_grad(set_to_none=True)
    gc.collect()
    assert meter.live_bytes == 0

    with LiveBytesMeter(limit_bytes=forward_peak // 2, device="cpu") as meter:
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
        LiveBytesMeter(limit_bytes=0)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device here: the CUDA path (memory_allocated / max_memory_allocated, limit "
    "via set_per_process_memory_fraction) can only run on a GPU machine",
)
def test_cuda_path_reads_the_allocator():
    with LiveBytesMeter(device="cuda") as meter:
        x = torch.empty(1 << 20, device="cuda")
        assert meter.live_bytes >= 4 << 20
        del x
    assert meter.peak_bytes >= 4 << 20
