"""ART_MEGATRON_* environment -> one frozen, validated, printable `Settings` object.

Everything is parsed and checked here, before any model exists, so a bad value fails in
milliseconds with the variable's name instead of minutes later inside Megatron.

Value words: `none`, `null`, `off`, `disabled`, `empty` (any case) and the empty string mean
"explicitly unset", i.e. Megatron's None (e.g. `ART_MEGATRON_RECOMPUTE_METHOD=none`). Two
consequences worth knowing:
- `RECOMPUTE_GRANULARITY=none` means no recompute at all, whereas leaving the variable out of
  the environment means the default, full recompute.
- For the boolean SEQUENCE_PARALLEL, `off`/`disabled` mean false (anyone writing "off" for a
  switch means false), while `none`/`null`/`empty` mean "use the default".
The defaults for RECOMPUTE_METHOD (uniform) and RECOMPUTE_NUM_LAYERS (1) apply only when the
granularity is full: with selective recompute Megatron requires num_layers to be unset.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields

from art.megatron.layout import ParallelLayout
from art.megatron.model_builder import RecomputeConfig
from art.megatron.recompute import RECOMPUTE_MODULES

ENV_PREFIX = "ART_MEGATRON_"
UNSET_WORDS: frozenset[str] = frozenset(
    {"none", "null", "off", "disable", "disabled", "empty", ""})
TRUE_WORDS: frozenset[str] = frozenset({"1", "true", "yes", "on", "enabled"})
FALSE_WORDS: frozenset[str] = frozenset({"0", "false", "no", "off", "disable", "disabled"})
GRANULARITIES: tuple[str, ...] = ("full", "selective")
METHODS: tuple[str, ...] = ("uniform", "block")

# Variable name (without the prefix) -> meaning and default. Ordered as printed.
KNOWN_VARIABLES: dict[str, str] = {
    "TENSOR_MODEL_PARALLEL_SIZE": "tensor parallel ranks per model replica (int >= 1; default 1)",
    "CONTEXT_PARALLEL_SIZE": "context parallel ranks (int >= 1; default 1)",
    "PIPELINE_MODEL_PARALLEL_SIZE": "pipeline stages (int >= 1; default 1)",
    "VIRTUAL_PIPELINE_MODEL_PARALLEL_SIZE": (
        "virtual chunks per pipeline stage (int >= 1, > 1 needs pipeline > 1; default unset = 1)"
    ),
    "EXPERT_MODEL_PARALLEL_SIZE": "expert parallel ranks for MoE layers (int >= 1; default 1)",
    "EXPERT_TENSOR_PARALLEL_SIZE": (
        "tensor parallel ranks inside each expert (int >= 1; default unset = same as tensor "
        "parallel, Megatron's rule)"
    ),
    "SEQUENCE_PARALLEL": "shard norms/dropout activations over TP (bool; default on when TP > 1)",
    "RECOMPUTE_GRANULARITY": "activation recompute: full | selective | none (default full)",
    "RECOMPUTE_METHOD": (
        "full recompute layout: uniform | block | none (default uniform when granularity is full)"
    ),
    "RECOMPUTE_NUM_LAYERS": (
        "layers per full checkpoint (uniform) or checkpointed layers per chunk (block); int >= 1 "
        "or none (default 1 when granularity is full; must be unset for selective)"
    ),
    "RECOMPUTE_MODULES": (
        "selective recompute modules, comma list of " + ", ".join(RECOMPUTE_MODULES)
        + " (default unset = core_attn)"
    ),
}


# Names upstream (ART) reads that change nothing in this build: accepted, their values
# validated, and listed by print_env as "no effect on this build". name -> (kind, meaning).
# Kinds: int, bool, list, choice:a|b|c, sms ("default" or a positive even int).
NO_EFFECT_VARIABLES: dict[str, tuple[str, str]] = {
    "VPP_MICROBATCH_GROUP_SIZE": ("int", "micro-batches per virtual-pipeline group"),
    "MOE_ROUTER_DTYPE": ("choice:fp32|fp64", "MoE router dtype"),
    "OFFLOAD_MODULES": ("list", "activation offloading of modules"),
    "OVERLAP_MOE_EXPERT_PARALLEL_COMM": ("bool", "overlap of the MoE all-to-all"),
    "DELAY_WGRAD_COMPUTE": ("bool", "delayed weight-gradient computation"),
    "EP_OVERLAP_EARLY_ATTN_MEMORY_RELEASE": ("bool", "early attention memory release under "
                                             "EP overlap"),
    "MOE_APPLY_PROBS_ON_INPUT": ("bool", "MoE router probabilities applied on the input"),
    "BIAS_ACTIVATION_FUSION": ("bool", "fused bias + activation (set from the kernels built)"),
    "FINE_GRAINED_ACTIVATION_OFFLOADING": ("bool", "fine-grained activation offloading"),
    "MOE_SHARED_EXPERT_OVERLAP": ("bool", "shared-expert overlap"),
    "MOE_HYBRIDEP_NUM_SMS": ("sms", "SMs for the hybrid-EP dispatcher"),
    "ENABLE_MOE_ROUTING_REPLAY": ("bool", "MoE routing replay"),
}
# Read elsewhere (art.megatron.train), validated here.
APPLIED_ELSEWHERE: dict[str, str] = {
    "RANDOM_STATE": "seed for Python, torch and the initial weights (int; default unset)",
}
# Upstream aliases: name -> the name it stands for.
ALIASES: dict[str, str] = {"EXPERT_TENSOR_MODEL_PARALLEL_SIZE": "EXPERT_TENSOR_PARALLEL_SIZE"}
# Names upstream retired and refuses: name -> what to do instead.
RETIRED_VARIABLES: dict[str, str] = {
    "MOE_FLEX_DISPATCHER_BACKEND": "the flex dispatcher backend is chosen by Megatron; unset it",
    "MOE_DEEPEP_NUM_SMS": "DeepEP is not used; unset it (see MOE_HYBRIDEP_NUM_SMS)",
}
# A name this close to a known one is a typo (an error with the suggestion); anything else
# unknown is only warned about, as upstream ignores unknown names.
MISSPELLING_CUTOFF = 0.8


@dataclass(frozen=True)
class Settings:
    """All parsed ART_MEGATRON_* values. `sources` says, per field, where the value came from."""

    tensor_model_parallel_size: int = 1
    context_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    sequence_parallel: bool = False
    recompute_granularity: str | None = "full"
    recompute_method: str | None = "uniform"
    recompute_num_layers: int | None = 1
    recompute_modules: tuple[str, ...] | None = None
    # field name -> "ART_MEGATRON_X=raw" or "default"; informational only.
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    # Accepted upstream names that change nothing here: ("ART_MEGATRON_X", raw value).
    no_effect: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.recompute_granularity != "full":
            # The method and layer count describe full recompute only: left at their
            # defaults (not named by a variable), they do not apply to another granularity.
            for name in ("recompute_method", "recompute_num_layers"):
                default = next(f.default for f in fields(self) if f.name == name)
                if self.source_of(name) == "default" and getattr(self, name) == default:
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
    for name in ("virtual_pipeline_model_parallel_size", "expert_tensor_parallel_size",
                 "recompute_num_layers"):
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
    granularity, method = s.recompute_granularity, s.recompute_method
    if granularity not in (None, *GRANULARITIES):
        raise ValueError(
            f"{_where(s, 'recompute_granularity')}: {granularity!r} is not one of full, "
            "selective, none"
        )
    if method not in (None, *METHODS):
        raise ValueError(
            f"{_where(s, 'recompute_method')}: {method!r} is not one of uniform, block, none"
        )
    if s.recompute_modules is not None:
        unknown = [m for m in s.recompute_modules if m not in RECOMPUTE_MODULES]
        if unknown:
            raise ValueError(
                f"{_where(s, 'recompute_modules')}: unknown module(s) {', '.join(unknown)}; "
                f"allowed: {', '.join(RECOMPUTE_MODULES)}"
            )
    if granularity == "full":
        if method is None:
            raise ValueError(
                f"{_where(s, 'recompute_method')}: full recompute needs a method (uniform or "
                "block); Megatron rejects full recompute without one"
            )
        if s.recompute_num_layers is None:
            raise ValueError(
                f"{_where(s, 'recompute_num_layers')}: full recompute needs a number of layers "
                "(>= 1), e.g. 1"
            )
        if s.recompute_modules is not None:
            raise ValueError(
                f"{_where(s, 'recompute_modules')}: recompute modules only apply to selective "
                "recompute; unset them or set RECOMPUTE_GRANULARITY=selective"
            )
    elif granularity == "selective":
        if s.recompute_num_layers is not None:
            raise ValueError(
                f"{_where(s, 'recompute_num_layers')}: selective recompute does not take a "
                "number of layers (Megatron rejects it); set it to none"
            )
    else:
        stray = [
            n for n in ("recompute_method", "recompute_num_layers", "recompute_modules")
            if getattr(s, n) is not None
        ]
        if stray:
            raise ValueError(
                f"{', '.join(_where(s, n) for n in stray)}: set while recompute granularity is "
                "none, so it would be ignored; unset it or choose a granularity"
            )


def _require_positive(s: Settings, name: str, value: object, *, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{_where(s, name)}: must be an integer >= 1, got {value!r}")


def _env_name(field_name: str) -> str:
    return ENV_PREFIX + _FIELD_TO_VARIABLE[field_name]


def _where(s: Settings, field_name: str) -> str:
    source = s.source_of(field_name)
    return source if source != "default" else f"{_env_name(field_name)} (default)"


_FIELD_TO_VARIABLE: dict[str, str] = {
    "tensor_model_parallel_size": "TENSOR_MODEL_PARALLEL_SIZE",
    "context_parallel_size": "CONTEXT_PARALLEL_SIZE",
    "pipeline_model_parallel_size": "PIPELINE_MODEL_PARALLEL_SIZE",
    "virtual_pipeline_model_parallel_size": "VIRTUAL_PIPELINE_MODEL_PARALLEL_SIZE",
    "expert_model_parallel_size": "EXPERT_MODEL_PARALLEL_SIZE",
    "expert_tensor_parallel_size": "EXPERT_TENSOR_PARALLEL_SIZE",
    "sequence_parallel": "SEQUENCE_PARALLEL",
    "recompute_granularity": "RECOMPUTE_GRANULARITY",
    "recompute_method": "RECOMPUTE_METHOD",
    "recompute_num_layers": "RECOMPUTE_NUM_LAYERS",
    "recompute_modules": "RECOMPUTE_MODULES",
}
_VARIABLE_TO_FIELD = {v: k for k, v in _FIELD_TO_VARIABLE.items()}
assert set(_VARIABLE_TO_FIELD) == set(KNOWN_VARIABLES)

_UNSET = object()  # "explicitly unset" marker, distinct from "absent from the environment"


def _parse_int(variable: str, raw: str) -> object:
    text = raw.strip().lower()
    if text in UNSET_WORDS:
        return _UNSET
    try:
        value = int(text)
    except ValueError:
        raise ValueError(
            f"{variable}={raw!r} is not an integer; use a whole number >= 1 or none"
        ) from None
    if value < 1:
        raise ValueError(f"{variable}={raw!r} must be >= 1 (or none)")
    return value


def _parse_choice(variable: str, raw: str, choices: tuple[str, ...]) -> object:
    text = raw.strip().lower()
    if text in UNSET_WORDS:
        return _UNSET
    if text not in choices:
        raise ValueError(f"{variable}={raw!r} is not one of {', '.join(choices)}, none")
    return text


def _parse_bool(variable: str, raw: str) -> object:
    text = raw.strip().lower()
    if text in FALSE_WORDS:
        return False
    if text in TRUE_WORDS:
        return True
    if text in UNSET_WORDS:
        return _UNSET
    raise ValueError(
        f"{variable}={raw!r} is not a boolean; use true/false (1/0, yes/no, on/off) or none "
        "for the default"
    )


def _parse_modules(variable: str, raw: str) -> object:
    text = raw.strip().lower()
    if text in UNSET_WORDS:
        return _UNSET
    items = [item.strip() for item in text.split(",")]
    if any(not item for item in items):
        raise ValueError(
            f"{variable}={raw!r} has an empty item; write a comma list like core_attn,mlp"
        )
    unknown = [item for item in items if item not in RECOMPUTE_MODULES]
    if unknown:
        hints = []
        for item in unknown:
            close = difflib.get_close_matches(item, RECOMPUTE_MODULES, n=1)
            hints.append(f"{item!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ValueError(
            f"{variable}={raw!r}: unknown module(s) {', '.join(hints)}; allowed: "
            f"{', '.join(RECOMPUTE_MODULES)}"
        )
    if len(set(items)) != len(items):
        raise ValueError(f"{variable}={raw!r} lists a module twice")
    return tuple(items)


def reject_unknown_variable(name: str, raw: str, prefix: str, known: Iterable[str]) -> None:
    """Raise ValueError for a `prefix*` variable that is not in `known` (short names), with the
    closest known name: a typo must never fall back silently to a default."""
    known = list(known)
    short = name[len(prefix):]
    if short in known:
        return
    close = difflib.get_close_matches(short, known, n=1, cutoff=0.5)
    hint = f"did you mean {prefix}{close[0]}? " if close else ""
    raise ValueError(
        f"unknown variable {name}={raw!r}: {hint}known variables: "
        f"{', '.join(prefix + k for k in known)}"
    )


def all_known_variables() -> list[str]:
    """Every ART_MEGATRON_* short name this build accepts (applied or not)."""
    return [*KNOWN_VARIABLES, *NO_EFFECT_VARIABLES, *APPLIED_ELSEWHERE, *ALIASES]


def check_unknown_variable(name: str, raw: str) -> None:
    """An ART_MEGATRON_* name nobody reads: a close misspelling of a known name (compared
    without case or surrounding space) is an error with the suggestion; anything else is a
    warning, as upstream ignores unknown names."""
    import warnings

    known = all_known_variables()
    short = name[len(ENV_PREFIX):]
    cleaned = short.strip().upper()
    close = difflib.get_close_matches(cleaned, known, n=1, cutoff=MISSPELLING_CUTOFF)
    if cleaned in known or close:
        suggestion = cleaned if cleaned in known else close[0]
        raise ValueError(
            f"unknown variable {name}={raw!r}: did you mean {ENV_PREFIX}{suggestion}? (a "
            "misspelt name would silently leave the setting at its default)"
        )
    warnings.warn(
        f"{name}={raw!r} is not a variable this build or upstream reads; ignored",
        stacklevel=3,
    )


def _check_no_effect_value(variable: str, raw: str, kind: str) -> None:
    text = raw.strip().lower()
    if kind == "int":
        _parse_int(variable, raw)
    elif kind == "bool":
        _parse_bool(variable, raw)
    elif kind.startswith("choice:"):
        _parse_choice(variable, raw, tuple(kind.split(":", 1)[1].split("|")))
    elif kind == "sms" and text not in UNSET_WORDS and text != "default":
        if not text.isdigit() or int(text) < 2 or int(text) % 2:
            raise ValueError(f"{variable}={raw!r} must be 'default' or a positive even integer")


def load_settings(env: Mapping[str, str] | None = None, *,
                  labels: Mapping[str, str] | None = None) -> Settings:
    """Parse ART_MEGATRON_* from `env` (default os.environ). Raises ValueError on any bad value
    and on any unknown ART_MEGATRON_* name (with the closest known name suggested).

    `labels`: variable name -> how the user gave that value (e.g. "--tp" for a command-line
    flag the caller turned into ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE): errors and
    `sources` name the label, so the same rules check flags and environment alike."""
    env = os.environ if env is None else env
    labels = labels or {}
    present: dict[str, str] = {}
    no_effect: list[tuple[str, str]] = []
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        short = name[len(ENV_PREFIX):]
        if short in RETIRED_VARIABLES:
            raise ValueError(f"{name} is retired: {RETIRED_VARIABLES[short]}")
        if short in ALIASES:
            if ENV_PREFIX + ALIASES[short] in env and env[ENV_PREFIX + ALIASES[short]] != raw:
                raise ValueError(
                    f"{name}={raw!r} and {ENV_PREFIX}{ALIASES[short]}="
                    f"{env[ENV_PREFIX + ALIASES[short]]!r} name the same setting; set one")
            short = ALIASES[short]
        if short in NO_EFFECT_VARIABLES:
            _check_no_effect_value(name, raw, NO_EFFECT_VARIABLES[short][0])
            no_effect.append((name, raw))
            continue
        if short in APPLIED_ELSEWHERE:
            if short == "RANDOM_STATE" and raw.strip().lower() not in UNSET_WORDS:
                try:
                    int(raw.strip())
                except ValueError:
                    raise ValueError(f"{name}={raw!r} is not an integer seed") from None
            continue
        if short not in KNOWN_VARIABLES:
            check_unknown_variable(name, raw)
            continue
        present[short] = raw

    parsed: dict[str, object] = {}
    for short, raw in present.items():
        variable = labels.get(ENV_PREFIX + short, ENV_PREFIX + short)
        if short == "SEQUENCE_PARALLEL":
            parsed[short] = _parse_bool(variable, raw)
        elif short == "RECOMPUTE_GRANULARITY":
            parsed[short] = _parse_choice(variable, raw, GRANULARITIES)
        elif short == "RECOMPUTE_METHOD":
            parsed[short] = _parse_choice(variable, raw, METHODS)
        elif short == "RECOMPUTE_MODULES":
            parsed[short] = _parse_modules(variable, raw)
        else:
            parsed[short] = _parse_int(variable, raw)

    def get(short: str, default: object) -> object:
        if short not in parsed:
            return default
        value = parsed[short]
        return None if value is _UNSET else value

    tp = get("TENSOR_MODEL_PARALLEL_SIZE", 1) or 1
    granularity = get("RECOMPUTE_GRANULARITY", "full")
    full = granularity == "full"
    sequence_parallel = parsed.get("SEQUENCE_PARALLEL", _UNSET)
    values = dict(
        tensor_model_parallel_size=tp,
        context_parallel_size=get("CONTEXT_PARALLEL_SIZE", 1) or 1,
        pipeline_model_parallel_size=get("PIPELINE_MODEL_PARALLEL_SIZE", 1) or 1,
        virtual_pipeline_model_parallel_size=get("VIRTUAL_PIPELINE_MODEL_PARALLEL_SIZE", None),
        expert_model_parallel_size=get("EXPERT_MODEL_PARALLEL_SIZE", 1) or 1,
        expert_tensor_parallel_size=get("EXPERT_TENSOR_PARALLEL_SIZE", None),
        sequence_parallel=(tp > 1) if sequence_parallel is _UNSET else sequence_parallel,
        recompute_granularity=granularity,
        recompute_method=get("RECOMPUTE_METHOD", "uniform" if full else None),
        recompute_num_layers=get("RECOMPUTE_NUM_LAYERS", 1 if full else None),
        recompute_modules=get("RECOMPUTE_MODULES", None),
    )
    sources = tuple(
        (field_name,
         f"{labels.get(ENV_PREFIX + short, ENV_PREFIX + short)}={present[short]}")
        for field_name, short in _FIELD_TO_VARIABLE.items()
        if short in present
    )
    return Settings(**values, sources=sources,  # type: ignore[arg-type]
                    no_effect=tuple(sorted(no_effect)))
