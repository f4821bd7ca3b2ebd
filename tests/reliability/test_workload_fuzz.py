"""Randomised forward_micro_batches calls on a real Megatron-Core model (tiny, LoRA, fp32,
selective recompute) under virtual memory limits from "nothing fits" to "everything fits".

The suite runs WORKLOAD_FUZZ_CALLS calls (default 100, to keep the suite within its time);
scripts/soak_workload.py runs the same fuzzer for 500 calls on each of several seeds, and its
committed totals are bench/soak_workload.json. The
invariants are listed in _fuzz.py: no OOM escapes, every item yielded once or declined,
outputs equal the unpacked reference, declines are exactly the items that cannot fit.
"""

from __future__ import annotations

import logging
import os

import pytest
from _fuzz import WorkloadFuzzer, fuzz_provider
from _reliability import write_counts

CALLS = int(os.environ.get("WORKLOAD_FUZZ_CALLS", "100"))


@pytest.fixture(scope="module")
def fuzz_model(megatron_process):
    provider = fuzz_provider()
    return provider, provider.build_model(seed=0)


def test_random_workloads_keep_every_invariant(fuzz_model):
    provider, model = fuzz_model
    logging.getLogger("art.trainer_rank").setLevel(logging.ERROR)
    fuzzer = WorkloadFuzzer(model, provider, seed=1234)
    counts = fuzzer.run(CALLS)
    write_counts("workload_fuzz", counts.as_dict())
    assert counts.calls == CALLS and counts.escaped_ooms == 0
    # The mix must really exercise the paths it claims to (a generator regression would
    # otherwise make the invariants vacuous).
    assert counts.declined_items > 0 and counts.calls_fully_declined < CALLS // 2
    assert counts.micro_batches >= CALLS // 2
    assert counts.outputs_checked >= CALLS
    assert counts.decisions["admitted"] + counts.decisions["cold-capped"] > 0


def test_the_readme_quotes_the_committed_soak():
    """README's workload-soak figures are bench/soak_workload.json's."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    totals = json.loads((root / "bench" / "soak_workload.json").read_text())
    text = " ".join((root / "README.md").read_text().split())
    assert totals["command"] in text
    assert (f"{totals['calls']:,} calls, {totals['micro_batches']:,} micro-batches, "
            f"{totals['outputs_checked']:,} outputs checked, {totals['declined_items']:,} items "
            f"declined, {totals['runtime_oom_retries']} runtime OOM retries, "
            f"{totals['escaped_ooms']} escaped OOMs") in text
