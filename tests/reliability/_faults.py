"""OOM fault trials for the reliability tests and scripts/soak_faults.py, on the injection
harness beside the soak scripts (scripts/_rank_faults.py: the Injector and the caller's loop).

OOMs are injected through the virtual limit itself: at the k-th allocation made in one place
inside the trainer's meter, the limit is lowered to what is live, so that allocation fails
exactly as a real out-of-memory would (torch.OutOfMemoryError, peak above the limit). The
places: inside a transformer layer's forward, in the output head, in the caller's backward
while the micro-batch is yielded. k is drawn among the allocations a fault-free dry run made
there. After every fault: nothing escapes, every item is yielded exactly once (again, after a
caller-backward OOM) or declined with the error listing it, the outputs equal the unpacked
reference, and the accumulated LoRA gradients equal a fault-free run over the same items.
"""

from __future__ import annotations

import random
import sys
from collections import Counter
from pathlib import Path

import torch
from _fuzz import Leaf, ReferencePool, _check_leaf, _loss, _to_input

from art.megatron.train import TrainingRuntime
from art.trainer_rank import TrainerRank, TrainerRankOptions

# The harness lives beside the scripts (conftest puts scripts/ on the path; torchrun workers
# and scripts import this module without it).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from _rank_faults import Injector, caller_loop  # noqa: E402

__all__ = ["Injector", "drive", "fault_trial", "locations"]

LIMIT_BYTES = 64 * 2**20


def drive(trainer, inputs, grad, injector):
    """A training loop that follows the documented protocol (scripts/_rank_faults.py): an OOM
    in its own backward is caught and iteration continues (the trainer undoes the gradients
    and re-yields); checks that no item was yielded twice or lost and nothing escaped."""
    result = caller_loop(trainer, inputs, injector, loss_of=_loss, grad=grad)
    assert not result.escaped_ooms, "an out-of-memory error escaped forward_micro_batches"
    assert not result.yielded_twice, f"item(s) {result.yielded_twice} yielded twice"
    seen, declined = result.seen, result.declined
    for index in declined:
        assert f"item {index} " in str(result.error)
    assert result.voided <= set(declined), (
        f"items {result.voided - set(declined)} OOMed in backward, then neither re-yielded "
        "nor declined")
    assert not set(seen) & set(declined)
    assert set(seen) | set(declined) == set(range(len(inputs)))
    return seen, declined


def lora_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None}


def zero_grads(model):
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()


def fault_workload(rng: random.Random, pool: ReferencePool):
    plan = []
    for _ in range(rng.randint(2, 4)):
        leaves = [Leaf(pool.sequence(), (True, rng.choice((0, 2)), False, rng.random() < 0.3))
                  for _ in range(rng.randint(1, 3))]
        plan.append(leaves if len(leaves) > 1 or rng.random() < 0.5 else leaves[0])
    return plan


def make_trainer(provider, model, limit_bytes: int = LIMIT_BYTES):
    return TrainerRank(TrainingRuntime.for_model(model, provider,
                       trainer_options=TrainerRankOptions(test_memory_limit_bytes=limit_bytes)))


def fault_trial(provider, model, rng: random.Random, pool: ReferencePool, *, grad: bool,
                location: str, counts: Counter) -> None:
    """One injected OOM in `location` on a random small workload; checks every invariant
    (module docstring) and tallies into `counts`."""
    plan = fault_workload(rng, pool)
    inputs = [_to_input(item, pool, not grad) for item in plan]
    # Two dry runs: the first warms what Megatron keeps between forwards (its attention
    # buffer, the gradient accumulators), the second gives the steady-state counts.
    for _ in range(2):
        zero_grads(model)
        with Injector() as dry:
            drive(make_trainer(provider, model), inputs, grad, dry)
    available = dry.counts[location]
    assert available, f"the dry run made no allocation in {location}"

    zero_grads(model)
    trainer = make_trainer(provider, model)
    with Injector(location, rng.randint(1, available)) as injector:
        seen, declined = drive(trainer, inputs, grad, injector)
    assert injector.fired == location, (injector.fired, location)
    counts[f"faults injected ({location}, {'grad' if grad else 'no-grad'})"] += 1
    counts["items yielded after a fault"] += len(seen)
    counts["items declined after a fault"] += len(declined)
    for index, out in seen.items():
        leaves = plan[index] if isinstance(plan[index], list) else [plan[index]]
        outs = out if isinstance(out, list) else [out]
        for k, (leaf, o) in enumerate(zip(leaves, outs)):
            counts["outputs checked"] += _check_leaf(leaf, o, pool, f"item {index}.{k}")
    if grad:
        got = lora_grads(model)
        zero_grads(model)
        clean = [inputs[i] for i in sorted(seen)]
        with Injector() as again:
            drive(make_trainer(provider, model), clean, grad, again)
        want = lora_grads(model)
        assert got.keys() == want.keys() and got
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)
        counts["gradient sets compared"] += 1
    zero_grads(model)


def locations(grad: bool) -> list[str]:
    return ["layer forward", "head"] + (["caller backward"] if grad else [])
