"""The planner behind `plan`: the question to ask before renting GPUs.

Given a model, one micro-batch (the largest item a step will hand `forward_micro_batches`),
the memory of one GPU and the number of GPUs, price that micro-batch under each recompute
policy (none, selective default, selective + mlp, full uniform 1) crossed with each
tensor/context-parallel layout the GPU count allows (a MoE model's with its experts at EP 1
and spread over the GPUs, `candidate_layouts`), and recommend the cheapest cell that fits:
least recomputation first (recompute costs time on every step), then the fewest GPUs per
model replica (the rest become data parallel, which costs nothing per item), then the most
headroom. Every figure is per rank, from the memory model (this module presents; it does not
price).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from art.megatron.default_layout import default_layout
from art.megatron.geometry import ModelGeometry, load_geometry
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.megatron.provider import Provider
from art.megatron.recompute import EffectiveRecompute, RecomputePolicy
from art.megatron.settings import load_settings
from art.trainer_rank._request import LoraShape, MicroBatchShape
from art.trainer_rank.cli.args import expert_load_json
from art.trainer_rank.decide.runnable import layout_refusal

if TYPE_CHECKING:
    from art.trainer_rank.pricing.row_changes import ExpertShare

GIB = 1024**3

# Total memory per device as the CUDA runtime reports it (torch.cuda.mem_get_info), in GiB;
# marketing figures (141 GB, 80 GB) are decimal and include memory the driver keeps.
GPU_MEMORY_GIB: dict[str, float] = {
    "H200": 139.8,
    "H100": 79.2,
    "H100-NVL": 93.1,
    "A100-80GB": 79.2,
    "A100-40GB": 39.4,
    "L40S": 44.4,
}


# The planner's rows: a policy is one named recompute setting.
Policy = RecomputePolicy


POLICIES: tuple[Policy, ...] = (
    Policy("none", None, cost_rank=0),
    Policy("selective", "selective", cost_rank=1),
    Policy("selective+mlp", "selective", modules=("core_attn", "mlp"), cost_rank=2),
    Policy("full", "full", method="uniform", num_layers=1, cost_rank=3),
)


def candidate_layouts(gpus: int, geometry: ModelGeometry | None = None) -> list[ParallelLayout]:
    """Every TP x CP whose product divides the GPU count (the rest is data parallel),
    fewest GPUs per replica first. Sequence parallel is on whenever TP > 1 (the default).
    For a MoE `geometry` each one comes twice: its experts at EP 1 (expert TP = TP), and
    spread over the GPUs (`experts_spread`, expert TP 1), as the runtime's default layout
    spreads them."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    layouts = []
    for tp in _divisors(gpus):
        for cp in _divisors(gpus // tp):
            layouts.append(
                ParallelLayout(
                    tensor_parallel=tp, context_parallel=cp, sequence_parallel=tp > 1,
                    expert_tensor_parallel=tp, data_parallel=gpus // (tp * cp),
                )
            )
    layouts.sort(key=lambda lo: (lo.tensor_parallel * lo.context_parallel,
                                 lo.context_parallel))
    ep = experts_spread(gpus, geometry) if geometry is not None else 1
    if ep == 1:
        return layouts
    return [variant for lo in layouts
            for variant in (lo, replace(lo, expert_parallel=ep, expert_tensor_parallel=1))]


def experts_spread(gpus: int, geometry: ModelGeometry) -> int:
    """The expert-parallel size `plan` spreads a MoE model's experts over: the most of the
    GPUs that divide its experts evenly (1: a dense model, or one GPU)."""
    if not geometry.is_moe:
        return 1
    return max(d for d in _divisors(gpus) if geometry.num_experts % d == 0)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_env(layout: ParallelLayout) -> dict[str, str]:
    env = {
        "ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": str(layout.tensor_parallel),
        "ART_MEGATRON_CONTEXT_PARALLEL_SIZE": str(layout.context_parallel),
    }
    if layout.expert_parallel > 1:
        env["ART_MEGATRON_EXPERT_MODEL_PARALLEL_SIZE"] = str(layout.expert_parallel)
        env["ART_MEGATRON_EXPERT_TENSOR_PARALLEL_SIZE"] = str(layout.expert_tensor_parallel)
    return env


def layout_name(layout: ParallelLayout) -> str:
    name = f"TP{layout.tensor_parallel}"
    if layout.context_parallel > 1:
        name += f" CP{layout.context_parallel}"
    if layout.pipeline_parallel > 1:
        name += f" PP{layout.pipeline_parallel}"
    if layout.expert_parallel > 1:
        name += f" EP{layout.expert_parallel}"
    return name + (f" DP{layout.data_parallel}" if layout.data_parallel > 1 else "")


@dataclass(frozen=True)
class PlanCell:
    """One policy x layout: its estimate (per rank) or why it cannot be built."""

    policy: Policy
    layout: ParallelLayout
    limit_bytes: int
    estimate: Any | None = None  # the memory model's Estimate
    max_tokens: int | None = None  # largest packed tokens that fit (same sequences, outputs)
    unavailable: str = ""  # why this layout/policy cannot be built for this model
    not_runnable: str = ""  # why TrainerRank refuses this layout (priced, never recommended)

    @property
    def peak_bytes(self) -> int | None:
        return None if self.estimate is None else int(self.estimate.peak_bytes)

    @property
    def fits(self) -> bool:
        return self.estimate is not None and int(self.estimate.peak_bytes) <= self.limit_bytes

    @property
    def headroom_bytes(self) -> int | None:
        return None if self.estimate is None else self.limit_bytes - int(self.estimate.peak_bytes)

    @property
    def runnable(self) -> bool:
        return not self.unavailable and not self.not_runnable

    @property
    def gpus_per_replica(self) -> int:
        return self.layout.tensor_parallel * self.layout.context_parallel

    @property
    def env(self) -> dict[str, str]:
        return {**layout_env(self.layout), **self.policy.env}

    def verdict(self) -> str:
        if self.unavailable:
            return "n/a"
        assert self.headroom_bytes is not None
        pct = 100.0 * self.headroom_bytes / self.limit_bytes
        if self.fits:
            verdict = f"fits, {self.headroom_bytes / GIB:.1f} GiB ({pct:.0f}%) free"
        else:
            verdict = f"DOES NOT FIT, {-self.headroom_bytes / GIB:.1f} GiB over"
        return verdict + ("; TrainerRank cannot run it yet" if self.not_runnable else "")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "policy": self.policy.name,
            "layout": layout_name(self.layout),
            "tensor_parallel": self.layout.tensor_parallel,
            "context_parallel": self.layout.context_parallel,
            "expert_parallel": self.layout.expert_parallel,
            "data_parallel": self.layout.data_parallel,
            "limit_bytes": self.limit_bytes,
            "fits": self.fits,
            "peak_bytes": self.peak_bytes,
            "headroom_bytes": self.headroom_bytes,
            "max_tokens": self.max_tokens,
            "env": self.env,
            "unavailable": self.unavailable or None,
            "runnable": self.runnable,
            "not_runnable": self.not_runnable or None,
        }
        if self.estimate is not None:
            out["recompute"] = self.estimate.recompute_summary
            out["estimate"] = self.estimate.to_dict()
        return out


@dataclass(frozen=True)
class PlanResult:
    model: str
    geometry: ModelGeometry
    batch: MicroBatchShape
    gpus: int
    gpu_memory_bytes: int
    implementation: Implementation
    lora_rank: int
    dtype: str
    alloc_conf: str | None
    cells: tuple[PlanCell, ...]
    # The LoRA shape priced (resident checkpoint slots included); None: rank lora_rank only.
    lora: LoraShape | None = None
    # Under EP: the router's spread given (`estimate --expert-load`); None: balanced routing.
    expert_load: ExpertShare | None = None
    # The cell the ART_MEGATRON_* environment selects (`current_cell`), when it is in the grid
    current: CurrentCell | None = None

    def is_current(self, cell: PlanCell) -> bool:
        return self.current == CurrentCell.of(cell)

    @property
    def recommended(self) -> PlanCell | None:
        # Only what TrainerRank runs: a layout it refuses at construction is never recommended.
        fitting = [c for c in self.cells if c.fits and c.runnable]
        if not fitting:
            return None
        return min(
            fitting,
            key=lambda c: (c.policy.cost_rank, c.gpus_per_replica, c.layout.context_parallel,
                           -(c.headroom_bytes or 0)),
        )

    def cell(self, policy: str, tensor_parallel: int, context_parallel: int = 1,
             expert_parallel: int = 1) -> PlanCell:
        key = CurrentCell(policy, tensor_parallel, context_parallel, expert_parallel)
        for c in self.cells:
            if CurrentCell.of(c) == key:
                return c
        raise KeyError(f"no cell for policy {policy!r} at TP{tensor_parallel} CP{context_parallel}"
                       f" EP{expert_parallel}")

    def layouts(self) -> list[ParallelLayout]:
        seen: list[ParallelLayout] = []
        for c in self.cells:
            if c.layout not in seen:
                seen.append(c.layout)
        return seen

    def layout_summaries(self) -> list[str]:
        """Per layout, one sentence: which policies fit and which do not, with per-rank peaks."""
        lines = []
        for layout in self.layouts():
            cells = [c for c in self.cells if c.layout == layout]
            if all(c.unavailable for c in cells):
                lines.append(f"{layout_name(layout)}: not buildable ({cells[0].unavailable})")
                continue
            parts = []
            for c in cells:
                if c.unavailable:
                    parts.append(f"{c.policy.name} n/a")
                    continue
                word = "fits" if c.fits else "does not fit"
                parts.append(f"{c.policy.name} {word} ({_gib(c.peak_bytes)} GiB/rank)")
            refused = cells[0].not_runnable
            lines.append(f"{layout_name(layout)}: " + "; ".join(parts) + (
                f"; TrainerRank cannot run this layout yet ({refused})" if refused else ""))
        return lines

    def table(self) -> str:
        header = ("layout", "policy", "peak GiB/rank", "limit GiB", "verdict",
                  "max tokens that fit", "")
        rows = [header]
        rec = self.recommended
        for c in self.cells:
            marks = (["<- recommended"] if c is rec else []) + (
                ["<- your ART_MEGATRON_* settings"] if self.is_current(c) else [])
            rows.append(
                (
                    layout_name(c.layout), c.policy.name,
                    "-" if c.estimate is None else _gib(c.peak_bytes),
                    _gib(c.limit_bytes),
                    c.verdict() if not c.unavailable else "n/a (see below)",
                    "-" if c.max_tokens is None else f"{c.max_tokens:,}",
                    " ".join(marks),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                 for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths).rstrip())
        return "\n".join(lines)

    def report(self, rung_lines: Sequence[str] = ()) -> str:
        """What `plan` prints: the workload, the grid, per-layout summaries, `rung_lines` (the
        recompute rungs of one layout), the recommendation and the term table of the
        recommended cell."""
        b = self.batch
        out = [
            f"plan for {self.model} ({self.dtype}, LoRA rank {self.lora_rank}, "
            f"{self.implementation.key}): one micro-batch of {len(b.sequence_lengths_tokens)} "
            f"sequence(s), {b.logical_tokens:,} logical / {b.packed_tokens:,} packed tokens, "
            f"outputs {b.outputs.key}, {'with' if b.grad_enabled else 'without'} grad",
            f"on {self.gpus} GPU(s) of {_gib(self.gpu_memory_bytes)} GiB; every figure is per "
            "rank (resident + dynamic peak + allocator reserve)",
            "",
            self.table(),
            "",
            *self.layout_summaries(),
            "",
        ]
        if not b.grad_enabled:
            out[-1:-1] = ["without grad nothing is kept for backward, so every recompute policy "
                          "prices the same; only the layout matters"]
        if self.geometry.is_moe:
            ep = experts_spread(self.gpus, self.geometry)
            out[-1:-1] = [
                "MoE: each layout priced with its experts at EP 1 (expert TP = TP)"
                + (f" and spread over EP {ep} (expert TP 1, as the runtime's default layout "
                   "spreads them)" if ep > 1 else "")
                + (", balanced routing" if self.expert_load is None else
                   f", routing at the spread given (--expert-load {self.expert_load.working:g},"
                   f"{self.expert_load.held:g},{self.expert_load.expert:g})")
                + "; an EP group's other ranks run a micro-batch of this size (`estimate "
                "--ep N` prices another EP size)"]
        if rung_lines:
            out += [*rung_lines, ""]
        rec = self.recommended
        if rec is None:
            refused = sorted({layout_name(c.layout) for c in self.cells
                              if c.fits and c.not_runnable})
            out.append(
                ("nothing TrainerRank can run fits" if refused else "nothing fits")
                + f" on {self.gpus} GPU(s) of {_gib(self.gpu_memory_bytes)} GiB"
                + (f" (only {', '.join(refused)}, which it cannot run yet)" if refused else "")
                + ": use more or larger GPUs, split the item into smaller items, or request "
                "fewer outputs (hidden states and logits are the large ones)"
            )
            return "\n".join(out)
        assert rec.estimate is not None
        env = " ".join(f"{k}={v}" for k, v in rec.env.items())
        out += [
            f"recommended: {_policy_words(rec.policy)} on {layout_name(rec.layout)}: "
            f"{_gib(rec.peak_bytes)} GiB of {_gib(rec.limit_bytes)} GiB per rank "
            f"({_gib(rec.headroom_bytes)} GiB free)",
            f"  {env} \\",
            f"    torchrun --nproc_per_node={self.gpus} your_driver.py",
            "",
            rec.estimate.table(),
        ]
        return "\n".join(out)

    def to_dict(self) -> dict[str, Any]:
        rec = self.recommended
        b = self.batch
        return {
            "model": self.model,
            "dtype": self.dtype,
            "lora_rank": self.lora_rank,
            "implementation": self.implementation.key,
            "gpus": self.gpus,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "batch": {
                "sequence_lengths_tokens": list(b.sequence_lengths_tokens),
                "logical_tokens": b.logical_tokens,
                "packed_tokens": b.packed_tokens,
                "outputs": b.outputs.key,
                "grad_enabled": b.grad_enabled,
            },
            "policies": [p.name for p in POLICIES],
            "expert_load": expert_load_json(self.expert_load),
            "layouts": [layout_name(lo) for lo in self.layouts()],
            "cells": [c.to_dict() for c in self.cells],
            "current": None if self.current is None else self.current._asdict(),
            "recommended": None if rec is None else {
                "policy": rec.policy.name,
                "layout": layout_name(rec.layout),
                "peak_bytes": rec.peak_bytes,
                "headroom_bytes": rec.headroom_bytes,
                "env": rec.env,
                "term_table": rec.estimate.table() if rec.estimate is not None else "",
            },
        }


def _policy_words(policy: Policy) -> str:
    return "no recompute" if policy.granularity is None else f"{policy.name} recompute"


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:.1f}"


# (geometry, layout, recompute, implementation, lora, dtype, alloc_conf) -> MemoryModel
MemoryModelFactory = Callable[..., Any]


def _default_factory(**kwargs: Any) -> Any:
    from art.trainer_rank.pricing.model import MemoryModel

    geometry = kwargs.pop("geometry")
    return MemoryModel(geometry, **kwargs)


def resolve_model(model: str | Path | ModelGeometry) -> tuple[str, ModelGeometry]:
    if isinstance(model, ModelGeometry):
        return model.name, model
    geometry = load_geometry(model)
    return geometry.name, geometry


def built_implementation(implementation: Implementation,
                         layout: ParallelLayout) -> Implementation:
    """What the runtime builds for this layout: CP > 1 runs in the segmented flash attention
    (`Implementation.detect`), whatever the CLI was told to price at CP = 1."""
    if layout.context_parallel > 1:
        return implementation.for_context_parallel()
    return implementation


def memory_model_for(
    geometry: ModelGeometry,
    layout: ParallelLayout,
    policy: Policy,
    *,
    implementation: Implementation,
    lora_rank: int,
    dtype: str,
    alloc_conf: str | None,
    factory: MemoryModelFactory | None = None,
    lora: LoraShape | None = None,
    expert_load: ExpertShare | None = None,
) -> tuple[Any, EffectiveRecompute]:
    """The memory model for one cell. The provider validates the layout and resolves the
    policy exactly as a real launch with these ART_MEGATRON_* settings would (ValueError when
    Megatron could not build it)."""
    implementation = built_implementation(implementation, layout)
    settings = load_settings({**layout_env(layout), **policy.env})
    provider = Provider(geometry, settings=settings, dtype=dtype, implementation=implementation)
    recompute = provider.effective_recompute
    make = factory or _default_factory
    memory_model = make(
        geometry=geometry,
        layout=replace(provider.layout, data_parallel=layout.data_parallel),
        recompute=recompute,
        implementation=implementation,
        lora=lora or LoraShape(rank=lora_rank),
        dtype=dtype,
        alloc_conf=alloc_conf,
        # Only given: a factory that prices no router's spread need not take it.
        **({} if expert_load is None else {"expert_load": expert_load}),
    )
    return memory_model, recompute


def plan(
    model: str | Path | ModelGeometry,
    *,
    batch: MicroBatchShape,
    gpus: int,
    gpu_memory_bytes: int,
    lora_rank: int = 1,
    dtype: str | None = None,
    implementation: Implementation | None = None,
    alloc_conf: str | None = None,
    policies: Sequence[Policy] = POLICIES,
    layouts: Sequence[ParallelLayout] | None = None,
    factory: MemoryModelFactory | None = None,
    current: CurrentCell | None = None,
    lora: LoraShape | None = None,
    expert_load: ExpertShare | None = None,
) -> PlanResult:
    """Price `batch` under every policy x layout; see the module docstring. `current` marks
    the cell a launch with the caller's settings would use (see `current_cell`)."""
    if gpu_memory_bytes <= 0:
        raise ValueError(f"gpu_memory_bytes must be > 0, got {gpu_memory_bytes}")
    name, geometry = resolve_model(model)
    implementation = implementation or Implementation.gpu_te()
    dtype = dtype or geometry.dtype
    cells: list[PlanCell] = []
    for layout in layouts or candidate_layouts(gpus, geometry):
        built = built_implementation(implementation, layout)
        for policy in policies:
            try:
                memory_model, _ = memory_model_for(
                    geometry, layout, policy, implementation=implementation,
                    lora_rank=lora_rank, dtype=dtype, alloc_conf=alloc_conf, factory=factory,
                    lora=lora, expert_load=expert_load,
                )
            except ValueError as exc:
                cells.append(PlanCell(policy, layout, gpu_memory_bytes, unavailable=str(exc)))
                continue
            estimate = memory_model.estimate(batch)
            usable = gpu_memory_bytes - int(estimate.resident_bytes)
            max_packed = max_packed_tokens(memory_model, batch, usable)
            cells.append(PlanCell(policy, layout, gpu_memory_bytes, estimate, max_packed,
                                  not_runnable=layout_refusal(layout, built, geometry) or ""))
    return PlanResult(
        model=name, geometry=geometry, batch=batch, gpus=gpus, gpu_memory_bytes=gpu_memory_bytes,
        implementation=implementation, lora_rank=lora_rank, dtype=dtype, alloc_conf=alloc_conf,
        cells=tuple(cells), current=current, lora=lora, expert_load=expert_load,
    )


class CurrentCell(NamedTuple):
    """The grid cell a launch's ART_MEGATRON_* settings select."""

    policy: str
    tensor_parallel: int
    context_parallel: int
    expert_parallel: int = 1

    @classmethod
    def of(cls, cell: PlanCell) -> CurrentCell:
        return cls(cell.policy.name, cell.layout.tensor_parallel, cell.layout.context_parallel,
                   cell.layout.expert_parallel)


def current_cell(env: Any = None, *, gpus: int | None = None,
                 geometry: ModelGeometry | None = None) -> CurrentCell | None:
    """The cell the ART_MEGATRON_* settings in `env` (default os.environ) select; with `gpus`
    and `geometry`, as a launch on that many GPUs lays the job out when they name no layout
    size (`default_layout`: CP = the GPUs, and EP = the GPUs for a MoE model). None when
    their recompute policy is not one of POLICIES (e.g. full block 2), or their experts are
    split over expert TP other than the grid's (EP > 1 with expert TP > 1)."""
    settings = load_settings(env)
    if gpus is not None and geometry is not None:
        settings = default_layout(settings, geometry, visible_gpus=gpus)
    ep = settings.expert_model_parallel_size
    etp = settings.expert_tensor_parallel_size
    if ep > 1 and (etp if etp is not None else settings.tensor_model_parallel_size) != 1:
        return None
    modules = settings.recompute_modules
    for policy in POLICIES:
        if policy.granularity != settings.recompute_granularity:
            continue
        if policy.granularity == "full" and (policy.method, policy.num_layers) != (
            settings.recompute_method, settings.recompute_num_layers
        ):
            continue
        if policy.granularity == "selective" and sorted(policy.modules or ("core_attn",)) != \
                sorted(modules if modules is not None else ("core_attn",)):
            continue
        return CurrentCell(policy.name, settings.tensor_model_parallel_size,
                           settings.context_parallel_size, ep)
    return None


def scaled_batch(batch: MicroBatchShape, packed_tokens: int) -> MicroBatchShape:
    """The same micro-batch (sequence count, proportions, packing ratio, outputs) scaled to
    `packed_tokens` packed tokens."""
    factor = packed_tokens / batch.packed_tokens
    lengths = tuple(max(1, round(n * factor)) for n in batch.sequence_lengths_tokens)
    padded = packed_tokens if batch.padded_tokens else 0
    return replace(batch, sequence_lengths_tokens=lengths, padded_tokens=padded)


def max_packed_tokens(memory_model: Any, batch: MicroBatchShape, usable_bytes: int) -> int:
    """Largest packed-token count of this batch's shape whose dynamic peak fits `usable_bytes`
    (bisection over the estimate; 0 when not even one token per sequence fits)."""
    from art.trainer_rank.pricing.model import largest_fitting

    if usable_bytes <= 0:
        return 0
    sequences = len(batch.sequence_lengths_tokens)

    def fits(packed: int) -> bool:
        return int(memory_model.estimate(scaled_batch(batch, packed)).dynamic_bytes) <= usable_bytes

    if not fits(sequences):
        return 0
    # Past 2**34 tokens (more than any context) the bound reached is reported; a 0.1%
    # bracket is as precise as a plan's figure needs.
    return largest_fitting(fits, sequences, max(batch.packed_tokens, sequences) * 2,
                           cap=1 << 34, slack=lambda low: max(1, low // 1000))
