"""The output head, vocab-parallel and in token chunks: target log-probs, top-k, logits.

The head never calls the model's output layer on the whole row. For each chunk of
`chunk_tokens` tokens it forms this rank's vocab shard of the logits (fp32), reduces the
log-sum-exp and the target logit over the TP ranks, and keeps only what was asked for, so the
largest head allocation is one chunk x vocab/TP, not the whole pack x vocab (the second report
in the seed failed allocating exactly that). Full logits exist only when requested.

Under grad each chunk runs inside a non-reentrant activation checkpoint: the forward keeps only
the chunk's input, and backward rebuilds one chunk's logits at a time. The TP collectives are
Megatron's autograd-aware mappings: the input is "copied to" the TP region (its gradient is
all-reduced, since every rank only sees its vocab shard), the log-sum-exp and target logit are
"reduced from" it (identity gradient: the replicated result is one loss on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from art.trainer_rank._forward import unwrap_model
from art.trainer_rank._packing import IGNORE_INDEX

HEAD_CHUNK_TOKENS = 2048


@dataclass
class HeadOutputs:
    target_logprobs: Tensor | None  # [S] fp32 (0.0 where target == -100), differentiable
    top_k_logprobs: Tensor | None  # [S, k] fp32
    top_k_tokens: Tensor | None  # [S, k] long
    logits: Tensor | None  # [S, vocab] fp32, gathered across TP


@dataclass(frozen=True)
class _VocabShard:
    group: Any
    size: int
    start: int  # first vocab id held by this rank
    local_vocab: int

    @property
    def vocab(self) -> int:
        return self.local_vocab * self.size


def output_weight(model: Any) -> Tensor:
    """This rank's [vocab/TP, hidden] output projection (the embedding when tied)."""
    inner = unwrap_model(model)
    if inner.share_embeddings_and_output_weights:
        return inner.shared_embedding_or_output_weight()
    return inner.output_layer.weight


def _vocab_shard(local_vocab: int) -> _VocabShard:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return _VocabShard(None, 1, 0, local_vocab)
    group = parallel_state.get_tensor_model_parallel_group()
    size = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    return _VocabShard(group, size, rank * local_vocab, local_vocab)


def _chunk_heads(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor | None,
    top_k: int,
    want_logits: bool,
    shard: _VocabShard,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    from megatron.core import tensor_parallel

    tp = shard.size > 1
    if tp:
        hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden, group=shard.group)
    # The projection runs in the model dtype (as Megatron's own output layer does); softmax
    # statistics are fp32.
    local = F.linear(hidden, weight).float()  # [c, vocab/TP]
    row_max = local.detach().amax(dim=-1)
    if tp:
        torch.distributed.all_reduce(
            row_max, op=torch.distributed.ReduceOp.MAX, group=shard.group
        )
    sum_exp = torch.exp(local - row_max.unsqueeze(-1)).sum(dim=-1)
    if tp:
        sum_exp = tensor_parallel.reduce_from_tensor_model_parallel_region(
            sum_exp, group=shard.group
        )
    log_normalizer = torch.log(sum_exp) + row_max  # [c]

    target_logprobs = None
    if targets is not None:
        in_shard = (targets >= shard.start) & (targets < shard.start + shard.local_vocab)
        local_ids = (targets - shard.start).clamp(0, shard.local_vocab - 1)
        picked = local.gather(1, local_ids.unsqueeze(1)).squeeze(1)
        picked = torch.where(in_shard, picked, torch.zeros_like(picked))
        if tp:
            picked = tensor_parallel.reduce_from_tensor_model_parallel_region(
                picked, group=shard.group
            )
        target_logprobs = torch.where(
            targets == IGNORE_INDEX, torch.zeros_like(picked), picked - log_normalizer
        )

    top_values = top_tokens = None
    if top_k:
        local_k = min(top_k, shard.local_vocab)
        values, ids = local.topk(local_k, dim=-1)
        ids = ids + shard.start
        if tp:
            # Every rank's local top-k together hold the global top-k.
            values = tensor_parallel.gather_from_tensor_model_parallel_region(
                values, group=shard.group
            )
            ids = tensor_parallel.gather_from_tensor_model_parallel_region(
                ids, group=shard.group
            )
        top_values, position = values.topk(top_k, dim=-1)
        top_tokens = ids.gather(1, position)
        top_values = top_values - log_normalizer.unsqueeze(-1)

    logits = None
    if want_logits:
        logits = local
        if tp:
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(
                local, group=shard.group
            )
    return target_logprobs, top_values, top_tokens, logits


def compute_heads(
    model: Any,
    hidden: Tensor,
    *,
    target_tokens: Tensor | None,
    top_k: int = 0,
    logits: bool = False,
    chunk_tokens: int = HEAD_CHUNK_TOKENS,
) -> HeadOutputs:
    """Outputs for every token of `hidden` [S, hidden] (the full row, same on every TP rank).

    target_tokens: [S] long vocabulary ids, IGNORE_INDEX (-100) where no log-prob is wanted.
    """
    weight = output_weight(model)
    if hidden.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"compute_heads expects hidden [S, {weight.shape[1]}], got {tuple(hidden.shape)}"
        )
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    shard = _vocab_shard(weight.shape[0])
    tokens = hidden.shape[0]
    if top_k < 0 or top_k > shard.vocab:
        raise ValueError(f"top_k must be between 0 and the vocabulary {shard.vocab}, got {top_k}")
    if target_tokens is not None:
        if target_tokens.shape != (tokens,):
            raise ValueError(
                f"target_tokens must be [{tokens}] (one per packed token), got "
                f"{tuple(target_tokens.shape)}"
            )
        target_tokens = target_tokens.to(device=hidden.device, dtype=torch.long)
        outside = (target_tokens < 0) | (target_tokens >= shard.vocab)
        bad = (target_tokens != IGNORE_INDEX) & outside
        if bool(bad.any()):
            value = int(target_tokens[bad][0])
            raise ValueError(
                f"target token id {value} is outside the vocabulary [0, {shard.vocab}); use "
                f"{IGNORE_INDEX} for positions without a target"
            )

    track_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    device = hidden.device
    out_logprobs = (
        torch.empty(tokens, dtype=torch.float32, device=device)
        if target_tokens is not None
        else None
    )
    out_top_values = (
        torch.empty(tokens, top_k, dtype=torch.float32, device=device) if top_k else None
    )
    out_top_tokens = torch.empty(tokens, top_k, dtype=torch.long, device=device) if top_k else None
    out_logits = (
        torch.empty(tokens, shard.vocab, dtype=torch.float32, device=device) if logits else None
    )
    for start in range(0, tokens, chunk_tokens):
        end = min(tokens, start + chunk_tokens)
        chunk_targets = target_tokens[start:end] if target_tokens is not None else None
        args = (hidden[start:end], weight, chunk_targets, top_k, logits, shard)
        if track_grad:
            results = checkpoint(_chunk_heads, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            results = _chunk_heads(*args)
        chunk_logprobs, chunk_top_values, chunk_top_tokens, chunk_logits = results
        # Slice assignment keeps one output buffer (autograd records CopySlices) instead of a
        # list of chunks plus their concatenation.
        if out_logprobs is not None:
            out_logprobs[start:end] = chunk_logprobs
        if out_top_values is not None and out_top_tokens is not None:
            out_top_values[start:end] = chunk_top_values
            out_top_tokens[start:end] = chunk_top_tokens
        if out_logits is not None:
            out_logits[start:end] = chunk_logits
    return HeadOutputs(
        target_logprobs=out_logprobs,
        top_k_logprobs=out_top_values,
        top_k_tokens=out_top_tokens,
        logits=out_logits,
    )
