"""What a fault is: the phases of a micro-batch (or the optimizer step) a rank can fail in,
the fault record every rank of a job reads (`Fault`, published by `phases.PhaseAgreement`),
and the errors it becomes on each rank: the agreed TrainerRankMemoryError of an OOM (in a
micro-batch, the optimizer step or a probe), or a TrainerRankPeerError naming the rank whose
exception ended the call."""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass

import torch.distributed as dist

from art.trainer_rank._types import TrainerRankMemoryError, TrainerRankPeerError


class Phase(enum.StrEnum):
    """Where in a micro-batch (or the optimizer step) a rank is; the value is the words the
    errors say and the fault record carries."""

    PLAN = "plan"
    PREPARE = "prepare"
    FORWARD = "forward"
    HEADS = "heads"
    CALLER_BACKWARD = "caller backward"
    OPTIMIZER_STEP = "optimizer step"
    CALLER_LOOP = "caller's loop body"


class FaultKind(enum.StrEnum):
    """What a fault is: an out-of-memory error, or any other exception (the fault record's
    word)."""

    OOM = "oom"
    ERROR = "error"


PLAN, PREPARE, FORWARD, HEADS = Phase.PLAN, Phase.PREPARE, Phase.FORWARD, Phase.HEADS
CALLER_BACKWARD, OPTIMIZER_STEP = Phase.CALLER_BACKWARD, Phase.OPTIMIZER_STEP
CALLER_LOOP = Phase.CALLER_LOOP
OOM, ERROR = FaultKind.OOM, FaultKind.ERROR


@dataclass(frozen=True)
class MicroBatchContext:
    """What every rank of the replica knows about the micro-batch in flight (same plan)."""

    call: int
    micro_batch: int
    items: tuple[int, ...]
    signature: str
    packed_tokens: int
    usable_bytes: int
    predicted_bytes: int
    recompute_summary: str
    model_bytes: int = 0  # the memory model's own prediction (what profiles correct)


@dataclass(frozen=True)
class Fault:
    """An error on one rank, as every rank of the job reports it: `kind` OOM (an
    out-of-memory error) or ERROR (any other exception, `error_type` its class name).
    `context`: the micro-batch in flight; None in the optimizer step."""

    rank: int
    phase: Phase
    where: str
    detail: str
    context: MicroBatchContext | None
    kind: FaultKind = OOM
    error_type: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Fault:
        raw = json.loads(text)
        ctx = raw.pop("context")
        if ctx is not None:
            ctx["items"] = tuple(ctx["items"])
            ctx = MicroBatchContext(**ctx)
        raw["phase"], raw["kind"] = Phase(raw["phase"]), FaultKind(raw["kind"])
        return cls(context=ctx, **raw)

    def error(self) -> RuntimeError:
        """The error every rank but the failing one raises (for an OOM, the failing one too)."""
        if self.kind == ERROR:
            return self._peer_error()
        if self.context is None and self.phase == PLAN:
            return probe_memory_error(self.rank, self.detail, Probing(self.where), closed=True)
        if self.context is None:
            return self._step_error()
        ctx = self.context
        where = f", {self.where}" if self.where else ""
        return TrainerRankMemoryError(
            f"forward_micro_batches: rank {self.rank} ran out of memory in the {self.phase} "
            f"of micro-batch {ctx.micro_batch} (call {ctx.call}, items {list(ctx.items)}, "
            f"{ctx.packed_tokens} packed tokens, predicted {ctx.predicted_bytes} bytes, usable "
            f"{ctx.usable_bytes}{where}): {self.detail}. The other ranks of its model replica "
            "(or, with expert parallel across data-parallel ranks, its expert-parallel "
            "partners) were inside this phase's collectives, which the failing rank cannot "
            "complete, so "
            "the call ends here on every rank of the job and the process groups are closed. "
            "The miss is recorded in the profile; restart the job (the planner then admits "
            "less), or lower the usable memory, or switch to full recompute",
            predicted_peak_bytes=ctx.predicted_bytes,
            usable_limit_bytes=ctx.usable_bytes,
            recompute_summary=ctx.recompute_summary,
            suggestion="restart the job; the miss is recorded and the planner admits less",
            indices_not_run=ctx.items,
        )

    def _step_error(self) -> TrainerRankMemoryError:
        where = f" ({self.where})" if self.where else ""
        return TrainerRankMemoryError(
            f"optim_step: rank {self.rank} ran out of memory in the optimizer step{where}: "
            f"{self.detail}. The other ranks were inside the step's collectives (gradient "
            "reduction over data-parallel ranks, the gradient norm), which the failing rank "
            "cannot complete, so the step ends here on every rank of the job and the process "
            "groups are closed; some ranks' parameters may be updated and others not. Restart "
            "the job from the last saved checkpoint with more memory left for the optimizer "
            "(fewer resident checkpoint slots, or a lower usable limit for the forwards)",
            suggestion="restart from the last checkpoint with more memory left for the step",
        )

    def _peer_error(self) -> TrainerRankPeerError:
        where = f", {self.where}" if self.where else ""
        ctx = self.context
        at = (f" of micro-batch {ctx.micro_batch} (call {ctx.call}, items {list(ctx.items)}"
              f"{where})" if ctx is not None else (f" ({self.where})" if self.where else ""))
        what = "optim_step" if self.phase == OPTIMIZER_STEP else "forward_micro_batches"
        message = self.detail.split(": ", 1)[1] if ": " in self.detail else self.detail
        return TrainerRankPeerError(
            f"{what}: rank {self.rank} raised {self.detail} in the {self.phase}{at}. The other "
            "ranks of the job were inside or next to this phase's collectives, which that rank "
            "will not complete, so the call ends here on every rank and the process groups are "
            f"closed. Rank {self.rank}'s own traceback shows the cause; fix it and restart the "
            "job",
            failing_rank=self.rank, phase=self.phase, error_type=self.error_type,
            error_message=message,
        )


class Probing(enum.StrEnum):
    """When a probe runs (a fault record's `where` for a failure in one)."""

    ON_FIRST_USE = "probing the model on first use"
    AT_START_UP = "probing the model at start-up"


def probe_memory_error(rank: int, detail: str, when: Probing, *,
                       closed: bool) -> TrainerRankMemoryError:
    """An out-of-memory error in a probe: on first use, a layer mode or a head measured while
    a call plans, before any of its micro-batches ran; at start-up, every mode measured when
    the trainer is built (expert parallel). `closed`: on several ranks, where the others
    were inside the probe's collectives and the process groups are closed."""
    others = (" The other ranks its collectives span were inside them, which the failing "
              "rank cannot complete, so it ends here on every rank of the job and the "
              "process groups are closed." if closed else "")
    what, before = (("forward_micro_batches", "in the plan, before any micro-batch of the "
                     "call ran") if when == Probing.ON_FIRST_USE else
                    ("TrainerRank(runtime)", "expert parallel measures every layer mode "
                     "when the trainer is built"))
    return TrainerRankMemoryError(
        f"{what}: rank {rank} ran out of memory while {when} ({before}): {detail}. The probe "
        "measures one layer, or the head, at token counts the default formulas fit in the "
        f"usable limit, and this one did not fit.{others} Restart the job with more free "
        "memory on that rank's device, or with the probe off "
        "(ART_TRAINER_RANK_PROBE_LAYERS=false: the default formulas price every micro-batch)",
        suggestion="free memory on the device, or set ART_TRAINER_RANK_PROBE_LAYERS=false",
    )


def is_communication_error(exc: BaseException) -> bool:
    """A collective failed because a peer went away, closed its pairs or timed out."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(marker in text for marker in (
        "gloo/transport", "Connection closed by peer", "Connection reset by peer",
        "pair closure", "Timed out waiting", "NCCL communicator was aborted",
    ))


def where_in_model(exc: BaseException) -> tuple[Phase, str]:
    """(phase, where) of an error raised inside the compute path, from its traceback: the
    heads module, or the transformer layer whose forward was running (its number)."""
    phase, where = FORWARD, ""
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        path = frame.f_code.co_filename
        if path.endswith("compute/heads.py"):
            phase = HEADS
        elif path.endswith("transformer_layer.py"):
            layer = getattr(frame.f_locals.get("self"), "layer_number", None)
            if isinstance(layer, int):
                where = f"layer {layer}"
        tb = tb.tb_next
    return phase, where


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]
