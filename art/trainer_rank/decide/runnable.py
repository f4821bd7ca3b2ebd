"""Which parallel layouts TrainerRank can run today: one answer for the constructor (which
refuses the rest) and for `plan` (which marks them and never recommends them)."""

from __future__ import annotations

from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.trainer_rank.compute.packing import check_layout_supported


def layout_refusal(layout: ParallelLayout, implementation: Implementation) -> str | None:
    """Why TrainerRank refuses `layout` with `implementation`, or None when it runs it."""
    if layout.pipeline_parallel > 1:
        return (
            f"pipeline parallel size {layout.pipeline_parallel}: TrainerRank runs the whole "
            "model on each rank; set ART_MEGATRON_PIPELINE_MODEL_PARALLEL_SIZE=1"
        )
    if layout.context_parallel > 1 and implementation.spec == "te":
        return (
            f"context parallel {layout.context_parallel} with the Transformer Engine spec: TE's "
            "THD context parallel needs every sequence split on its own, which the compute "
            "path does not do; context parallel runs in the segmented flash attention (the "
            "local spec: what the runtime builds when CP > 1), or set "
            "ART_MEGATRON_CONTEXT_PARALLEL_SIZE=1 and use tensor parallel"
        )
    try:
        check_layout_supported(implementation, layout)
    except ValueError as exc:
        return str(exc)
    return None
