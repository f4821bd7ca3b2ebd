"""Default pricing of the chain's tail (final norm, chunked vocab head, requested outputs, the
caller's loss and its backward) and of the largest single allocation of a micro-batch."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Protocol

from art.megatron.geometry import ModelGeometry
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.trainer_rank._request import MicroBatchShape, OutputRequest
from art.trainer_rank.pricing.coefficients import MeasuredTail
from art.trainer_rank.pricing.layer_terms import FP32

INT64 = 8
# The head backward's per-token side tensors: masks, clamped ids, fp32 per-token weights.
HEAD_BOOKKEEPING_BYTES_PER_TOKEN = 32


class PricedModel(Protocol):
    """What the tail's pricing reads of a memory model."""

    geometry: ModelGeometry
    layout: ParallelLayout
    implementation: Implementation
    head_chunk_tokens: int

    @property
    def dtype_bytes(self) -> int: ...


@dataclass(frozen=True)
class TailCost:
    """`kept`: what stays live through the layers' backward (the hidden row the caller's frame
    holds, the requested outputs); `forward` / `backward`: peaks above the decoder output;
    `gathered_logits`: the TP all-gather of one logits chunk, live at the forward peak on top
    of `forward` (a term of its own); `saved`: what the head and final norm keep for their own
    backward beside `kept` (the log-normaliser, the norm's inverse rms), live from the
    forward's return until the head's backward; `caller_loss`: of `backward`, a caller's
    per-token loss gradients at the row (`caller_per_token_loss_bytes`); `head_backward`: of
    the backward's moments, the head's and the final norm's without the caller's own ops on
    the row (measured by the probe; None: not told apart, `backward` stands for it)."""

    kept: float
    forward: float
    backward: float
    note: str
    gathered_logits: float = 0.0
    saved: float = 0.0
    caller_loss: float = 0.0
    head_backward: float | None = None

    @property
    def head_backward_peak(self) -> float:
        """The head's backward moment: `head_backward`, else the whole `backward`."""
        return self.backward if self.head_backward is None else self.head_backward


def gathered_logits_bytes(model: PricedModel, batch: MicroBatchShape, s: int) -> float:
    """Full logits at TP > 1: each chunk's shard is all-gathered into TP pieces of
    [chunk, vocab/TP] fp32 and concatenated into [chunk, vocab] before it is copied into the
    output, so pieces and concatenation are live together beside the local shard."""
    tp = model.layout.tensor_parallel
    if not batch.outputs.logits or tp == 1:
        return 0.0
    chunk = min(model.head_chunk_tokens, s)
    return 2.0 * chunk * model.geometry.vocab_size * FP32


# The caller's loss and its gradient: two fp32 scalars live through the backward.
CALLER_LOSS_SCALARS_BYTES = 2 * FP32


def caller_per_token_loss_bytes(outputs: OutputRequest, rows: float) -> float:
    """What a caller's per-token loss over the returned log-probs keeps live through the
    head's backward, beyond the probe's synthetic loss (a plain sum, whose gradient is a view
    of one scalar): an RL policy loss (importance ratios, a KL penalty, mean over tokens)
    hands back one fp32 gradient per target log-prob, and an entropy over the returned top-k
    keeps its exp(top-k), fp32 per token and k, for its backward. Priced for every grad
    micro-batch that returns log-probs, since the trainer never sees the caller's loss."""
    per_token = (1 if outputs.target_logprobs else 0) + outputs.top_k
    return rows * per_token * FP32


def caller_mean_square_per_row(model: PricedModel) -> tuple[float, float]:
    """Bytes per row of the caller's fp32 mean-square on hidden states: (forward, backward).
    Forward: the squares, and the fp32 copy in low precision, which the square keeps. Its
    backward holds four hidden-sized fp32 rows at once (the incoming gradient, x^1, 2 x^1,
    their product: pow's backward) before the hidden row's gradient exists: three beyond it.
    Where the rows are the decoder's own, torch's composite final norm runs the same pow
    backward beside that gradient on the rows it normed (`final_norm_pow_backward_bytes`)."""
    g, b = model.geometry, model.dtype_bytes
    copy = g.hidden_size * FP32 if b < FP32 else 0.0
    return g.hidden_size * FP32 + copy, 3 * g.hidden_size * FP32 + copy


def final_norm_pow_backward_bytes(model: PricedModel, norm_rows: float) -> float:
    """The one fp32 hidden-sized row per normed row that torch's composite final norm adds to
    the caller's mean-square backward on the decoder's rows; the norm runs inside the
    decoder, on this CP rank's rows only."""
    if model.implementation.norm != "torch":
        return 0.0
    return norm_rows * model.geometry.hidden_size * FP32


def default_tail(model: PricedModel, batch: MicroBatchShape, s: int) -> TailCost:
    """Final norm + head + outputs + caller loss, priced from the compute path's head."""
    g, b, tp = model.geometry, model.dtype_bytes, model.layout.tensor_parallel
    out = batch.outputs
    grad = batch.grad_enabled
    # The decoder output is gathered to the full row on every TP and CP rank: `s` is the
    # whole row's tokens here.
    rows = s
    hidden_row = rows * g.hidden_size * b
    # The final norm's weight is frozen, so its multiply keeps nothing: the inverse rms per
    # row, plus torch's fp32 upcast of the input in low precision. It runs inside the decoder,
    # on this CP rank's rows.
    norm_rows = math.ceil(rows / model.layout.context_parallel)
    norm_internal = norm_rows * FP32 + (
        norm_rows * g.hidden_size * FP32
        if model.implementation.norm == "torch" and b < FP32 else 0)
    uses_head = out.uses_head
    vocab_local = g.vocab_size / tp
    chunk = min(model.head_chunk_tokens, rows)
    # One chunk: [chunk, vocab/TP] logits in the model dtype, upcast to fp32 (a copy only in
    # low precision; shift and exp run in place on it); top-k: the shard's values and ids,
    # gathered over TP, their top-k and the ids gathered at it.
    upcast = chunk * vocab_local * FP32 if b < FP32 else 0.0
    top_k = chunk * out.top_k * ((FP32 + INT64) * (tp + 1) + INT64)
    chunk_fwd = chunk * vocab_local * b + upcast + top_k if uses_head else 0.0
    held = hidden_row
    if out.target_logprobs:
        held += rows * FP32
    if out.top_k:
        held += rows * out.top_k * (FP32 + INT64)
    if out.logits:
        held += rows * g.vocab_size * FP32
    if grad:
        held += CALLER_LOSS_SCALARS_BYTES
    saved_head = rows * FP32 if uses_head else 0.0  # the log-normaliser kept for backward
    bookkeeping = rows * HEAD_BOOKKEEPING_BYTES_PER_TOKEN if uses_head else 0.0
    forward = held + saved_head + chunk_fwd + bookkeeping + (norm_internal if grad else 0.0)
    note = f"head chunk {chunk} tok x vocab/TP {int(vocab_local)}; outputs {out.key}"
    backward = 0.0
    caller_loss = 0.0
    if grad:
        caller = 0.0
        if out.hidden_states:
            # The caller's fp32 mean-square (`caller_mean_square_per_row`); the hidden row's
            # gradient is in `grads`.
            square_forward, square_backward = caller_mean_square_per_row(model)
            caller = rows * square_backward + final_norm_pow_backward_bytes(model, norm_rows)
            forward += rows * square_forward
        if out.logits:
            caller += rows * g.vocab_size * FP32
        # Head backward, per chunk: the logits rebuilt (the softmax and its gradient run in
        # place on them; in low precision an fp32 copy and the gradient cast back for the
        # matmul), the chunk's input gradient; plus the zero-initialised gradient of the whole
        # hidden row and per-token bookkeeping (target masks, clamped ids, fp32 weights).
        low = FP32 + b if b < FP32 else 0
        chunk_bwd = (chunk * vocab_local * (b + low) + chunk * g.hidden_size * b
                     if uses_head else 0.0)
        # The caller's gradient of the top-k log-probs and its fp32 sum over k.
        top_k_grads = rows * out.top_k * FP32 * 2
        grads = hidden_row + bookkeeping + top_k_grads
        caller_loss = caller_per_token_loss_bytes(out, rows)
        backward = held + saved_head + norm_internal + chunk_bwd + grads + caller + caller_loss
    return TailCost(kept=held, forward=forward, backward=backward, note=note,
                    gathered_logits=gathered_logits_bytes(model, batch, rows),
                    saved=saved_head + (norm_internal if grad else 0.0),
                    caller_loss=caller_loss)


def tail_past_its_rows(model: PricedModel, at_last: MeasuredTail, outputs: OutputRequest,
                       grad: bool, s: int) -> MeasuredTail:
    """A tail the probe measured up to `at_last.measured_up_to_tokens` rows (no more than one
    head chunk), carried to `s` rows by the formulas' growth from there: past a chunk the
    head's working set stops growing, which a curve fitted below the chunk cannot know."""
    last = at_last.measured_up_to_tokens

    def formulas(rows: int) -> TailCost:
        return default_tail(model, MicroBatchShape((rows,), outputs=outputs,
                                                   grad_enabled=grad), rows)

    here, there = formulas(s), formulas(last)
    growth_forward = (here.forward + here.gathered_logits
                      - there.forward - there.gathered_logits)
    growth_head = here.head_backward_peak - there.head_backward_peak
    return MeasuredTail(
        kept_bytes=int(at_last.kept_bytes + max(0.0, here.kept - there.kept)),
        forward_bytes=int(at_last.forward_bytes + max(0.0, growth_forward)),
        backward_bytes=int(at_last.backward_bytes + max(0.0, here.backward - there.backward)),
        head_backward_bytes=int(at_last.head_backward_bytes + max(0.0, growth_head)),
        measured_up_to_tokens=last)


def shared_output_copies(model: PricedModel, batch: MicroBatchShape,
                         row: TailCost) -> TailCost:
    """`row` (the tail over the packed row) with the per-sequence outputs of a row that lays
    shared prefixes out once: every sequence's outputs are a copy of its rows (compute/
    packing.py `_GatherSequences`), L = logical rows in all. The head's row outputs die when
    the forward returns and the copies stay; the decoder's hidden row lives on beside them
    until the head's backward. Forward:
    the larger of the row's own peak and the moment of the copies (row outputs, their copies
    and, with grad on hidden states, the caller's fp32 squares over L rows). Backward: the
    larger of the row's backward beside the extra copies and the gather's backward (every
    sequence's output gradients, L rows, beside the one zeroed row they are added into)."""
    g, b = model.geometry, model.dtype_bytes
    out = batch.outputs
    logical = float(batch.logical_tokens)
    rows = float(batch.packed_tokens)
    if logical <= rows:
        return row
    head_row = (FP32 if out.target_logprobs else 0.0) + out.top_k * (FP32 + INT64) + (
        g.vocab_size * FP32 if out.logits else 0.0)
    hidden_row = g.hidden_size * b if out.hidden_states else 0.0
    # Each gathered output keeps its rows' int64 indices for its backward.
    gathers = (int(out.target_logprobs) + 2 * int(out.top_k > 0) + int(out.logits)
               + int(out.hidden_states))
    copies = logical * (head_row + hidden_row + gathers * INT64)
    # Through the layers' backward the copies stand in for the row's outputs; the decoder's
    # hidden row, which the row's tail keeps, dies with the head's backward (no output is a
    # view of it), and without a head output, once the copies are made: only the head's
    # backward reads it.
    decoder_row = rows * g.hidden_size * b
    uses_head = out.uses_head
    # The head keeps the row's top-k ids for its backward (the row's other outputs die as
    # the forward returns): live beside the copies until the head's backward ends.
    saved_top_k_ids = rows * out.top_k * INT64
    held_row = decoder_row + saved_top_k_ids if uses_head else 0.0
    rescore = rescored_branch_rows(model, batch)
    kept = (row.kept - decoder_row + (logical - rows) * head_row
            + logical * (hidden_row + gathers * INT64) + rescore.kept)
    caller_forward = 0.0
    backward = row.backward
    if batch.grad_enabled:
        # Per row, the gradients of the log-probs (target and top-k), then of every output.
        logprob_grad_row = (FP32 if out.target_logprobs else 0.0) + out.top_k * FP32
        grad_row = logprob_grad_row + (g.vocab_size * FP32 if out.logits else 0.0) + hidden_row
        caller_backward = 0.0
        if out.hidden_states:
            # The caller's fp32 mean-square per sequence, over L rows; its backward's
            # transients, one sequence at a time, end before the gather's.
            square_forward, square_backward = caller_mean_square_per_row(model)
            caller_forward = logical * square_forward
            caller_backward = float(max(batch.sequence_lengths_tokens)) * square_backward
        gather_backward = (kept + held_row + row.saved + logical * grad_row
                           + max(rows * grad_row, caller_backward))
        # The head's backward runs beside the copies, the decoder row it saved and the
        # gather's zeroed rows. Those stand in for the caller's gradients at the row, which
        # for log-probs summed by the caller are a view of the loss's scalar gradient (no
        # storage) and for logits and hidden states are tensors the row's tail holds.
        # (The row's own caller-loss term is that same gradient at the row: not twice.)
        # Only the head's moment of the row's backward meets the copies: the caller's own ops
        # run per sequence, on the copies, and the gather's branch prices them.
        backward = max(row.head_backward_peak - row.caller_loss + kept + held_row
                       + rows * logprob_grad_row - row.kept + rescore.backward,
                       gather_backward)
    # The head's moment (its TP gather of a logits chunk included) is the row's own: the
    # copies do not exist yet and the decoder row is the head's input. The gather is gone by
    # the copies' moment: the larger of the two is the forward, with the gather a term of
    # its own only where the head's moment is it.
    head_moment = row.forward + row.gathered_logits + rescore.forward
    copies_moment = row.kept + row.saved + copies + caller_forward
    if copies_moment > head_moment:
        forward, gathered = copies_moment, 0.0
    else:
        forward, gathered = head_moment - row.gathered_logits, row.gathered_logits
    return replace(row, kept=kept, forward=forward, backward=backward, head_backward=None,
                   gathered_logits=gathered,
                   note=f"{row.note}; per-sequence output copies of {int(logical)} rows")


@dataclass(frozen=True)
class RescoredRows:
    """The rows of a shared prefix whose sequences continue with different tokens: their
    target log-probs are scored again with each other sequence's target (compute/execute.py,
    `extra_rows`). What it keeps and adds beside the tail, forward and backward."""

    kept: float
    forward: float
    backward: float


def rescored_branch_rows(model: PricedModel, batch: MicroBatchShape) -> RescoredRows:
    """At most one row per sequence beyond the first (a prefix node's last row, once per
    child after the first): the gathered hidden rows and their log-normaliser are kept for
    the extra head's backward, its logits are one small chunk in forward, and the gather's
    backward materialises a zeroed [S, hidden] gradient of the whole row, live beside the
    head's own backward until the two are added (unless hidden states are requested, whose
    own gather's gradient row it is added into)."""
    if not (batch.outputs.target_logprobs and batch.logical_tokens > batch.packed_tokens):
        return RescoredRows(0.0, 0.0, 0.0)
    g, b, tp = model.geometry, model.dtype_bytes, model.layout.tensor_parallel
    extra = float(max(0, len(batch.sequence_lengths_tokens) - 1))
    kept = extra * (g.hidden_size * b + FP32)
    forward = extra * (g.vocab_size / tp) * (b + FP32)
    # With hidden states requested, their gather's backward already holds a zeroed
    # [S, hidden] row, into which this gradient is added in place.
    backward = (float(batch.packed_tokens) * g.hidden_size * b
                if batch.grad_enabled and not batch.outputs.hidden_states else 0.0)
    return RescoredRows(kept, forward, backward)


def largest_allocation(model: PricedModel, batch: MicroBatchShape, s: int, S: int) -> int:
    """The largest single tensor of the micro-batch (what the allocator reserve must fit)."""
    g, b, tp = model.geometry, model.dtype_bytes, model.layout.tensor_parallel
    # The heads run on the whole row on every CP rank (S = s without CP).
    sizes = [S * g.hidden_size * b]
    out = batch.outputs
    if out.uses_head:
        chunk = min(model.head_chunk_tokens, S)
        sizes.append(chunk * g.vocab_size / tp * FP32)
    if out.logits:
        sizes.append(S * g.vocab_size * FP32)
    if model.implementation.attention == "unfused":
        sizes.append(g.num_attention_heads / tp * s * S * FP32)
    sizes.append(s * 2 * g.ffn_hidden_size / tp * b)
    return int(max(sizes))
