"""Profiles under concurrency: processes saving the same profile file at the same time never
leave it corrupt (each save is a write to a private temp file, then an atomic os.replace),
and a reader never sees half a file; a half-written file or a stray temp file is ignored."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
import warnings
from pathlib import Path

import pytest
from _reliability import write_counts

from art.trainer_rank.decide.profiles import PROFILE_FILE_VERSION, ProfileStore

SAVES_PER_WRITER = 80


def _writer(path: str, writer: int, start: float) -> None:
    while time.time() < start:  # start together so the saves really overlap
        pass
    for i in range(SAVES_PER_WRITER):
        # Each save is a job's first: a store that holds only what it learned itself (its
        # own signature, and one both writers observe), so an observation another save
        # dropped from the file comes back with no later save.
        store = ProfileStore(None)
        store.path = Path(path)
        store.observe(f"writer{writer}|save{i}", 64 + i, 1000 * (i + 1), 900 * (i + 1))
        store.observe("shared|sig", 32 * (writer + 1), 500 + i, 500)
        store.save()


def test_concurrent_writers_never_corrupt_the_file(tmp_path):
    path = tmp_path / "profiles.json"
    start = time.time() + 0.5
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_writer, args=(str(path), w, start)) for w in range(2)]
    for p in writers:
        p.start()
    reads = parsed = 0
    while any(p.is_alive() for p in writers):
        if not path.exists():
            continue
        reads += 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a warning here would mean a torn or invalid file
            store = ProfileStore(path)
        data = json.loads(path.read_text())
        assert data["version"] == PROFILE_FILE_VERSION
        parsed += bool(store.profiles)
    for p in writers:
        p.join(timeout=60)
        assert p.exitcode == 0
    final = ProfileStore(path)
    assert final.profiles, "nothing was saved"
    # profiles.json.lock is the advisory lock's sidecar (kept: unlinking it would race).
    leftovers = [f.name for f in tmp_path.iterdir()
                 if f.name not in ("profiles.json", "profiles.json.lock")]
    assert leftovers == [], f"temp files left behind: {leftovers}"
    # Merge-on-save holds an advisory lock around read-merge-replace: no save drops what
    # another wrote, so every save's signature of both writers is there.
    kept = {w: sum(s.startswith(f"writer{w}|") for s in final.profiles) for w in range(2)}
    write_counts("profile_concurrency", {"saves": 2 * SAVES_PER_WRITER, "reads": reads,
                                          "reads_with_profiles": parsed,
                                          "signatures_kept_writer0": kept[0],
                                          "signatures_kept_writer1": kept[1]})
    assert kept == {0: SAVES_PER_WRITER, 1: SAVES_PER_WRITER}, kept
    assert reads > 10  # the reader really raced the writers


def test_half_written_file_and_stray_temp_files_are_ignored(tmp_path):
    path = tmp_path / "profiles.json"
    good = ProfileStore(path)
    good.observe("sig", 128, 4096, 4000)
    good.save()
    text = path.read_text()
    # A crashed writer's temp file next to the real one: never read.
    (tmp_path / "profiles.json.abc123.tmp").write_text(text[: len(text) // 2])
    assert ProfileStore(path).profiles["sig"].observations == [(128, 4096, 4000)]
    # A file cut in half (a writer that did not use the atomic path): ignored, with a warning
    # naming the file, and replaced by the next save.
    path.write_text(text[: len(text) // 2])
    with pytest.warns(RuntimeWarning, match="ignoring memory profile file"):
        torn = ProfileStore(path)
    assert torn.profiles == {}
    torn.observe("sig2", 64, 100, 90)
    torn.save()
    assert set(ProfileStore(path).profiles) == {"sig2"}
    assert os.path.getsize(path) > 0 and Path(str(path)).read_text().startswith("{")


def _same_signature_writer(path: str, writer: int, barrier) -> None:
    from art.trainer_rank.decide import profiles as _profiles

    read = _profiles._load

    def slow_read(*args, **kwargs):
        profiles = read(*args, **kwargs)
        time.sleep(0.4)  # hold the read-merge-replace window open: the other writer is in it
        return profiles

    _profiles._load = slow_read
    store = ProfileStore(path)
    store.observe("shared|sig", 64 * (writer + 1), 1000 * (writer + 1), 900)
    barrier.wait()
    store.save()


def test_two_writers_observations_of_one_signature_both_survive(tmp_path):
    # Both writers save one observation of the same signature at the same moment, each with
    # its read-merge-replace held open: without the lock both read the empty file and the
    # second replace drops the first writer's observation.
    path = tmp_path / "profiles.json"
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    writers = [ctx.Process(target=_same_signature_writer, args=(str(path), w, barrier))
               for w in range(2)]
    for p in writers:
        p.start()
    for p in writers:
        p.join(timeout=60)
        assert p.exitcode == 0
    kept = ProfileStore(path).profiles["shared|sig"].observations
    assert sorted(kept) == [(64, 1000, 900), (128, 2000, 900)]
