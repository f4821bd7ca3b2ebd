"""Learned memory profiles: measured dynamic peaks per signature, a curve through them (chords
between observed sizes), a trust window around the sizes observed, and atomic, versioned JSON
persistence under an advisory lock.

A signature names everything that changes bytes per token: topology, the effective recompute
key, grad mode, the output mix and the adapter shape. Admission uses max(memory model,
profile) inside the trust window; outside it only the memory model speaks, because peaks
measured on small micro-batches say little about an s^2 term at ten times the size.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from art.trainer_rank._memory.probe import Fit

PROFILE_FILE_VERSION = 1
ENV_PROFILE_PATH = "ART_TRAINER_RANK_PROFILE_PATH"
MAX_OBSERVATIONS = 64


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
    """Observations for one signature. observations: (packed_tokens, measured dynamic bytes)
    of micro-batches that ran; misses: (packed_tokens, bytes it was known to exceed) of
    micro-batches that ran out of memory."""

    observations: list[tuple[int, int]] = field(default_factory=list)
    misses: list[tuple[int, int]] = field(default_factory=list)

    def observe(self, packed_tokens: int, dynamic_bytes: int) -> None:
        self.observations.append((int(packed_tokens), int(dynamic_bytes)))
        del self.observations[:-MAX_OBSERVATIONS]

    def record_miss(self, packed_tokens: int, exceeded_bytes: int) -> None:
        self.misses.append((int(packed_tokens), int(exceeded_bytes)))
        del self.misses[:-MAX_OBSERVATIONS]

    @property
    def has_observations(self) -> bool:
        return bool(self.observations)

    def curve(self) -> Fit:
        """The measured peaks as a curve: through the largest peak seen at each size and
        chords between neighbouring sizes (the probe's `Fit`, used inside the observed range).

        Peaks are convex in the packed length (a maximum of polynomials in s with
        non-negative s^2 terms: CPU attention scores grow with s^2), and a convex curve lies
        on or below its chords, so between observations the prediction is a safe and tight
        bound; a straight line fitted through all of them lay 39-64% above the truth between
        its points (bench/RESULTS.md). Cached until the observations change."""
        if not self.observations:
            raise ValueError("curve: no observations")
        stamp = (len(self.observations), self.observations[0], self.observations[-1])
        cached = self.__dict__.get("_curve")
        if cached is not None and cached[0] == stamp:
            return cached[1]
        peaks: dict[int, int] = {}
        for tokens, peak in self.observations:
            peaks[tokens] = max(peak, peaks.get(tokens, 0))
        sizes = sorted(peaks)
        curve = Fit.fit(sizes, [peaks[t] for t in sizes])
        self.__dict__["_curve"] = (stamp, curve)
        return curve

    def _beyond(self, curve: Fit, packed_tokens: int) -> int:
        """Past the largest size seen. Only a lower bound is knowable from the points (a convex
        curve rises above every chord's extension); admission takes the larger of this and the
        memory model, which prices the curvature. The slope is the secant over the whole
        observed range: noise between two close sizes cannot blow it up, as a quadratic or the
        last chord through them would (and did: 168 MiB predicted for a 27 MiB item)."""
        ts, vs = curve.tokens, curve.values
        if len(ts) == 1:
            # One size seen: proportional growth is the only slope it offers.
            return int(vs[0] * packed_tokens / ts[0] + 0.5)
        slope = max(0.0, (vs[-1] - vs[0]) / (ts[-1] - ts[0]))
        return int(vs[-1] + slope * (packed_tokens - ts[-1]) + 0.5)

    def window(self, trust_window: float) -> tuple[float, float]:
        sizes = [t for t, _ in self.observations]
        return min(sizes) / trust_window, max(sizes) * trust_window

    def predict(self, packed_tokens: int, trust_window: float) -> int | None:
        """Predicted dynamic bytes, or None when the size is outside what the profile covers."""
        predicted: int | None = None
        if self.observations:
            low, high = self.window(trust_window)
            if low <= packed_tokens <= high:
                curve = self.curve()
                first_tokens, last_tokens = curve.tokens[0], curve.tokens[-1]
                if packed_tokens <= first_tokens:
                    # Peaks grow with the row: the smallest size seen bounds everything below.
                    predicted = int(curve.values[0])
                elif packed_tokens > last_tokens:
                    predicted = self._beyond(curve, packed_tokens)
                else:
                    predicted = curve.at(packed_tokens)
        # A miss at T bytes proves that anything at least as large needs more than that.
        floor = max((b + 1 for t, b in self.misses if t <= packed_tokens), default=None)
        if floor is not None:
            predicted = floor if predicted is None else max(predicted, floor)
        return predicted


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

    def observe(self, sig: str, packed_tokens: int, dynamic_bytes: int) -> None:
        self.profiles.setdefault(sig, Profile()).observe(packed_tokens, dynamic_bytes)

    def record_miss(self, sig: str, packed_tokens: int, exceeded_bytes: int) -> None:
        self.profiles.setdefault(sig, Profile()).record_miss(packed_tokens, exceeded_bytes)

    def predict(self, sig: str, packed_tokens: int, trust_window: float) -> int | None:
        profile = self.profiles.get(sig)
        return None if profile is None else profile.predict(packed_tokens, trust_window)

    def save(self) -> None:
        """Merge with what is on disk (another process may have learned too), then replace the
        file atomically: a reader sees the old file or the new one, never half of one."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(self.path):
            self._merge_and_replace()

    def _merge_and_replace(self) -> None:
        assert self.path is not None
        merged = _read(self.path, warn=False)
        for sig, profile in self.profiles.items():
            old = merged.get(sig, Profile())
            seen = set(old.observations)
            obs = old.observations + [o for o in profile.observations if o not in seen]
            seen_miss = set(old.misses)
            misses = old.misses + [m for m in profile.misses if m not in seen_miss]
            merged[sig] = Profile(obs[-MAX_OBSERVATIONS:], misses[-MAX_OBSERVATIONS:])
        payload = {
            "version": PROFILE_FILE_VERSION,
            "profiles": {
                sig: {"observations": p.observations, "misses": p.misses}
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


def _pairs(raw: object, what: str) -> list[tuple[int, int]]:
    if not isinstance(raw, list):
        raise ValueError(f"{what} is not a list")
    out = []
    for pair in raw:
        if (
            not isinstance(pair, list)
            or len(pair) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in pair)
        ):
            raise ValueError(f"{what} holds {pair!r}, not [tokens, bytes]")
        out.append((pair[0], pair[1]))
    return out


def _read(path: Path, *, warn: bool = True) -> dict[str, Profile]:
    """Profiles from `path`; a missing file is empty, a corrupt or other-version one is
    ignored with a warning (learning starts again; the file is replaced on the next save)."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != PROFILE_FILE_VERSION:
            found = data.get("version") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"version {found!r}, expected {PROFILE_FILE_VERSION}")
        raw = data.get("profiles")
        if not isinstance(raw, dict):
            raise ValueError("'profiles' is not an object")
        return {
            str(sig): Profile(
                _pairs(entry.get("observations", []), f"{sig}.observations"),
                _pairs(entry.get("misses", []), f"{sig}.misses"),
            )
            for sig, entry in raw.items()
        }
    except (OSError, ValueError, AttributeError) as exc:
        if warn:
            warnings.warn(
                f"ignoring memory profile file {path}: {exc}; profiles will be re-learned and "
                "the file replaced",
                RuntimeWarning,
                stacklevel=3,
            )
        return {}
