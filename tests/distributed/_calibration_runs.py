"""What the TP=2 and CP=2 calibration tests share: each torchrun rank measures its cells and
stores its probe; the merged rows re-price from those stored probes without a rank running."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


def measure_on_this_rank(out_dir: Path, cells: Sequence[Any], **run_cells_kwargs: Any) -> None:
    """Run `cells` on this rank (its probe stored in <out>/probes/rank<R>) and write its rows
    to <out>/rank<R>.json."""
    from _calibration.harness import run_cells

    rank = int(os.environ["RANK"])
    results = run_cells(cells, store_probe_dir=str(out_dir / "probes" / f"rank{rank}"),
                        **run_cells_kwargs)
    (out_dir / f"rank{rank}.json").write_text(json.dumps([r.row() for r in results]))


def assert_rows_reprice(run_dir: Path, probes: Path, probe_tokens: tuple[int, ...]
                        ) -> list[dict]:
    """The ranks' rows merged (busiest rank's measurement, highest rank estimate) re-price to
    the same bytes from each rank's stored probe, copied to `probes`; returns the merged rows."""
    from _calibration.harness import merge_rank_rows
    from _calibration.reprice import reprice_rows

    from _torchrun import rank_records

    merged = merge_rank_rows(rank_records(run_dir))
    shutil.copytree(run_dir / "probes", probes)
    again = reprice_rows(merged, str(probes), probe_tokens=probe_tokens)
    for row, repriced in zip(merged, again, strict=True):
        assert repriced["predicted_bytes"] == row["predicted_bytes"], row["lengths"]
        assert repriced["predicted_default_bytes"] == row["predicted_default_bytes"]
    return merged
