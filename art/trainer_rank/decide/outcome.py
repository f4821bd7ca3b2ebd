"""What a micro-batch's plan reports once it ran (its MicroBatchStats), a run-time OOM recorded
as a profile miss, and the errors that end items: declined (alone, after run-time misses, or
several combined into one after every other item was yielded), too many OOMs in one call, a
caller-backward OOM whose gradients cannot be undone."""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass, field

from art.trainer_rank._types import (
    COLD_CAPPED,
    MicroBatchStats,
    TrainerRankMemoryError,
    TrainerRankPartialExecutionError,
)
from art.trainer_rank.compute.items import group_shared_tokens
from art.trainer_rank.decide.admission import Admission
from art.trainer_rank.decide.plan import Plan, PlanRequest
from art.trainer_rank.decide.priced import gib
from art.trainer_rank.decide.profiles import ProfileStore
from art.trainer_rank.ranks.lockstep import Wave

logger = logging.getLogger("art.trainer_rank")


@dataclass
class CallOutcome:
    """What one public call has run into so far, across its waves and micro-batches: the
    declined items' errors (raised together once everything else ran), run-time OOMs (bounded
    per call) and the retries of each item."""

    number: int
    micro_batches: int = 0
    declined: list[TrainerRankMemoryError] = field(default_factory=list)
    retries: dict[int, int] = field(default_factory=dict)
    oom_count: int = 0
    last_oom: BaseException | None = None

    def decline(self, plan: Plan) -> None:
        """Keep a declined plan's error, raised once the call ran everything else; after
        run-time misses of its items the error says how many attempts they had."""
        assert plan.error is not None
        error = plan.error
        attempts = max((self.retries.get(i, 0) for i in plan.indices), default=0)
        if attempts:
            error = declined_after_retries(error, plan.indices, attempts)
        logger.warning("%s", error)
        self.declined.append(error)

    def count_oom(self, plan: Plan, usable: int, exc: BaseException, pending: list[int],
                  max_retries: int) -> None:
        """A run-time OOM of `plan`: its items are retried (smaller) unless the call has run
        out of memory more than `max_retries` times, which ends it (`pending`: the items not
        planned yet, named in that error)."""
        self.oom_count += 1
        self.last_oom = exc
        if self.oom_count > max_retries:
            raise too_many_ooms(plan, usable, self.oom_count, max_retries,
                                sorted(plan.indices), pending) from exc
        for index in plan.indices:
            self.retries[index] = self.retries.get(index, 0) + 1

    def raise_declined(self) -> None:
        if self.declined:
            raise combine_declined(self.declined) from self.last_oom


def plan_stats(admission: Admission, plan: Plan, usable: int, grad: bool,
               retries: dict[int, int], wave: Wave) -> MicroBatchStats:
    return MicroBatchStats(
        global_start=wave.start,
        global_stop=wave.stop,
        global_count=wave.width,
        local_count=len(plan.items),
        # A split reports every sub-forward's packed tokens; its prices are its largest's.
        packed_tokens=sum(
            admission.packed_length(
                [plan.leaves[i].num_tokens for i in sub],
                sum(group_shared_tokens([plan.leaves[i] for i in group])
                    for group in plan.group_indices(sub)),
            )
            for sub in plan.sub_forwards
        ),
        logical_tokens=sum(leaf.num_tokens for leaf in plan.leaves),
        estimated_required_bytes=plan.pricing.dynamic_bytes,
        available_bytes=usable,
        rejected_candidates=plan.rejected_candidates,
        cold_start=plan.decision == COLD_CAPPED,
        subforward_count=len(plan.sub_forwards),
        decision=plan.decision,
        predicted_peak_bytes=plan.pricing.peak_bytes,
        recompute_summary=plan.pricing.recompute.summary if grad else "no grad",
        grad_enabled=grad,
        term_table=plan.pricing.table(),
        predicted_source=plan.pricing.source,
        retries=max((retries.get(i, 0) for i in plan.indices), default=0),
        note=plan.note,
    )


def partial_execution(plan: Plan, ran: int, usable: int, exc: BaseException
                      ) -> TrainerRankPartialExecutionError:
    """A held split ran out of memory after `ran` of its sub-forwards completed."""
    count = len(plan.sub_forwards)
    return TrainerRankPartialExecutionError(
        f"dp_rank_forward: sub-forward {ran + 1} of {count} ran out of memory after sub-forwards "
        f"1-{ran} had run (items {plan.indices}, predicted {gib(plan.pricing.dynamic_bytes)} "
        f"against a usable limit of {gib(usable)}): {exc}. Their graphs and outputs are "
        "dropped; the miss is recorded, so the call planned again is split further",
        predicted_peak_bytes=plan.pricing.dynamic_bytes, usable_limit_bytes=usable,
        recompute_summary=plan.pricing.recompute.summary,
        suggestion="call dp_rank_forward again (the planner now admits less), or with fewer "
        "items", indices_not_run=tuple(plan.indices))


def combine_declined(errors: list[TrainerRankMemoryError]) -> TrainerRankMemoryError:
    if len(errors) == 1:
        return errors[0]
    indices = tuple(sorted(i for e in errors for i in e.indices_not_run))
    worst = max(errors, key=lambda e: e.predicted_peak_bytes)
    return TrainerRankMemoryError(
        f"forward_micro_batches: {len(errors)} items were declined before running (indices "
        f"{list(indices)}); every other item was yielded.\n" + "\n".join(str(e) for e in errors),
        predicted_peak_bytes=worst.predicted_peak_bytes,
        usable_limit_bytes=worst.usable_limit_bytes,
        recompute_summary=worst.recompute_summary,
        suggestion=worst.suggestion,
        indices_not_run=indices,
    )


def record_oom(admission: Admission, profiles: ProfileStore, plan: Plan, request: PlanRequest,
               failed_sub: tuple[int, ...] | None, exc: BaseException) -> None:
    """Record a run-time OOM of `plan` (planned for `request`) as a miss of what ran: the
    failing sub-forward of a split (priced alone), else the whole plan."""
    usable = request.usable_bytes
    if failed_sub is not None and len(plan.sub_forwards) > 1:
        pricing, shape, sig = admission.price(
            [plan.leaves[i] for i in failed_sub], plan.shape.grad_enabled,
            plan.pricing.recompute, gradients=request.gradients,
        )
        profiles.record_miss(sig, shape.packed_tokens, usable, pricing.model_peak_bytes)
    else:
        profiles.record_miss(plan.signature, plan.shape.packed_tokens, usable,
                             plan.pricing.model_peak_bytes)
    if exc.__traceback__ is not None:
        traceback.clear_frames(exc.__traceback__)  # drop the tensors the frames held
    logger.warning(
        "OOM at run time for items %s (%d packed tokens, predicted %d bytes, usable %d): "
        "recorded; re-planning smaller", plan.indices, plan.shape.packed_tokens,
        plan.pricing.dynamic_bytes, usable,
    )


def declined_after_retries(error: TrainerRankMemoryError, indices: list[int], attempts: int
                           ) -> TrainerRankMemoryError:
    return TrainerRankMemoryError(
        f"item(s) {indices} ran out of memory at run time ({attempts} "
        "attempt(s)); re-priced with that miss, their smallest form cannot run: " + str(error),
        predicted_peak_bytes=error.predicted_peak_bytes,
        usable_limit_bytes=error.usable_limit_bytes,
        recompute_summary=error.recompute_summary,
        suggestion=error.suggestion,
        indices_not_run=error.indices_not_run,
    )


def too_many_ooms(plan: Plan, usable: int, oom_count: int, limit: int, chosen: list[int],
                  pending: list[int]) -> TrainerRankMemoryError:
    return TrainerRankMemoryError(
        f"forward_micro_batches: {oom_count} run-time OOMs in one call (limit "
        f"{limit}); items {chosen} and {pending} were not run. The memory model and "
        "profile keep under-predicting this run; lower the usable limit or "
        "switch to full recompute",
        predicted_peak_bytes=plan.pricing.dynamic_bytes,
        usable_limit_bytes=usable,
        recompute_summary=plan.pricing.recompute.summary,
        suggestion="switch to full recompute or use smaller items",
        indices_not_run=tuple(sorted({*chosen, *pending})),
    )


def caller_oom_not_retried(plan: Plan, usable: int) -> TrainerRankMemoryError:
    return TrainerRankMemoryError(
        f"forward_micro_batches: the caller's backward for items {plan.indices} ran "
        f"out of memory (predicted {plan.pricing.dynamic_bytes} bytes, usable "
        f"{usable}); the trainable parameters are too large to snapshot their "
        "gradients, so the partially accumulated gradients cannot be undone and the "
        "items are not retried. Zero the gradients and run the step again; the miss "
        "is recorded and the planner will admit less",
        predicted_peak_bytes=plan.pricing.dynamic_bytes,
        usable_limit_bytes=usable,
        recompute_summary=plan.pricing.recompute.summary,
        suggestion="rerun the step; the planner now admits less",
        indices_not_run=tuple(plan.indices),
    )
