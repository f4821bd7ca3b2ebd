"""Measured memory curves: exact at the probe's token counts, local quadratics between them.

Used by the layer probe (`measuring/probe.py`) for every quantity it measures."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

import torch

WINDOW = 3
# Two neighbouring three-point quadratics further apart than this (relative to the chord)
# mean the winning op changes between the points: the chord is used there.
KINK_TOLERANCE = 0.005


@dataclass(frozen=True)
class Poly:
    c0: float = 0.0
    c1: float = 0.0
    c2: float = 0.0

    def at(self, s: float) -> int:
        return int(round(self.c0 + self.c1 * s + self.c2 * s * s))

    @classmethod
    def fit(cls, tokens: Iterable[int], values: Iterable[float]) -> Poly:
        """Exact quadratic through three points (least squares through more)."""
        xs = [float(t) for t in tokens]
        ys = [float(v) for v in values]
        a = torch.tensor([[1.0, x, x * x] for x in xs], dtype=torch.float64)
        b = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
        sol = torch.linalg.lstsq(a, b).solution.squeeze(1).tolist()
        return cls(*sol)


@dataclass(frozen=True)
class Fit:
    """A measured curve: exact at the probe points, local quadratics between them, the
    quadratic through the last three points beyond.

    The peak of a layer is a maximum over its ops of polynomials in s (which op wins changes
    with s: a linear-in-s projection at small counts, the s^2 scores at large ones), so one
    quadratic fitted on all points mispredicts other counts in both directions. Between two
    neighbouring points the curve is the larger of the quadratics through the two three-point
    windows that contain both (at the ends: the one that does and its neighbour), when they
    agree (exact wherever one op's polynomial wins across both windows), never above the
    chord; where they disagree, the chord: a maximum of quadratics with non-negative s^2
    terms is convex, so the chord bounds it from above, but a chord alone lies up to
    (t2 - t1)^2 / 4 x c2 above a pure s^2 term (7% off-grid between 128 and 256 tokens).
    Beyond the last point the
    quadratic through the last three points (never below the last chord's line)
    extrapolates; below the first, the quadratic through the first three, between the first
    chord's extension (convex: a lower bound) and the first point (growing: an upper bound).
    """

    tokens: tuple[int, ...]
    values: tuple[float, ...]
    head: Poly  # quadratic through the first three points
    tail: Poly  # quadratic through the last three points

    def at(self, s: float) -> int:
        ts, vs = self.tokens, self.values
        if s <= ts[0]:
            if len(ts) < 3:
                return int(round(vs[0]))
            # Peaks grow with the row: the first point bounds everything below it.
            return int(round(min(vs[0], max(self.head.at(s), vs[0] - (ts[0] - s) * (
                (vs[1] - vs[0]) / (ts[1] - ts[0]))))))
        if s >= ts[-1]:
            if len(ts) < 2:
                return int(round(vs[-1]))
            slope = (vs[-1] - vs[-2]) / (ts[-1] - ts[-2])
            line = vs[-1] + slope * (s - ts[-1])
            quad = self.tail.at(s) if len(ts) >= 3 else line
            return int(round(max(line, quad)))
        i = bisect.bisect_right(ts, s) - 1
        i = min(i, len(ts) - 2)
        frac = (s - ts[i]) / (ts[i + 1] - ts[i])
        chord = vs[i] + frac * (vs[i + 1] - vs[i])
        # The windows containing the interval; at either end, where only one does, the
        # neighbouring window (extrapolated one interval) stands in for the missing one.
        windows = [j for j in (i - 1, i) if 0 <= j and j + 3 <= len(ts)]
        if len(windows) == 1:
            windows.append(windows[0] + (1 if windows[0] == i else -1))
        local = [_lagrange(ts[j:j + 3], vs[j:j + 3], s) for j in windows
                 if 0 <= j and j + 3 <= len(ts)]
        if len(local) < 2 or abs(local[0] - local[1]) > KINK_TOLERANCE * chord:
            # The two disagree: another op takes over the peak near here, where a quadratic
            # through the switch would dip below the truth.
            return int(round(chord))
        return int(round(min(chord, max(local))))

    @classmethod
    def fit(cls, tokens: Iterable[int], values: Iterable[float]) -> Fit:
        ts, vs = tuple(int(t) for t in tokens), tuple(float(v) for v in values)
        head = Poly.fit(ts[:WINDOW], vs[:WINDOW]) if len(ts) >= WINDOW else Poly()
        tail = Poly.fit(ts[-WINDOW:], vs[-WINDOW:]) if len(ts) >= WINDOW else Poly()
        return cls(ts, vs, head, tail)


def _lagrange(ts: tuple[int, ...], vs: tuple[float, ...], s: float) -> float:
    """The quadratic through three points, evaluated at s."""
    (t0, t1, t2), (v0, v1, v2) = ts, vs
    return (v0 * (s - t1) * (s - t2) / ((t0 - t1) * (t0 - t2))
            + v1 * (s - t0) * (s - t2) / ((t1 - t0) * (t1 - t2))
            + v2 * (s - t0) * (s - t1) / ((t2 - t0) * (t2 - t1)))
