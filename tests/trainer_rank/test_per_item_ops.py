"""A call of many short items costs the model's ops, not ops per item: validating the ids,
laying out the row, its positions and targets, and handing each sequence its log-probs take a
fixed number of ops whatever the item count. On CPU every op of a micro-batch also passes
through the memory meter's Python observer, so an op per item is paid many times over."""

from __future__ import annotations

from collections import Counter

import torch
from _trainer_helpers import VOCAB, provider
from torch.utils._python_dispatch import TorchDispatchMode

from art.megatron.train import TrainingRuntime
from art.trainer_rank import ForwardInput, TrainerRank, TrainerRankOptions


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _items(count: int, seed: int) -> list[ForwardInput]:
    # One length for all: the segmented attention runs them as one batched call, so what is
    # left per item is the trainer's own.
    g = torch.Generator().manual_seed(seed)
    return [ForwardInput(input_tokens=torch.randint(0, VOCAB, (12,), generator=g),
                         target_tokens=torch.randint(0, VOCAB, (12,), generator=g))
            for _ in range(count)]


def test_a_call_of_many_short_items_issues_no_op_per_item(megatron_process):
    p = provider()
    trainer = TrainerRank(TrainingRuntime.for_model(
        p.build_model(seed=0), p,
        trainer_options=TrainerRankOptions(test_memory_limit_bytes=256 * 2**20)))
    counts = {}
    for count in (50, 250):
        items = _items(count, seed=count)
        list(trainer.forward_micro_batches(items, no_grad=True))  # profile learned
        counter = _OpCounter()
        with counter:
            batches = list(trainer.forward_micro_batches(items, no_grad=True))
        assert len(batches) == 1 and len(batches[0].outputs) == count
        assert all(out.target_logprobs.shape == (12,) for out in batches[0].outputs)
        counts[count] = counter.ops
    extra = counts[250] - counts[50]
    # 200 more items: the ops that grew, and by how many. The head's chunks of a longer row
    # add a few dozen; one op per item (200) is what this guards against.
    assert sum(extra.values()) < 50, extra.most_common(8)
