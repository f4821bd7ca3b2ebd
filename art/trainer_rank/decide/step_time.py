"""How long a grad micro-batch takes, learnt from the ones that ran: seconds = fixed + per-FLOP
x work, where work is the micro-batch's forward, its backward (twice the forward) and the
forward FLOPs its recompute re-runs (`RecomputeLadder.work_flops`).

`adaptive` recompute weighs two plans with it (decide/admission.py): packing under the
least-work rung the first item fits alone (less recompute, smaller micro-batches), against
packing as the configured policy does and then lowering the rung as far as that micro-batch
fits (fewer micro-batches). What a micro-batch costs beside its FLOPs (launches, the head's
and the loss's Python, the optimizer's hooks, collectives) is the fixed part; which plan is
faster per token depends on it, and only timing tells it.

The times come from every rank of a replica as their maximum (`_micro_batch_run.caller_peak`),
so every rank fits the same line and plans alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

# Observations kept (the newest): enough to average out noise, few enough to follow a change.
KEPT_OBSERVATIONS = 32
# A line needs this many micro-batches, spread over at least this ratio of work.
MIN_OBSERVATIONS = 3
MIN_WORK_SPREAD = 1.25
# A time more than this many standard deviations (from the median absolute deviation of the
# residuals) above the line is an outlier, and the line is fitted again without it.
SLOW_OUTLIER_SIGMAS = 3.0
MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class MicroBatchTime:
    """One grad micro-batch that ran: its forward FLOPs, the forward FLOPs its recompute
    re-ran, and its wall time from the start of its forward to the caller asking for the next
    one (the caller's loss and backward included)."""

    forward_flops: float
    recomputed_flops: float
    seconds: float

    @property
    def work_flops(self) -> float:
        """Forward, backward (twice the forward) and recompute."""
        return micro_batch_work_flops(self.forward_flops, self.recomputed_flops)


def micro_batch_work_flops(forward_flops: float, recomputed_flops: float) -> float:
    return 3 * forward_flops + recomputed_flops


@dataclass(frozen=True)
class StepTimeFit:
    """seconds = fixed_seconds + seconds_per_flop x work."""

    fixed_seconds: float
    seconds_per_flop: float
    observations: int

    def predict_seconds(self, forward_flops: float, recomputed_flops: float) -> float:
        return self.predict_work_seconds(micro_batch_work_flops(forward_flops, recomputed_flops))

    def predict_work_seconds(self, work_flops: float) -> float:
        return self.fixed_seconds + self.seconds_per_flop * work_flops

    @property
    def summary(self) -> str:
        return (f"{self.fixed_seconds * 1e3:.1f} ms + {self.seconds_per_flop * 1e12:.2f} s/TFLOP "
                f"({self.observations} micro-batches)")


@dataclass(frozen=True)
class StepTimes:
    """The newest grad micro-batches' times (a value: `with_time` returns a new record)."""

    times: tuple[MicroBatchTime, ...] = ()

    def with_time(self, time: MicroBatchTime) -> StepTimes:
        return StepTimes((*self.times, time)[-KEPT_OBSERVATIONS:])

    def fit(self) -> StepTimeFit | None:
        """The line through these times, fitted once per record (every plan reads it)."""
        return self._line

    @cached_property
    def _line(self) -> StepTimeFit | None:
        return fit_step_time(self.times)


def fit_step_time(times: Sequence[MicroBatchTime]) -> StepTimeFit | None:
    """The least-squares line through `times`, without the ones far slower than a robust
    line (Theil-Sen: the median slope over pairs) predicts: a micro-batch that shared the
    machine, or met a garbage collection, says nothing about the next. None while they cannot
    tell the fixed part from the per-FLOP part (too few, or their work too alike) or the slope
    is not positive."""
    usable = [t for t in times if t.work_flops > 0 and t.seconds > 0]
    if not _separable(usable):
        return None
    slopes = [(b.seconds - a.seconds) / (b.work_flops - a.work_flops)
              for i, a in enumerate(usable) for b in usable[i + 1:]
              if b.work_flops != a.work_flops]
    slope = statistics.median(slopes)
    fixed = statistics.median(t.seconds - slope * t.work_flops for t in usable)
    residuals = [t.seconds - fixed - slope * t.work_flops for t in usable]
    middle = statistics.median(residuals)
    spread = MAD_TO_SIGMA * statistics.median(abs(r - middle) for r in residuals)
    if spread > 0:
        usable = [t for t, r in zip(usable, residuals)
                  if r <= middle + SLOW_OUTLIER_SIGMAS * spread]
    return _line(usable)


def _separable(times: Sequence[MicroBatchTime]) -> bool:
    """Enough times, spread enough in work, to tell a fixed part from a per-FLOP part."""
    if len(times) < MIN_OBSERVATIONS:
        return False
    works = [t.work_flops for t in times]
    return max(works) >= MIN_WORK_SPREAD * min(works)


def _line(times: Sequence[MicroBatchTime]) -> StepTimeFit | None:
    """Least squares; a negative fixed part is noise: the line then goes through the origin."""
    if not _separable(times):
        return None
    works = [t.work_flops for t in times]
    n = float(len(times))
    mean_w = sum(works) / n
    mean_t = sum(t.seconds for t in times) / n
    var_w = sum((w - mean_w) ** 2 for w in works)
    slope = sum((t.work_flops - mean_w) * (t.seconds - mean_t) for t in times) / var_w
    if slope <= 0:
        return None
    fixed = mean_t - slope * mean_w
    if fixed < 0:
        fixed = 0.0
        slope = sum(t.work_flops * t.seconds for t in times) / sum(w * w for w in works)
    return StepTimeFit(fixed, slope, len(times))
