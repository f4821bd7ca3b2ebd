"""Shared pieces of the reliability tests: count reporting for the closing note."""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV_COUNTS_DIR = "ART_RELIABILITY_COUNTS_DIR"


def write_counts(name: str, counts: dict[str, int]) -> None:
    """Write `counts` to $ART_RELIABILITY_COUNTS_DIR/<name>.json when that variable is set
    (the soak script and the report read them); otherwise do nothing."""
    directory = os.environ.get(ENV_COUNTS_DIR)
    if not directory:
        return
    path = Path(directory) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(counts, indent=1, sort_keys=True))
