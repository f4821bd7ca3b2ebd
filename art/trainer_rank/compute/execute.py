"""Run one planned micro-batch: pack each sub-forward, decoder, chunked heads, and hand every
sequence its own outputs (only those it asked for), in source order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.trainer_rank._types import ForwardInput, ForwardOutput, TopK
from art.trainer_rank.compute.forward import decoder_hidden_states
from art.trainer_rank.compute.heads import compute_heads
from art.trainer_rank.compute.items import outputs_union
from art.trainer_rank.compute.packing import (
    IGNORE_INDEX,
    PackedBatch,
    PackedTargets,
    pack_sequences,
    pack_targets,
    unpack,
)


def run_sub_forward(
    model: Any,
    leaves: Sequence[ForwardInput],
    *,
    implementation: Implementation,
    layout: ParallelLayout,
    device: torch.device,
    head_chunk_tokens: int,
    checkpoint: str | None = None,
    groups: Sequence[int] | None = None,
    batch: PackedBatch | None = None,
) -> list[ForwardOutput]:
    """One packed forward over `leaves` under the caller's grad mode. `groups`: consecutive
    leaves per indivisible group (their shared prefixes are laid out once); None = none.
    `batch`: the leaves already packed (pack_leaves), else they are packed here."""
    if batch is None:
        batch = pack_leaves(leaves, implementation=implementation, layout=layout,
                            device=device, groups=groups)
    wanted = outputs_union(leaves)
    # K targets per position: the widest request; narrower ones are padded with IGNORE_INDEX.
    columns = max((leaf.targets_per_position for leaf in leaves), default=0)
    # One target per position everywhere ([T] targets, or none): the row's targets and
    # log-probs take one column, packed and handed out without an op per sequence.
    vector_targets = all(leaf.target_tokens is None or leaf.target_tokens.dim() == 1
                         for leaf in leaves)
    hidden = decoder_hidden_states(model, batch)
    targets = None
    if wanted.target_logprobs:
        targets = _packed_targets(leaves, columns, batch, device, vector_targets)
    heads = None
    if wanted.uses_head:
        heads = compute_heads(
            model, hidden, target_tokens=None if targets is None else targets.row_targets,
            top_k=wanted.top_k, logits=wanted.logits, chunk_tokens=head_chunk_tokens,
        )
    per_hidden = unpack(hidden, batch) if wanted.hidden_states else None
    per_logprobs = None
    # With no shared row scored twice, each sequence's [T] log-probs are views of the row's
    # first column, from one split.
    one_column = (vector_targets and targets is not None
                  and not targets.extra_rows.numel())
    if heads is not None and targets is not None and one_column:
        per_logprobs = unpack(heads.target_logprobs[:, 0], batch, one_op=True)
    elif heads is not None and targets is not None:
        per_logprobs = unpack(heads.target_logprobs, batch)
        if targets.extra_rows.numel():
            # Shared rows whose sequences want different targets: score just those rows
            # again with the other targets (a gather of E rows, not the whole row).
            extra = compute_heads(
                model, hidden.index_select(0, targets.extra_rows),
                target_tokens=targets.extra_targets, chunk_tokens=head_chunk_tokens,
            ).target_logprobs
            for i, override in enumerate(targets.overrides):
                if override is not None:
                    positions, picks = override
                    per_logprobs[i] = per_logprobs[i].index_put(
                        (positions,), extra.index_select(0, picks))
    per_top_values = per_top_tokens = per_logits = None
    if heads is not None and wanted.top_k:
        per_top_values = unpack(heads.top_k_logprobs, batch, one_op=True)
        per_top_tokens = unpack(heads.top_k_tokens, batch, one_op=True)
    if heads is not None and wanted.logits:
        per_logits = unpack(heads.logits, batch)
    outputs = []
    for i, leaf in enumerate(leaves):
        top = None
        if leaf.top_k and per_top_values is not None and per_top_tokens is not None:
            top = TopK(per_top_values[i][:, : leaf.top_k], per_top_tokens[i][:, : leaf.top_k])
        outputs.append(ForwardOutput(
            target_logprobs=(None if leaf.target_tokens is None or per_logprobs is None
                             else per_logprobs[i] if one_column
                             else _own_columns(per_logprobs[i], leaf)),
            top_k=top,
            logits=per_logits[i] if leaf.logits and per_logits is not None else None,
            hidden_states=(per_hidden[i] if leaf.hidden_states and per_hidden is not None
                           else None),
            checkpoint=checkpoint,
            no_grad=not torch.is_grad_enabled(),
        ))
    return outputs


def pack_leaves(
    leaves: Sequence[ForwardInput],
    *,
    implementation: Implementation,
    layout: ParallelLayout,
    device: torch.device,
    groups: Sequence[int] | None = None,
) -> PackedBatch:
    """The packed row of one forward: this rank's own allocations, no collective."""
    return pack_sequences([leaf.input_tokens for leaf in leaves], implementation=implementation,
                          layout=layout, device=device, groups=groups)


def detached_output(out: ForwardOutput) -> ForwardOutput:
    """A sequence that asked for no grad inside a grad run: its outputs carry no graph."""
    def d(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach()

    top = out.top_k
    return replace(
        out, target_logprobs=d(out.target_logprobs), logits=d(out.logits),
        hidden_states=d(out.hidden_states), no_grad=True,
        top_k=None if top is None else TopK(top.logprobs.detach(), top.tokens),
    )


def _packed_targets(leaves: Sequence[ForwardInput], columns: int, batch: PackedBatch,
                    device: torch.device, vector_targets: bool) -> PackedTargets:
    """The row's targets as [S, columns]. `vector_targets` (every sequence's targets [T] or
    none, so one column): the 1-D targets are packed as they are and the row gets its column
    once (no op per sequence)."""
    if vector_targets:
        packed = pack_targets([_one_column(leaf).to(device) for leaf in leaves], batch)
        return replace(packed, row_targets=packed.row_targets.unsqueeze(1),
                       extra_targets=packed.extra_targets.unsqueeze(1))
    return pack_targets([_target_columns(leaf, columns).to(device) for leaf in leaves], batch)


def _one_column(leaf: ForwardInput) -> torch.Tensor:
    """[T] long targets on CPU: the caller's tensor itself when it already is one (pack_targets
    copies it into the row and never writes to it)."""
    targets = leaf.target_tokens
    if targets is None:
        return torch.full((leaf.num_tokens,), IGNORE_INDEX, dtype=torch.long)
    if targets.dtype == torch.long and targets.device.type == "cpu":
        return targets
    return targets.detach().to("cpu", torch.long)


def _target_columns(leaf: ForwardInput, columns: int) -> torch.Tensor:
    """This sequence's targets as [T, columns] on the input's device (IGNORE_INDEX padding);
    the caller's tensor is read, never changed."""
    out = torch.full((leaf.num_tokens, columns), IGNORE_INDEX, dtype=torch.long)
    targets = leaf.target_tokens
    if targets is not None:
        targets = targets.detach().to("cpu", torch.long)
        out[:, : leaf.targets_per_position] = targets.view(leaf.num_tokens, -1)
    return out


def _own_columns(logprobs: torch.Tensor, leaf: ForwardInput) -> torch.Tensor:
    """[T] for [T] targets, [T, k] for [T, k] targets."""
    if leaf.target_tokens is not None and leaf.target_tokens.dim() == 1:
        return logprobs[:, 0]
    return logprobs[:, : leaf.targets_per_position]
