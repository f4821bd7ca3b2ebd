"""Fault injection: OOMs at random points of a micro-batch, and broken profile files.

OOMs are injected through the virtual limit itself: at the k-th allocation inside the
trainer's meter the limit is lowered to what is live, so that allocation fails exactly as a
real out-of-memory would (torch.OutOfMemoryError, peak above the limit). k is drawn among the
allocations a fault-free dry run made in one place: inside a transformer layer's forward, in
the output head, or in the caller's backward while the micro-batch is yielded. After every
fault: nothing escapes, every item is yielded exactly once (again, after a caller-backward
OOM) or declined with the error listing it, the outputs equal the unpacked reference, and the
accumulated LoRA gradients equal a fault-free run over the same items.
"""

from __future__ import annotations

import json
import logging
import random
import sys
import warnings
from collections import Counter

import pytest
import torch
from _fuzz import Leaf, ReferencePool, _check_leaf, _loss, _to_input, fuzz_provider
from _reliability import write_counts

from art.trainer_rank import Runtime, TrainerRank, TrainerRankMemoryError, TrainerRankOptions
from art.trainer_rank._memory import virtual_limit
from art.trainer_rank._profiles import PROFILE_FILE_VERSION, ProfileStore

LIMIT_BYTES = 64 * 2**20
COUNTS: Counter = Counter()


@pytest.fixture(scope="module")
def fuzz_model(megatron_process):
    logging.getLogger("art.trainer_rank").setLevel(logging.ERROR)
    provider = fuzz_provider()
    yield provider, provider.build_model(seed=0)
    write_counts("fault_injection", dict(COUNTS))


class Injector:
    """Wraps LiveBytesMeter._grow: counts the allocations made in each place, and at the
    `fail_nth` allocation made in `fail_location` makes that allocation fail as a real OOM."""

    def __init__(self, fail_location: str | None = None, fail_nth: int = 0) -> None:
        self.fail_location = fail_location
        self.fail_nth = fail_nth
        self.counts: Counter = Counter()
        self.in_caller_backward = False
        self.fired: str | None = None
        self._original = virtual_limit.LiveBytesMeter._grow

    def _location(self) -> str:
        if self.in_caller_backward:
            return "caller backward"
        frame = sys._getframe(2)
        while frame is not None:
            path = frame.f_code.co_filename
            if path.endswith("_heads.py"):
                return "head"
            if "megatron/core/transformer" in path:
                return "layer forward"
            frame = frame.f_back
        return "other"

    def __enter__(self) -> Injector:
        injector, original = self, self._original

        def grow(meter, nbytes, func):
            where = injector._location()
            injector.counts[where] += 1
            if (injector.fired is None and where == injector.fail_location
                    and injector.counts[where] == injector.fail_nth):
                injector.fired = where
                meter.limit_bytes = meter._live_bytes  # this allocation now crosses it
            return original(meter, nbytes, func)

        virtual_limit.LiveBytesMeter._grow = grow
        return self

    def __exit__(self, *exc) -> None:
        virtual_limit.LiveBytesMeter._grow = self._original


def _flatten(value):
    return [x for v in value for x in _flatten(v)] if isinstance(value, list) else [value]


def _drive(trainer, inputs, grad, injector):
    """A training loop that follows the documented protocol: an OOM in its own backward is
    caught and iteration continues (the trainer undoes the gradients and re-yields)."""
    seen, voided, declined = {}, set(), ()
    try:
        for mb in trainer.forward_micro_batches(inputs, no_grad=not grad):
            for index in mb.indices:
                assert index not in seen or index in voided, f"item {index} yielded twice"
                voided.discard(index)
            seen.update(zip(mb.indices, mb.outputs))
            if grad:
                loss = _loss([o for out in mb.outputs for o in _flatten(out)])
                injector.in_caller_backward = True
                try:
                    loss.backward()
                except torch.OutOfMemoryError:
                    voided.update(mb.indices)
                finally:
                    injector.in_caller_backward = False
                del loss
    except TrainerRankMemoryError as exc:
        declined = exc.indices_not_run
        for index in declined:
            assert f"item {index} " in str(exc)
    assert not voided, f"items {voided} were never re-yielded after a backward OOM"
    assert not set(seen) & set(declined)
    assert set(seen) | set(declined) == set(range(len(inputs)))
    return seen, declined


def _lora_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None}


def _zero(model):
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()


def _workload(rng: random.Random, pool: ReferencePool):
    plan = []
    for _ in range(rng.randint(2, 4)):
        leaves = [Leaf(pool.sequence(), (True, rng.choice((0, 2)), False, rng.random() < 0.3))
                  for _ in range(rng.randint(1, 3))]
        plan.append(leaves if len(leaves) > 1 or rng.random() < 0.5 else leaves[0])
    return plan


def _trainer(provider, model):
    return TrainerRank(Runtime(model, provider),
                       options=TrainerRankOptions(test_memory_limit_bytes=LIMIT_BYTES))


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_ooms_at_random_points_are_recovered(fuzz_model, grad):
    provider, model = fuzz_model
    rng = random.Random(11 if grad else 12)
    pool = ReferencePool(model, rng)
    pool.draw_length = lambda: rng.randint(4, 160)  # short: every fault is a full re-run
    locations = ["layer forward", "head"] + (["caller backward"] if grad else [])
    for trial in range(6 if grad else 4):
        plan = _workload(rng, pool)
        inputs = [_to_input(item, pool, not grad) for item in plan]
        want_location = locations[trial % len(locations)]
        # Two dry runs: the first warms what Megatron keeps between forwards (its attention
        # buffer, the gradient accumulators), the second gives the steady-state counts.
        for _ in range(2):
            _zero(model)
            with Injector() as dry:
                _drive(_trainer(provider, model), inputs, grad, dry)
        available = dry.counts[want_location]
        assert available, f"the dry run made no allocation in {want_location}"

        _zero(model)
        trainer = _trainer(provider, model)
        with Injector(want_location, rng.randint(1, available)) as injector:
            seen, declined = _drive(trainer, inputs, grad, injector)
        assert injector.fired == want_location, (injector.fired, want_location)
        COUNTS[f"faults injected ({want_location}, {'grad' if grad else 'no-grad'})"] += 1
        COUNTS["items yielded after a fault"] += len(seen)
        COUNTS["items declined after a fault"] += len(declined)
        for index, out in seen.items():
            leaves = plan[index] if isinstance(plan[index], list) else [plan[index]]
            outs = out if isinstance(out, list) else [out]
            for k, (leaf, o) in enumerate(zip(leaves, outs)):
                where = f"trial {trial} item {index}.{k}"
                COUNTS["outputs checked"] += _check_leaf(leaf, o, pool, where)
        if not grad:
            continue
        got = _lora_grads(model)
        _zero(model)
        clean = [inputs[i] for i in sorted(seen)]
        with Injector() as again:
            _drive(_trainer(provider, model), clean, grad, again)
        want = _lora_grads(model)
        assert got.keys() == want.keys() and got
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)
        COUNTS["gradient sets compared"] += 1
    _zero(model)


# ---------------------------------------------------------------- profile files

def _valid_payload(signature: str) -> dict:
    return {"version": PROFILE_FILE_VERSION,
            "profiles": {signature: {"observations": [[64, 10_000]], "misses": []}}}


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
        trainer = TrainerRank(Runtime(model, provider), options=TrainerRankOptions(
            test_memory_limit_bytes=LIMIT_BYTES, profile_path=str(path)))
    assert trainer.profiles.profiles == {}
    if kind != "empty" or path.stat().st_size:
        assert any("ignoring memory profile file" in str(w.message) for w in caught), kind
    seen, declined = _drive(trainer, inputs, False, Injector())
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
    probe = _trainer(provider, model)
    items = __import__("art.trainer_rank._items", fromlist=["make_items"]).make_items(inputs)
    _, shape, own_sig = probe.admission.price(items[0].leaves, True)
    other_sig = own_sig.replace(provider.geometry.name, "Qwen3-32B")
    # Another model's entry, and a profile for this very signature claiming ~1 byte per token
    # at every size: admission takes the max of memory model and profile, so a lie that
    # under-states memory cannot admit more than the model does.
    payload = {"version": PROFILE_FILE_VERSION, "profiles": {
        other_sig: {"observations": [[100, 5]], "misses": []},
        own_sig: {"observations": [[t, t] for t in (8, 64, 512, 4096)], "misses": []},
    }}
    path.write_text(json.dumps(payload))
    tight = max(probe.admission.price(item.leaves, True)[0].model_dynamic_bytes
                for item in items) + 1
    trainer = TrainerRank(Runtime(model, provider), options=TrainerRankOptions(
        test_memory_limit_bytes=tight, profile_path=str(path)))
    assert trainer.profiles.has_profile(own_sig)
    _zero(model)
    seen, declined = _drive(trainer, inputs, True, Injector())
    assert not declined and sorted(seen) == [0, 1, 2]
    assert all(s.retries == 0 for s in trainer.stats_history)
    assert all(s.measured_peak_bytes <= tight for s in trainer.stats_history)
    saved = json.loads(path.read_text())["profiles"]
    assert other_sig in saved and saved[other_sig]["observations"] == [[100, 5]]
    _zero(model)
    COUNTS["foreign or lying profiles"] += 2
