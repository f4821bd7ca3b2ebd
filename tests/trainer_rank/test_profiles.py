"""Learned profiles: a correction of the memory model, trust window, misses that age out,
atomic versioned persistence."""

from __future__ import annotations

import json
import warnings

import pytest

from art.trainer_rank.decide.profiles import (
    MISS_AGE_OBSERVATIONS,
    PROFILE_FILE_VERSION,
    Profile,
    ProfileStore,
    signature,
)


def test_profile_is_a_correction_of_the_model_not_a_curve_through_other_rows():
    p = Profile()
    # A long single sequence measured 2% above what the model predicted for it.
    p.observe(2048, 102_000_000, 100_000_000)
    assert p.correction() == (1.02, 0.0)
    # A differently split row of half the size: the model prices it (here 30 MB: short
    # sequences) and the profile corrects that; it is never priced off the 2,048-token peak.
    assert p.predict(1024, 2.0, 30_000_000) == 30_600_000
    # Outside the trust window the profile says nothing: the model alone speaks.
    assert p.predict(5000, 2.0, 300_000_000) is None


def test_correction_takes_the_worst_ratio_and_reports_its_spread_and_never_lowers():
    p = Profile()
    for tokens, measured, predicted in ((100, 1_050, 1_000), (200, 1_900, 2_000),
                                        (300, 3_150, 3_000)):
        p.observe(tokens, measured, predicted)
    worst, spread = p.correction()
    assert worst == 1.05 and abs(spread - 0.1) < 1e-12
    assert p.predict(250, 2.0, 2_000) == 2_100
    over = Profile()
    over.observe(100, 500, 1_000)  # the model over-predicts 2x: the price stays the model's
    assert over.predict(100, 2.0, 1_000) == 1_000


def test_miss_is_a_floor_for_larger_rows_and_ages_out():
    p = Profile()
    p.record_miss(300, 9_000, 6_000)  # ran out at 9,000 usable where the model said 6,000
    assert p.predict(299, 2.0, 5_000) is None
    assert p.predict(300, 2.0, 6_000) == 9_001
    assert p.predict(600, 2.0, 12_000) == 18_002  # the ratio carries to larger rows
    for _ in range(MISS_AGE_OBSERVATIONS - 1):
        p.observe(100, 1_000, 1_000)
    assert p.predict(300, 2.0, 6_000) == 9_001
    p.observe(100, 1_000, 1_000)
    # After enough later micro-batches the miss no longer declines that size.
    assert p.predict(300, 2.0, 6_000) is None


def test_persistence_round_trip_merges_and_is_versioned(tmp_path):
    path = tmp_path / "sub" / "profiles.json"
    sig = signature(topology="t", recompute_key="selective-abc", grad_enabled=True,
                    outputs_key="logprobs", adapter="r1")
    a = ProfileStore(path)
    a.observe(sig, 64, 1_000, 900)
    a.save()
    b = ProfileStore(path)
    assert b.has_profile(sig) and b.predict(sig, 64, 2.0, 900) == 1_000
    b.observe(sig, 128, 1_900, 2_000)
    a.record_miss(sig, 512, 50_000, 40_000)
    b.save()
    a.save()  # merges with b's observation instead of clobbering it
    data = json.loads(path.read_text())
    assert data["version"] == PROFILE_FILE_VERSION
    assert data["profiles"][sig]["observations"] == [[64, 1000, 900], [128, 1900, 2000]]
    assert data["profiles"][sig]["misses"] == [[512, 50000, 40000, 1]]
    assert not list(path.parent.glob("*.tmp"))


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps({"version": 999, "profiles": {}}),
        json.dumps({"version": PROFILE_FILE_VERSION, "profiles": {"s": {"observations": [[1]]}}}),
    ],
)
def test_corrupt_or_mismatched_file_is_ignored_and_kept_aside(tmp_path, content):
    path = tmp_path / "p.json"
    path.write_text(content)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = ProfileStore(path)
    assert store.profiles == {}
    assert any("ignoring memory profile file" in str(w.message) for w in caught)
    store.observe("s", 10, 10, 10)
    with pytest.warns(RuntimeWarning, match="kept as ") as saved:
        store.save()
    assert json.loads(path.read_text())["version"] == PROFILE_FILE_VERSION
    # The other file is not overwritten: renamed aside, byte for byte, where the warning says.
    aside = [p for p in tmp_path.iterdir() if p.name.endswith(".bak")]
    assert len(aside) == 1 and aside[0].read_text() == content
    assert str(aside[0]) in str(saved[0].message)


def _save_many(path: str, writer: int, start: float) -> None:
    import time

    while time.time() < start:  # start together so the saves overlap
        pass
    store = ProfileStore(path)
    for i in range(40):
        store.observe(f"w{writer}|s{i}", 64 + i, 1_000 + i, 1_000)
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
            assert final[f"w{w}|s{i}"].observations == [(64 + i, 1_000 + i, 1_000)], (w, i)
