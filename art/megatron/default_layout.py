"""The parallel layout a job gets when its ART_MEGATRON_* settings name none.

Upstream (ART's provider, `_apply_default_parallel_topology`) lays a job over every visible GPU:
context parallel over all of them (TP = 1) for the model families whose handler supports CP,
tensor parallel over all of them for the others, and for MoE models expert parallel over all of
them as well (expert TP 1). Every model kind runs under CP here (dense, Gated DeltaNet hybrid,
MoE and hybrid MoE), so every model gets CP = the GPUs, as upstream's Qwen3, Qwen3-MoE and
Qwen3.5 families do; a MoE model's experts spread over the same GPUs (EP = the GPUs, expert
TP 1: each rank holds whole experts, the EP group is the CP group) where the experts divide
evenly. Otherwise, on CPU, on one GPU, or when any layout size is set, nothing changes.
"""

from __future__ import annotations

from dataclasses import replace

from art.megatron.geometry import ModelGeometry
from art.megatron.settings import Settings

LAYOUT_FIELDS = ("tensor_model_parallel_size", "context_parallel_size",
                 "pipeline_model_parallel_size", "expert_model_parallel_size",
                 "expert_tensor_parallel_size")


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
    sources = (*settings.sources, ("context_parallel_size", why))
    if not (geometry.is_moe and geometry.num_experts % gpus == 0):
        return replace(settings, context_parallel_size=gpus, sources=sources)
    return replace(settings, context_parallel_size=gpus, expert_model_parallel_size=gpus,
                   expert_tensor_parallel_size=1,
                   sources=(*sources, ("expert_model_parallel_size", why),
                            ("expert_tensor_parallel_size", why)))


def visible_cuda_gpus() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    from art.megatron.cpu_runtime import cuda_available

    if not cuda_available():
        return 0
    import torch

    return int(torch.cuda.device_count())
