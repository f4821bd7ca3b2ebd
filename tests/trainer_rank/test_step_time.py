"""The step-time line adaptive recompute weighs its packings with: fitted from the grad
micro-batches that ran, robust to a slow outlier, and only once the times can tell the fixed
part from the per-FLOP part."""

from __future__ import annotations

import pytest

from art.trainer_rank.decide.step_time import (
    KEPT_OBSERVATIONS,
    MicroBatchTime,
    StepTimes,
    fit_step_time,
)


def _time(work_flops: float, seconds: float, recomputed_share: float = 0.0) -> MicroBatchTime:
    """A micro-batch of `work_flops` (forward x 3 + recompute), `recomputed_share` of its
    forward re-run."""
    forward = work_flops / (3 + recomputed_share)
    return MicroBatchTime(forward, forward * recomputed_share, seconds)


def test_work_is_three_forwards_and_the_recompute() -> None:
    assert MicroBatchTime(2e9, 1e9, 0.5).work_flops == 7e9


def test_the_line_recovers_a_fixed_and_a_per_flop_part() -> None:
    times = StepTimes()
    for work, share in ((1e9, 0.0), (2e9, 1.0), (3e9, 0.5), (5e9, 0.25)):
        times = times.with_time(_time(work, 0.25 + 2e-10 * work, share))
    fit = times.fit()
    assert fit is not None and fit.observations == 4
    assert fit.fixed_seconds == pytest.approx(0.25)
    assert fit.seconds_per_flop == pytest.approx(2e-10)
    assert fit.predict_seconds(1e9, 1e9) == pytest.approx(0.25 + 0.8)


def test_a_micro_batch_far_slower_than_the_line_is_left_out() -> None:
    times = [_time(w, 0.1 + 1e-10 * w + jitter)
             for w, jitter in ((1e9, 0.002), (2e9, -0.001), (3e9, 0.001), (4e9, -0.002),
                               (5e9, 0.0), (6e9, 0.001))]
    slow = _time(2.5e9, 3.0)  # shared the machine with something else
    fit = fit_step_time([*times, slow])
    assert fit is not None and fit.observations == len(times)
    assert fit.fixed_seconds == pytest.approx(0.1, abs=0.01)
    assert fit.seconds_per_flop == pytest.approx(1e-10, rel=0.05)


def test_no_line_until_the_work_is_spread_and_the_slope_positive() -> None:
    alike = [_time(1e9 * (1 + 0.01 * k), 1.0 + 0.1 * k) for k in range(5)]
    assert fit_step_time(alike) is None  # work within 4%: cannot separate the parts
    assert fit_step_time(alike[:2]) is None
    falling = [_time(w, 3.0 - w / 1e9) for w in (1e9, 2e9, 3e9)]
    assert fit_step_time(falling) is None


def test_a_negative_fixed_part_is_noise_and_the_line_goes_through_the_origin() -> None:
    fit = fit_step_time([_time(w, 1e-9 * w - 0.1) for w in (1e9, 2e9, 4e9)])
    assert fit is not None and fit.fixed_seconds == 0.0
    assert fit.seconds_per_flop > 0


def test_only_the_newest_times_are_kept() -> None:
    times = StepTimes()
    for k in range(KEPT_OBSERVATIONS + 5):
        times = times.with_time(MicroBatchTime(1e9 + k, 0.0, 1.0))
    assert len(times.times) == KEPT_OBSERVATIONS
    assert times.times[0].forward_flops == 1e9 + 5
