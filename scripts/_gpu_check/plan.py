"""The GPU check's matrix as typed records: geometries, cells, and the ordered steps that run
them in one process per allocator setting, each step with its predicted seconds, fitted to
the check's GPU-time budget.

The GPU plan: the seed's geometry (Qwen3.5-27B dims) cut to 8 layers (the 3:1 Gated DeltaNet
to attention pattern kept), bf16, rank-1 LoRA, TP=1, under every policy the planner offers
(none, selective, selective core_attn+mlp, full uniform 1): the seed's group (two rollouts
sharing a prompt, scaled until every policy fits the GPU) and pairs of rollouts of N and 3N/4
tokens (N = 2k, 4k, 8k, 16k: the packed row lies between the probe's points), with grad
(target log-probs, hidden states) and without (target log-probs); and Qwen3-8B dims cut to 4
layers, selective recompute, a few cells, one of them a group sharing a prompt, so the dense
packed path runs on CUDA too. Both allocator settings (`PYTORCH_CUDA_ALLOC_CONF` unset, and
`expandable_segments:True`) run these steps, each in its own process (the second less what
the trim rules take from it first); the second reuses the first's probes (the allocator does
not change what is allocated).

`fit_to_budget` trims sizes and output mixes (rules in `TRIM_RULES`, in order) until the
predicted seconds fit, never a policy or the seed's group. The dry run is the same plan on CPU:
tiny geometries, one hybrid cell sharing a prefix and one dense cell.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from _calibration.cells import POLICY_BY_NAME, Cell, lora_targets_for
from _calibration.harness import calibration_provider, cell_sequences, micro_batch_shape
from seed_call import SEED_LENGTHS, SEED_PROMPT

from _gpu_check import costs
from art.megatron.geometry import ModelGeometry, load_geometry
from art.megatron.implementation import Implementation
from art.trainer_rank._request import LoraShape, OutputRequest
from art.trainer_rank.measuring.probe import default_probe_tokens, modes_for
from art.trainer_rank.pricing.model import MemoryModel

# The check ends itself by 590 s of a 600 s device call: the matrix gets 420 s of it, then the
# seed's call through TrainerRank up to 130 s, leaving the wheels' install, process shutdowns
# and the reports their time.
BUDGET_SECONDS = 420.0
SEED_CALL_SECONDS = 130.0
DEVICE_TIMEOUT_SECONDS = 590
# The dry run is far under this on any CI machine; it only bounds a stuck run.
DRY_RUN_BUDGET_SECONDS = 300.0
# What torch reports for one H200 (the plan CLI's --gpu H200).
H200_MEMORY_BYTES = int(139.8 * 2**30)
# A cell runs when its priced peak (resident + dynamic + reserve, default formulas) stays
# under this share of the GPU: the rest is the CUDA context, the parent's, fla's caches.
USABLE_FRACTION = 0.9

ALLOCATORS: dict[str, str | None] = {"segmented": None,
                                     "expandable": "expandable_segments:True"}
POLICIES: tuple[str, ...] = ("none", "selective default", "selective core_attn+mlp",
                             "full uniform 1")
LORA_RANK = 1
PAIR_SIZES: tuple[int, ...] = (16384, 8192, 4096, 2048)  # largest first: the most telling
SEED_SCALES: tuple[float, ...] = tuple(round(1.0 - 0.1 * i, 1) for i in range(10))
SEED_LABEL = "seed group"
DENSE_GROUP_LABEL = "group of 4 sharing 2k"
ESSENTIAL_LABELS = frozenset({SEED_LABEL, DENSE_GROUP_LABEL})


@dataclass(frozen=True)
class CheckGeometry:
    """A shipped model config with its layer count cut (the layer pattern's first layers)."""

    name: str
    config: str
    layers: int

    def build(self) -> ModelGeometry:
        return load_geometry(self.config).first_layers(self.layers, self.name)


@dataclass(frozen=True)
class CheckCell:
    """One micro-batch of the matrix: the calibration harness's cell and a label."""

    label: str
    cell: Cell

    @property
    def row(self) -> costs.Row:
        return costs.Row.of(self.cell.lengths, self.cell.shared_prefix)


@dataclass(frozen=True)
class Step:
    """One unit of work with its predicted seconds: a worker process starting, a model built
    and probed, or a cell measured. `probes`: the model step measures its probe (else the
    earlier process's, stored on disk, is read)."""

    kind: str  # "start" | "model" | "cell"
    allocator: str
    geometry: str = ""
    policy: str = ""
    predicted_seconds: float = 0.0
    cell: CheckCell | None = None
    probes: bool = False
    # Run before any step that is not, when time runs short (see budget.py): process starts,
    # model steps, the seed's group and the dense geometry's group sharing a prompt.
    essential: bool = False

    @property
    def name(self) -> str:
        if self.kind == "start":
            return f"{self.allocator}: process start"
        if self.kind == "model":
            return f"{self.allocator}: {self.geometry} {self.policy} model"
        assert self.cell is not None
        c = self.cell.cell
        return (f"{self.allocator}: {self.geometry} {self.policy} {self.cell.label} "
                f"{c.outputs} {'grad' if c.grad else 'no grad'}")


@dataclass(frozen=True)
class Plan:
    name: str  # "gpu" | "dry-run"
    device: str  # "cuda" | "cpu"
    dtype: str
    implementation: str  # the kernels the plan was priced for (Implementation.key)
    geometries: tuple[CheckGeometry, ...]
    steps: tuple[Step, ...]
    budget_seconds: float
    gpu_memory_bytes: int
    seed_scale: float
    probe_tokens: tuple[int, ...] | None  # None: the probe's default points for the device
    setup_seconds: float = 0.0  # the parent's own work, before and between the processes
    trimmed: tuple[str, ...] = field(default=())

    @property
    def allocators(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.allocator for s in self.steps))

    def steps_for(self, allocator: str) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if s.allocator == allocator)

    def cells(self) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if s.kind == "cell")

    def predicted_seconds(self, allocator: str | None = None) -> float:
        """One process's steps, or (None) the whole run, the parent's setup included."""
        if allocator is not None:
            return sum(s.predicted_seconds for s in self.steps if s.allocator == allocator)
        return self.setup_seconds + sum(s.predicted_seconds for s in self.steps)

    def geometry(self, name: str) -> CheckGeometry:
        return next(g for g in self.geometries if g.name == name)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        raw: dict[str, Any] = json.loads(text)

        def step(d: dict[str, Any]) -> Step:
            cell = d.pop("cell")
            if cell is not None:
                c = dict(cell["cell"], lengths=tuple(cell["cell"]["lengths"]))
                cell = CheckCell(cell["label"], Cell(**c))
            return Step(**d, cell=cell)

        probe_tokens = raw.pop("probe_tokens")
        return cls(**raw | {
            "geometries": tuple(CheckGeometry(**g) for g in raw["geometries"]),
            "steps": tuple(step(dict(s)) for s in raw["steps"]),
            "probe_tokens": None if probe_tokens is None else tuple(probe_tokens),
            "trimmed": tuple(raw["trimmed"])})


# ---------------------------------------------------------------------------------- cells

def pair(n: int) -> tuple[int, int]:
    """Two rollouts of N and 3N/4 tokens, no shared prompt."""
    return (n, 3 * n // 4)


def seed_lengths(scale: float) -> tuple[tuple[int, ...], int]:
    """The seed's group (19,222 + 19,221 tokens sharing 5,733) with every length scaled."""
    prompt = max(1, round(SEED_PROMPT * scale))
    return tuple(max(prompt + 1, round(n * scale)) for n in SEED_LENGTHS), prompt


def _cell(geometry: str, policy: str, label: str, lengths: tuple[int, ...], outputs: str,
          grad: bool, dtype: str, shared_prefix: int = 0) -> CheckCell:
    # Log-probs with grad get an RL caller's loss, the rest the probe's own (losses.py).
    loss = "rl" if grad and outputs == "logprobs" else "synthetic"
    return CheckCell(label, Cell(geometry, policy, LORA_RANK, 1, lengths, outputs, grad,
                                 dtype=dtype, loss=loss, shared_prefix=shared_prefix))


OUTPUT_MIXES: tuple[tuple[str, bool], ...] = (("hidden_states", True), ("logprobs", True),
                                              ("logprobs", False))


def hybrid_cells(geometry: str, policy: str, seed_scale: float, dtype: str) -> list[CheckCell]:
    """The seed's group first (the seed asked for hidden states), then the pairs."""
    lengths, prompt = seed_lengths(seed_scale)
    cells = [_cell(geometry, policy, SEED_LABEL, lengths, o, g, dtype, prompt)
             for o, g in OUTPUT_MIXES]
    for n in PAIR_SIZES:
        cells += [_cell(geometry, policy, f"pair {n // 1024}k", pair(n), o, g, dtype)
                  for o, g in (("logprobs", True), ("hidden_states", True),
                               ("logprobs", False))]
    return cells


def dense_cells(geometry: str, policy: str, dtype: str) -> list[CheckCell]:
    """A few cells of the dense packed path: pairs and four rollouts sharing a prompt."""
    group = (5000, 5000, 5000, 5000)
    return [_cell(geometry, policy, DENSE_GROUP_LABEL, group, "logprobs", True, dtype,
                  2000),
            _cell(geometry, policy, "pair 8k", pair(8192), "hidden_states", True, dtype),
            _cell(geometry, policy, "pair 4k", pair(4096), "logprobs", True, dtype),
            _cell(geometry, policy, "pair 8k", pair(8192), "logprobs", False, dtype)]


# ---------------------------------------------------------------------------------- pricing

def planning_implementation(device: str, delta_rule: str = "fla") -> Implementation:
    """The kernels the plan prices: CUDA without Transformer Engine (what the device builds:
    no TE is carried there) with fla's delta rule or, where fla refuses its backward, the
    torch rule; or its CPU counterpart (the local spec, segmented attention)."""
    if device == "cuda":
        return Implementation.cuda_local(delta_rule=delta_rule)
    return Implementation.cpu_local("flash")


def what_if_model(geometry: ModelGeometry, policy: str, dtype: str,
                  implementation: Implementation) -> tuple[Any, MemoryModel]:
    """The provider a worker builds for `policy` (without its LoRA config: peft's import
    alone takes seconds, and the parent never builds a model) and its memory model with
    default coefficients, priced for the worker's rank-1 adapters on the calibration
    harness's targets and for the segmented allocator (its reserve is the larger)."""
    provider = calibration_provider(geometry, POLICY_BY_NAME[policy], lora_rank=0,
                                    tensor_parallel=1, dtype=dtype,
                                    implementation=implementation)
    lora = LoraShape(LORA_RANK, tuple(sorted(lora_targets_for(geometry))))
    return provider, replace(MemoryModel.for_provider(provider), lora=lora, alloc_conf=None)


def priced_peak_bytes(model: MemoryModel, geometry: ModelGeometry, check: CheckCell) -> int:
    """The cell's peak (resident + dynamic + reserve) as the default formulas price it."""
    cell = check.cell
    sequences = cell_sequences(cell, geometry.vocab_size)
    batch = micro_batch_shape(cell.lengths, OutputRequest.parse(cell.outputs), cell.grad,
                              model.layout, model.implementation, sequences)
    return model.estimate(batch).peak_bytes


def seed_scale_that_fits(geometry: ModelGeometry, dtype: str, implementation: Implementation,
                         limit_bytes: int) -> float:
    """The largest of SEED_SCALES at which the seed's group fits under every policy."""
    models = [what_if_model(geometry, p, dtype, implementation)[1] for p in POLICIES]
    for scale in SEED_SCALES:
        lengths, prompt = seed_lengths(scale)
        check = _cell(geometry.name, POLICIES[0], SEED_LABEL, lengths, "hidden_states", True,
                      dtype, prompt)
        if all(priced_peak_bytes(m, geometry, check) <= limit_bytes for m in models):
            return scale
    raise ValueError(f"{geometry.name}: the seed's group does not fit {limit_bytes} bytes "
                     f"under every policy even at scale {SEED_SCALES[-1]}")


# ---------------------------------------------------------------------------------- steps

@dataclass(frozen=True)
class _Model:
    geometry: ModelGeometry
    policy: str
    cells: tuple[CheckCell, ...]


def _steps(models: Sequence[_Model], *, dtype: str, implementation: Implementation,
           speeds: costs.Speeds, probe_tokens: tuple[int, ...] | None) -> list[Step]:
    """Every allocator's process: its start, then each model and its cells, in order."""
    steps: list[Step] = []
    for n, allocator in enumerate(ALLOCATORS):
        steps.append(Step("start", allocator, predicted_seconds=speeds.process_start_s,
                          essential=True))
        warmed: set[bool] = set()  # the families (hybrid or not) this process has compiled
        for m in models:
            g = m.geometry
            provider, memory = what_if_model(g, m.policy, dtype, implementation)
            grads = sorted({c.cell.grad for c in m.cells})
            modes = {mode for grad in grads
                     for mode in modes_for(g, provider.effective_recompute, grad)}
            tails = {(_needs_head(c.cell.outputs), c.cell.grad) for c in m.cells}
            points = probe_tokens or default_probe_tokens(speeds.device, implementation, g)
            seconds = costs.build_seconds(memory.estimate(micro_batch_shape(
                (16,), OutputRequest(target_logprobs=True), True, memory.layout,
                implementation)).resident_bytes / g.dtype_bytes, speeds)
            if g.is_hybrid not in warmed:
                warmed.add(g.is_hybrid)
                seconds += (speeds.dense_warmup_s if not g.is_hybrid else
                            speeds.first_hybrid_warmup_s if n == 0 else
                            speeds.later_hybrid_warmup_s)
            if n == 0:
                seconds += costs.probe_seconds(g, modes, tails, points, speeds=speeds)
            steps.append(Step("model", allocator, g.name, m.policy, seconds, probes=n == 0,
                              essential=True))
            for c in m.cells:
                seconds = costs.micro_batch_seconds(
                    g, provider.effective_recompute, c.row, grad=c.cell.grad,
                    head=_needs_head(c.cell.outputs), speeds=speeds)
                steps.append(Step("cell", allocator, g.name, m.policy, seconds, cell=c,
                                  essential=c.label in ESSENTIAL_LABELS))
    return steps


def _needs_head(outputs: str) -> bool:
    return OutputRequest.parse(outputs).uses_head


# What fit_to_budget drops, in order, while the plan's predicted seconds exceed its budget:
# output mixes of the second allocator first (its question is the reserve, sharpest under
# grad), then the pairs' output mixes but grad log-probs, then their sizes, the middle first.
# Never a policy, a model step or a group sharing a prompt: what is left after every rule
# is the essential steps.
TRIM_RULES: tuple[tuple[str, Callable[[Step], bool]], ...] = (
    ("expandable_segments: no-grad cells",
     lambda s: s.allocator == "expandable" and s.cell is not None and not s.cell.cell.grad),
    ("expandable_segments: the pairs' hidden-states cells",
     lambda s: s.allocator == "expandable" and s.cell is not None
     and s.cell.label.startswith("pair") and s.cell.cell.outputs == "hidden_states"),
    ("the pairs' no-grad cells",
     lambda s: s.cell is not None and s.cell.label.startswith("pair")
     and not s.cell.cell.grad),
    ("the pairs' hidden-states cells",
     lambda s: s.cell is not None and s.cell.label.startswith("pair")
     and s.cell.cell.outputs == "hidden_states"),
    ("the pairs of 4k tokens", lambda s: s.cell is not None and s.cell.label == "pair 4k"),
    ("the pairs of 2k tokens", lambda s: s.cell is not None and s.cell.label == "pair 2k"),
    ("the pairs of 8k tokens", lambda s: s.cell is not None and s.cell.label == "pair 8k"),
    ("the pairs of 16k tokens", lambda s: s.cell is not None and s.cell.label == "pair 16k"),
)


def fit_to_budget(plan: Plan) -> Plan:
    """`plan` with TRIM_RULES applied in order until its predicted seconds fit its budget
    (never trimming an essential step), or ValueError when its essential steps alone do not.
    The predictions are assumptions until a GPU run measures them (costs.py); at run time a
    step starts only when it fits and leaves room for the essential steps after it
    (budget.py), so a slower machine skips pairs, never a policy."""
    trimmed = list(plan.trimmed)
    steps = plan.steps
    budget = plan.budget_seconds - plan.setup_seconds
    for reason, drop in TRIM_RULES:
        if sum(s.predicted_seconds for s in steps) <= budget:
            break
        kept = tuple(s for s in steps if s.essential or not drop(s))
        if len(kept) < len(steps):
            trimmed.append(f"{reason} ({len(steps) - len(kept)} cells)")
            steps = kept
    total = plan.setup_seconds + sum(s.predicted_seconds for s in steps)
    if total > plan.budget_seconds:
        raise ValueError(f"the {plan.name} plan needs {total:.0f} s after every trim rule, "
                         f"over its budget of {plan.budget_seconds:.0f} s")
    return replace(plan, steps=steps, trimmed=tuple(trimmed))


def _fitting(models: list[_Model], implementation: Implementation, dtype: str,
             limit_bytes: int) -> tuple[list[_Model], list[str]]:
    """Each model's cells whose priced peak fits `limit_bytes` (the rest are named)."""
    kept, dropped = [], []
    for m in models:
        memory = what_if_model(m.geometry, m.policy, dtype, implementation)[1]
        fits = [c for c in m.cells if priced_peak_bytes(memory, m.geometry, c) <= limit_bytes]
        dropped += [f"{m.geometry.name} {m.policy} {c.label} {c.cell.outputs}: priced over "
                    f"{USABLE_FRACTION:.0%} of the GPU" for c in m.cells if c not in fits]
        kept.append(replace(m, cells=tuple(fits)))
    return kept, dropped


HYBRID = CheckGeometry("Qwen3.5-27B-8L", "Qwen3.5-27B", 8)
DENSE = CheckGeometry("Qwen3-8B-4L", "Qwen3-8B", 4)
# The dense geometry is there for its packed path on CUDA (pairs, a group sharing a prompt):
# one policy, Megatron's default selective recompute.
DENSE_POLICIES = ("selective default",)


def gpu_plan(gpu_memory_bytes: int = H200_MEMORY_BYTES,
             budget_seconds: float = BUDGET_SECONDS, *, delta_rule: str = "fla") -> Plan:
    """The matrix on one GPU of `gpu_memory_bytes`, fitted to `budget_seconds`; `delta_rule`:
    the Gated DeltaNet rule the device builds (Implementation.delta_rule)."""
    dtype, implementation = "bfloat16", planning_implementation("cuda", delta_rule)
    limit = int(gpu_memory_bytes * USABLE_FRACTION)
    hybrid, dense = HYBRID.build(), DENSE.build()
    scale = seed_scale_that_fits(hybrid, dtype, implementation, limit)
    models = [_Model(hybrid, p, tuple(hybrid_cells(hybrid.name, p, scale, dtype)))
              for p in POLICIES]
    models += [_Model(dense, p, tuple(dense_cells(dense.name, p, dtype)))
               for p in DENSE_POLICIES]
    models, dropped = _fitting(models, implementation, dtype, limit)
    steps = _steps(models, dtype=dtype, implementation=implementation, speeds=costs.H200,
                   probe_tokens=None)
    plan = Plan("gpu", "cuda", dtype, implementation.key, (HYBRID, DENSE), tuple(steps),
                budget_seconds, gpu_memory_bytes, scale, None, costs.H200.setup_s,
                tuple(dropped))
    return fit_to_budget(plan)


DRY_HYBRID = CheckGeometry("tiny-qwen3_5", "tiny-qwen3_5", 4)
DRY_DENSE = CheckGeometry("tiny-qwen3", "tiny-qwen3", 4)
# The seed's group at 2% (384 + 384 tokens sharing 115); CPU probe points up to 256 tokens
# (the quadratics carry it beyond), enough for the chunked fits (points inside a chunk and
# three whole-chunk ones), so the dry run takes seconds.
DRY_SEED_SCALE = 0.02
DRY_PROBE_TOKENS: tuple[int, ...] = (32, 64, 96, 128, 256)
DRY_MEMORY_BYTES = 4 * 2**30


def dry_run_plan(budget_seconds: float = DRY_RUN_BUDGET_SECONDS) -> Plan:
    """Two cells on CPU through the same steps: the tiny hybrid's seed group (a shared
    prefix) under selective recompute, and a tiny dense pair under full recompute."""
    dtype, implementation = "bfloat16", planning_implementation("cpu")
    hybrid, dense = DRY_HYBRID.build(), DRY_DENSE.build()
    lengths, prompt = seed_lengths(DRY_SEED_SCALE)
    models = [
        _Model(hybrid, "selective default", (_cell(
            hybrid.name, "selective default", SEED_LABEL, lengths, "logprobs", True, dtype,
            prompt),)),
        _Model(dense, "full uniform 1", (_cell(
            dense.name, "full uniform 1", "pair 256", pair(256), "hidden_states", True,
            dtype),)),
    ]
    steps = _steps(models, dtype=dtype, implementation=implementation, speeds=costs.CPU,
                   probe_tokens=DRY_PROBE_TOKENS)
    plan = Plan("dry-run", "cpu", dtype, implementation.key, (DRY_HYBRID, DRY_DENSE),
                tuple(steps), budget_seconds, DRY_MEMORY_BYTES, DRY_SEED_SCALE,
                DRY_PROBE_TOKENS, costs.CPU.setup_s)
    return fit_to_budget(plan)
