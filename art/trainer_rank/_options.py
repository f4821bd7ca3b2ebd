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
from art.megatron.recompute_ladder import RecomputeChoice
from art.megatron.settings import reject_unknown_variable
from art.trainer_rank.compute.heads import HEAD_CHUNK_TOKENS
from art.trainer_rank.decide.profiles import ENV_PROFILE_PATH
from art.trainer_rank.measuring.probe_store import default_probe_cache_dir
from art.trainer_rank.measuring.virtual_limit import ENV_TEST_MEMORY_LIMIT, test_memory_limit_bytes

ENV_PREFIX = "ART_TRAINER_RANK_"
# env name (after the prefix) -> (field, meaning)
ENV_VARIABLES: dict[str, tuple[str, str]] = {
    "PROFILE_PATH": ("profile_path", "JSON file for learned memory profiles (unset: in memory)"),
    "TEST_MEMORY_LIMIT_BYTES": (
        "test_memory_limit_bytes",
        "virtual memory limit for CPU runs: live tensor bytes past it raise OutOfMemoryError",
    ),
    "RECOMPUTE": (
        "recompute",
        "which recompute rung a grad micro-batch runs: configured (the configured policy, or "
        "decline), escalate (default: the configured policy when it fits, else the least-work "
        "rung above it that fits), adaptive (the least-work rung that fits, below the "
        "configured one too)",
    ),
    "ESCALATE_TO_FULL_RECOMPUTE": (
        "escalate_to_full_recompute",
        "false: never run another recompute than the configured one (the same as "
        "RECOMPUTE=configured; default true)",
    ),
    "COLD_START_FRACTION": (
        "cold_start_fraction",
        "first micro-batch of an unprofiled signature: this fraction of what the model admits",
    ),
    "TRUST_WINDOW": (
        "trust_window",
        "a profile is used from min observed / w to max observed x w tokens (default 2)",
    ),
    "HEAD_CHUNK_TOKENS": ("head_chunk_tokens", "tokens per output-head chunk"),
    "PROBE_LAYERS": (
        "probe_layers",
        "measure one real layer (and the head per output mix) at start-up and price with the "
        "measured coefficients instead of the default formulas (default true)",
    ),
    "FAULT_TIMEOUT_S": (
        "fault_timeout_s",
        "after a peer's collective failed, seconds to wait for the fault record that names "
        "the failing rank; also how long a rank whose caller left the micro-batch loop waits "
        "for its peers to leave too (default 60)",
    ),
    "PROBE_CACHE": (
        "probe_cache",
        "keep the probe's coefficients on disk and reuse them in later jobs when the same "
        "software measured the same model, layout and policy (default true; false: in memory "
        "only)",
    ),
    "PROBE_CACHE_DIR": (
        "probe_cache_dir",
        "directory for cached probe coefficients (unset: the profile file's directory, else "
        "$XDG_CACHE_HOME/art-trainer-rank/probes, else ~/.cache/art-trainer-rank/probes)",
    ),
}
# Upstream's test-only switches (layout anchors, hooks): accepted, nothing here reads them.
UPSTREAM_TEST_ONLY: frozenset[str] = frozenset({"TEST_HOOKS", "TEST_ANCHOR"})
assert f"{ENV_PREFIX}PROFILE_PATH" == ENV_PROFILE_PATH
assert f"{ENV_PREFIX}TEST_MEMORY_LIMIT_BYTES" == ENV_TEST_MEMORY_LIMIT

_BOOLEAN_FIELDS = ("escalate_to_full_recompute", "probe_layers", "probe_cache")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class TrainerRankOptions:
    profile_path: str | None = None
    test_memory_limit_bytes: int | None = None
    escalate_to_full_recompute: bool = True
    recompute: RecomputeChoice = RecomputeChoice.ESCALATE
    cold_start_fraction: float = 0.25
    trust_window: float = 2.0
    head_chunk_tokens: int = HEAD_CHUNK_TOKENS
    probe_layers: bool = True
    probe_cache: bool = True
    probe_cache_dir: str | None = None
    # Runtime OOMs tolerated for one call before giving up (each one shrinks what is admitted).
    max_oom_retries: int = 8
    # How long a rank whose collective failed waits for the peer's fault record, and a rank whose
    # caller left the loop waits for its peers to leave too (ranks/phases.py).
    fault_timeout_s: float = 60.0

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
        for name, raw in environ.items():
            if not name.startswith(ENV_PREFIX):
                continue
            short = name[len(ENV_PREFIX):]
            if short in UPSTREAM_TEST_ONLY:
                continue
            reject_unknown_variable(name, raw, ENV_PREFIX, ENV_VARIABLES)
            field_name = ENV_VARIABLES[short][0]
            value = _parse(name, field_name, raw)
            # Checked here, so that the error names the variable the value came from.
            problem = field_problem(field_name, value)
            if problem is not None:
                raise ValueError(f"{name}={raw!r}: {problem}")
            values[field_name] = value
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


def _parse(name: str, field_name: str, raw: str) -> Any:
    text = raw.strip()
    if field_name in ("profile_path", "probe_cache_dir"):
        return text or None
    if field_name == "test_memory_limit_bytes":
        return test_memory_limit_bytes({ENV_TEST_MEMORY_LIMIT: text})
    if field_name == "recompute":
        choice = _choice(text)
        return text if choice is None else choice
    if field_name in _BOOLEAN_FIELDS:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError(f"{name}={raw!r} is not a boolean; use true or false")
    if field_name in ("cold_start_fraction", "trust_window", "fault_timeout_s"):
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not a number") from None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
