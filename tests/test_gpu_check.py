"""`scripts/gpu_check --dry-run` end to end on CPU: the entry point, one worker process per
allocator setting, real tiny Megatron-Core models (a hybrid sharing a prompt, a dense pair)
through the calibration harness, and the outputs: the CSV's columns and figures, the MD, the
PNG, the JSON, the log and the summary line printed last."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _gpu_check import report
from _gpu_check.plan import dry_run_plan

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(
    r"^gpu_check: (?P<ok>\d+)/(?P<cells>\d+) cells measured on .+ \((?P<device>cpu|cuda)\); "
    r"TrainerRank predicted/measured (?P<low>\d+\.\d{3})-(?P<high>\d+\.\d{3}) \(\d+ in "
    r"\[1\.00, 1\.05\]\); defaults \d+\.\d{3}-\d+\.\d{3}; reserve not priced on this device; "
    r"(?P<failed>\d+) failed, (?P<skipped>\d+) skipped, (?P<not_run>\d+) not run; "
    r"\d+ s of a \d+ s budget; report (?P<md>\S+gpu_check\.md)$")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess,
                                                                Path]:
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run([str(ROOT / "scripts" / "gpu_check"), "--dry-run", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return done, out


def test_the_dry_run_ends_with_its_summary_line(dry_run) -> None:
    done, out = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    match = SUMMARY.match(last)
    assert match, last
    assert (match["ok"], match["cells"], match["device"]) == ("4", "4", "cpu")
    assert (match["failed"], match["skipped"], match["not_run"]) == ("0", "0", "0")
    assert Path(match["md"]) == out / "gpu_check.md"
    assert 0 < float(match["low"]) <= float(match["high"])


def test_the_csv_has_every_column_and_positive_figures(dry_run) -> None:
    _, out = dry_run
    with (out / "gpu_check.csv").open() as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames or ()) == report.COLUMNS
        rows = list(reader)
    assert len(rows) == 4 and {r["status"] for r in rows} == {"ok"}
    assert {r["allocator"] for r in rows} == {"segmented", "expandable"}
    for r in rows:
        for key in ("trainer_rank_predicted_bytes", "estimate_defaults_bytes", "measured_bytes",
                    "ratio", "defaults_ratio", "micro_batch_seconds", "seconds"):
            value = float(r[key])
            assert math.isfinite(value) and value > 0, (key, r[key])
        # Probe-priced within a loose band on CPU (the calibration's own band is tighter).
        assert 0.8 < float(r["ratio"]) < 1.25, r
        # No caching allocator on CPU: nothing priced, nothing seen.
        assert float(r["reserve_priced_bytes"]) == float(r["reserve_seen_bytes"]) == 0
    plan = dry_run_plan()
    for r in rows:
        assert r["geometry"] in {g.name for g in plan.geometries}
    hybrid = [r for r in rows if int(r["shared_prefix"])]
    assert len(hybrid) == 2 and all(
        int(r["packed_tokens"]) < sum(map(int, r["lengths"].split("+"))) for r in hybrid)


def test_the_md_png_json_and_log_are_written(dry_run) -> None:
    done, out = dry_run
    md = (out / "gpu_check.md").read_text()
    for heading in ("# GPU check", "## Summary", "## Per policy", "## Every cell",
                    "## Time: predicted against taken", "## Plot"):
        assert heading in md
    assert "(gpu_check.png)" in md  # matplotlib is in the test extra
    assert (out / "gpu_check.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "gpu_check.json").read_text())
    assert data["plan"]["name"] == "dry-run" and data["device"]["device"] == "cpu"
    assert len(data["steps"]) == len(dry_run_plan().steps)
    assert [p["exit"] for p in data["processes"]] == [0, 0]
    assert (out / "gpu_check.log").read_text().strip().splitlines()[-1] == \
        done.stdout.strip().splitlines()[-1]
    assert sorted(p.name for p in out.iterdir()) == sorted(report.FILES)
