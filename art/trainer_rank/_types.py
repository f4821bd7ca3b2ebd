"""The public value types of art.trainer_rank: inputs, outputs, micro-batches, stats, errors.

Field names and defaults follow ART's `art.trainer_rank` so that a driver written against it
runs unchanged; fields of ours come after upstream's, always with defaults.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import torch

from art.trainer_rank._request import OutputRequest


class Decision(enum.StrEnum):
    """What admission decided for one micro-batch (MicroBatchStats.decision); the value is the
    word the stats, tables and bench files show."""

    COLD_CAPPED = "cold-capped"  # no profile yet for this signature: size capped, then measured
    ADMITTED = "admitted"  # fits under the recompute in force
    SPLIT = "split"  # a no-grad group that does not fit whole, run as several sub-forwards
    ESCALATED = "escalated"  # fits only under full recompute, run with full recompute
    DECLINED = "declined"  # fits under no policy we may use; not run
    EMPTY = "empty"  # a DP rank with nothing left in this wave: nothing ran (lockstep)


COLD_CAPPED = Decision.COLD_CAPPED
ADMITTED = Decision.ADMITTED
SPLIT = Decision.SPLIT
ESCALATED = Decision.ESCALATED
DECLINED = Decision.DECLINED
EMPTY = Decision.EMPTY
DECISIONS: tuple[Decision, ...] = tuple(Decision)

T = TypeVar("T")


class _Unset:
    """The type of `Unset`: "not given here, inherit from the enclosing call"."""

    _instance: _Unset | None = None

    def __new__(cls) -> _Unset:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "Unset"

    def __reduce__(self) -> str:
        return "Unset"


Unset = _Unset()
# Which adapter a forward runs with: a checkpoint name/path, None (the base model, no adapter)
# or Unset (whatever the enclosing call or the trainer's active adapter says).
AdapterSelection: TypeAlias = str | None | _Unset


@dataclass(frozen=True)
class AdamParams:
    """Per-step Adam hyper-parameters for `TrainerRank.optim_step`."""

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.1
    grad_clip_norm: float = 0.1
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if not self.learning_rate >= 0.0:
            raise ValueError(f"AdamParams.learning_rate must be >= 0, got {self.learning_rate!r}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"AdamParams.{name} must be in [0, 1), got {value!r}")
        if not self.weight_decay >= 0.0:
            raise ValueError(f"AdamParams.weight_decay must be >= 0, got {self.weight_decay!r}")
        if not self.grad_clip_norm >= 0.0:
            raise ValueError(
                f"AdamParams.grad_clip_norm must be >= 0 (0 = no clipping), got "
                f"{self.grad_clip_norm!r}"
            )
        if not self.eps > 0.0:
            raise ValueError(f"AdamParams.eps must be > 0, got {self.eps!r}")


@dataclass(kw_only=True, eq=False)
class ForwardInput:
    """One sequence to run through the model (keyword arguments only, as upstream).

    input_tokens: integer token ids, 1-D or [1, T] (kept as a 1-D view; the caller's tensor is
    never changed), on any device. target_tokens: optional, [T] or [T, k] (k targets per
    position); position t is scored as log p(target | input_tokens[:t+1]); -100 means "ignore"
    (logprob 0.0). top_k: return the k most likely next tokens per position.
    logits / hidden_states: return the full-vocabulary logits / the final hidden states.
    no_grad: None inherits the call's mode; True/False override it for this sequence.
    checkpoint: which adapter runs this sequence (Unset: the call's).
    """

    input_tokens: torch.Tensor
    target_tokens: torch.Tensor | None = None
    top_k: int | None = None
    logits: bool = False
    hidden_states: bool = False
    no_grad: bool | None = None
    checkpoint: Any = Unset

    def __post_init__(self) -> None:
        tokens = self.input_tokens
        if not isinstance(tokens, torch.Tensor):
            raise ValueError(
                f"ForwardInput.input_tokens must be a tensor, got {type(tokens).__name__}"
            )
        if tokens.dim() == 2 and tokens.shape[0] == 1:
            tokens = tokens.reshape(-1)
        if tokens.dim() != 1:
            raise ValueError(
                f"ForwardInput.input_tokens must be [T] or [1, T], got {tuple(tokens.shape)}"
            )
        if tokens.numel() < 1:
            raise ValueError("ForwardInput.input_tokens is empty; every sequence needs >= 1 token")
        if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise ValueError(
                f"ForwardInput.input_tokens must hold integer token ids, got {tokens.dtype}"
            )
        self.input_tokens = tokens
        targets = self.target_tokens
        if targets is not None:
            if not isinstance(targets, torch.Tensor):
                raise ValueError(
                    f"ForwardInput.target_tokens must be a tensor, got {type(targets).__name__}"
                )
            n = tokens.shape[0]
            if targets.dim() == 2 and targets.shape[0] == 1 and targets.shape[1] == n and n > 1:
                targets = targets.reshape(-1)  # [1, T], like the input
            if not (targets.dim() == 1 and targets.shape[0] == n) and not (
                targets.dim() == 2 and targets.shape[0] == n and targets.shape[1] >= 1
            ):
                raise ValueError(
                    f"ForwardInput.target_tokens must be [T] or [T, k] with T = {n} (the input's "
                    f"length), got {tuple(targets.shape)}"
                )
            if targets.dtype.is_floating_point or targets.dtype == torch.bool:
                raise ValueError(
                    f"ForwardInput.target_tokens must hold integer ids (-100 = ignore), got "
                    f"{targets.dtype}"
                )
            self.target_tokens = targets
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1
        ):
            raise ValueError(f"ForwardInput.top_k must be None or an integer >= 1, got "
                             f"{self.top_k!r}")
        if self.no_grad is not None and not isinstance(self.no_grad, bool):
            raise ValueError(f"ForwardInput.no_grad must be None or a bool, got {self.no_grad!r}")

    @property
    def num_tokens(self) -> int:
        return int(self.input_tokens.shape[0])

    @property
    def targets_per_position(self) -> int:
        """k for [T, k] targets, 1 for [T], 0 without targets."""
        if self.target_tokens is None:
            return 0
        return 1 if self.target_tokens.dim() == 1 else int(self.target_tokens.shape[1])

    @property
    def outputs(self) -> OutputRequest:
        return OutputRequest(
            target_logprobs=self.target_tokens is not None,
            top_k=self.top_k or 0,
            logits=self.logits,
            hidden_states=self.hidden_states,
        )


@dataclass(frozen=True)
class TopK:
    logprobs: torch.Tensor  # [T, k] fp32, descending
    tokens: torch.Tensor  # [T, k] long


@dataclass(frozen=True)
class ForwardOutput:
    """Per-sequence results, each the full sequence in source order, on every TP/CP rank."""

    target_logprobs: torch.Tensor | None = None  # [T] (or [T, k]) fp32; 0.0 where ignored
    top_k: TopK | None = None
    logits: torch.Tensor | None = None  # [T, vocab] fp32, gathered across TP
    hidden_states: torch.Tensor | None = None  # [T, hidden] in the model dtype
    checkpoint: str | None = None  # the adapter that produced it (None: the base model)
    no_grad: bool = False


@dataclass(frozen=True)
class MicroBatchStats:
    """One yielded micro-batch: upstream's fields first (required, as upstream has them), then
    what admission predicted. `global_start` / `global_stop` are the data-parallel wave the
    micro-batch belongs to (every index lies in it), `global_count` its width.
    `estimated_required_bytes` is the dynamic peak compared with `available_bytes` (the usable
    limit agreed over the replica). The peak measured through the caller's backward is known
    only after the caller hands control back: `TrainerRank.stats_history` holds these records
    with `measured_peak_bytes` filled in."""

    global_start: int
    global_stop: int
    global_count: int
    local_count: int
    packed_tokens: int
    logical_tokens: int
    estimated_required_bytes: int
    available_bytes: int
    rejected_candidates: int
    cold_start: bool
    subforward_count: int = 1
    # ours
    decision: Decision = ADMITTED
    predicted_peak_bytes: int = 0  # resident + dynamic, the larger of memory model and profile
    recompute_summary: str = ""  # the recompute this micro-batch ran with
    grad_enabled: bool = True
    term_table: str = ""  # the memory model's itemised estimate
    predicted_source: str = "model"  # "model" or "model x profile correction"
    # The dynamic peak from the forward through the caller's backward: None in the record the
    # caller receives, filled in the copy kept in TrainerRank.stats_history.
    measured_peak_bytes: int | None = None
    retries: int = 0  # how many times these items were re-run after an OOM
    note: str = ""

    def __post_init__(self) -> None:
        if self.decision not in DECISIONS:
            raise ValueError(f"decision must be one of {tuple(str(d) for d in DECISIONS)}, "
                             f"got {self.decision!r}")

    @property
    def predicted_dynamic_bytes(self) -> int:
        return self.estimated_required_bytes

    @property
    def usable_limit_bytes(self) -> int:
        return self.available_bytes

    @property
    def sub_forwards(self) -> int:
        return self.subforward_count

    @property
    def measured_over_predicted(self) -> float | None:
        if self.measured_peak_bytes is None or self.estimated_required_bytes <= 0:
            return None
        return self.measured_peak_bytes / self.estimated_required_bytes


@dataclass(frozen=True)
class MicroBatch:
    """One yielded micro-batch: whole top-level items, their outputs (same nesting), stats.

    indices are positions in the caller's top-level list (the list every DP rank passed).
    """

    inputs: Sequence[Any]
    outputs: Sequence[Any]
    indices: Sequence[int]
    stats: MicroBatchStats

    def select(self, xs: Sequence[T]) -> list[T]:
        """The entries of a per-input list of the caller's that belong to this micro-batch."""
        return [xs[i] for i in self.indices]


class TrainerRankMemoryError(RuntimeError):
    """An item cannot run within the memory limit (declined before running, or OOM at run time)."""

    def __init__(
        self,
        message: str,
        *,
        predicted_peak_bytes: int = 0,
        usable_limit_bytes: int = 0,
        suggestion: str = "",
        recompute_summary: str = "",
        indices_not_run: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.predicted_peak_bytes = int(predicted_peak_bytes)
        self.usable_limit_bytes = int(usable_limit_bytes)
        self.suggestion = suggestion
        self.recompute_summary = recompute_summary
        self.indices_not_run = tuple(indices_not_run)

    def __reduce__(self):
        # Keyword-only fields: rebuild through a helper so the error survives pickling
        # (it crosses process boundaries in multi-process launchers).
        return (
            _rebuild_memory_error,
            (
                type(self),
                self.message,
                self.predicted_peak_bytes,
                self.usable_limit_bytes,
                self.suggestion,
                self.recompute_summary,
                self.indices_not_run,
            ),
        )


class TrainerRankPartialExecutionError(TrainerRankMemoryError):
    """A call split into several sub-forwards failed after some of them ran (their graphs and
    outputs are dropped; gradients they accumulated are restored when affordable)."""


def _rebuild_memory_error(
    cls: type[TrainerRankMemoryError],
    message: str,
    predicted_peak_bytes: int,
    usable_limit_bytes: int,
    suggestion: str,
    recompute_summary: str,
    indices_not_run: tuple[int, ...],
) -> TrainerRankMemoryError:
    return cls(
        message,
        predicted_peak_bytes=predicted_peak_bytes,
        usable_limit_bytes=usable_limit_bytes,
        suggestion=suggestion,
        recompute_summary=recompute_summary,
        indices_not_run=indices_not_run,
    )


class TrainerRankPeerError(RuntimeError):
    """Another rank of the job raised an exception (not an out-of-memory error) inside a phase
    with collectives; this rank cannot complete them, so it ends the call too. The failing
    rank raises its own exception; this error names that rank, the phase and the exception."""

    def __init__(self, message: str, *, failing_rank: int = -1, phase: str = "",
                 error_type: str = "", error_message: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.failing_rank = int(failing_rank)
        self.phase = phase
        self.error_type = error_type
        self.error_message = error_message

    def __reduce__(self):
        return (_rebuild_peer_error, (type(self), self.message, self.failing_rank, self.phase,
                                      self.error_type, self.error_message))


def _rebuild_peer_error(cls: type[TrainerRankPeerError], message: str, failing_rank: int,
                        phase: str, error_type: str, error_message: str) -> TrainerRankPeerError:
    return cls(message, failing_rank=failing_rank, phase=phase, error_type=error_type,
               error_message=error_message)


class TrainerRankRuntimeSupportError(RuntimeError):
    """The requested run needs something this runtime does not support (e.g. pipeline stages)."""


class TrainerRankSlotStateError(RuntimeError):
    """An adapter-slot operation does not fit the trainer's slot state (e.g. an optimizer step
    while a caller still holds a graph, or a checkpoint that is not loaded)."""


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
