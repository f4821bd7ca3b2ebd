"""Shared-prefix cases and the shared-vs-unshared comparison (TP=1 tests and the TP=2 worker).

A case is one GRPO-shaped group: a prompt and N completions (some sharing deeper parts, one
possibly ending with the prompt, one a duplicate), every output requested, targets that differ
between sequences on shared rows (next tokens, random ids, -100). `compare` runs the group
once packed as a prefix tree and once every sequence alone (the reference), through the
trainer's own sub-forward, and returns the largest output and gradient differences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.trainer_rank._types import ForwardInput
from art.trainer_rank.compute.execute import run_sub_forward
from art.trainer_rank.compute.packing import pack_sequences

TOP_K = 3


@dataclass(frozen=True)
class Case:
    rollouts: int
    prompt_tokens: int
    completion_tokens: tuple[int, int]  # min, max
    seed: int
    deeper: bool = False  # completions 0 and 1 share a part after the prompt


CASES = (
    Case(1, 5, (3, 9), 0),
    Case(2, 1, (4, 12), 1),          # a one-token prefix
    Case(3, 30, (1, 3), 2),          # most of every sequence is the prefix
    Case(4, 8, (2, 10), 3, deeper=True),
    Case(16, 6, (1, 7), 4),
)
# For recurrent (Gated DeltaNet) layers, whose kernels work in 64-token chunks: prefixes of one
# token, of more than one chunk and of most of the sequence; children shorter than a chunk and
# longer than several; a deeper shared part (depth 3), a duplicate, 16 children.
HYBRID_CASES = (
    Case(2, 1, (70, 140), 10),
    Case(3, 130, (1, 3), 11),
    Case(4, 66, (60, 200), 12, deeper=True),
    Case(16, 6, (1, 7), 13),
)


def group(case: Case, vocab: int) -> list[ForwardInput]:
    g = torch.Generator().manual_seed(case.seed)
    prompt = torch.randint(1, vocab, (case.prompt_tokens,), generator=g)
    deeper = torch.randint(1, vocab, (3,), generator=g)
    leaves = []
    for i in range(case.rollouts):
        n = int(torch.randint(case.completion_tokens[0], case.completion_tokens[1] + 1, (1,),
                              generator=g))
        completion = torch.randint(1, vocab, (n,), generator=g)
        if case.deeper and i < 2:
            completion = torch.cat([deeper, completion])
        tokens = torch.cat([prompt, completion])
        if case.rollouts > 2 and i == case.rollouts - 1:
            tokens = prompt.clone()  # a sequence that is the prompt and nothing more
        targets = torch.cat([tokens[1:], tokens.new_full((1,), -100)])
        if i % 3 == 1:  # targets that differ from the siblings' on shared rows
            targets = torch.randint(0, vocab, tokens.shape, generator=g)
            targets[0] = -100
        if i == 3:  # [T, k] targets: the next token and a random one per position
            targets = torch.stack([targets, torch.randint(0, vocab, tokens.shape, generator=g)],
                                  dim=1)
        leaves.append(ForwardInput(input_tokens=tokens, target_tokens=targets,
                                   top_k=TOP_K if i % 2 == 0 else None,
                                   logits=i % 4 == 0, hidden_states=i % 2 == 1))
    if case.rollouts > 3:
        leaves[2] = leaves[0]  # a duplicate rollout
    return leaves


def _loss(outputs, weights_seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(weights_seed)
    total = torch.zeros(())
    for out in outputs:
        for value in (out.target_logprobs, out.logits, out.hidden_states,
                      None if out.top_k is None else out.top_k.logprobs):
            if value is not None:
                total = total + (value * torch.randn(value.shape, generator=g)).sum()
    return total


def _run(model, leaves, implementation, layout, shared: bool):
    model.zero_grad(set_to_none=True)
    if shared:
        outputs = run_sub_forward(model, leaves, implementation=implementation, layout=layout,
                                  device=torch.device("cpu"), head_chunk_tokens=16,
                                  groups=[len(leaves)])
    else:
        outputs = [
            run_sub_forward(model, [leaf], implementation=implementation, layout=layout,
                            device=torch.device("cpu"), head_chunk_tokens=16)[0]
            for leaf in leaves
        ]
    _loss(outputs, 7).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if layout.sequence_parallel:
        # Norm weights under sequence parallel see only this rank's rows (Megatron sums them
        # over TP in finalize_model_grads); which rows a rank holds depends on the packing.
        from megatron.core import parallel_state

        for name, param in model.named_parameters():
            if getattr(param, "sequence_parallel", False) and name in grads:
                torch.distributed.all_reduce(
                    grads[name], group=parallel_state.get_tensor_model_parallel_group())
    return outputs, grads


def compare(model, leaves, implementation: Implementation, layout: ParallelLayout) -> dict:
    """Largest |shared - unshared| per output kind and over the gradients, plus the tokens."""
    batch = pack_sequences([leaf.input_tokens for leaf in leaves], implementation=implementation,
                           layout=layout, groups=[len(leaves)])
    shared_out, shared_grads = _run(model, leaves, implementation, layout, True)
    alone_out, alone_grads = _run(model, leaves, implementation, layout, False)
    diffs = {"logprobs": 0.0, "top_k": 0.0, "logits": 0.0, "hidden": 0.0, "grad": 0.0,
             "top_k_tokens_equal": True, "present": True}

    def worst(key: str, a, b) -> None:
        if (a is None) != (b is None):
            diffs["present"] = False
        elif a is not None:
            if a.shape != b.shape:
                diffs["present"] = False
            else:
                diffs[key] = max(diffs[key], (a - b).abs().max().item())

    for a, b in zip(shared_out, alone_out):
        worst("logprobs", a.target_logprobs, b.target_logprobs)
        worst("logits", a.logits, b.logits)
        worst("hidden", a.hidden_states, b.hidden_states)
        worst("top_k", None if a.top_k is None else a.top_k.logprobs,
              None if b.top_k is None else b.top_k.logprobs)
        if a.top_k is not None and b.top_k is not None:
            diffs["top_k_tokens_equal"] &= bool(torch.equal(a.top_k.tokens, b.top_k.tokens))
    scale = max(g.abs().max().item() for g in alone_grads.values())
    assert shared_grads.keys() == alone_grads.keys()
    for name, grad in shared_grads.items():
        diffs["grad"] = max(diffs["grad"], (grad - alone_grads[name]).abs().max().item() / scale)
    diffs["logical_tokens"] = batch.logical_tokens
    diffs["packed_tokens"] = batch.padded_tokens
    diffs["shared_tokens"] = batch.shared_tokens
    return diffs
