"""Seeded RL-like workloads: groups of rollouts that share a prompt, with long-tailed lengths.

What an RL trainer hands `forward_micro_batches`: for each prompt, several sampled completions
(one group = one top-level item, which is never split across micro-batches under grad). Most
completions are short and a few run to the length cap, so the lengths are drawn from a
log-normal and clipped. The demo, the benchmarks and the fuzzers share this one generator so
that their workloads are comparable and reproducible from a seed.

`group_lengths` is pure (no torch) and is what pricing code needs; `rl_groups` adds token ids;
`forward_inputs` turns groups into the nested `ForwardInput` lists TrainerRank takes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from art.trainer_rank._types import ForwardInput

IGNORE_INDEX = -100


@dataclass(frozen=True)
class WorkloadSpec:
    """The shape of an RL step: `groups` prompts x `rollouts_per_group` completions each.

    Every sequence (prompt + completion) has between min_tokens and max_tokens tokens. The prompt
    takes `prompt_fraction_range` of the group's first drawn length, so all rollouts of a group
    start with the same prompt. Completion lengths are log-normal with the given median, which
    gives the long tail RL rollouts show (many short answers, a few that hit the cap).
    """

    groups: int = 8
    rollouts_per_group: int = 4
    min_tokens: int = 64
    max_tokens: int = 1500
    median_completion_tokens: int = 200
    completion_sigma: float = 0.9  # log-normal sigma: 0.9 puts ~5% of completions at 4x median
    prompt_tokens_range: tuple[int, int] = (24, 160)
    vocab_size: int = 512
    seed: int = 0
    # Field -> how the caller's user spells it (e.g. "--groups"), for the messages below.
    names: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        def n(name: str) -> str:
            return f"{self.names.get(name, name)}={getattr(self, name)}"

        if self.groups < 1:
            raise ValueError(f"{n('groups')}: a workload needs at least one group (prompt)")
        if self.rollouts_per_group < 1:
            raise ValueError(f"{n('rollouts_per_group')}: a group needs at least one rollout")
        if not 2 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"{n('min_tokens')}, {n('max_tokens')}: every sequence has between the two, so "
                "they need 2 <= min <= max; change one of them"
            )
        low, high = self.prompt_tokens_range
        if not 1 <= low <= high:
            raise ValueError(f"{n('prompt_tokens_range')}: needs 1 <= low <= high")
        if high >= self.max_tokens:
            raise ValueError(
                f"{n('prompt_tokens_range')} leaves no room for a completion under "
                f"{n('max_tokens')}; lower it or raise max_tokens"
            )
        if self.median_completion_tokens < 1:
            raise ValueError(f"{n('median_completion_tokens')}: must be >= 1 token")
        if self.completion_sigma < 0:
            raise ValueError(f"{n('completion_sigma')}: must be >= 0")
        if self.vocab_size < 2:
            raise ValueError(f"{n('vocab_size')}: must be >= 2")


@dataclass(frozen=True)
class GroupLengths:
    """One group's shape: the shared prompt length and each rollout's completion length."""

    prompt_tokens: int
    completion_tokens: tuple[int, ...]

    @property
    def sequence_lengths_tokens(self) -> tuple[int, ...]:
        return tuple(self.prompt_tokens + c for c in self.completion_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.sequence_lengths_tokens)


@dataclass(frozen=True)
class RolloutGroup:
    """One prompt and its rollouts as token ids (1-D long tensors)."""

    prompt: torch.Tensor
    completions: tuple[torch.Tensor, ...]

    @property
    def sequences(self) -> list[torch.Tensor]:
        return [torch.cat([self.prompt, c]) for c in self.completions]

    @property
    def sequence_lengths_tokens(self) -> tuple[int, ...]:
        return tuple(int(self.prompt.numel() + c.numel()) for c in self.completions)

    @property
    def num_tokens(self) -> int:
        return sum(self.sequence_lengths_tokens)


def group_lengths(spec: WorkloadSpec) -> list[GroupLengths]:
    """The lengths of every group, reproducible from spec.seed (pure Python, no tensors)."""
    rng = random.Random(spec.seed)
    low, high = spec.prompt_tokens_range
    out: list[GroupLengths] = []
    for _ in range(spec.groups):
        prompt = rng.randint(low, high)
        # Each sequence must land in [min_tokens, max_tokens] with this prompt in front.
        min_completion = max(1, spec.min_tokens - prompt)
        max_completion = spec.max_tokens - prompt
        completions = []
        for _ in range(spec.rollouts_per_group):
            drawn = spec.median_completion_tokens * math.exp(rng.gauss(0.0, spec.completion_sigma))
            completions.append(min(max_completion, max(min_completion, round(drawn))))
        out.append(GroupLengths(prompt_tokens=prompt, completion_tokens=tuple(completions)))
    return out


def rl_groups(spec: WorkloadSpec) -> list[RolloutGroup]:
    """Token ids for `group_lengths(spec)`; the same seed gives the same tokens."""
    generator = torch.Generator().manual_seed(spec.seed)
    groups = []
    for shape in group_lengths(spec):
        prompt = torch.randint(0, spec.vocab_size, (shape.prompt_tokens,), generator=generator)
        completions = tuple(
            torch.randint(0, spec.vocab_size, (n,), generator=generator)
            for n in shape.completion_tokens
        )
        groups.append(RolloutGroup(prompt=prompt, completions=completions))
    return groups


def completion_targets(prompt_tokens: int, sequence: torch.Tensor) -> torch.Tensor:
    """Targets scoring the completion only: position t holds token t+1 when t+1 is a completion
    token, else IGNORE_INDEX (the prompt is given, not sampled, and the last position has no
    next token)."""
    targets = torch.full_like(sequence, IGNORE_INDEX)
    if sequence.numel() > 1:
        targets[:-1] = sequence[1:]
    targets[: max(0, prompt_tokens - 1)] = IGNORE_INDEX
    return targets


def forward_inputs(
    groups: Sequence[RolloutGroup],
    *,
    target_logprobs: bool = True,
    top_k: int | None = None,
    logits: bool = False,
    hidden_states: bool = False,
    no_grad: bool | None = None,
) -> list[list[ForwardInput]]:
    """One top-level item (a list of ForwardInputs) per group, requesting the given outputs."""
    items = []
    for group in groups:
        prompt_tokens = int(group.prompt.numel())
        items.append(
            [
                ForwardInput(
                    input_tokens=seq,
                    target_tokens=completion_targets(prompt_tokens, seq) if target_logprobs
                    else None,
                    top_k=top_k,
                    logits=logits,
                    hidden_states=hidden_states,
                    no_grad=no_grad,
                )
                for seq in group.sequences
            ]
        )
    return items
