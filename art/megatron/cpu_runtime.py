"""Run real Megatron-Core 0.16.1 on CPU by redirecting its few CUDA-only calls.

Active only when CUDA is not available: `install()` is a no-op on a GPU machine, except
for the CheckpointWithoutOutput FP8 fix, which applies whenever Transformer Engine is
missing (the FP8 path it wrongly enables can only work with Transformer Engine).
Everything patched here is listed in `REDIRECTS` so that tests and the README can name it.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

import torch

REDIRECTS: tuple[str, ...] = (
    "optimizer and grad clipping (cuda_calls_on_cpu): device cuda -> cpu, .cuda() no-op, "
    "CPU tensor.type() named as the CUDA type Megatron compares with",
    "torch.cuda.current_device -> 'cpu'",
    "torch.cuda.get_rng_state / set_rng_state / manual_seed / manual_seed_all -> CPU generator",
    "torch.cuda.random.get_rng_state / set_rng_state -> CPU generator",
    "megatron.core.tensor_parallel.random._get_cuda_rng_state / _set_cuda_rng_state -> CPU",
    "megatron.core.transformer.utils.get_default_causal_mask -> allocated on CPU",
    "torch.cuda.Stream / current_stream / stream -> synchronous stand-ins (MoE dispatcher)",
    "megatron.core.transformer.moe.moe_utils.te_general_gemm -> None when TE is missing",
    "CheckpointWithoutOutput(fp8=False) -> FP8 path off (0.16.1 bug: `fp8 is not None`)",
    "megatron.core.ssm.gated_delta_net.HAVE_FLA / l2norm / chunk_gated_delta_rule -> the "
    "pure-torch kernels in cpu_gated_delta (fla's saved set for backward)",
    "GatedDeltaNet._apply_gated_norm (torch.compile) -> one autograd function keeping what "
    "the compiled one keeps (x, weight, gate, fp32 rstd)",
    "megatron.core.transformer.mlp.bias_swiglu_impl (torch.compile) -> cpu_fused.bias_swiglu "
    "(keeps its input, as the fused kernel does; used by GPU-shaped CPU builds only)",
    "megatron.core.transformer.attention.apply_rotary_pos_emb -> cpu_fused.fused_rope for "
    "GPU-shaped CPU builds (keeps the frequencies only, as TE's fused RoPE does)",
    "torch.distributed.all_to_all_single -> split sizes given as tensors passed as lists (gloo)",
    "torch.distributed.all_gather / reduce_scatter -> uneven shards padded to the largest "
    "(gloo needs equal sizes and has no list reduce_scatter; expert TP with uneven routing)",
)

_installed = False


def cuda_available() -> bool:
    return torch.cuda.is_available()


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


class _CpuEvent:
    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def record(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True


class _CpuStream:
    """Stand-in for torch.cuda.Stream: CPU work is synchronous, so every call is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, event: Any = None) -> _CpuEvent:
        return _CpuEvent()

    def query(self) -> bool:
        return True


_CPU_STREAM = _CpuStream()


def _fix_checkpoint_without_output_fp8() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    cls = mrandom.CheckpointWithoutOutput
    if getattr(cls, "_art_fp8_fixed", False):
        return
    original_init = cls.__init__

    def __init__(self: Any, fp8: Any = False) -> None:
        original_init(self, fp8)
        # 0.16.1 sets `self.fp8 = fp8 is not None`, which is True for fp8=False.
        self.fp8 = bool(fp8)

    cls.__init__ = __init__
    cls._art_fp8_fixed = True


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _redirect_gated_delta_net() -> None:
    """fla's Triton kernels need a GPU; Megatron's GatedDeltaNet refuses to build without
    fla (HAVE_FLA) and calls its `l2norm` and `chunk_gated_delta_rule` by module-level name.
    Both are pointed at CPU functions that keep fla's saved set for backward."""
    from megatron.core.ssm import gated_delta_net

    from art.megatron import cpu_gated_delta

    gated_delta_net.HAVE_FLA = True
    gated_delta_net.l2norm = cpu_gated_delta.l2norm
    gated_delta_net.chunk_gated_delta_rule = cpu_gated_delta.chunk_gated_delta_rule
    gated_delta_net.GatedDeltaNet._apply_gated_norm = cpu_gated_delta.apply_gated_norm


def install() -> bool:
    """Apply the redirects once. Returns True when the CPU redirects are active."""
    global _installed
    if not transformer_engine_available():
        _fix_checkpoint_without_output_fp8()
    if cuda_available():
        return False
    if _installed:
        return True

    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(state: torch.Tensor, device: Any = "cuda") -> None:
        torch.set_rng_state(state)

    def manual_seed(seed: int) -> None:
        torch.default_generator.manual_seed(seed)

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.get_rng_state = get_rng_state  # type: ignore[assignment]
    torch.cuda.set_rng_state = set_rng_state  # type: ignore[assignment]
    torch.cuda.manual_seed = manual_seed  # type: ignore[assignment]
    torch.cuda.manual_seed_all = manual_seed  # type: ignore[assignment]
    torch.cuda.random.get_rng_state = get_rng_state  # type: ignore[assignment]
    torch.cuda.random.set_rng_state = set_rng_state  # type: ignore[assignment]
    torch.cuda.Stream = _CpuStream  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda device=None: _CPU_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]

    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import utils as mutils

    def _get_cuda_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
        state = torch.get_rng_state()
        return state.clone() if clone else state

    def _set_cuda_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = _get_cuda_rng_state
    mrandom._set_cuda_rng_state = _set_cuda_rng_state
    mutils.get_default_causal_mask = _cpu_causal_mask
    # fused_softmax imported the helper by name and keeps its own reference.
    from megatron.core.fusions import fused_softmax

    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    _redirect_gated_delta_net()
    _redirect_fused_kernels()
    _redirect_all_to_all_split_sizes()
    _redirect_uneven_gathers()
    try:
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
    except ImportError:
        pass
    _installed = True
    return True


def _redirect_uneven_gathers() -> None:
    """Megatron's alltoall dispatcher gathers and reduce-scatters the routed tokens over the
    expert-TP group in uneven shards (`gather_from_sequence_parallel_region` with
    `output_split_sizes`, and its backward), as lists of tensors; NCCL takes them, gloo wants
    equal shapes and has no list reduce-scatter. Here uneven shards are padded to the largest
    (zeros, which the sum leaves alone) and the reduce-scatter is an all-reduce of them."""
    import torch.distributed as dist

    all_gather, all_reduce, reduce_scatter = dist.all_gather, dist.all_reduce, dist.reduce_scatter

    def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
        if t.shape[0] == rows:
            return t.contiguous()
        return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])

    def uneven_all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor,
                          group: Any = None, async_op: bool = False) -> Any:
        if async_op or len({t.shape for t in [*tensor_list, tensor]}) == 1:
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        gathered = [tensor.new_empty(rows, *tensor.shape[1:]) for _ in tensor_list]
        all_gather(gathered, _padded(tensor, rows), group=group)
        for out, got in zip(tensor_list, gathered):
            out.copy_(got[:out.shape[0]])
        return None

    def list_reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor],
                            op: Any = dist.ReduceOp.SUM, group: Any = None,
                            async_op: bool = False) -> Any:
        if async_op:  # no handle to give back from the emulation: the backend's own answer
            return reduce_scatter(output, input_list, op=op, group=group, async_op=True)
        rows = max(t.shape[0] for t in input_list)
        stacked = torch.stack([_padded(t, rows) for t in input_list])
        all_reduce(stacked, op=op, group=group)
        output.copy_(stacked[dist.get_rank(group)][:output.shape[0]])
        return None

    dist.all_gather = uneven_all_gather
    dist.reduce_scatter = list_reduce_scatter


def _redirect_all_to_all_split_sizes() -> None:
    """Megatron's alltoall MoE dispatcher passes `all_to_all_single` its split sizes as
    tensors, which the gloo binding refuses (NCCL's accepts them): here they go as lists."""
    import torch.distributed as dist

    original = dist.all_to_all_single

    def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Any = None, input_split_sizes: Any = None,
                          group: Any = None, async_op: bool = False) -> Any:
        def as_list(sizes: Any) -> Any:
            return sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes

        return original(output, input, as_list(output_split_sizes), as_list(input_split_sizes),
                        group=group, async_op=async_op)

    dist.all_to_all_single = all_to_all_single


# Set on a TransformerConfig by the model builder for a GPU-shaped CPU build: its attention
# applies RoPE through the fused kernel's stand-in.
GPU_SHAPED_CONFIG_FLAG = "art_gpu_shaped_cpu"


def _redirect_fused_kernels() -> None:
    """The fused SwiGLU and RoPE a GPU build runs, as CPU stand-ins (cpu_fused.py). Megatron
    calls its fused SwiGLU only with bias_activation_fusion, which only GPU-shaped CPU builds
    set here; RoPE goes through the stand-in only for configs carrying the GPU-shaped flag."""
    from megatron.core.transformer import attention, mlp

    from art.megatron import cpu_fused

    mlp.bias_swiglu_impl = cpu_fused.bias_swiglu
    torch_path = attention.apply_rotary_pos_emb

    def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, config: Any,
                             cu_seqlens: Any = None, mscale: float = 1.0,
                             cp_group: Any = None) -> torch.Tensor:
        if (getattr(config, GPU_SHAPED_CONFIG_FLAG, False) and cu_seqlens is None
                and mscale == 1.0 and not config.rotary_interleaved
                and not config.multi_latent_attention and freqs.shape[-1] <= t.shape[-1]):
            return cpu_fused.fused_rope(t, freqs)
        return torch_path(t, freqs, config=config, cu_seqlens=cu_seqlens, mscale=mscale,
                          cp_group=cp_group)

    attention.apply_rotary_pos_emb = apply_rotary_pos_emb


_CUDA_TYPE_NAMES: dict[str, str] = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
}


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, str):
        return value.startswith("cuda")
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return False


class _CudaCallsOnCpu(torch.overrides.TorchFunctionMode):
    """Inside Megatron's optimizer and grad clipping: allocations on 'cuda' land on the CPU,
    `.cuda()` is a no-op, and `tensor.type()` names the CUDA type the code compares with."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda_device(kwargs.get("device")) or isinstance(kwargs.get("device"), int):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda_device(a) else a for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_calls_on_cpu():
    """Run Megatron's optimizer construction and step on CPU (no-op where CUDA exists)."""
    if cuda_available():
        yield
        return
    install()
    with _CudaCallsOnCpu():
        yield
