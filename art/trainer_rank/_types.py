"""The public value types of art.trainer_rank: inputs, outputs, micro-batches, stats, errors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from art.trainer_rank._memory.request import OutputRequest

# Decisions admission can take for one micro-batch (MicroBatchStats.decision).
COLD_CAPPED = "cold-capped"  # no profile yet for this signature: size capped, then measured
ADMITTED = "admitted"  # fits under the recompute in force
SPLIT = "split"  # a no-grad group that does not fit whole, run as several sub-forwards
ESCALATED = "escalated"  # fits only under full recompute, run with full recompute
DECLINED = "declined"  # fits under no policy we may use; not run
DECISIONS: tuple[str, ...] = (COLD_CAPPED, ADMITTED, SPLIT, ESCALATED, DECLINED)


@dataclass(frozen=True, eq=False)
class ForwardInput:
    """One sequence to run through the model.

    input_tokens: 1-D integer token ids. target_tokens: optional, same length; position t is
    scored as log p(target_tokens[t] | input_tokens[:t+1]); -100 means "ignore" (logprob 0.0).
    top_k: return the k most likely next tokens per position (None = not requested, else >= 1).
    logits / hidden_states: return the full-vocabulary logits / the final hidden states.
    no_grad: this sequence needs no gradient (all sequences of one call must agree).
    """

    input_tokens: torch.Tensor
    target_tokens: torch.Tensor | None = None
    top_k: int | None = None
    logits: bool = False
    hidden_states: bool = False
    no_grad: bool = False

    def __post_init__(self) -> None:
        tokens = self.input_tokens
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
            shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens)
            raise ValueError(f"ForwardInput.input_tokens must be a 1-D tensor, got {shape}")
        if tokens.numel() < 1:
            raise ValueError("ForwardInput.input_tokens is empty; every sequence needs >= 1 token")
        if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise ValueError(
                f"ForwardInput.input_tokens must hold integer token ids, got {tokens.dtype}"
            )
        targets = self.target_tokens
        if targets is not None:
            if not isinstance(targets, torch.Tensor) or tuple(targets.shape) != tuple(tokens.shape):
                shape = tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets)
                raise ValueError(
                    f"ForwardInput.target_tokens must be a tensor shaped like input_tokens "
                    f"{tuple(tokens.shape)}, got {shape}"
                )
            if targets.dtype.is_floating_point or targets.dtype == torch.bool:
                raise ValueError(
                    f"ForwardInput.target_tokens must hold integer ids (-100 = ignore), got "
                    f"{targets.dtype}"
                )
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1
        ):
            raise ValueError(f"ForwardInput.top_k must be None or an integer >= 1, got "
                             f"{self.top_k!r}")

    @property
    def num_tokens(self) -> int:
        return int(self.input_tokens.numel())

    @property
    def outputs(self) -> OutputRequest:
        return OutputRequest(
            target_logprobs=self.target_tokens is not None,
            top_k=self.top_k or 0,
            logits=self.logits,
            hidden_states=self.hidden_states,
        )


class TopK(NamedTuple):
    logprobs: torch.Tensor  # [T, k] fp32, descending
    tokens: torch.Tensor  # [T, k] long


@dataclass
class ForwardOutput:
    """Per-sequence results, each the full sequence in source order, on every TP/CP rank."""

    target_logprobs: torch.Tensor | None = None  # [T] fp32; 0.0 where target == -100
    top_k: TopK | None = None
    logits: torch.Tensor | None = None  # [T, vocab] fp32, gathered across TP
    hidden_states: torch.Tensor | None = None  # [T, hidden] in the model dtype


@dataclass
class MicroBatchStats:
    """What admission predicted and what was measured for one yielded micro-batch."""

    decision: str
    packed_tokens: int
    logical_tokens: int
    predicted_peak_bytes: int  # resident + dynamic, the larger of memory model and profile
    predicted_dynamic_bytes: int  # what was compared with the usable limit
    usable_limit_bytes: int
    recompute_summary: str  # the recompute this micro-batch ran with
    grad_enabled: bool
    term_table: str = ""  # the memory model's itemised estimate
    predicted_source: str = "model"  # "model" or "profile" (whichever was larger)
    measured_peak_bytes: int | None = None  # dynamic peak, forward through caller backward
    sub_forwards: int = 1
    retries: int = 0  # how many times these items were re-run after an OOM
    note: str = ""

    def __post_init__(self) -> None:
        if self.decision not in DECISIONS:
            raise ValueError(f"decision must be one of {DECISIONS}, got {self.decision!r}")

    @property
    def measured_over_predicted(self) -> float | None:
        if self.measured_peak_bytes is None or self.predicted_dynamic_bytes <= 0:
            return None
        return self.measured_peak_bytes / self.predicted_dynamic_bytes


@dataclass
class MicroBatch:
    """One yielded micro-batch: whole top-level items, their outputs (same nesting), stats.

    indices are positions in the caller's top-level list (the list every DP rank passed).
    """

    inputs: list[Any]
    outputs: list[Any]
    indices: list[int]
    stats: MicroBatchStats


class TrainerRankMemoryError(RuntimeError):
    """An item cannot run within the memory limit (declined before running, or OOM at run time)."""

    def __init__(
        self,
        message: str,
        *,
        predicted_peak_bytes: int,
        usable_limit_bytes: int,
        recompute_summary: str,
        suggestion: str,
        indices_not_run: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.predicted_peak_bytes = int(predicted_peak_bytes)
        self.usable_limit_bytes = int(usable_limit_bytes)
        self.recompute_summary = recompute_summary
        self.suggestion = suggestion
        self.indices_not_run = tuple(indices_not_run)

    def __reduce__(self):
        # Keyword-only fields: rebuild through a helper so the error survives pickling
        # (it crosses process boundaries in multi-process launchers).
        return (
            _rebuild_memory_error,
            (
                self.message,
                self.predicted_peak_bytes,
                self.usable_limit_bytes,
                self.recompute_summary,
                self.suggestion,
                self.indices_not_run,
            ),
        )


def _rebuild_memory_error(
    message: str,
    predicted_peak_bytes: int,
    usable_limit_bytes: int,
    recompute_summary: str,
    suggestion: str,
    indices_not_run: tuple[int, ...],
) -> TrainerRankMemoryError:
    return TrainerRankMemoryError(
        message,
        predicted_peak_bytes=predicted_peak_bytes,
        usable_limit_bytes=usable_limit_bytes,
        recompute_summary=recompute_summary,
        suggestion=suggestion,
        indices_not_run=indices_not_run,
    )


class TrainerRankRuntimeSupportError(RuntimeError):
    """The requested run needs something this runtime does not support (e.g. pipeline stages)."""


def format_stats_table(stats_list: list[MicroBatchStats], *, unit: str = "MiB") -> str:
    """Plain-text table, one row per micro-batch (the demo's closing table)."""
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]

    def fmt(n: int | None) -> str:
        return "-" if n is None else f"{n / scale:.2f}"

    header = (
        "#", "decision", "packed", "logical", "grad", f"pred dyn {unit}", f"measured {unit}",
        "meas/pred", f"limit {unit}", "source", "recompute",
    )
    rows = [header]
    for i, s in enumerate(stats_list):
        ratio = s.measured_over_predicted
        rows.append(
            (
                str(i), s.decision + (f" x{s.sub_forwards}" if s.sub_forwards > 1 else ""),
                str(s.packed_tokens), str(s.logical_tokens), "yes" if s.grad_enabled else "no",
                fmt(s.predicted_dynamic_bytes), fmt(s.measured_peak_bytes),
                "-" if ratio is None else f"{ratio:.3f}", fmt(s.usable_limit_bytes),
                s.predicted_source, s.recompute_summary,
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
