"""TrainerRankOptions: every knob of the trainer, from arguments or ART_TRAINER_RANK_* env,
validated before anything runs."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from art._paths import directory_problem, file_path_problem
from art.env_vars import (
    UNSET,
    EnvTable,
    EnvVar,
    UnknownName,
    Unset,
    is_unset_word,
    parse_bool,
    parse_byte_count,
    parse_int,
    parse_number,
    parse_text,
)
from art.megatron.recompute_ladder import RecomputeChoice
from art.trainer_rank.compute.heads import HEAD_CHUNK_TOKENS
from art.trainer_rank.decide.profiles import ENV_PROFILE_PATH
from art.trainer_rank.measuring.probe_store import default_probe_cache_dir
from art.trainer_rank.measuring.virtual_limit import ENV_TEST_MEMORY_LIMIT

ENV_PREFIX = "ART_TRAINER_RANK_"


def _recompute_choice(variable: str, raw: str) -> RecomputeChoice | Unset:
    if is_unset_word(raw):
        return UNSET
    choice = _choice(raw)
    if choice is None:
        raise ValueError(f"{variable}={raw!r}: must be one of "
                         + ", ".join(c.value for c in RecomputeChoice))
    return choice


TRAINER_RANK_ENV = EnvTable(
    prefix=ENV_PREFIX,
    variables=(
        EnvVar("PROFILE_PATH", parse_text, "JSON file for learned memory profiles",
               field="profile_path", default=None, nullable=True,
               default_text="unset: in memory, per process"),
        EnvVar("RECOMPUTE", _recompute_choice,
               "which recompute rung a grad micro-batch runs: `configured` (the configured "
               "policy, or decline), `escalate` (the configured policy when it fits, else the "
               "least-work rung above it that fits), `adaptive` (the least-work rung that fits, "
               "below the configured one too); see \"Recompute per micro-batch\". With expert "
               "parallel across data-parallel ranks every rank runs `configured` (\"Expert "
               "parallel\")",
               field="recompute", default=RecomputeChoice.ESCALATE, default_text="escalate"),
        EnvVar("ESCALATE_TO_FULL_RECOMPUTE", parse_bool,
               "false: never run another recompute than the configured one (the same as "
               "`RECOMPUTE=configured`)",
               field="escalate_to_full_recompute", default=True, default_text="true"),
        EnvVar("COLD_START_FRACTION", parse_number,
               "first micro-batch of an unprofiled signature: this fraction of the longest "
               "row the default formulas admit",
               field="cold_start_fraction", default=0.25, default_text="0.25"),
        EnvVar("TRUST_WINDOW", parse_number,
               "a profile is trusted from (smallest observed / w) to (largest observed x w) "
               "tokens",
               field="trust_window", default=2.0, default_text="2"),
        EnvVar("HEAD_CHUNK_TOKENS", parse_int,
               "tokens per output-head chunk (full-vocabulary logits exist one chunk at a time)",
               field="head_chunk_tokens", default=HEAD_CHUNK_TOKENS,
               default_text=str(HEAD_CHUNK_TOKENS)),
        EnvVar("TEST_MEMORY_LIMIT_BYTES", parse_byte_count,
               "virtual memory limit (CPU tests and the demo)",
               field="test_memory_limit_bytes", default=None, nullable=True,
               default_text="unset"),
        EnvVar("PROBE_LAYERS", parse_bool,
               "measure one real layer per recompute mode and each output mix's head, each "
               "the first time a micro-batch needs it, and price with those coefficients "
               "instead of the default formulas; it measures only sizes whose micro-batch "
               "fits the usable limit",
               field="probe_layers", default=True, default_text="true"),
        EnvVar("FAULT_TIMEOUT_S", parse_number,
               "after a collective failed because a peer failed, how long a rank waits for the "
               "peer's fault record that names it; also how long a rank whose caller left the "
               "loop waits for its peers to leave too (see \"An OOM on one rank\")",
               field="fault_timeout_s", default=60.0, default_text="60"),
        EnvVar("PROBE_CACHE", parse_bool,
               "keep the probe's coefficients on disk, so that later jobs on the same model, "
               "layout and policy skip the probe (see \"The probe is paid once\")",
               field="probe_cache", default=True, default_text="true"),
        EnvVar("PROBE_CACHE_DIR", parse_text,
               "directory for the cached probe coefficients (JSON, one file per "
               "model/layout/policy key)",
               field="probe_cache_dir", default=None, nullable=True,
               default_text="the profile file's directory, else "
                            "`$XDG_CACHE_HOME/art-trainer-rank/probes`, else "
                            "`~/.cache/art-trainer-rank/probes`"),
    ),
    # Upstream's test-only switches (layout anchors, hooks): accepted, nothing here reads them.
    ignored=frozenset({"TEST_HOOKS", "TEST_ANCHOR"}),
    unknown=UnknownName.ERROR,
)
_default = TRAINER_RANK_ENV.default
assert f"{ENV_PREFIX}PROFILE_PATH" == ENV_PROFILE_PATH
assert f"{ENV_PREFIX}TEST_MEMORY_LIMIT_BYTES" == ENV_TEST_MEMORY_LIMIT

# The switches: what field_problem checks for a bool when the options come as arguments.
_BOOLEAN_FIELDS = frozenset(v.field for v in TRAINER_RANK_ENV.applied_variables()
                            if v.parse is parse_bool)


@dataclass(frozen=True)
class TrainerRankOptions:
    profile_path: str | None = _default("profile_path")
    test_memory_limit_bytes: int | None = _default("test_memory_limit_bytes")
    escalate_to_full_recompute: bool = _default("escalate_to_full_recompute")
    recompute: RecomputeChoice = _default("recompute")
    cold_start_fraction: float = _default("cold_start_fraction")
    trust_window: float = _default("trust_window")
    head_chunk_tokens: int = _default("head_chunk_tokens")
    probe_layers: bool = _default("probe_layers")
    probe_cache: bool = _default("probe_cache")
    probe_cache_dir: str | None = _default("probe_cache_dir")
    # Runtime OOMs tolerated for one call before giving up (each one shrinks what is admitted).
    max_oom_retries: int = 8
    # How long a rank whose collective failed waits for the peer's fault record, and a rank whose
    # caller left the loop waits for its peers to leave too (ranks/phases.py).
    fault_timeout_s: float = _default("fault_timeout_s")

    def __post_init__(self) -> None:
        if isinstance(self.recompute, str) and not isinstance(self.recompute, RecomputeChoice):
            choice = _choice(self.recompute)
            if choice is not None:
                object.__setattr__(self, "recompute", choice)
        for f in fields(self):
            value = getattr(self, f.name)
            problem = field_problem(f.name, value)
            if problem is not None:
                raise ValueError(f"TrainerRankOptions.{f.name}={value!r}: {problem}")
        if not self.escalate_to_full_recompute and self.recompute == RecomputeChoice.ADAPTIVE:
            raise ValueError(
                "TrainerRankOptions: recompute='adaptive' runs other rungs than the configured "
                "policy, but escalate_to_full_recompute=False forbids that; unset "
                "ART_TRAINER_RANK_ESCALATE_TO_FULL_RECOMPUTE, or set "
                "ART_TRAINER_RANK_RECOMPUTE=configured")

    @property
    def recompute_choice(self) -> RecomputeChoice:
        """The rung choice in force: escalate_to_full_recompute=False means configured."""
        if not self.escalate_to_full_recompute:
            return RecomputeChoice.CONFIGURED
        return self.recompute

    def resolved_probe_cache_dir(self) -> str | None:
        """Where probe coefficients are cached on disk: nowhere when the cache is off; the
        explicit directory; else next to the profile file (both are per-machine knowledge of
        the same model); else the user cache folder, when it can be written (a cache never
        stops a run: an unwritable default keeps the probe in memory, with a warning)."""
        if not self.probe_cache:
            return None
        if self.probe_cache_dir:
            return self.probe_cache_dir
        if self.profile_path:
            return os.path.dirname(os.path.abspath(self.profile_path))
        default = default_probe_cache_dir()
        problem = directory_problem(default)
        if problem is not None:
            warnings.warn(f"the probe cache folder {default} {problem}: probe coefficients "
                          "are kept in memory (set ART_TRAINER_RANK_PROBE_CACHE_DIR to a "
                          "writable directory, or ART_TRAINER_RANK_PROBE_CACHE=false)",
                          stacklevel=2)
            return None
        return str(default)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> TrainerRankOptions:
        """Options from ART_TRAINER_RANK_* (arguments in `overrides` win). An unknown
        ART_TRAINER_RANK_* name is an error with the closest known name."""
        environ = os.environ if env is None else env
        values: dict[str, Any] = {}
        for given in TRAINER_RANK_ENV.read(environ).applied:
            name = given.variable.field
            # Checked here, so that the error names the variable the value came from.
            problem = field_problem(name, given.value)
            if problem is not None:
                raise ValueError(f"{given.label}={given.raw!r}: {problem}")
            values[name] = given.value
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"unknown TrainerRankOptions field(s) {sorted(unknown)}")
        return replace(cls(**values), **overrides)


def _choice(text: str) -> RecomputeChoice | None:
    try:
        return RecomputeChoice(text.strip().lower())
    except ValueError:
        return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def field_problem(field_name: str, value: Any) -> str | None:
    """What is wrong with `value` for the option `field_name` (a clause for the message, which
    names where the value came from), or None. The one validation of every option, whether it
    comes from ART_TRAINER_RANK_* or from arguments."""
    if field_name == "profile_path":
        if value is None:
            return None
        if not isinstance(value, (str, os.PathLike)):
            return "must be a file path or None"
        problem = file_path_problem(value)
        return None if problem is None else f"{problem} (unset it to keep profiles in memory)"
    if field_name == "probe_cache_dir":
        if value is None:
            return None
        if not isinstance(value, (str, os.PathLike)):
            return "must be a directory path or None"
        problem = directory_problem(value)
        return None if problem is None else (
            f"{problem} (unset it to keep probe coefficients beside the profile "
            "file, or in memory)")
    if field_name == "test_memory_limit_bytes":
        if value is None or (_is_int(value) and value > 0):
            return None
        return "must be a positive integer byte count, e.g. 268435456 (256 MiB), or unset"
    if field_name in _BOOLEAN_FIELDS:
        return None if isinstance(value, bool) else "must be true or false"
    if field_name == "recompute":
        if isinstance(value, RecomputeChoice):
            return None
        return "must be one of " + ", ".join(c.value for c in RecomputeChoice)
    if field_name == "cold_start_fraction":
        if _is_number(value) and 0.0 < value <= 1.0:
            return None
        return "must be a fraction in (0, 1], e.g. 0.25"
    if field_name == "trust_window":
        if _is_number(value) and math.isfinite(value) and value >= 1.0:
            return None
        return "must be a finite number >= 1, e.g. 2"
    if field_name == "head_chunk_tokens":
        return None if _is_int(value) and value >= 1 else "must be an integer >= 1, e.g. 2048"
    if field_name == "fault_timeout_s":
        if _is_number(value) and math.isfinite(value) and value > 0:
            return None
        return "must be a finite number of seconds > 0, e.g. 60"
    if field_name == "max_oom_retries":
        return None if _is_int(value) and value >= 0 else "must be an integer >= 0"
    return None
