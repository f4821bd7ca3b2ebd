"""The GPU-time budget inside one worker process: which step may still start before its
deadline, and the loop that runs a process's steps, writing one row per step as it goes.

A step starts only when its predicted seconds, scaled by how this process's finished steps
of its kind compared with their predictions, fit before the deadline. A step that is not
essential must also leave room for every essential step after it (model steps, the groups
sharing a prompt), so when time runs short the pairs go first and every policy's model and
group still run. A step that does not fit is written as skipped with the reason; a model
step skipped or failed takes its cells with it. Rows are flushed one by one, so a process
stopped from outside leaves every row it finished.
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from _gpu_check.plan import Step

# Predictions are scaled per kind of step (model, cell) by the median of taken / predicted
# over this process's finished steps of that kind, from this many on, kept in bounds: one
# slow step does not skip the rest, and steps faster than predicted do not admit ones that
# would then overrun.
MIN_STEPS_FOR_SCALE = {"model": 1, "cell": 3}
SCALE_BOUNDS = (1.0, 4.0)


@dataclass
class Budget:
    deadline: float  # time.time() seconds
    clock: Callable[[], float] = time.time
    ratios: dict[str, list[float]] = field(default_factory=dict)  # kind -> taken / predicted

    def scale(self, kind: str) -> float:
        seen = self.ratios.get(kind, [])
        if len(seen) < MIN_STEPS_FOR_SCALE.get(kind, 1):
            return 1.0
        low, high = SCALE_BOUNDS
        return min(high, max(low, statistics.median(seen)))

    def need(self, step: Step) -> float:
        """`step`'s predicted seconds, scaled by how this process's steps of its kind ran."""
        return step.predicted_seconds * self.scale(step.kind)

    def refusal(self, step: Step, later: Sequence[Step]) -> str | None:
        """Why `step` may not start now (None: it may)."""
        left = self.deadline - self.clock()
        need = self.need(step)
        if need > left:
            return (f"budget: predicted {need:.1f} s, {max(0.0, left):.1f} s left before the "
                    "deadline")
        if not step.essential:
            held = sum(self.need(s) for s in later if s.essential)
            if need + held > left:
                return (f"budget: predicted {need:.1f} s, and {held:.1f} s of {left:.1f} s "
                        "left are held for the model steps and groups still to come")
        return None

    def record(self, step: Step, seconds: float) -> None:
        if step.predicted_seconds > 0:
            self.ratios.setdefault(step.kind, []).append(seconds / step.predicted_seconds)


@dataclass
class StepRow:
    """What one step's row says: the step, its status and its figures."""

    step: Step
    status: str  # "ok" | "failed" | "skipped" ("not run": the parent's, for rows never written)
    seconds: float = 0.0
    reason: str = ""
    figures: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        s = self.step
        row: dict[str, Any] = {
            "kind": s.kind, "allocator": s.allocator, "geometry": s.geometry,
            "policy": s.policy, "name": s.name, "status": self.status,
            "reason": self.reason, "seconds": round(self.seconds, 3),
            "predicted_seconds": round(s.predicted_seconds, 3), "essential": s.essential}
        if s.cell is not None:
            c = s.cell.cell
            row |= {"label": s.cell.label, "lengths": "+".join(map(str, c.lengths)),
                    "shared_prefix": c.shared_prefix, "packed_tokens": s.cell.row.tokens,
                    "outputs": c.outputs, "grad": c.grad, "loss": c.loss}
        return row | self.figures


def run_steps(steps: Sequence[Step], budget: Budget, *,
              build: Callable[[Step], Any],
              measure: Callable[[Any, Step], dict[str, Any]],
              release: Callable[[], None],
              write: Callable[[StepRow], None]) -> None:
    """Run `steps` in order: "model" steps through `build` (the model its cells then use),
    "cell" steps through `measure`; once a model's cells are done the loop drops it and calls
    `release` (to free what it held); "start" steps are written by the caller. Failures are
    rows, never exceptions."""
    model: Any = None
    model_missing = ""  # why the current model's cells cannot run
    for n, step in enumerate(steps):
        if step.kind == "start":
            continue
        if step.kind == "model":
            if model is not None:
                model = None
                release()
            refusal = budget.refusal(step, steps[n + 1:])
            if refusal is not None:
                model_missing = "its model was skipped"
                write(StepRow(step, "skipped", reason=refusal))
                continue
            start = budget.clock()
            try:
                model = build(step)
            except Exception as error:  # any failure is this step's row; the run goes on
                model_missing = "its model failed to build"
                write(StepRow(step, "failed", budget.clock() - start, _described(error)))
                continue
            model_missing = ""
            budget.record(step, budget.clock() - start)
            write(StepRow(step, "ok", budget.clock() - start))
            continue
        if model is None:
            write(StepRow(step, "skipped", reason=model_missing or "no model step before it"))
            continue
        refusal = budget.refusal(step, steps[n + 1:])
        if refusal is not None:
            write(StepRow(step, "skipped", reason=refusal))
            continue
        start = budget.clock()
        try:
            figures = measure(model, step)
        except Exception as error:  # an OOM too: the cell's row says so, the next one runs
            write(StepRow(step, "failed", budget.clock() - start, _described(error)))
            continue
        taken = budget.clock() - start
        budget.record(step, taken)
        write(StepRow(step, "ok", taken, figures=figures))
    if model is not None:
        model = None
        release()


def _described(error: BaseException) -> str:
    """One line: the exception and where it was raised."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno})" if frames else ""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:400]}{where}"
