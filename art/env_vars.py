"""Environment variables as declarations: each variable is declared once (its name, the field it
sets, its parser, its default and README's text for it), values are read in one vocabulary of
none-words and booleans, and one loader reads a prefix's variables out of an environment.

The vocabulary, the same for every variable of every prefix:
- `none`, `null`, `off`, `disable`, `disabled`, `empty` (any case) and the empty string mean
  "explicitly unset": a variable whose field takes None gets None, any other its default;
- for a boolean, `0`, `false`, `no`, `off`, `disable`, `disabled` are false (anyone writing
  "off" for a switch means false), `1`, `true`, `yes`, `on`, `enable`, `enabled` true, and the
  other none-words mean "use the default".
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

UNSET_WORDS: frozenset[str] = frozenset(
    {"none", "null", "off", "disable", "disabled", "empty", ""})
TRUE_WORDS: frozenset[str] = frozenset({"1", "true", "yes", "on", "enable", "enabled"})
FALSE_WORDS: frozenset[str] = frozenset({"0", "false", "no", "off", "disable", "disabled"})


class Unset(Enum):
    """What a none-word parses to: distinct from None (a value) and from "absent"."""

    UNSET = "unset"


UNSET = Unset.UNSET

# (how the message names the variable, the raw text) -> the value, or UNSET for a none-word.
# A parser raises ValueError naming the variable and the value, and what to write instead.
Parser = Callable[[str, str], Any]


def is_unset_word(raw: str) -> bool:
    return raw.strip().lower() in UNSET_WORDS


def parse_bool(variable: str, raw: str) -> bool | Unset:
    text = raw.strip().lower()
    if text in FALSE_WORDS:
        return False
    if text in TRUE_WORDS:
        return True
    if text in UNSET_WORDS:
        return UNSET
    raise ValueError(
        f"{variable}={raw!r} is not a boolean; use true/false (1/0, yes/no, on/off) or none "
        "for the default")


def int_at_least(minimum: int) -> Parser:
    """Whole numbers >= `minimum`."""

    def parse(variable: str, raw: str) -> int | Unset:
        text = raw.strip().lower()
        if text in UNSET_WORDS:
            return UNSET
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{variable}={raw!r} is not an integer; use a whole number >= "
                             f"{minimum} or none") from None
        if value < minimum:
            raise ValueError(f"{variable}={raw!r} must be >= {minimum} (or none)")
        return value

    return parse


def parse_int(variable: str, raw: str) -> int | Unset:
    """A whole number; its range is the field's own check."""
    text = raw.strip().lower()
    if text in UNSET_WORDS:
        return UNSET
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{variable}={raw!r} is not an integer") from None


def parse_number(variable: str, raw: str) -> float | Unset:
    """A real number; its range is the field's own check."""
    text = raw.strip().lower()
    if text in UNSET_WORDS:
        return UNSET
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{variable}={raw!r} is not a number") from None


def parse_byte_count(variable: str, raw: str) -> int | Unset:
    """A positive byte count, as an integer or in float notation (268435456, 2.5e8)."""
    text = raw.strip().lower()
    if text in UNSET_WORDS:
        return UNSET
    try:
        value = int(float(text)) if any(c in text for c in ".e") else int(text)
    except (ValueError, OverflowError):  # OverflowError: "1e999"
        raise ValueError(f"{variable}={raw!r} is not a byte count; set a positive integer such "
                         "as 268435456 (256 MiB) or unset it") from None
    if value <= 0:
        raise ValueError(f"{variable}={raw!r} must be a positive byte count; set one such as "
                         "268435456 (256 MiB) or unset it")
    return value


def parse_text(variable: str, raw: str) -> str | Unset:
    """Free text such as a path (the field checks it); a none-word is unset."""
    return UNSET if is_unset_word(raw) else raw.strip()


def one_of(choices: Iterable[str]) -> Parser:
    """One word of `choices` (any case)."""
    allowed = tuple(choices)

    def parse(variable: str, raw: str) -> str | Unset:
        text = raw.strip().lower()
        if text in UNSET_WORDS:
            return UNSET
        if text not in allowed:
            raise ValueError(f"{variable}={raw!r} is not one of {', '.join(allowed)}, none")
        return text

    return parse


def list_of(allowed: Iterable[str]) -> Parser:
    """A comma list of distinct words of `allowed` (any case), with the closest word suggested
    for one that is not."""
    words = tuple(allowed)

    def parse(variable: str, raw: str) -> tuple[str, ...] | Unset:
        text = raw.strip().lower()
        if text in UNSET_WORDS:
            return UNSET
        items = [item.strip() for item in text.split(",")]
        if any(not item for item in items):
            raise ValueError(f"{variable}={raw!r} has an empty item; write a comma list like "
                             f"{','.join(words[:2])}")
        unknown = [item for item in items if item not in words]
        if unknown:
            hints = []
            for item in unknown:
                close = difflib.get_close_matches(item, words, n=1)
                hints.append(f"{item!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ValueError(f"{variable}={raw!r}: unknown module(s) {', '.join(hints)}; "
                             f"allowed: {', '.join(words)}")
        if len(set(items)) != len(items):
            raise ValueError(f"{variable}={raw!r} lists a module twice")
        return tuple(items)

    return parse


def any_text(variable: str, raw: str) -> str:
    """Accepted as written (a variable nothing here reads)."""
    return raw


class Effect(Enum):
    """What this build does with a variable it accepts."""

    APPLIED = "applied"  # sets a field of the record its table loads
    ELSEWHERE = "elsewhere"  # validated here, read by another module (e.g. the seed)
    NO_EFFECT = "no effect"  # an upstream name that changes nothing here: validated, listed


@dataclass(frozen=True)
class EnvVar:
    """One variable, declared once: README's table row is (`prefix + name`, meaning,
    default_text), checked by a test."""

    name: str  # without the prefix
    parse: Parser
    meaning: str
    field: str = ""  # the record field it sets (APPLIED only)
    default: Any = None
    default_text: str = ""
    effect: Effect = Effect.APPLIED
    # A none-word gives None where the field takes None, else the default.
    nullable: bool = False

    def value_of(self, parsed: Any) -> Any:
        if parsed is not UNSET:
            return parsed
        return None if self.nullable else self.default


class UnknownName(Enum):
    """What an unknown name under the prefix is."""

    ERROR = "error"  # always an error, with the closest known name
    # an error when it is a close misspelling of a known name, else a warning (upstream ignores
    # names it does not know)
    ERROR_IF_CLOSE = "error if close"


@dataclass(frozen=True)
class EnvValue:
    """A variable as read: how messages name it, the raw text, the parsed value (UNSET for a
    none-word)."""

    variable: EnvVar
    label: str
    raw: str
    parsed: Any

    @property
    def value(self) -> Any:
        return self.variable.value_of(self.parsed)

    @property
    def source(self) -> str:
        return f"{self.label}={self.raw}"


@dataclass(frozen=True)
class EnvReading:
    """What one prefix's variables said in one environment."""

    applied: tuple[EnvValue, ...]
    no_effect: tuple[tuple[str, str], ...]  # ("PREFIX_NAME", raw), sorted

    def by_field(self) -> dict[str, EnvValue]:
        return {v.variable.field: v for v in self.applied}


@dataclass(frozen=True)
class EnvTable:
    """Every variable under one prefix: the declarations, upstream's aliases and retired names,
    names accepted and ignored, and what an unknown name is."""

    prefix: str
    variables: tuple[EnvVar, ...]
    aliases: Mapping[str, str] = field(default_factory=dict)  # name -> the name it stands for
    retired: Mapping[str, str] = field(default_factory=dict)  # name -> what to do instead
    ignored: frozenset[str] = frozenset()  # accepted, never read, never listed
    unknown: UnknownName = UnknownName.ERROR
    misspelling_cutoff: float = 0.8

    def __post_init__(self) -> None:
        names = [v.name for v in self.variables]
        assert len(names) == len(set(names)), names
        fields_ = [v.field for v in self.applied_variables()]
        assert all(fields_) and len(fields_) == len(set(fields_)), fields_

    def applied_variables(self) -> tuple[EnvVar, ...]:
        return tuple(v for v in self.variables if v.effect is Effect.APPLIED)

    def variable(self, name: str) -> EnvVar:
        return next(v for v in self.variables if v.name == name)

    def for_field(self, field_name: str) -> EnvVar:
        return next(v for v in self.applied_variables() if v.field == field_name)

    def default(self, field_name: str) -> Any:
        return self.for_field(field_name).default

    def known_names(self) -> list[str]:
        return [*(v.name for v in self.variables), *self.aliases]

    def read(self, env: Mapping[str, str], labels: Mapping[str, str] | None = None
             ) -> EnvReading:
        """Parse every `prefix*` variable of `env`. `labels`: full variable name -> how the
        user gave that value (e.g. a command-line flag the caller turned into the variable), so
        that messages and sources name it. Raises ValueError on a bad value, a retired name, an
        alias that disagrees with its name, or (per `unknown`) an unknown name."""
        labels = labels or {}
        declared = {v.name: v for v in self.variables}
        # Names first, values after: a misspelt name is reported before any bad value.
        named: list[tuple[str, str, EnvVar]] = []
        for name, raw in env.items():
            if not name.startswith(self.prefix):
                continue
            short = name[len(self.prefix):]
            if short in self.ignored:
                continue
            if short in self.retired:
                raise ValueError(f"{name} is retired: {self.retired[short]}")
            if short in self.aliases:
                target = self.prefix + self.aliases[short]
                if target in env and env[target] != raw:
                    raise ValueError(f"{name}={raw!r} and {target}={env[target]!r} name the "
                                     "same setting; set one")
                short = self.aliases[short]
                if target in env:
                    continue  # read once, under its own name
                name = target
            variable = declared.get(short)
            if variable is None:
                self._unknown(name, raw)
                continue
            named.append((name, raw, variable))
        applied: list[EnvValue] = []
        no_effect: list[tuple[str, str]] = []
        for name, raw, variable in named:
            label = labels.get(name, name)
            parsed = variable.parse(label, raw)
            if variable.effect is Effect.NO_EFFECT:
                no_effect.append((name, raw))
            elif variable.effect is Effect.APPLIED:
                applied.append(EnvValue(variable, label, raw, parsed))
        order = {v.name: i for i, v in enumerate(self.variables)}
        applied.sort(key=lambda v: order[v.variable.name])
        return EnvReading(tuple(applied), tuple(sorted(no_effect)))

    def _unknown(self, name: str, raw: str) -> None:
        known = self.known_names()
        short = name[len(self.prefix):]
        if self.unknown is UnknownName.ERROR:
            close = difflib.get_close_matches(short, known, n=1, cutoff=0.5)
            hint = f"did you mean {self.prefix}{close[0]}? " if close else ""
            raise ValueError(f"unknown variable {name}={raw!r}: {hint}known variables: "
                             f"{', '.join(self.prefix + k for k in known)}")
        cleaned = short.strip().upper()
        close = difflib.get_close_matches(cleaned, known, n=1, cutoff=self.misspelling_cutoff)
        if cleaned in known or close:
            suggestion = cleaned if cleaned in known else close[0]
            raise ValueError(
                f"unknown variable {name}={raw!r}: did you mean {self.prefix}{suggestion}? (a "
                "misspelt name would silently leave the setting at its default)")
        warnings.warn(f"{name}={raw!r} is not a variable this build or upstream reads; ignored",
                      stacklevel=4)

    def markdown_rows(self) -> list[str]:
        """README's table rows for the applied variables, in declaration order."""
        return [f"| `{self.prefix}{v.name}` | {v.meaning} | {v.default_text} |"
                for v in self.applied_variables()]
