"""Learned profiles: chord curve, trust window, misses, atomic versioned persistence."""

from __future__ import annotations

import json
import warnings

import pytest

from art.trainer_rank._profiles import PROFILE_FILE_VERSION, Profile, ProfileStore, signature


def test_curve_is_exact_at_observations_and_tight_between_them_on_a_convex_peak():
    # A convex peak, like the CPU attention scores' s^2: 10 kB + 20 B/token + 0.05 B/token^2.
    def peak(t: int) -> int:
        return int(10_000 + 20 * t + 0.05 * t * t)

    p = Profile()
    for t in (128, 256, 512, 1024):
        p.observe(t, peak(t))
    p.observe(256, peak(256) - 500)  # a smaller repeat at one size: the largest counts
    for t in (128, 256, 512, 1024):
        assert p.predict(t, 2.0) == peak(t)
    for t in range(130, 1024, 37):
        predicted = p.predict(t, 2.0)
        assert predicted >= peak(t)  # never below the convex truth between observations
        assert predicted <= 1.10 * peak(t)  # and tight (a straight line was 1.39-1.64x)
    # Below the smallest size: the smallest size's peak (peaks grow with the row).
    assert p.predict(64, 2.0) == peak(128)
    # Past the largest, inside the trust window: the secant over the observed range.
    secant = (peak(1024) - peak(128)) / (1024 - 128)
    assert p.predict(2048, 2.0) == round(peak(1024) + secant * 1024)


def test_extrapolation_is_not_blown_up_by_noise_between_close_sizes():
    p = Profile()
    for t, b in [(100, 1_000_000), (290, 2_000_000), (300, 2_400_000)]:
        p.observe(t, b)
    # The last chord's slope (40 kB/token) would predict 14.4 MB at 600 tokens; the secant
    # over the whole range (7 kB/token) gives 4.5 MB.
    assert p.predict(600, 2.0) == 2_400_000 + 7_000 * 300


def test_curve_is_refit_only_when_observations_change():
    p = Profile()
    p.observe(100, 1_000)
    p.observe(200, 2_500)
    first = p.curve()
    assert p.curve() is first
    p.observe(300, 4_000)
    assert p.curve() is not first and p.predict(300, 2.0) == 4_000


def test_single_size_is_proportional_and_trust_window_bounds_use():
    p = Profile()
    p.observe(100, 5_000)
    assert p.predict(100, 2.0) == 5_000
    assert p.predict(200, 2.0) == 10_000
    assert p.predict(201, 2.0) is None and p.predict(49, 2.0) is None


def test_miss_is_a_floor_for_larger_sizes():
    p = Profile()
    p.record_miss(300, 9_000)
    assert p.predict(299, 2.0) is None
    assert p.predict(300, 2.0) == 9_001
    p.observe(280, 1_000)
    assert p.predict(310, 2.0) == 9_001


def test_persistence_round_trip_merges_and_is_versioned(tmp_path):
    path = tmp_path / "sub" / "profiles.json"
    sig = signature(topology="t", recompute_key="selective-abc", grad_enabled=True,
                    outputs_key="logprobs", adapter="r1")
    a = ProfileStore(path)
    a.observe(sig, 64, 1_000)
    a.save()
    b = ProfileStore(path)
    assert b.has_profile(sig) and b.predict(sig, 64, 2.0) == 1_000
    b.observe(sig, 128, 1_900)
    a.record_miss(sig, 512, 50_000)
    b.save()
    a.save()  # merges with b's observation instead of clobbering it
    data = json.loads(path.read_text())
    assert data["version"] == PROFILE_FILE_VERSION
    assert data["profiles"][sig]["observations"] == [[64, 1000], [128, 1900]]
    assert data["profiles"][sig]["misses"] == [[512, 50000]]
    assert not list(path.parent.glob("*.tmp"))


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps({"version": 999, "profiles": {}}),
        json.dumps({"version": PROFILE_FILE_VERSION, "profiles": {"s": {"observations": [[1]]}}}),
    ],
)
def test_corrupt_or_mismatched_file_is_ignored_with_a_warning(tmp_path, content):
    path = tmp_path / "p.json"
    path.write_text(content)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = ProfileStore(path)
    assert store.profiles == {}
    assert any("ignoring memory profile file" in str(w.message) for w in caught)
    store.observe("s", 10, 10)
    store.save()
    assert json.loads(path.read_text())["version"] == PROFILE_FILE_VERSION


def _save_many(path: str, writer: int, start: float) -> None:
    import time

    while time.time() < start:  # start together so the saves overlap
        pass
    store = ProfileStore(path)
    for i in range(40):
        store.observe(f"w{writer}|s{i}", 64 + i, 1_000 + i)
        store.save()


def test_concurrent_saves_keep_both_writers_entries(tmp_path):
    """Two processes read-merge-replace one file 40 times each, starting together: under the
    advisory lock every entry of both survives (without it, a save that read the file before
    the other's replace drops the other's newest entries)."""
    import multiprocessing
    import time

    path = tmp_path / "profiles.json"
    start = time.time() + 0.3
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_save_many, args=(str(path), w, start)) for w in range(2)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(timeout=60)
        assert w.exitcode == 0
    final = ProfileStore(path).profiles
    for w in range(2):
        for i in range(40):
            assert final[f"w{w}|s{i}"].observations == [(64 + i, 1_000 + i)], (w, i)
