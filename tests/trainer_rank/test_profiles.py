"""Learned profiles: envelope fit, trust window, misses, atomic versioned persistence."""

from __future__ import annotations

import json
import warnings

import pytest

from art.trainer_rank._profiles import PROFILE_FILE_VERSION, Profile, ProfileStore, signature


def test_fit_is_an_upper_envelope_of_what_was_seen():
    p = Profile()
    for t, b in [(100, 1_100), (200, 2_000), (400, 4_300)]:
        p.observe(t, b)
    rate, intercept = p.fit()
    assert all(rate * t + intercept >= b for t, b in p.observations)
    # Tight: at least one observation lies on the line.
    assert min(rate * t + intercept - b for t, b in p.observations) == pytest.approx(0, abs=1e-6)


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
