"""EffectiveRecompute: what Megatron-Core 0.16.1 will actually checkpoint, layer by layer.

Megatron's rules, read from its source (transformer_block.py, transformer_layer.py,
attention.py, moe_layer.py):
- full + uniform N: each model chunk is cut into consecutive groups of N layers; each group is
  one checkpoint that keeps only its input. N must divide the chunk (0.16.1 raises IndexError
  in the forward otherwise), so such a configuration is rejected here.
- full + block N: the first N layers of each chunk are checkpointed one by one; the rest keep
  everything. N above the chunk size checkpoints all of them.
- full only takes effect in training mode with grad enabled; under no_grad nothing is retained.
- selective: the listed modules are recomputed in every layer; `mlp` is ignored on MoE layers,
  `layernorm` does nothing where the norm is fused into the next linear (Transformer Engine
  spec), `moe`/`moe_act`/`shared_experts` need MoE layers, `mla_up_proj` needs MLA.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace

from art.megatron.geometry import LayerKind

RECOMPUTE_MODULES: tuple[str, ...] = (
    "core_attn",
    "mlp",
    "moe",
    "moe_act",
    "layernorm",
    "shared_experts",
    "mla_up_proj",
)
DEFAULT_SELECTIVE_MODULES: tuple[str, ...] = ("core_attn",)
# Modules Megatron recomputes with CheckpointWithoutOutput: the output storage is freed
# after its consumer ran and is rebuilt in backward.
WITHOUT_OUTPUT_MODULES: frozenset[str] = frozenset({"layernorm", "moe_act", "mla_up_proj"})


GRANULARITIES: tuple[str, ...] = ("full", "selective")
METHODS: tuple[str, ...] = ("uniform", "block")


@dataclass(frozen=True)
class RecomputeRuleBreak:
    """A recompute configuration Megatron rejects or would silently ignore: the settings at
    fault (RecomputeConfig's field names) and a clause that says why and what to do."""

    settings: tuple[str, ...]
    reason: str


def recompute_rule_break(granularity: str | None, method: str | None,
                         num_layers: int | None, modules: tuple[str, ...] | None
                         ) -> RecomputeRuleBreak | None:
    """Megatron-Core's rules on the recompute settings alone (no model needed): the first one
    broken, or None. The settings loader and resolve_recompute both ask this, so each rule
    lives here once; the rules that need the model (a uniform count dividing each chunk, the
    modules a model has) are resolve_recompute's own."""
    if granularity not in (None, *GRANULARITIES):
        return RecomputeRuleBreak(("granularity",),
                                  f"{granularity!r} is not one of full, selective, none")
    if method not in (None, *METHODS):
        return RecomputeRuleBreak(("method",), f"{method!r} is not one of uniform, block, none")
    if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int)
                                   or num_layers < 1):
        return RecomputeRuleBreak(("num_layers",), f"must be an integer >= 1, got {num_layers!r}")
    if modules is not None:
        unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
        if unknown:
            return RecomputeRuleBreak(("modules",), f"unknown module(s) {', '.join(unknown)}; "
                                      f"allowed: {', '.join(RECOMPUTE_MODULES)}")
    if granularity == "full":
        if method is None:
            return RecomputeRuleBreak(("method",), "full recompute needs a method (uniform or "
                                      "block); Megatron rejects full recompute without one")
        if num_layers is None:
            return RecomputeRuleBreak(("num_layers",), "full recompute needs a number of layers "
                                      "(>= 1), e.g. 1")
        if modules:
            return RecomputeRuleBreak(("modules",), "recompute modules only apply to selective "
                                      "recompute; unset them or set RECOMPUTE_GRANULARITY="
                                      "selective")
    elif granularity == "selective":
        if num_layers is not None:
            return RecomputeRuleBreak(("num_layers",), "selective recompute does not take a "
                                      "number of layers (Megatron rejects it); set it to none")
    else:
        stray = tuple(name for name, is_set in (("method", method is not None),
                                                ("num_layers", num_layers is not None),
                                                ("modules", bool(modules))) if is_set)
        if stray:
            return RecomputeRuleBreak(stray, "set while recompute granularity is none, so it "
                                      "would be ignored; unset it or choose a granularity")
    return None


@dataclass(frozen=True)
class LayerRecompute:
    """The recompute that applies to one transformer layer."""

    layer_number: int  # 1-based, global across pipeline stages (Megatron's numbering)
    pipeline_stage: int
    virtual_chunk: int
    # Index of the full-recompute checkpoint unit within its chunk, None when not inside one.
    full_checkpoint_unit: int | None
    # Number of layers in that checkpoint unit (0 when not inside one).
    full_unit_layers: int
    # Selective modules that really take effect on this layer.
    selective_modules: frozenset[str]
    # With `layernorm` recompute: which norms are really rebuilt in backward ("input",
    # "pre_mlp"). The TE spec fuses the input norm into linear_qkv everywhere and the pre-MLP
    # norm into fc1 on dense layers, so there only an MoE layer's pre-MLP norm is left.
    recomputed_norms: frozenset[str] = frozenset()
    # Gated DeltaNet layers have no core_attn checkpoint.
    layer_type: LayerKind = LayerKind.ATTENTION

    @property
    def mode(self) -> str:
        if self.full_checkpoint_unit is not None:
            return "full"
        if self.selective_modules:
            return "selective"
        return "none"


@dataclass(frozen=True)
class EffectiveRecompute:
    """Per-layer recompute, as Megatron will run it, plus the raw settings it came from."""

    granularity: str | None  # None | "selective" | "full"
    method: str | None  # None | "uniform" | "block"
    num_layers: int | None
    modules: tuple[str, ...]  # requested selective modules (after defaults)
    layers: tuple[LayerRecompute, ...]
    pipeline_stages: int = 1
    virtual_chunks: int = 1

    @property
    def summary(self) -> str:
        if self.granularity == "full" and self.method == "block":
            rest = (f", selective {'+'.join(self.modules)} on the rest" if self.modules
                    else "")
            return f"full recompute of the first {self.num_layers} layer(s) per chunk{rest}"
        if self.granularity == "full":
            return f"full recompute ({self.method}, {self.num_layers} layer(s) per checkpoint)"
        if self.granularity == "selective":
            mods = "+".join(self.modules) if self.modules else "nothing"
            return f"selective recompute ({mods})"
        return "no recompute"

    @property
    def mode(self) -> str:
        return self.granularity or "none"

    @property
    def key(self) -> str:
        """Stable key for profiles: equal policies give equal keys across processes."""
        payload = json.dumps(
            {
                "g": self.granularity,
                "m": self.method,
                "n": self.num_layers,
                "mods": sorted(self.modules),
                "layers": [
                    (lr.full_checkpoint_unit, lr.full_unit_layers, sorted(lr.selective_modules))
                    + ((sorted(lr.recomputed_norms),) if lr.recomputed_norms else ())
                    for lr in self.layers
                ],
            },
            sort_keys=True,
        )
        return f"{self.mode}-{hashlib.sha256(payload.encode()).hexdigest()[:12]}"

    def chunk_layers(self, stage: int, chunk: int = 0) -> tuple[LayerRecompute, ...]:
        return tuple(
            lr for lr in self.layers if lr.pipeline_stage == stage and lr.virtual_chunk == chunk
        )

    def for_grad(self, grad_enabled: bool) -> EffectiveRecompute:
        """The policy as it runs: without grad nothing is checkpointed (nothing is retained)."""
        if grad_enabled:
            return self
        return replace(
            self,
            layers=tuple(
                replace(lr, full_checkpoint_unit=None, full_unit_layers=0,
                        selective_modules=frozenset(), recomputed_norms=frozenset())
                for lr in self.layers
            ),
        )

    def describe_layers(self) -> str:
        """Compact per-layer description, runs of equal layers merged."""
        parts: list[str] = []
        run_start = 0
        labels = [_layer_label(lr) for lr in self.layers]
        for i in range(1, len(labels) + 1):
            if i == len(labels) or labels[i] != labels[run_start]:
                first = self.layers[run_start].layer_number
                last = self.layers[i - 1].layer_number
                span = f"{first}" if first == last else f"{first}-{last}"
                parts.append(f"layers {span}: {labels[run_start]}")
                run_start = i
        return "; ".join(parts)


def _layer_label(lr: LayerRecompute) -> str:
    if lr.full_checkpoint_unit is not None:
        return f"full (unit of {lr.full_unit_layers})"
    if lr.selective_modules:
        return "selective " + "+".join(sorted(lr.selective_modules))
    return "keeps everything"


def resolve_recompute(
    *,
    granularity: str | None,
    method: str | None,
    num_layers: int | None,
    modules: tuple[str, ...] | None,
    moe_layers: tuple[bool, ...],
    pipeline_stages: int = 1,
    virtual_chunks: int = 1,
    layers_per_chunk: tuple[int, ...] | None = None,
    norm_fused_into_linear: bool = False,
    has_mla: bool = False,
    has_grouped_gemm: bool = False,
    has_shared_experts: bool = False,
    layer_types: tuple[LayerKind, ...] | None = None,
) -> EffectiveRecompute:
    """Apply Megatron-Core's rules. Raises ValueError for what Megatron would crash on."""
    total = len(moe_layers)
    if layer_types is None:
        layer_types = (LayerKind.ATTENTION,) * total
    if len(layer_types) != total:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {total} layers")
    n_chunks = pipeline_stages * virtual_chunks
    if layers_per_chunk is None:
        if total % n_chunks:
            raise ValueError(
                f"{total} layers cannot be split evenly over {pipeline_stages} pipeline stage(s) "
                f"x {virtual_chunks} virtual chunk(s); choose sizes whose product divides {total}"
            )
        layers_per_chunk = (total // n_chunks,) * n_chunks
    if sum(layers_per_chunk) != total or len(layers_per_chunk) != n_chunks:
        raise ValueError(f"layers_per_chunk {layers_per_chunk} does not cover {total} layers")

    rule_break = recompute_rule_break(granularity, method, num_layers, modules)
    if rule_break is not None:
        named = ", ".join(f"recompute {name}={value!r}" for name, value in (
            ("granularity", granularity), ("method", method), ("num_layers", num_layers),
            ("modules", modules)) if name in rule_break.settings)
        raise ValueError(f"{named}: {rule_break.reason}")
    requested: tuple[str, ...] = ()
    if granularity == "full" and method == "uniform":
        assert num_layers is not None
        for c, n in enumerate(layers_per_chunk):
            if n % num_layers:
                raise ValueError(
                    f"full uniform recompute with num_layers={num_layers} does not divide the "
                    f"{n} layers of model chunk {c} (Megatron-Core 0.16.1 fails with "
                    f"IndexError mid-forward); use a divisor of {n}, e.g. 1"
                )
    elif granularity == "selective":
        requested = DEFAULT_SELECTIVE_MODULES if modules is None else tuple(modules)
        any_moe = any(moe_layers)
        needs = {
            "moe": (any_moe, "MoE layers"),
            "moe_act": (any_moe and has_grouped_gemm, "MoE layers with grouped GEMM"),
            "shared_experts": (any_moe and has_shared_experts, "MoE layers with shared experts"),
            "mla_up_proj": (has_mla, "multi-latent attention"),
        }
        for mod in requested:
            if mod in needs and not needs[mod][0]:
                raise ValueError(
                    f"recompute module {mod!r} needs {needs[mod][1]}, which this model does not "
                    "have; remove it from the recompute modules"
                )

    layers: list[LayerRecompute] = []
    index = 0
    for c, n in enumerate(layers_per_chunk):
        # Megatron orders virtual chunks round-robin over stages: chunk v of stage p holds
        # the (v * stages + p)-th block of layers.
        stage, chunk = c % pipeline_stages, c // pipeline_stages
        for i in range(n):
            is_moe = moe_layers[index]
            is_linear_attention = layer_types[index] == LayerKind.LINEAR_ATTENTION
            unit: int | None = None
            unit_layers = 0
            selective: set[str] = set()
            norms: set[str] = set()
            if granularity == "full":
                assert num_layers is not None
                if method == "uniform":
                    unit, unit_layers = i // num_layers, num_layers
                elif i < num_layers:
                    unit, unit_layers = i, 1
            elif granularity == "selective":
                for mod in requested:
                    if mod == "mlp" and is_moe:
                        continue  # Megatron ignores mlp recompute on MoE layers
                    if mod in ("moe", "moe_act", "shared_experts") and not is_moe:
                        continue
                    if mod == "core_attn" and is_linear_attention:
                        continue  # Gated DeltaNet has no core-attention checkpoint
                    if mod == "layernorm":
                        # TE fuses the input norm into linear_qkv and the pre-MLP norm into
                        # fc1 on dense layers; an MoE layer keeps a real one. A Gated DeltaNet
                        # layer's input norm sits inside its in_proj in both specs (the layer's
                        # input_layernorm is the identity), so it is never rebuilt.
                        if not norm_fused_into_linear:
                            norms.add("pre_mlp")
                            if not is_linear_attention:
                                norms.add("input")
                        elif is_moe:
                            norms.add("pre_mlp")
                        if not norms:
                            continue
                    selective.add(mod)
            layers.append(
                LayerRecompute(
                    layer_number=index + 1,
                    pipeline_stage=stage,
                    virtual_chunk=chunk,
                    full_checkpoint_unit=unit,
                    full_unit_layers=unit_layers,
                    selective_modules=frozenset(selective),
                    recomputed_norms=frozenset(norms),
                    layer_type=layer_types[index],
                )
            )
            index += 1
    layers.sort(key=lambda lr: lr.layer_number)
    return EffectiveRecompute(
        granularity=granularity,
        method=method if granularity == "full" else None,
        num_layers=num_layers if granularity == "full" else None,
        modules=requested,
        layers=tuple(layers),
        pipeline_stages=pipeline_stages,
        virtual_chunks=virtual_chunks,
    )


@dataclass(frozen=True)
class RecomputePolicy:
    """A named recompute setting to price or run (planner rows, calibration cells).

    cost_rank orders policies by how much they recompute (0 = nothing)."""

    name: str
    granularity: str | None
    method: str | None = None
    num_layers: int | None = None
    modules: tuple[str, ...] | None = None
    cost_rank: int = 0

    @property
    def env(self) -> dict[str, str]:
        """The ART_MEGATRON_* settings that select this policy."""
        env = {"ART_MEGATRON_RECOMPUTE_GRANULARITY": self.granularity or "none"}
        if self.granularity == "full":
            env["ART_MEGATRON_RECOMPUTE_METHOD"] = str(self.method)
            env["ART_MEGATRON_RECOMPUTE_NUM_LAYERS"] = str(self.num_layers)
        elif self.granularity == "selective" and self.modules is not None:
            env["ART_MEGATRON_RECOMPUTE_MODULES"] = ",".join(self.modules)
        return env
