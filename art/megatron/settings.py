"""ART_MEGATRON_* environment -> one frozen, validated, printable `Settings` object.

Everything is parsed and checked here, before any model exists, so a bad value fails in
milliseconds with the variable's name instead of minutes later inside Megatron. Each variable
is declared once below (`MEGATRON_ENV`); values are read in the one vocabulary of
`art/env_vars.py`. Two consequences of that vocabulary worth knowing:
- `RECOMPUTE_GRANULARITY=none` means no recompute at all, whereas leaving the variable out of
  the environment means the default, full recompute.
- For the boolean SEQUENCE_PARALLEL, `off`/`disabled` mean false, while `none`/`null`/`empty`
  mean "use the default" (on when TP > 1).
The defaults for RECOMPUTE_METHOD (uniform) and RECOMPUTE_NUM_LAYERS (1) apply only when the
granularity is full: with selective recompute Megatron requires num_layers to be unset.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from art.env_vars import (
    UNSET,
    UNSET_WORDS,
    Effect,
    EnvTable,
    EnvVar,
    Parser,
    UnknownName,
    any_text,
    int_at_least,
    list_of,
    one_of,
    parse_bool,
)
from art.megatron.layout import ParallelLayout
from art.megatron.model_builder import RecomputeConfig
from art.megatron.recompute import (
    GRANULARITIES,
    METHODS,
    RECOMPUTE_MODULES,
    recompute_rule_break,
)

ENV_PREFIX = "ART_MEGATRON_"


def _seed(variable: str, raw: str) -> int | None:
    text = raw.strip()
    if text.lower() in UNSET_WORDS:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{variable}={raw!r} is not an integer seed") from None


def _streaming_multiprocessors(variable: str, raw: str) -> str:
    text = raw.strip().lower()
    if text not in UNSET_WORDS and text != "default":
        if not text.isdigit() or int(text) < 2 or int(text) % 2:
            raise ValueError(f"{variable}={raw!r} must be 'default' or a positive even integer")
    return raw


def _no_effect(name: str, parse: Parser, meaning: str) -> EnvVar:
    return EnvVar(name, parse, meaning, effect=Effect.NO_EFFECT)


_DEFAULT_LAYOUT = "([default layout](#the-default-layout))"
MEGATRON_ENV = EnvTable(
    prefix=ENV_PREFIX,
    variables=(
        EnvVar("TENSOR_MODEL_PARALLEL_SIZE", int_at_least(1),
               "tensor-parallel ranks per model replica",
               field="tensor_model_parallel_size", default=1, default_text="1"),
        EnvVar("CONTEXT_PARALLEL_SIZE", int_at_least(1),
               "context-parallel ranks: dense, hybrid and MoE models, in the segmented flash "
               "attention ([Context parallel](#context-parallel))",
               field="context_parallel_size", default=1,
               default_text="1; on several GPUs with no layout set: the GPUs "
                            + _DEFAULT_LAYOUT),
        EnvVar("PIPELINE_MODEL_PARALLEL_SIZE", int_at_least(1),
               "pipeline stages (priced; `TrainerRank` runs only 1)",
               field="pipeline_model_parallel_size", default=1, default_text="1"),
        EnvVar("VIRTUAL_PIPELINE_MODEL_PARALLEL_SIZE", int_at_least(1),
               "virtual chunks per stage (> 1 needs pipeline > 1)",
               field="virtual_pipeline_model_parallel_size", default=None, nullable=True,
               default_text="unset = 1"),
        EnvVar("EXPERT_MODEL_PARALLEL_SIZE", int_at_least(1),
               "expert-parallel ranks for MoE layers",
               field="expert_model_parallel_size", default=1,
               default_text="1; MoE models on several GPUs with no layout set: the GPUs "
                            + _DEFAULT_LAYOUT),
        EnvVar("EXPERT_TENSOR_PARALLEL_SIZE", int_at_least(1),
               "tensor-parallel ranks inside each expert",
               field="expert_tensor_parallel_size", default=None, nullable=True,
               default_text="unset = tensor parallel; 1 where the default layout spreads "
                            "the experts " + _DEFAULT_LAYOUT),
        # Its default depends on TP: load_settings derives it (False is the TP = 1 value).
        EnvVar("SEQUENCE_PARALLEL", parse_bool,
               "shard norm/dropout activations over TP (bool)",
               field="sequence_parallel", default=False, default_text="on when TP > 1"),
        EnvVar("RECOMPUTE_GRANULARITY", one_of(GRANULARITIES),
               "activation recompute: `full`, `selective` or `none`",
               field="recompute_granularity", default="full", nullable=True,
               default_text="`full`"),
        EnvVar("RECOMPUTE_METHOD", one_of(METHODS),
               "full recompute layout: `uniform` or `block`",
               field="recompute_method", default="uniform", nullable=True,
               default_text="`uniform` when full"),
        EnvVar("RECOMPUTE_NUM_LAYERS", int_at_least(1),
               "layers per full checkpoint (uniform) or checkpointed layers per chunk (block); "
               "must be unset for selective",
               field="recompute_num_layers", default=1, nullable=True,
               default_text="1 when full"),
        EnvVar("RECOMPUTE_MODULES", list_of(RECOMPUTE_MODULES),
               "selective modules: " + ", ".join(f"`{m}`" for m in RECOMPUTE_MODULES),
               field="recompute_modules", default=None, nullable=True,
               default_text="unset = `core_attn`"),
        # Read by art.megatron.train (the seed), validated with everything else.
        EnvVar("RANDOM_STATE", _seed, "seed for Python, torch and the initial weights",
               effect=Effect.ELSEWHERE),
        # Names upstream (ART) reads that change nothing in this build: accepted, their values
        # validated, and listed by print_env as "no effect on this build".
        _no_effect("VPP_MICROBATCH_GROUP_SIZE", int_at_least(1),
                   "micro-batches per virtual-pipeline group"),
        _no_effect("MOE_ROUTER_DTYPE", one_of(("fp32", "fp64")), "MoE router dtype"),
        _no_effect("OFFLOAD_MODULES", any_text, "activation offloading of modules"),
        _no_effect("OVERLAP_MOE_EXPERT_PARALLEL_COMM", parse_bool,
                   "overlap of the MoE all-to-all"),
        _no_effect("DELAY_WGRAD_COMPUTE", parse_bool, "delayed weight-gradient computation"),
        _no_effect("EP_OVERLAP_EARLY_ATTN_MEMORY_RELEASE", parse_bool,
                   "early attention memory release under EP overlap"),
        _no_effect("MOE_APPLY_PROBS_ON_INPUT", parse_bool,
                   "MoE router probabilities applied on the input"),
        _no_effect("BIAS_ACTIVATION_FUSION", parse_bool,
                   "fused bias + activation (set from the kernels built)"),
        _no_effect("FINE_GRAINED_ACTIVATION_OFFLOADING", parse_bool,
                   "fine-grained activation offloading"),
        _no_effect("MOE_SHARED_EXPERT_OVERLAP", parse_bool, "shared-expert overlap"),
        _no_effect("MOE_HYBRIDEP_NUM_SMS", _streaming_multiprocessors,
                   "SMs for the hybrid-EP dispatcher"),
        _no_effect("ENABLE_MOE_ROUTING_REPLAY", parse_bool, "MoE routing replay"),
    ),
    aliases={"EXPERT_TENSOR_MODEL_PARALLEL_SIZE": "EXPERT_TENSOR_PARALLEL_SIZE"},
    retired={
        "MOE_FLEX_DISPATCHER_BACKEND": "the flex dispatcher backend is chosen by Megatron; "
                                       "unset it",
        "MOE_DEEPEP_NUM_SMS": "DeepEP is not used; unset it (see MOE_HYBRIDEP_NUM_SMS)",
    },
    # A name this close to a known one is a typo (an error with the suggestion); anything else
    # unknown is only warned about, as upstream ignores unknown names.
    unknown=UnknownName.ERROR_IF_CLOSE,
)
_default = MEGATRON_ENV.default
# The recompute rules' names for Settings' fields.
_RECOMPUTE_FIELDS = {"granularity": "recompute_granularity", "method": "recompute_method",
                     "num_layers": "recompute_num_layers", "modules": "recompute_modules"}


@dataclass(frozen=True)
class Settings:
    """All parsed ART_MEGATRON_* values. `sources` says, per field, where the value came from."""

    tensor_model_parallel_size: int = _default("tensor_model_parallel_size")
    context_parallel_size: int = _default("context_parallel_size")
    pipeline_model_parallel_size: int = _default("pipeline_model_parallel_size")
    virtual_pipeline_model_parallel_size: int | None = _default(
        "virtual_pipeline_model_parallel_size")
    expert_model_parallel_size: int = _default("expert_model_parallel_size")
    expert_tensor_parallel_size: int | None = _default("expert_tensor_parallel_size")
    sequence_parallel: bool = _default("sequence_parallel")
    recompute_granularity: str | None = _default("recompute_granularity")
    recompute_method: str | None = _default("recompute_method")
    recompute_num_layers: int | None = _default("recompute_num_layers")
    recompute_modules: tuple[str, ...] | None = _default("recompute_modules")
    # field name -> "ART_MEGATRON_X=raw" or "default"; informational only.
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    # Accepted upstream names that change nothing here: ("ART_MEGATRON_X", raw value).
    no_effect: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.recompute_granularity != "full":
            # The method and layer count describe full recompute only: left at their
            # defaults (not named by a variable), they do not apply to another granularity.
            for name in ("recompute_method", "recompute_num_layers"):
                if self.source_of(name) == "default" and getattr(self, name) == _default(name):
                    object.__setattr__(self, name, None)
        _validate(self)

    def layout(self, world_size: int | None = None) -> ParallelLayout:
        """The parallel layout; data parallel = world_size / (TP x CP x PP) when given."""
        model_parallel = (
            self.tensor_model_parallel_size
            * self.context_parallel_size
            * self.pipeline_model_parallel_size
        )
        data_parallel = 1
        if world_size is not None:
            if world_size < 1 or world_size % model_parallel:
                raise ValueError(
                    f"world size {world_size} is not a multiple of TP x CP x PP = "
                    f"{model_parallel}; launch a multiple of {model_parallel} processes"
                )
            data_parallel = world_size // model_parallel
        return ParallelLayout(
            tensor_parallel=self.tensor_model_parallel_size,
            context_parallel=self.context_parallel_size,
            pipeline_parallel=self.pipeline_model_parallel_size,
            virtual_pipeline_parallel=self.virtual_pipeline_model_parallel_size or 1,
            expert_parallel=self.expert_model_parallel_size,
            expert_tensor_parallel=(
                self.expert_tensor_parallel_size or self.tensor_model_parallel_size
            ),
            sequence_parallel=self.sequence_parallel,
            data_parallel=data_parallel,
        )

    def recompute_config(self) -> RecomputeConfig:
        return RecomputeConfig(
            granularity=self.recompute_granularity,
            method=self.recompute_method,
            num_layers=self.recompute_num_layers,
            modules=self.recompute_modules,
        )

    def source_of(self, field_name: str) -> str:
        return dict(self.sources).get(field_name, "default")

    def named(self, field_name: str, otherwise: str) -> str:
        """How a message names this setting: the command-line flag it came from
        ("--tp=3", see load_settings' labels), else `otherwise`."""
        source = self.source_of(field_name)
        return source if source.startswith("--") else otherwise

    def __str__(self) -> str:
        rows = []
        for f in fields(self):
            if f.name in ("sources", "no_effect"):
                continue
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = ",".join(value) if value else "(empty)"
            text = "none" if value is None else str(value)
            if f.name == "recompute_modules" and value is None:
                if self.recompute_granularity == "selective":
                    text = "none (Megatron default: core_attn)"
            rows.append((f.name, text, self.source_of(f.name)))
        width_name = max(len(r[0]) for r in rows)
        width_value = max(len(r[1]) for r in rows)
        lines = ["Megatron settings"]
        lines += [f"  {n:<{width_name}}  {v:<{width_value}}  ({s})" for n, v, s in rows]
        lines += [f"  {name}={raw!r}: no effect on this build" for name, raw in self.no_effect]
        return "\n".join(lines)


def _validate(s: Settings) -> None:
    for name in (
        "tensor_model_parallel_size",
        "context_parallel_size",
        "pipeline_model_parallel_size",
        "expert_model_parallel_size",
    ):
        _require_positive(s, name, getattr(s, name), allow_none=False)
    for name in ("virtual_pipeline_model_parallel_size", "expert_tensor_parallel_size"):
        _require_positive(s, name, getattr(s, name), allow_none=True)
    vpp = s.virtual_pipeline_model_parallel_size
    if vpp is not None and vpp > 1 and s.pipeline_model_parallel_size == 1:
        raise ValueError(
            f"{_where(s, 'virtual_pipeline_model_parallel_size')}: {vpp} virtual chunks need "
            "PIPELINE_MODEL_PARALLEL_SIZE > 1; unset it or add pipeline stages"
        )
    if s.sequence_parallel and s.tensor_model_parallel_size == 1:
        raise ValueError(
            f"{_where(s, 'sequence_parallel')}: sequence parallel needs "
            "TENSOR_MODEL_PARALLEL_SIZE > 1; turn it off or raise tensor parallel"
        )
    rule_break = recompute_rule_break(s.recompute_granularity, s.recompute_method,
                                      s.recompute_num_layers, s.recompute_modules)
    if rule_break is not None:
        where = ", ".join(_where(s, _RECOMPUTE_FIELDS[name]) for name in rule_break.settings)
        raise ValueError(f"{where}: {rule_break.reason}")


def _require_positive(s: Settings, name: str, value: object, *, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{_where(s, name)}: must be an integer >= 1, got {value!r}")


def _where(s: Settings, field_name: str) -> str:
    source = s.source_of(field_name)
    if source != "default":
        return source
    return f"{ENV_PREFIX}{MEGATRON_ENV.for_field(field_name).name} (default)"


def load_settings(env: Mapping[str, str] | None = None, *,
                  labels: Mapping[str, str] | None = None) -> Settings:
    """Parse ART_MEGATRON_* from `env` (default os.environ). Raises ValueError on any bad value
    and on a misspelt ART_MEGATRON_* name (with the closest known name suggested).

    `labels`: variable name -> how the user gave that value (e.g. "--tp" for a command-line
    flag the caller turned into ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE): errors and
    `sources` name the label, so the same rules check flags and environment alike."""
    reading = MEGATRON_ENV.read(os.environ if env is None else env, labels)
    given = reading.by_field()
    values = {name: value.value for name, value in given.items()}
    sequence_parallel = given.get("sequence_parallel")
    if sequence_parallel is None or sequence_parallel.parsed is UNSET:
        values["sequence_parallel"] = values.get(
            "tensor_model_parallel_size", _default("tensor_model_parallel_size")) > 1
    sources = tuple((name, value.source) for name, value in given.items())
    return Settings(**values, sources=sources, no_effect=reading.no_effect)
