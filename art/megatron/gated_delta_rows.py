"""Gated DeltaNet's two stateful kernels over a packed row, one recurrence per path of the
row's recurrent layout, on whatever kernels are installed.

The causal conv: each segment is convolved after the last kernel-1 inputs of its path (zeros
where the path is shorter), so a sequence never sees another and a child segment continues its
parent's window. With causal-conv1d installed and a row of plain sequences, its `seq_idx` does
the same in one call; otherwise (and always for a tree) one depthwise `conv1d` over the segments
laid end to end, each after its window, with no padding between.

The gated delta rule, in fla's varlen contract (`chunk_gated_delta_rule(q, k, v, g, beta,
scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)`: batch 1,
states [sequences, heads, dk, dv], fp32): a row of plain sequences is one call with its
cu_seqlens. A tree runs depth by depth: the packer lays a tree out depth by depth, so each
depth's segments are a slice of the row (a `RecurrentLayout.calls` run), run as one varlen call
whose initial states are the final states its parents ended with (zero for a sequence's first
segment); the runs' outputs are concatenated in row order. Gradients flow through the
handed-over states, so a child's loss reaches its prefix.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from art.megatron.recurrent_layout import RecurrentLayout

DeltaRule = Callable[..., tuple[Tensor, Tensor | None]]


def cu_seqlens(lengths: list[int] | tuple[int, ...], device: torch.device) -> Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.long, device=device)


def segmented_causal_conv(x: Tensor, weight: Tensor, bias: Tensor | None,
                          layout: RecurrentLayout) -> Tensor:
    """x [b, channels, s] -> [b, channels, s]: a depthwise causal conv per segment after its
    path's window. `weight` is nn.Conv1d's [channels, 1, kernel]."""
    width = weight.shape[-1] - 1
    pieces: list[Tensor] = []
    spans: list[tuple[int, int]] = []  # each segment's first output and length in the result
    cursor = 0
    for index, segment in enumerate(layout.segments):
        window = layout.path_rows(index, width)
        if len(window) < width:
            pieces.append(x.new_zeros(*x.shape[:-1], width - len(window)))
        if window:
            pieces.append(x[..., window])
        pieces.append(x[..., segment.start:segment.end])
        spans.append((cursor, segment.length))
        cursor += width + segment.length
    y = torch.nn.functional.conv1d(torch.cat(pieces, dim=-1), weight, bias, groups=x.shape[1])
    return torch.cat([y[..., o:o + n] for o, n in spans], dim=-1)


def causal_conv(module: Any, x: Tensor, layout: RecurrentLayout, activation: str,
                act_fn: Callable[[Tensor], Tensor], conv_fn: Callable[..., Tensor] | None
                ) -> Tensor:
    """The layer's conv + activation over the row: x [b, channels, s] contiguous."""
    seq_len = x.shape[-1]
    single = len(layout.segments) == 1
    if conv_fn is None and single:
        # One sequence: Megatron's own call (nn.Conv1d padded both sides, cut to the row).
        return act_fn(module(x)[..., :seq_len])
    if conv_fn is not None and not layout.is_tree:
        seq_idx = None
        if not single:
            # causal-conv1d takes seq_idx with channel-last x only.
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
            seq_idx = torch.cat([torch.full((s.length,), n, dtype=torch.int32, device=x.device)
                                 for n, s in enumerate(layout.segments)]).unsqueeze(0)
        return conv_fn(x=x, weight=module.weight.squeeze(1), bias=module.bias,
                       seq_idx=seq_idx, activation=activation)
    return act_fn(segmented_causal_conv(x, module.weight, module.bias, layout))


def delta_rule_over_row(rule: DeltaRule, q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                        beta: Tensor, layout: RecurrentLayout) -> Tensor:
    """The gated delta rule over a row of batch 1: [1, s, heads, d] in, [1, s, heads, dv]
    out, one recurrence per path of `layout`."""
    if not layout.is_tree:
        lengths = [s.length for s in layout.segments]
        cu = cu_seqlens(lengths, q.device) if len(lengths) > 1 else None
        out, _ = rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, cu_seqlens=cu)
        return out
    state_shape = (k.shape[2], k.shape[3], v.shape[3])
    sizes = [layout.segments[run[-1]].end - layout.segments[run[0]].start
             for run in layout.calls]
    # One split per input rather than a slice per run: the backward of a split concatenates
    # the runs' gradients once they all exist, where each slice's backward would fill a
    # row-sized zero tensor while the next run's backward is still working.
    per_run = list(zip(*(torch.split(t, sizes, dim=1) for t in (q, k, v, g, beta))))
    finals: dict[int, Tensor] = {}
    parts: list[Tensor] = []
    for run, (q_run, k_run, v_run, g_run, beta_run) in zip(layout.calls, per_run):
        members = [layout.segments[i] for i in run]
        initial = None
        if any(segment.parent is not None for segment in members):
            zero = torch.zeros(state_shape, dtype=torch.float32, device=q.device)
            initial = torch.stack([zero if s.parent is None else finals[s.parent]
                                   for s in members])
            del zero
        # A parent's children all run in the next run: its final state is needed no more
        # (the stacked copy, which the rule keeps for backward, is what flows on).
        finals.clear()
        wanted = any(layout.has_children[i] for i in run)
        part, final = rule(q_run, k_run, v_run, g=g_run, beta=beta_run, initial_state=initial,
                           output_final_state=wanted, use_qk_l2norm_in_kernel=False,
                           cu_seqlens=cu_seqlens([s.length for s in members], q.device))
        if wanted:
            assert final is not None
            for n, i in enumerate(run):
                if layout.has_children[i]:
                    finals[i] = final[n]
        parts.append(part)
        del part, final, initial
    # Concatenated rather than written into one output: the backward of a concatenation
    # hands each run a view of the row's gradient, where slice writes would clone it.
    return torch.cat(parts, dim=1)
