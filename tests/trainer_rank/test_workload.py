"""The RL workload generator: reproducible, in range, shared prompts, long-tailed, and turned
into ForwardInputs whose targets score the completions only."""

from __future__ import annotations

import statistics

import pytest
import torch

from _workload import (
    IGNORE_INDEX,
    WorkloadSpec,
    completion_targets,
    forward_inputs,
    group_lengths,
    rl_groups,
)


def test_same_seed_same_workload_other_seed_other_workload() -> None:
    spec = WorkloadSpec(groups=4, rollouts_per_group=3, seed=7)
    a, b = rl_groups(spec), rl_groups(spec)
    assert [g.sequence_lengths_tokens for g in a] == [g.sequence_lengths_tokens for g in b]
    assert all(torch.equal(x.prompt, y.prompt) for x, y in zip(a, b))
    other = group_lengths(WorkloadSpec(groups=4, rollouts_per_group=3, seed=8))
    assert [g.sequence_lengths_tokens for g in other] != [g.sequence_lengths_tokens for g in a]


def test_lengths_in_range_with_a_long_tail() -> None:
    spec = WorkloadSpec(groups=200, rollouts_per_group=4, min_tokens=64, max_tokens=1500)
    shapes = group_lengths(spec)
    lengths = [n for g in shapes for n in g.sequence_lengths_tokens]
    assert min(lengths) >= 64 and max(lengths) <= 1500
    assert all(len(g.completion_tokens) == 4 for g in shapes)
    median = statistics.median(lengths)
    # Long-tailed: some rollouts reach several times the median, a few hit the cap.
    assert max(lengths) > 3 * median
    assert sum(n == 1500 for n in lengths) >= 1
    assert statistics.mean(lengths) > median


def test_rollouts_of_a_group_share_the_prompt() -> None:
    for group in rl_groups(WorkloadSpec(groups=3, rollouts_per_group=4, seed=1)):
        p = group.prompt.numel()
        sequences = group.sequences
        assert len(sequences) == 4
        assert all(torch.equal(s[:p], group.prompt) for s in sequences)
        assert group.num_tokens == sum(s.numel() for s in sequences)


def test_forward_inputs_score_completions_only() -> None:
    groups = rl_groups(WorkloadSpec(groups=2, rollouts_per_group=2, seed=3, vocab_size=50))
    items = forward_inputs(groups, target_logprobs=True, top_k=5)
    assert len(items) == 2 and all(len(item) == 2 for item in items)
    for group, item in zip(groups, items):
        p = group.prompt.numel()
        for seq, fi in zip(group.sequences, item):
            assert torch.equal(fi.input_tokens, seq) and fi.top_k == 5
            t = fi.target_tokens
            assert (t[: p - 1] == IGNORE_INDEX).all() and t[-1] == IGNORE_INDEX
            assert torch.equal(t[p - 1:-1], seq[p:])
            assert int(seq.max()) < 50
    no_targets = forward_inputs(groups, target_logprobs=False, hidden_states=True, no_grad=True)
    assert no_targets[0][0].target_tokens is None and no_targets[0][0].no_grad


def test_completion_targets_edge_cases() -> None:
    assert completion_targets(1, torch.tensor([5])).tolist() == [IGNORE_INDEX]
    assert completion_targets(1, torch.tensor([5, 6, 7])).tolist() == [6, 7, IGNORE_INDEX]
    assert completion_targets(2, torch.tensor([5, 6, 7])).tolist() == [IGNORE_INDEX, 7,
                                                                       IGNORE_INDEX]


@pytest.mark.parametrize("kwargs, message", [
    (dict(groups=0), "at least|>= 1 group"),
    (dict(prompt_tokens_range=(10, 5)), "prompt_tokens_range"),
    (dict(prompt_tokens_range=(10, 1500)), "no room"),
    (dict(min_tokens=2000), "min_tokens"),
    (dict(vocab_size=1), "vocab_size"),
])
def test_bad_specs_say_what_is_wrong(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        WorkloadSpec(**kwargs)
