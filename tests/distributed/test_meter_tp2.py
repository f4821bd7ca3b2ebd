"""The CPU meter under real gloo collectives (torchrun, 2 ranks: meter_collectives_worker.py in
the shared 2-rank launch, conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from _torchrun import rank_records


@pytest.mark.torchrun
def test_collectives_under_the_meter_keep_their_values_and_storages_die_when_dropped(
        two_rank_launch):
    rows = rank_records(Path(two_rank_launch) / "meter")
    for rank, row in enumerate(rows):
        assert row["summed"] == [3.0] * 4 and row["summed_async"] == [6.0] * 4
        assert row["gathered"] == row["gathered_views"] == [0.0, 0.0, 1.0, 1.0]
        assert row["scattered"] == ([0.0, 2.0] if rank == 0 else [4.0, 6.0])
        assert row["exchanged"] == [10.0 * r + 2 * rank + i for r in (0, 1) for i in (0, 1)]
        assert row["broadcast"] == [1.0] * 3
        assert row["received"] == [float(1 - rank)] * 2
        assert row["input_version_kept"]
        assert row["live_bytes"] == row["expected_live_bytes"]
        # Gloo's worker thread drops its references to a collective's tensors some time after
        # the collective completes; the meter must not see that: a storage the caller dropped
        # is gone from the count at once, on every drop, on every rank.
        assert row["late_deaths"] == 0, f"rank {rank}: {row['late_deaths']} of {row['drops']}"
