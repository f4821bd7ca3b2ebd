"""Learned memory profiles: measured dynamic peaks per signature, a fitted per-token line, a
trust window around the sizes observed, and atomic, versioned JSON persistence.

A signature names everything that changes bytes per token: topology, the effective recompute
key, grad mode, the output mix and the adapter shape. Admission uses max(memory model,
profile) inside the trust window; outside it only the memory model speaks, because a line fitted
on small micro-batches says little about an s^2 term at ten times the size.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

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

    def fit(self) -> tuple[float, float]:
        """(bytes per token, intercept bytes): least squares, then the intercept raised so the
        line lies on or above every observation (a profile must not under-predict what it saw)."""
        if not self.observations:
            raise ValueError("fit: no observations")
        ts = [float(t) for t, _ in self.observations]
        bs = [float(b) for _, b in self.observations]
        n = len(ts)
        mean_t, mean_b = sum(ts) / n, sum(bs) / n
        var_t = sum((t - mean_t) ** 2 for t in ts)
        if var_t == 0.0:
            # One size seen: proportional through the origin is the only honest slope.
            rate = max(bs) / max(ts[0], 1.0)
        else:
            rate = sum((t - mean_t) * (b - mean_b) for t, b in zip(ts, bs)) / var_t
            rate = max(rate, 0.0)
        intercept = max(b - rate * t for t, b in zip(ts, bs))
        return rate, intercept

    def window(self, trust_window: float) -> tuple[float, float]:
        sizes = [t for t, _ in self.observations]
        return min(sizes) / trust_window, max(sizes) * trust_window

    def predict(self, packed_tokens: int, trust_window: float) -> int | None:
        """Predicted dynamic bytes, or None when the size is outside what the profile covers."""
        predicted: int | None = None
        if self.observations:
            low, high = self.window(trust_window)
            if low <= packed_tokens <= high:
                rate, intercept = self.fit()
                predicted = int(rate * packed_tokens + intercept + 0.5)
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
        self.path.parent.mkdir(parents=True, exist_ok=True)
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
