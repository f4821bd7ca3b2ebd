"""The parallel layout a job gets when its ART_MEGATRON_* settings name none.

Upstream (ART's provider, `_apply_default_parallel_topology`) lays a job over every visible GPU:
context parallel over all of them (TP = 1) for the model families it runs under CP, tensor
parallel over all of them for the others, and for MoE models expert parallel over all of them
as well. Here the same rule holds for what runs under CP here: dense and Gated DeltaNet hybrid
models get CP = the GPUs. MoE models, whose layers do not run under CP here, get upstream's
rule for families without CP, TP = the GPUs with sequence parallel, where their heads, KV
groups and widths split evenly, and, as upstream, their experts spread over the same GPUs (EP =
the GPUs, expert TP 1: each rank holds whole experts, the EP group is the TP group) where the
experts divide evenly. Otherwise, on CPU, on one GPU, or when any layout size is set, nothing
changes.
"""

from __future__ import annotations

from dataclasses import replace

from art.megatron.geometry import ModelGeometry
from art.megatron.runnable_layouts import runs_under_context_parallel
from art.megatron.settings import Settings

LAYOUT_FIELDS = ("tensor_model_parallel_size", "context_parallel_size",
                 "pipeline_model_parallel_size", "expert_model_parallel_size",
                 "expert_tensor_parallel_size")


def tensor_parallel_splits(geometry: ModelGeometry, size: int, *,
                           experts_whole: bool = False) -> bool:
    """Whether Megatron can shard this model's heads, KV groups and widths over `size` ranks
    (`experts_whole`: expert TP 1, the experts' width is not sharded)."""
    widths = [geometry.num_attention_heads, geometry.num_query_groups,
              geometry.ffn_hidden_size, geometry.vocab_size]
    if geometry.linear_attention is not None:
        widths += [geometry.linear_attention.num_key_heads,
                   geometry.linear_attention.num_value_heads]
    if geometry.is_moe and not experts_whole:
        widths.append(geometry.moe_ffn_hidden_size)
    return all(w % size == 0 for w in widths)


def default_layout(settings: Settings, geometry: ModelGeometry, *, visible_gpus: int,
                   world_size: int | None = None) -> Settings:
    """`settings` with upstream's default layout over `visible_gpus` (at most the job's
    `world_size`, which it must divide) when no layout size was set."""
    if any(settings.source_of(name) != "default" for name in LAYOUT_FIELDS):
        return settings
    gpus = visible_gpus if world_size is None else min(visible_gpus, world_size)
    if gpus <= 1 or (world_size is not None and world_size % gpus):
        return settings
    why = f"default: the {gpus} visible GPUs"
    if runs_under_context_parallel(geometry):
        return replace(settings, context_parallel_size=gpus,
                       sources=(*settings.sources, ("context_parallel_size", why)))
    spread = geometry.is_moe and geometry.num_experts % gpus == 0
    if not tensor_parallel_splits(geometry, gpus, experts_whole=spread):
        return settings
    sequence_parallel = (settings.sequence_parallel
                         if settings.source_of("sequence_parallel") != "default" else True)
    sources = (*settings.sources, ("tensor_model_parallel_size", why))
    if not spread:
        return replace(settings, tensor_model_parallel_size=gpus,
                       sequence_parallel=sequence_parallel, sources=sources)
    return replace(settings, tensor_model_parallel_size=gpus, sequence_parallel=sequence_parallel,
                   expert_model_parallel_size=gpus, expert_tensor_parallel_size=1,
                   sources=(*sources, ("expert_model_parallel_size", why),
                            ("expert_tensor_parallel_size", why)))


def visible_cuda_gpus() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    from art.megatron.cpu_runtime import cuda_available

    if not cuda_available():
        return 0
    import torch

    return int(torch.cuda.device_count())
