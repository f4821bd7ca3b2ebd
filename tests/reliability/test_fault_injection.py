"""Fault injection: OOMs at random points of a micro-batch (how, and the invariants checked
after each: _faults.py), and profile files that are corrupt, truncated, from another version,
for another model, or lying. scripts/soak_faults.py runs many more OOM trials."""

from __future__ import annotations

import json
import logging
import random
import warnings
from collections import Counter

import pytest
from _faults import (
    LIMIT_BYTES,
    Injector,
    drive,
    fault_trial,
    locations,
    make_trainer,
    zero_grads,
)
from _fuzz import Leaf, ReferencePool, _check_leaf, _to_input, fuzz_provider
from _reliability import write_counts

from art.megatron.train import TrainingRuntime
from art.trainer_rank import TrainerRank, TrainerRankOptions
from art.trainer_rank.compute.items import make_items
from art.trainer_rank.decide.profiles import PROFILE_FILE_VERSION, ProfileStore

COUNTS: Counter = Counter()


@pytest.fixture(scope="module")
def fuzz_model(megatron_process):
    logging.getLogger("art.trainer_rank").setLevel(logging.ERROR)
    provider = fuzz_provider()
    yield provider, provider.build_model(seed=0)
    write_counts("fault_injection", dict(COUNTS))


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_ooms_at_random_points_are_recovered(fuzz_model, grad):
    provider, model = fuzz_model
    rng = random.Random(11 if grad else 12)
    pool = ReferencePool(model, rng)
    pool.draw_length = lambda: rng.randint(4, 160)  # short: every fault is a full re-run
    where = locations(grad)
    for trial in range(6 if grad else 4):
        fault_trial(provider, model, rng, pool, grad=grad, location=where[trial % len(where)],
                    counts=COUNTS)


# ---------------------------------------------------------------- profile files

def _valid_payload(signature: str) -> dict:
    return {"version": PROFILE_FILE_VERSION,
            "profiles": {signature: {"observations": [[64, 10_000, 9_000]], "misses": []}}}


BROKEN_FILES = {
    "corrupt": b"\x00\xff{not json at all\x80",
    "truncated": json.dumps(_valid_payload("x" * 40)).encode()[:37],
    "empty": b"",
    "other version": json.dumps(dict(_valid_payload("x"), version=PROFILE_FILE_VERSION + 1)
                                ).encode(),
    "wrong shapes": json.dumps({"version": PROFILE_FILE_VERSION,
                                "profiles": {"s": {"observations": [[64, -5, 1]]}}}).encode(),
    "not an object": b"[1, 2, 3]",
}


@pytest.mark.parametrize("kind", list(BROKEN_FILES))
def test_broken_profile_file_is_ignored_and_replaced(fuzz_model, tmp_path, kind):
    provider, model = fuzz_model
    path = tmp_path / "profiles.json"
    path.write_bytes(BROKEN_FILES[kind])
    rng = random.Random(5)
    pool = ReferencePool(model, rng)
    plan = [Leaf(pool.sequence(), (True, 0, False, False)) for _ in range(3)]
    inputs = [_to_input(leaf, pool, True) for leaf in plan]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = TrainerRank(TrainingRuntime.for_model(
            model, provider, trainer_options=TrainerRankOptions(
            test_memory_limit_bytes=LIMIT_BYTES, profile_path=str(path))))
    assert trainer.profiles.profiles == {}
    if kind != "empty" or path.stat().st_size:
        assert any("ignoring memory profile file" in str(w.message) for w in caught), kind
    seen, declined = drive(trainer, inputs, False, Injector())
    assert not declined and sorted(seen) == [0, 1, 2]
    for index, out in seen.items():
        _check_leaf(plan[index], out, pool, kind)
    reread = ProfileStore(path)  # replaced atomically with a valid file that holds what we saw
    assert reread.profiles and all(p.observations for p in reread.profiles.values())
    COUNTS["broken profile files"] += 1


def test_profile_of_another_model_or_lying_profile_cannot_cause_an_oom(fuzz_model, tmp_path):
    provider, model = fuzz_model
    path = tmp_path / "profiles.json"
    rng = random.Random(6)
    pool = ReferencePool(model, rng)
    plan = [[Leaf(pool.sequence(), (True, 0, False, False)) for _ in range(2)]
            for _ in range(3)]
    inputs = [_to_input(item, pool, False) for item in plan]
    probe = make_trainer(provider, model)
    items = make_items(inputs)
    _, shape, own_sig = probe.admission.price(items[0].leaves, True)
    other_sig = own_sig.replace(provider.geometry.name, "Qwen3-32B")
    # Another model's entry, and a profile for this very signature claiming ~1 byte per token
    # at every size (1/1000 of the model): a profile only ever raises the model's price, so a
    # lie that under-states memory cannot admit more than the model does.
    payload = {"version": PROFILE_FILE_VERSION, "profiles": {
        other_sig: {"observations": [[100, 5, 5]], "misses": []},
        own_sig: {"observations": [[t, t, 1000 * t] for t in (8, 64, 512, 4096)],
                  "misses": []},
    }}
    path.write_text(json.dumps(payload))
    tight = max(probe.admission.price(item.leaves, True)[0].model_dynamic_bytes
                for item in items) + 1
    trainer = TrainerRank(TrainingRuntime.for_model(
        model, provider, trainer_options=TrainerRankOptions(
        test_memory_limit_bytes=tight, profile_path=str(path))))
    assert trainer.profiles.has_profile(own_sig)
    zero_grads(model)
    seen, declined = drive(trainer, inputs, True, Injector())
    assert not declined and sorted(seen) == [0, 1, 2]
    assert all(s.retries == 0 for s in trainer.stats_history)
    assert all(s.measured_peak_bytes <= tight for s in trainer.stats_history)
    saved = json.loads(path.read_text())["profiles"]
    assert other_sig in saved and saved[other_sig]["observations"] == [[100, 5, 5]]
    zero_grads(model)
    COUNTS["foreign or lying profiles"] += 2
