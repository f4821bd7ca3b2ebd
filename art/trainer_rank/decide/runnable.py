"""Which parallel layouts TrainerRank can run today: one answer for the constructor (which
refuses the rest) and for `plan` (which marks them and never recommends them), asked of
art.megatron.runnable_layouts, where every layout rule lives."""

from __future__ import annotations

from art.megatron import runnable_layouts
from art.megatron.geometry import ModelGeometry
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout


def layout_refusal(layout: ParallelLayout, implementation: Implementation,
                   geometry: ModelGeometry | None = None) -> str | None:
    """Why TrainerRank refuses `layout` with `implementation` (on `geometry`, where the model
    matters), or None when it runs it."""
    refused = runnable_layouts.refusal(layout, implementation, geometry,
                                       asker=runnable_layouts.Asker.TRAINER_RANK)
    return None if refused is None else refused.message()
