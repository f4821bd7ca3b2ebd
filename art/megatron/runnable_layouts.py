"""Which parallel layouts run, with which implementation, on which model: the one answer the
provider (what it builds), the packer (the rows it lays out), TrainerRank's constructor and
`plan` (what TrainerRank runs) ask.

Every rule lives here, in the order its refusal is reported, with the askers it binds:

- pipeline parallel: TrainerRank runs the whole model on each rank. The provider builds it and
  `plan` prices it (marked, never recommended), so only TrainerRank is refused.
- context parallel on Transformer Engine's THD attention: TE's CP needs every sequence split on
  its own, which the compute path does not do. The provider and TrainerRank refuse it; the
  packer still lays out THD rows (each sequence padded to 2 x CP), which the memory model
  prices for that spec.
- context parallel on Megatron's unfused DotProductAttention: it asserts CP == 1 at build.
  Every asker refuses it.

Context parallel runs in the segmented flash attention (the local spec), which the runtime
builds whenever CP > 1 (`Implementation.detect`), on every model kind: a Gated DeltaNet layer
runs the gathered whole row, and an MoE layer is token-wise, so Megatron's dispatcher routes
each CP rank's own rows (over the EP group, which may be the CP ranks themselves). Sequence
parallel runs on both specs (model_builder swaps the local spec's torch norms for ones that run
on sequence shards), so no rule refuses it. Checks of Megatron's sharding (sizes that divide the
heads, widths, experts and layers, expert parallel on a model with no experts) stay with the
provider, which reports them first.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from art.megatron.geometry import ModelGeometry
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout


class Asker(Enum):
    """Who asks, which decides the rules that bind it (see the module docstring)."""

    PROVIDER = "provider"  # what Megatron-Core builds here
    PACKER = "packer"  # the packed rows compute/packing.py lays out
    TRAINER_RANK = "trainer_rank"  # what TrainerRank runs (its constructor and `plan`)


class LayoutRule(Enum):
    """One reason a layout does not run; the members are in the order they are checked."""

    PIPELINE_PARALLEL = "pipeline_parallel"
    CONTEXT_PARALLEL_THD = "context_parallel_thd"
    CONTEXT_PARALLEL_UNFUSED = "context_parallel_unfused"


_BINDS: dict[LayoutRule, frozenset[Asker]] = {
    LayoutRule.PIPELINE_PARALLEL: frozenset({Asker.TRAINER_RANK}),
    LayoutRule.CONTEXT_PARALLEL_THD: frozenset({Asker.PROVIDER, Asker.TRAINER_RANK}),
    LayoutRule.CONTEXT_PARALLEL_UNFUSED: frozenset(Asker),
}


@dataclass(frozen=True)
class LayoutRefusal:
    """Why a layout does not run, and the ART_MEGATRON_* setting that does."""

    rule: LayoutRule
    setting: str  # the Settings field refused, e.g. "context_parallel_size"
    subject: str  # how the message names that setting when no command-line flag set it
    reason: str  # the message after the setting is named, ending with what to do
    remedy: str  # the ART_MEGATRON_* assignment that runs, e.g. "..._CONTEXT_PARALLEL_SIZE=1"

    def message(self, named: str | None = None) -> str:
        """The error text; `named`: how the caller names the setting (the provider passes the
        command-line flag it came from, see `Settings.named`)."""
        return f"{named or self.subject}{self.reason}"


_CP_REMEDY = "ART_MEGATRON_CONTEXT_PARALLEL_SIZE=1"


def _cp_refusal(rule: LayoutRule, context_parallel: int, reason: str) -> LayoutRefusal:
    return LayoutRefusal(rule, "context_parallel_size",
                         f"ART_MEGATRON_CONTEXT_PARALLEL_SIZE={context_parallel}", reason,
                         _CP_REMEDY)


def _refusals(layout: ParallelLayout, implementation: Implementation) -> list[LayoutRefusal]:
    """Every refusal of this layout, in LayoutRule order, whoever it binds."""
    found: list[LayoutRefusal] = []
    pp, cp = layout.pipeline_parallel, layout.context_parallel
    if pp > 1:
        remedy = "ART_MEGATRON_PIPELINE_MODEL_PARALLEL_SIZE=1"
        found.append(LayoutRefusal(
            LayoutRule.PIPELINE_PARALLEL, "pipeline_model_parallel_size",
            f"pipeline parallel size {pp}",
            f": TrainerRank runs the whole model on each rank; set {remedy}", remedy))
    if cp == 1:
        return found
    asked = (f" runs in the segmented flash attention (the local spec); the implementation "
             f"asked for here ({implementation.key}) has ")
    if implementation.spec == "te":
        found.append(_cp_refusal(
            LayoutRule.CONTEXT_PARALLEL_THD, cp,
            asked + "the Transformer Engine spec's THD attention, whose context parallel needs "
            "every sequence split on its own, which the compute path does not do. Leave the "
            "implementation to the runtime (it builds the segmented flash attention when "
            f"CP > 1) or set {_CP_REMEDY} and use tensor parallel"))
    elif implementation.attention != "flash":
        found.append(_cp_refusal(
            LayoutRule.CONTEXT_PARALLEL_UNFUSED, cp,
            asked + "Megatron's unfused DotProductAttention, which only supports context "
            "parallel size 1 (it refuses CP at build). Leave the implementation to the "
            "runtime (it builds the segmented flash attention when CP > 1; on CPU "
            f"Implementation.cpu_local('flash')) or set {_CP_REMEDY}"))
    return found


def refusal(layout: ParallelLayout, implementation: Implementation,
            geometry: ModelGeometry | None = None, *, asker: Asker) -> LayoutRefusal | None:
    """Why `layout` with `implementation` does not run for `asker`, or None when it runs; the
    first rule that binds `asker` wins. `geometry` is the model where the asker knows it: every
    model kind runs every layout these rules let through, so no rule reads it."""
    for found in _refusals(layout, implementation):
        if asker in _BINDS[found.rule]:
            return found
    return None
