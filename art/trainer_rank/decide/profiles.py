"""Learned memory profiles: how far the memory model is off, per signature, and atomic,
versioned JSON persistence under an advisory lock.

A signature names everything that changes bytes per token: topology, the effective recompute
key, grad mode, the output mix and the adapter shape. A profile never prices a micro-batch by
itself: it keeps, for each micro-batch that ran, the measured dynamic peak next to what the
memory model predicted for that very row, and learns the correction measured / predicted
(its worst recent value and its spread). A new row, split into sequences however it is, is
priced by the memory model and then corrected, never by a tokens -> bytes curve through other
rows (one long sequence says little about 64 short ones: the model knows the difference).

The correction only ever raises the price (a profile that under-states memory, from another
run or a corrupt file, cannot admit more than the model does) and applies inside the trust
window around the sizes measured: a ratio seen on small rows says little about an s^2 term at
ten times the size, where the admission grows step by step instead. A run-time miss (an OOM at
a known usable limit) says measured / predicted exceeded limit / predicted for that row and
anything larger: a floor on the correction at any size, which ages out after
`MISS_AGE_OBSERVATIONS` later micro-batches ran, so one miss does not decline that size
forever.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PROFILE_FILE_VERSION = 2
ENV_PROFILE_PATH = "ART_TRAINER_RANK_PROFILE_PATH"
MAX_OBSERVATIONS = 64
# A miss stops raising the price after this many later micro-batches of its signature ran.
MISS_AGE_OBSERVATIONS = 16


def signature(
    *,
    topology: str,
    recompute_key: str,
    grad_enabled: bool,
    outputs_key: str,
    adapter: str,
) -> str:
    """The profile key; equal runs in different processes give equal strings."""
    return "|".join(
        (topology, recompute_key, "grad" if grad_enabled else "no-grad", outputs_key, adapter)
    )


@dataclass
class Profile:
    """Observations for one signature. observations: (packed_tokens, measured dynamic bytes,
    the memory model's predicted dynamic bytes for that row) of micro-batches that ran;
    misses: (packed_tokens, bytes it was known to exceed, predicted bytes, the number of
    observations made before it) of micro-batches that ran out of memory."""

    observations: list[tuple[int, int, int]] = field(default_factory=list)
    misses: list[tuple[int, int, int, int]] = field(default_factory=list)
    observed_total: int = 0  # observations ever made (ages the misses)

    def observe(self, packed_tokens: int, dynamic_bytes: int, predicted_bytes: int) -> None:
        self.observations.append((int(packed_tokens), int(dynamic_bytes),
                                  max(1, int(predicted_bytes))))
        del self.observations[:-MAX_OBSERVATIONS]
        self.observed_total += 1

    def record_miss(self, packed_tokens: int, exceeded_bytes: int,
                    predicted_bytes: int) -> None:
        self.misses.append((int(packed_tokens), int(exceeded_bytes),
                            max(1, int(predicted_bytes)), self.observed_total))
        del self.misses[:-MAX_OBSERVATIONS]

    @property
    def has_observations(self) -> bool:
        return bool(self.observations)

    def ratios(self) -> list[float]:
        return [measured / predicted for _, measured, predicted in self.observations]

    def correction(self) -> tuple[float, float]:
        """(worst measured / predicted seen, spread = max - min of it); (1.0, 0.0) when
        nothing was observed."""
        ratios = self.ratios()
        if not ratios:
            return 1.0, 0.0
        return max(ratios), max(ratios) - min(ratios)

    def window(self, trust_window: float) -> tuple[float, float]:
        sizes = [t for t, _, _ in self.observations]
        return min(sizes) / trust_window, max(sizes) * trust_window

    def live_misses(self) -> list[tuple[int, int, int, int]]:
        return [m for m in self.misses if self.observed_total - m[3] < MISS_AGE_OBSERVATIONS]

    def predict(self, packed_tokens: int, trust_window: float, model_bytes: int) -> int | None:
        """The corrected dynamic bytes for a row the memory model prices at `model_bytes`, or
        None when the profile has nothing to say about it."""
        factor: float | None = None
        if self.observations:
            low, high = self.window(trust_window)
            if low <= packed_tokens <= high:
                factor = max(1.0, self.correction()[0])
        # A miss at limit L for a row predicted at P proves measured / predicted > L / P for
        # that row, and for any larger one until it ages out.
        floors = [(exceeded + 1) / predicted for tokens, exceeded, predicted, _ in
                  self.live_misses() if tokens <= packed_tokens]
        if floors:
            factor = max(floors) if factor is None else max(factor, max(floors))
        return None if factor is None else int(math.ceil(model_bytes * factor))


class ProfileStore:
    """Profiles by signature, optionally backed by a JSON file."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path else None
        self.profiles: dict[str, Profile] = {}
        if self.path is not None:
            self.profiles = _read(self.path)

    def get(self, sig: str) -> Profile | None:
        return self.profiles.get(sig)

    def has_profile(self, sig: str) -> bool:
        profile = self.profiles.get(sig)
        return profile is not None and profile.has_observations

    def observe(self, sig: str, packed_tokens: int, dynamic_bytes: int,
                predicted_bytes: int) -> None:
        self.profiles.setdefault(sig, Profile()).observe(packed_tokens, dynamic_bytes,
                                                         predicted_bytes)

    def record_miss(self, sig: str, packed_tokens: int, exceeded_bytes: int,
                    predicted_bytes: int) -> None:
        self.profiles.setdefault(sig, Profile()).record_miss(packed_tokens, exceeded_bytes,
                                                             predicted_bytes)

    def predict(self, sig: str, packed_tokens: int, trust_window: float,
                model_bytes: int) -> int | None:
        profile = self.profiles.get(sig)
        return None if profile is None else profile.predict(packed_tokens, trust_window,
                                                            model_bytes)

    def save(self) -> None:
        """Merge with what is on disk (another process may have learned too), then replace the
        file atomically: a reader sees the old file or the new one, never half of one."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(self.path):
            self._merge_and_replace()

    def merge_from(self, others: list[dict[str, Profile]]) -> None:
        """These profiles become the merge of `others` (every data-parallel replica's, in DP
        rank order): the same inputs give the same profiles on every rank."""
        merged: dict[str, Profile] = {}
        for profiles in others:
            merged = merge_profiles(merged, profiles)
        self.profiles = merged

    def _merge_and_replace(self) -> None:
        assert self.path is not None
        try:
            on_disk = _load(self.path)
        except UnusableProfileFile as unusable:
            # Another version's file (or a damaged one) is kept, not overwritten: renamed
            # aside under the lock, so that one writer moves it.
            on_disk = {}
            aside = _set_aside(self.path, unusable.tag)
            warnings.warn(
                f"memory profile file {self.path}: {unusable}; kept as {aside}, and a new "
                f"version {PROFILE_FILE_VERSION} file written in its place",
                RuntimeWarning, stacklevel=3)
        except OSError:
            on_disk = {}
        merged = merge_profiles(on_disk, self.profiles)
        payload = {
            "version": PROFILE_FILE_VERSION,
            "profiles": {
                sig: {"observations": p.observations, "misses": p.misses,
                      "observed_total": p.observed_total}
                for sig, p in sorted(merged.items())
            },
        }
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(payload, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def merge_profiles(base: dict[str, Profile], new: dict[str, Profile]) -> dict[str, Profile]:
    """`base` with every observation and miss of `new` that it lacks appended (the newest kept
    when a profile is full): the storage layer's one merge, whatever a profile's rows mean."""
    merged = dict(base)
    for sig, profile in new.items():
        old = merged.get(sig, Profile())
        seen = set(old.observations)
        obs = old.observations + [o for o in profile.observations if o not in seen]
        seen_miss = set(old.misses)
        misses = old.misses + [m for m in profile.misses if m not in seen_miss]
        merged[sig] = Profile(obs[-MAX_OBSERVATIONS:], misses[-MAX_OBSERVATIONS:],
                              max(old.observed_total, profile.observed_total))
    return merged


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on `<file>.lock` for one read-merge-replace, so two processes
    saving at once cannot both read the old file and drop each other's newest entries. The
    lock is a sidecar (the data file itself is replaced, so locking it would lock nothing);
    readers need no lock because the replace is atomic."""
    with open(path.with_name(path.name + ".lock"), "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _rows(raw: object, what: str, width: int) -> list[tuple[int, ...]]:
    if not isinstance(raw, list):
        raise ValueError(f"{what} is not a list")
    out = []
    for row in raw:
        if (
            not isinstance(row, list)
            or len(row) != width
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in row)
        ):
            raise ValueError(f"{what} holds {row!r}, not {width} non-negative integers")
        out.append(tuple(row))
    return out


class UnusableProfileFile(ValueError):
    """A profile file that is not this version's JSON; `tag` names it in the file kept aside
    ("v3" for another version, "corrupt" for one that does not parse)."""

    def __init__(self, message: str, tag: str) -> None:
        super().__init__(message)
        self.tag = tag


def _load(path: Path) -> dict[str, Profile]:
    """Profiles from `path` ({} when it does not exist); UnusableProfileFile when it holds
    something else, OSError when it cannot be read."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UnusableProfileFile(f"not JSON ({exc})", "corrupt") from None
    if not isinstance(data, dict) or data.get("version") != PROFILE_FILE_VERSION:
        found = data.get("version") if isinstance(data, dict) else type(data).__name__
        tag = f"v{found}" if isinstance(found, int) and not isinstance(found, bool) else "corrupt"
        raise UnusableProfileFile(f"version {found!r}, expected {PROFILE_FILE_VERSION}", tag)
    try:
        raw = data.get("profiles")
        if not isinstance(raw, dict):
            raise ValueError("'profiles' is not an object")
        return {
            str(sig): Profile(
                _rows(entry.get("observations", []), f"{sig}.observations", 3),  # type: ignore[arg-type]
                _rows(entry.get("misses", []), f"{sig}.misses", 4),  # type: ignore[arg-type]
                int(entry.get("observed_total", 0)),
            )
            for sig, entry in raw.items()
        }
    except (ValueError, TypeError, AttributeError) as exc:
        raise UnusableProfileFile(str(exc), "corrupt") from None


def _set_aside(path: Path, tag: str) -> Path:
    """Rename `path` to a name of its own beside it (never an existing file); returns it."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    aside = path.with_name(f"{path.name}.{tag}-{stamp}-{os.getpid()}.bak")
    os.replace(path, aside)
    return aside


def _read(path: Path) -> dict[str, Profile]:
    """Profiles from `path` for a starting store; a file that cannot be used is ignored with
    a warning (learning starts again, and the first save keeps that file renamed aside)."""
    try:
        return _load(path)
    except (OSError, UnusableProfileFile) as exc:
        kept = (" it is kept, renamed aside, when profiles are next saved;"
                if isinstance(exc, UnusableProfileFile) else "")
        warnings.warn(
            f"ignoring memory profile file {path}: {exc};{kept} profiles will be re-learned",
            RuntimeWarning,
            stacklevel=3,
        )
        return {}
