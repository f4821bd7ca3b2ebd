"""torchrun worker (2 ranks, gloo): `scripts/expert_partners.py`'s measurement (the
calibration's hybrid MoE at EP=2 across the two data-parallel ranks, each running a row of
its own, a round-robin router) on this launch's process group.

Writes out_dir/rank<R>.json: a list of {own, partner, grad, policy, measured, priced,
priced_as_own} (bytes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]


def run(out_dir: str) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from expert_partners import measure

    records = measure()
    with open(Path(out_dir) / f"rank{dist.get_rank()}.json", "w") as f:
        json.dump(records, f)
