"""The output head, vocab-parallel and in token chunks: target log-probs, top-k, logits.

The head never calls the model's output layer on the whole row. For each chunk of
`chunk_tokens` tokens it forms this rank's vocab shard of the logits in fp32, reduces the
log-sum-exp and the target logit over the TP ranks, and keeps only what was asked for, so the
largest head allocation is one chunk x vocab/TP, not the whole pack x vocab (on a long pack
that one tensor alone can exceed the free memory). Full logits exist only when requested.

Backward is written out rather than left to autograd, because autograd would hold several
chunk-wide tensors (logits, shifted logits, exponentials, and one gradient per use) and would
give every chunk's slice of the hidden states a full-row zero-filled gradient. Here backward
rebuilds one chunk's logits, turns them into the softmax in place, adds the one-hot terms of
the target and top-k picks in place, and writes that chunk's hidden-state gradient into one
[S, hidden] buffer: one fp32 chunk (plus its model-dtype copy) at a time. With TP each rank
holds a vocab shard, so the hidden-state gradient is summed over the TP group once at the end
(what Megatron's copy-to-TP-region mapping does); the log-sum-exp and target logit were
reduced in forward, and their gradient on each rank is the shard's own part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from art.trainer_rank.compute.forward import unwrap_model
from art.trainer_rank.compute.packing import IGNORE_INDEX

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

    def all_reduce(self, tensor: Tensor, op: Any = None) -> None:
        if self.size > 1:
            torch.distributed.all_reduce(
                tensor, op=op or torch.distributed.ReduceOp.SUM, group=self.group
            )

    def gather_last_dim(self, tensor: Tensor) -> Tensor:
        """[c, n] on every rank -> [c, n x TP], rank-major along the last dimension."""
        if self.size == 1:
            return tensor
        pieces = [torch.empty_like(tensor) for _ in range(self.size)]
        torch.distributed.all_gather(pieces, tensor.contiguous(), group=self.group)
        return torch.cat(pieces, dim=-1)


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


def _local_logits(hidden: Tensor, weight: Tensor) -> Tensor:
    # The projection runs in the model dtype, as Megatron's own output layer does; everything
    # after it is fp32.
    return F.linear(hidden, weight).float()


def _in_shard(ids: Tensor, shard: _VocabShard) -> tuple[Tensor, Tensor]:
    """(mask of ids this rank holds, their local index clamped into range)."""
    inside = (ids >= shard.start) & (ids < shard.start + shard.local_vocab)
    return inside, (ids - shard.start).clamp(0, shard.local_vocab - 1)


class _ChunkedVocabHead(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor | None,
        top_k: int,
        want_logits: bool,
        chunk_tokens: int,
        shard: _VocabShard,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        tokens, device = hidden.shape[0], hidden.device
        log_normalizer = torch.empty(tokens, dtype=torch.float32, device=device)
        # targets: [S, K] (K targets per position); one column per target.
        target_logprobs = (
            torch.empty(tokens, targets.shape[1], dtype=torch.float32, device=device)
            if targets is not None else hidden.new_empty(0, dtype=torch.float32)
        )
        top_values = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
        top_tokens = torch.empty(tokens, top_k, dtype=torch.long, device=device)
        logits = (
            torch.empty(tokens, shard.vocab, dtype=torch.float32, device=device) if want_logits
            else hidden.new_empty(0, dtype=torch.float32)
        )
        for start in range(0, tokens, chunk_tokens):
            end = min(tokens, start + chunk_tokens)
            local = _local_logits(hidden[start:end], weight)  # [c, vocab/TP]
            if want_logits:
                logits[start:end] = shard.gather_last_dim(local)
            if targets is not None:
                inside, local_ids = _in_shard(targets[start:end], shard)
                picked = local.gather(1, local_ids)
                picked.masked_fill_(~inside, 0.0)
                shard.all_reduce(picked)
                target_logprobs[start:end] = picked
            if top_k:
                values, ids = local.topk(min(top_k, shard.local_vocab), dim=-1)
                # Every rank's local top-k together hold the global top-k.
                values = shard.gather_last_dim(values)
                ids = shard.gather_last_dim(ids + shard.start)
                values, position = values.topk(top_k, dim=-1)
                top_values[start:end] = values
                top_tokens[start:end] = ids.gather(1, position)
            row_max = local.amax(dim=-1)
            shard.all_reduce(row_max, torch.distributed.ReduceOp.MAX)
            sum_exp = local.sub_(row_max.unsqueeze(-1)).exp_().sum(dim=-1)  # local reused
            del local
            shard.all_reduce(sum_exp)
            log_normalizer[start:end] = sum_exp.log_().add_(row_max)
        if targets is not None:
            target_logprobs.sub_(log_normalizer.unsqueeze(-1))
            target_logprobs.masked_fill_(targets == IGNORE_INDEX, 0.0)
        top_values.sub_(log_normalizer.unsqueeze(-1))
        ctx.save_for_backward(hidden, weight, targets, top_tokens, log_normalizer)
        ctx.chunk_tokens, ctx.shard, ctx.top_k = chunk_tokens, shard, top_k
        ctx.mark_non_differentiable(top_tokens)
        ctx.set_materialize_grads(False)
        return target_logprobs, top_values, top_tokens, logits

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any,
        grad_target: Tensor | None,
        grad_top: Tensor | None,
        _grad_top_tokens: Tensor | None,
        grad_logits: Tensor | None,
    ):
        hidden, weight, targets, top_tokens, log_normalizer = ctx.saved_tensors
        shard: _VocabShard = ctx.shard
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if targets is None or grad_target is None:
            grad_target = None
        else:
            # Ignored positions output a constant 0.0: no gradient flows from them.
            grad_target = grad_target.masked_fill(targets == IGNORE_INDEX, 0.0)
        if not ctx.top_k:
            grad_top = None
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if want_weight else None
        )
        nothing = grad_target is None and grad_top is None and grad_logits is None
        tokens = hidden.shape[0]
        for start in range(0, 0 if nothing else tokens, ctx.chunk_tokens):
            end = min(tokens, start + ctx.chunk_tokens)
            h = hidden[start:end]
            # d(output)/d(local logits): -softmax x (sum of the log-prob grads), plus the
            # one-hot picks, plus the logits' own gradient.
            grad_local = _local_logits(h, weight)
            grad_local.sub_(log_normalizer[start:end].unsqueeze(-1)).exp_()  # softmax shard
            weight_sum = torch.zeros(end - start, dtype=torch.float32, device=h.device)
            if grad_target is not None:
                weight_sum += grad_target[start:end].float().sum(dim=-1)
            if grad_top is not None:
                weight_sum += grad_top[start:end].float().sum(dim=-1)
            grad_local.mul_(weight_sum.neg_().unsqueeze(-1))
            if grad_target is not None:
                inside, local_ids = _in_shard(targets[start:end], shard)
                picks = grad_target[start:end].float() * inside
                grad_local.scatter_add_(1, local_ids, picks)
            if grad_top is not None:
                inside, local_ids = _in_shard(top_tokens[start:end], shard)
                grad_local.scatter_add_(1, local_ids, grad_top[start:end].float() * inside)
            if grad_logits is not None:
                lo = shard.start
                grad_local += grad_logits[start:end, lo : lo + shard.local_vocab]
            grad_local_model = grad_local.to(weight.dtype)
            del grad_local
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_local_model @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_local_model.t().float(), h.float())
            del grad_local_model  # before the next chunk allocates its logits
        if grad_hidden is not None:
            shard.all_reduce(grad_hidden)  # each rank saw only its vocab shard
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


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

    target_tokens: [S] (or [S, K]: K targets per position) long vocabulary ids, IGNORE_INDEX
    (-100) where no log-prob is wanted; target_logprobs has the same shape.
    Differentiable in `hidden` and the output weight when grad is enabled.
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
    one_column = target_tokens is not None and target_tokens.dim() == 1
    if target_tokens is not None:
        if target_tokens.shape[:1] != (tokens,) or target_tokens.dim() not in (1, 2):
            raise ValueError(
                f"target_tokens must be [{tokens}] or [{tokens}, K] (per packed token), got "
                f"{tuple(target_tokens.shape)}"
            )
        if one_column:
            target_tokens = target_tokens.unsqueeze(-1)
        target_tokens = target_tokens.to(device=hidden.device, dtype=torch.long)
        outside = (target_tokens < 0) | (target_tokens >= shard.vocab)
        bad = (target_tokens != IGNORE_INDEX) & outside
        if bool(bad.any()):
            value = int(target_tokens[bad][0])
            raise ValueError(
                f"target token id {value} is outside the vocabulary [0, {shard.vocab}); use "
                f"{IGNORE_INDEX} for positions without a target"
            )
    out_logprobs, out_top_values, out_top_tokens, out_logits = _ChunkedVocabHead.apply(
        hidden, weight, target_tokens, top_k, logits, chunk_tokens, shard
    )
    if one_column:
        out_logprobs = out_logprobs.squeeze(-1)
    return HeadOutputs(
        target_logprobs=out_logprobs if target_tokens is not None else None,
        top_k_logprobs=out_top_values if top_k else None,
        top_k_tokens=out_top_tokens if top_k else None,
        logits=out_logits if logits else None,
    )
