"""TrainerRank: forward_micro_batches and dp_rank_forward (orchestration only).

Each micro-batch: agree the usable limit over the replica's ranks, ask admission for a plan,
run it inside a live-bytes meter (CPU: the virtual limit; GPU: allocator stats), yield, and
when the caller hands control back (its loss and backward done) record the measured peak in
the profile. A run-time OOM is recorded as a miss and the items are re-planned, which makes
them smaller, split, escalated or declined; nothing is yielded twice unless the caller itself
caught an OOM in its backward and asked for the retry by iterating on.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from art.megatron.recompute_ladder import RecomputeChoice
from art.trainer_rank._micro_batch_run import (
    CallerPeak,
    ComputePath,
    Execution,
    caller_peak,
    decoder_passes,
    execute,
    micro_batch_context,
    trained_slots,
)
from art.trainer_rank._options import TrainerRankOptions
from art.trainer_rank._types import (
    DECLINED,
    EMPTY,
    AdapterSelection,
    MicroBatch,
    MicroBatchStats,
    TrainerRankMemoryError,
    TrainerRankPartialExecutionError,  # noqa: F401 - upstream drivers import it from _impl
    TrainerRankRuntimeSupportError,
    Unset,
)
from art.trainer_rank.compute.filler import FillerPasses
from art.trainer_rank.compute.forward import language_model
from art.trainer_rank.compute.items import Item, fingerprint, make_items, validate_items
from art.trainer_rank.decide.admission import Admission, AdmissionPolicy
from art.trainer_rank.decide.escalation import running_recompute
from art.trainer_rank.decide.expert_partners import ExpertPartners
from art.trainer_rank.decide.outcome import (
    CallOutcome,
    caller_oom_not_retried,
    partial_execution,
    plan_stats,
    record_oom,
)
from art.trainer_rank.decide.plan import Plan, PlanMode, PlanRequest
from art.trainer_rank.decide.profiles import ProfileStore
from art.trainer_rank.decide.runnable import layout_refusal
from art.trainer_rank.decide.step_time import MicroBatchTime, StepTimes
from art.trainer_rank.decide.trainer_admission import trainer_admission
from art.trainer_rank.measuring.device import (
    GradSnapshot,
    UnallocatedGradients,
    cuda_oom_count,
    device_usable_bytes,
    release_memory,
    unallocated_gradients,
)
from art.trainer_rank.measuring.meter import MemoryMeter, release_score_buffer
from art.trainer_rank.measuring.trainer_pricing import next_tp_memory_model, trainer_pricing
from art.trainer_rank.optimizer.graphs import GraphLedger, output_tensors
from art.trainer_rank.optimizer.methods import StepMethods
from art.trainer_rank.pricing.model import MemoryModel
from art.trainer_rank.ranks import agree as _agree
from art.trainer_rank.ranks.faults import OOM, PLAN, MicroBatchContext, Probing
from art.trainer_rank.ranks.lockstep import Wave, data_parallel_group, in_waves, widest_wave
from art.trainer_rank.ranks.paired_forwards import ForwardReady, fault_scope_ranks, paired_call
from art.trainer_rank.ranks.phases import PhaseAgreement
from art.trainer_rank.slots.api import SlotMethods
from art.trainer_rank.slots.saving import SaveQueue
from art.trainer_rank.slots.store import SlotStore
from art.trainer_rank.slots.types import MaterializedCheckpoint

if TYPE_CHECKING:
    from art.megatron.train import TrainingRuntime


logger = logging.getLogger("art.trainer_rank")
# A call's adapter: a slot name or path, a materialized checkpoint, None (the base model) or
# Unset (the active slot).
CheckpointSelection: TypeAlias = AdapterSelection | MaterializedCheckpoint

class TrainerRank(SlotMethods, StepMethods):
    """LoRA training and scoring forwards with recompute-aware memory admission."""

    def __init__(self, runtime: TrainingRuntime) -> None:
        self.runtime = runtime
        self.options = runtime.trainer_options or TrainerRankOptions.from_env()
        provider = runtime.provider
        self.provider = provider
        layout = provider.layout
        refusal = layout_refusal(layout, provider.implementation)
        if refusal is not None:
            raise TrainerRankRuntimeSupportError(refusal)
        chunks = list(getattr(runtime, "model", None) or [])
        if len(chunks) != 1:
            raise TrainerRankRuntimeSupportError(
                f"TrainerRank needs exactly one model chunk, the runtime has {len(chunks)}; "
                "virtual pipeline chunks are not supported: unset "
                "ART_MEGATRON_VIRTUAL_PIPELINE_MODEL_PARALLEL_SIZE"
            )
        self.chunks = chunks
        self.model = language_model(chunks[0])
        self.optimizer = runtime.optimizer
        self.graphs = GraphLedger()
        lora = provider.lora_config
        self.slots = SlotStore(
            self.model, has_builtin=lora is not None,
            base_model_name_or_path=getattr(runtime, "model_identifier", None)
            or provider.geometry.name,
            builtin_r=int(lora.r) if lora is not None else 0,
            builtin_alpha=float(lora.lora_alpha) if lora is not None else 0.0)
        self.slots.builtin_optimizer = runtime.optimizer
        self.saves = SaveQueue(self.slots)
        self._grad_slots: set[str] = set()
        # MoE layers exchanging tokens with other replicas: every forward is paired with
        # theirs (ranks/paired_forwards.py), so every rank of a step runs the configured
        # recompute (another rung would re-run a different set of all-to-alls in backward).
        self.paired_forwards = _agree.experts_cross_replicas()
        # Their rows' routed tokens reach this rank's experts: micro-batches are priced
        # beside the longest one (decide/expert_partners.py).
        self.expert_partners = ExpertPartners.of_this_rank() if self.paired_forwards else None
        recompute_choice = (RecomputeChoice.CONFIGURED if self.paired_forwards
                            else self.options.recompute_choice)
        # The per-phase agreement between ranks (OOMs, failed collectives): ranks/phases.py.
        # Made first: a probe run now (under expert parallel) runs inside its guard.
        self.phases = PhaseAgreement(self.options.fault_timeout_s)
        pricing = trainer_pricing(
            provider, self.model, runtime.memory_model,
            probe_layers=self.options.probe_layers,
            recompute_choice=recompute_choice,
            test_memory_limit_bytes=self.options.test_memory_limit_bytes,
            cache_dir=self.options.resolved_probe_cache_dir(),
            head_chunk_tokens=self.options.head_chunk_tokens,
            probe_guard=functools.partial(self.phases.probing, self._forward_ranks(),
                                          Probing.AT_START_UP))
        self.probe = pricing.probe
        self.memory_model = pricing.memory_model
        self.layout = layout
        self.implementation = provider.implementation
        self.device = next(self.model.parameters()).device
        self.profiles = ProfileStore(self.options.profile_path)
        self.profiles.profiles = _agree.broadcast_from_replica_root(self.profiles.profiles)
        self.admission, self.shares_prefixes = trainer_admission(
            provider, pricing, self.profiles,
            AdmissionPolicy(
                escalate_to_full_recompute=self.options.escalate_to_full_recompute,
                recompute=recompute_choice,
                cold_start_fraction=self.options.cold_start_fraction,
                trust_window=self.options.trust_window,
            ),
            self._next_tp_model)
        self.stats_history: list[MicroBatchStats] = []
        # How long grad micro-batches took, agreed over the replica (adaptive weighs its
        # packings with it: decide/step_time.py).
        self.step_times = StepTimes()
        self._calls = 0
        self._steps = 0
        # Filler forwards paired with other replicas' (ranks/paired_forwards.py).
        self._filler = FillerPasses(self.model, self.implementation, layout, self.device,
                                    self.phases, self._forward_ranks())
        # The probe's backward ran through the adapters: start from clean gradients.
        self.zero_grad()

    # -- limits and pricing helpers -----------------------------------------------------------

    def _next_tp_model(self) -> tuple[int, MemoryModel] | None:
        return next_tp_memory_model(self.provider, self.options.head_chunk_tokens)

    @property
    def compute_path(self) -> ComputePath:
        """What the next plan's forwards run on (read per micro-batch: a driver may replace
        `options` between calls)."""
        return ComputePath(
            model=self.model, implementation=self.implementation, layout=self.layout,
            device=self.device, head_chunk_tokens=self.options.head_chunk_tokens,
            shares_prefixes=self.shares_prefixes, adapter_key=self.slots.adapter_key,
            phases=self.phases)

    @property
    def active_checkpoint(self) -> str | None:
        """The slot a forward without its own selection runs with (None: the base model)."""
        return self.slots.active()

    def usable_limit_bytes(self, held_bytes: int = 0) -> int:
        """What the next micro-batch may use, the minimum over this replica's TP/CP ranks.
        Under a fixed limit (the CPU virtual one) resident checkpoint slots and `held_bytes`
        (what the trainer allocated for this micro-batch before reading the limit: the
        gradient snapshot) lower it; on a GPU the free memory already reflects them."""
        usable = device_usable_bytes(self.device, self.options.test_memory_limit_bytes)
        if self.options.test_memory_limit_bytes is not None:
            usable -= self.slots.resident_bytes() + held_bytes
        return _agree.min_over_replica(usable)

    def _meter(self, usable: int) -> MemoryMeter:
        limit = self.options.test_memory_limit_bytes
        return MemoryMeter(limit_bytes=None if limit is None else usable, device=self.device,
                           largest_on_cuda=False)

    # -- public API ---------------------------------------------------------------------------

    def forward_micro_batches(
        self, inputs: Iterable[Any], *, checkpoint: CheckpointSelection = Unset,
        no_grad: bool | None = None
    ) -> Iterator[MicroBatch]:
        """Yield micro-batches of whole top-level items (this DP rank's share of each wave).

        `inputs`: any iterable (read once) of ForwardInputs or nested groups of them (up to four
        levels; a group is indivisible and its outputs come back in its nesting); every DP rank
        passes the same items. They are dealt in contiguous waves `[start, start + width)`, rank
        r of D taking `start + r, start + r + D, ...` (`stats.global_start` / `global_stop`);
        the width is the widest every rank's share fits in. `no_grad=None` inherits
        `torch.is_grad_enabled()`; an input's own `no_grad` / `checkpoint` override the call's.
        Every DP rank yields the same number of micro-batches (a rank with nothing left in a
        wave gets an empty one), so a collective in the loop body cannot hang. With expert
        parallel across DP ranks a rank's empty micro-batch follows filler forwards that meet
        its partners' all-to-alls (ranks/paired_forwards.py).

        Compute the loss and run backward before asking for the next micro-batch: that peak is
        measured and learned too. If your backward raises torch.OutOfMemoryError, catch it,
        drop the loss (`del loss`) and keep iterating: the gradients it partly accumulated are
        restored (when the trainable parameters are small enough to snapshot, i.e. adapters)
        and the same items come again, smaller or escalated. Items that cannot run in any form
        are declined before running; after every other item was yielded, one
        TrainerRankMemoryError lists them (`indices_not_run`).
        """
        items = self._items(inputs, checkpoint, no_grad)
        self.phases.check()
        with self.phases.collectives(PLAN, None):
            _agree.check_same_call("forward_micro_batches", (
                *fingerprint(items), sum(1 for item in items if item.grad)))
        dp_rank, dp_size = _agree.data_parallel_rank_and_size()
        call = CallOutcome(self._next_call())

        def run_share(wave: Wave) -> Iterator[MicroBatch | ForwardReady]:
            share = [items[i] for i in wave.share(dp_rank, dp_size)]
            partners = self.expert_partners and functools.partial(
                self.expert_partners.in_wave, items, wave.start, wave.stop,
                packed_length=self.admission.packed_length)
            return self._by_grad_mode(share, call, wave, PlanMode.WAVE, partners=partners)

        def finish() -> None:
            self._merge_profiles_over_data_parallel()
            self._save_profiles()

        yield from in_waves(
            len(items),
            lambda start: self._propose_wave(items, start, dp_rank, dp_size),
            run_share, self._empty_micro_batch, finish=finish,
            guard=lambda: self.phases.between_micro_batches(dp_size),
            filler=self._filler if self.paired_forwards else None)
        call.raise_declined()

    def dp_rank_forward(
        self, inputs: Iterable[Any], *, checkpoint: CheckpointSelection = Unset,
        no_grad: bool | None = None
    ) -> list[Any]:
        """Run already-DP-local inputs in one call; outputs mirror `inputs`. With grad every
        graph stays live until the caller's backward: the grad items run whole when they fit,
        else as 2, 4, ... sub-forwards of whole items priced with all their graphs held
        together (`TrainerRankPartialExecutionError` if one fails after others ran), else the
        call is declined with TrainerRankMemoryError before anything runs. Without grad the
        items run as several micro-batches as needed. With expert parallel across DP ranks
        the ranks' forwards are paired; grad items that need different numbers of forwards on
        different ranks raise TrainerRankRuntimeSupportError on every rank before any runs."""
        items = self._items(inputs, checkpoint, no_grad)
        call = CallOutcome(self._next_call())
        results: dict[int, Any] = {}
        partners = None
        if self.expert_partners is not None:
            usable = self.usable_limit_bytes()
            with self.phases.collectives(PLAN, None), self._probing_below(usable):
                partners = self.expert_partners.in_call(items, self.admission, usable)
        # With grad the caller's backward comes after this call returns: not measurable here.
        micro_batches = self._by_grad_mode(items, call, Wave(0, len(items)), PlanMode.CALL,
                                           measure_caller=False, partners=partners)
        if self.paired_forwards:
            dp_size = _agree.data_parallel_rank_and_size()[1]
            micro_batches = paired_call(
                micro_batches, self._filler, data_parallel_group(), _agree.collective_device(),
                guard=lambda: self.phases.between_micro_batches(dp_size))
        for mb in micro_batches:
            assert isinstance(mb, MicroBatch)
            for index, out in zip(mb.indices, mb.outputs):
                results[index] = out
        self._save_profiles()
        call.raise_declined()
        return [results[item.index] for item in items]

    # -- inputs -------------------------------------------------------------------------------

    def _items(self, inputs: Iterable[Any], checkpoint: CheckpointSelection,
               no_grad: bool | None) -> list[Item]:
        self.slots.resolve(checkpoint)
        call_no_grad = (not torch.is_grad_enabled()) if no_grad is None else bool(no_grad)
        items = make_items(inputs, call_no_grad=call_no_grad)
        validate_items(items, self.provider.geometry.vocab_size)
        # Every sequence's slot, resolved now (input's, call's, pushed, loaded): a later push
        # or load does not change what this call runs with.
        items = [replace(item, checkpoints=tuple(
            self.slots.resolve(leaf.checkpoint, checkpoint) for leaf in item.leaves))
            for item in items]
        for item in items:
            self._check_training_mode(item.grad)
        return items

    def _next_call(self) -> int:
        self._calls += 1
        return self._calls

    def _propose_wave(self, items: list[Item], start: int, dp_rank: int, dp_size: int) -> int:
        """The widest wave from `start` whose share on this rank fits: its grad items as one
        micro-batch and its no-grad items as another (agreed over the replica's ranks)."""
        mine = items[start + dp_rank::dp_size]
        if not mine:
            return len(items) - start
        release_score_buffer()
        with self.phases.collectives(PLAN, None):
            usable = {grad: self.usable_limit_bytes(GradSnapshot.expected_bytes(self.model)
                                                    if grad else 0)
                      for grad in {item.grad for item in mine}}
            gradients = self._unallocated_gradients() if True in usable else None
            # A tail probed on first use measures below the lower limit (the grad one).
            partners = self.expert_partners and self.expert_partners.for_proposal(
                items, start, self.admission.packed_length)
            with self._probing_below(usable[True] if True in usable else usable[False]):
                fitting = self.admission.fitting_prefix(
                    mine, usable, gradients, self.step_times.fit() if True in usable else None,
                    expert_partner_tokens=partners)
        return widest_wave(start, len(items), dp_rank, dp_size, fitting, len(mine))

    def _by_grad_mode(self, local: list[Item], call: CallOutcome, wave: Wave, mode: PlanMode, *,
                      measure_caller: bool = True,
                      partners: Callable[[bool], int] | None = None
                      ) -> Iterator[MicroBatch | ForwardReady]:
        """Grad items first, then no-grad ones; one autograd mode per micro-batch. Declined
        items are kept in `call`, raised once the call ran everything else.
        `measure_caller` applies to grad micro-batches; without grad nothing of the caller's
        can add to the peak, so those are always measured. `partners(grad)`: the longest row
        an EP partner runs beside them (decide/expert_partners.py)."""
        for grad in (True, False):
            queue = [item for item in local if item.grad == grad]
            if queue:
                admission = self.admission.with_expert_partners(partners(grad) if partners else 0)
                yield from self._micro_batches(queue, grad, call, wave, mode, admission,
                                               measure_caller=measure_caller or not grad)

    def _forward_ranks(self) -> int:
        """The ranks one forward's collectives span: its replica's, or with paired forwards
        the job's (a fault in one then ends the call on every rank, as in a replica of
        several: a local retry would leave its partners in an all-to-all)."""
        return fault_scope_ranks(self.paired_forwards)

    def _empty_micro_batch(self, wave: Wave) -> MicroBatch:
        return MicroBatch(inputs=[], outputs=[], indices=[], stats=MicroBatchStats(
            global_start=wave.start, global_stop=wave.stop, global_count=wave.width,
            local_count=0, packed_tokens=0, logical_tokens=0, estimated_required_bytes=0,
            available_bytes=self.usable_limit_bytes(), rejected_candidates=0, cold_start=False,
            decision=EMPTY, note="this DP rank had no items left in this wave"))

    def _check_training_mode(self, grad: bool) -> None:
        # Megatron applies recompute (selective and full, hence escalation) only in training
        # mode; in eval mode a grad forward keeps every activation, which is not what was priced.
        if grad and not self.model.training:
            raise TrainerRankRuntimeSupportError(
                "a grad-enabled forward on a model in eval mode: Megatron recomputes nothing in "
                f"eval mode, so the memory priced for {self.provider.effective_recompute.summary} "
                "does not hold; call model.train() first, or pass no_grad=True for scoring"
            )

    # -- the loop -----------------------------------------------------------------------------

    def _micro_batches(self, local: list[Item], grad: bool, call: CallOutcome, wave: Wave,
                       mode: PlanMode, admission: Admission, *, measure_caller: bool = True
                       ) -> Iterator[MicroBatch | ForwardReady]:
        try:
            yield from self._micro_batch_loop(local, grad, call, wave, mode, admission,
                                              measure_caller=measure_caller)
        except TrainerRankMemoryError:
            fault = self.phases.fault
            if fault is not None and fault.kind == OOM and fault.context is not None:
                # Every rank of the job records the failing micro-batch's miss, then saves.
                ctx = fault.context
                self.profiles.record_miss(ctx.signature, ctx.packed_tokens, ctx.usable_bytes,
                                          ctx.model_bytes or ctx.predicted_bytes)
                self._save_profiles()
            raise

    def _plan(self, pending: list[Item], grad: bool, held_bytes: int, mode: PlanMode,
              admission: Admission) -> tuple[PlanRequest, Plan]:
        """The next plan for `pending`, agreed over the replica: a wave's share as one
        micro-batch when it fits (else as admission takes it, e.g. after a run-time OOM), a
        queue greedily, or a whole grad call. `held_bytes`: what the trainer holds for this
        micro-batch already (its gradient snapshot)."""
        usable = self.usable_limit_bytes(held_bytes)
        probed = self.probe.probes_on_first_use if self.probe is not None else 0
        request = self._request(pending, grad, usable, mode)
        with self._probing_below(usable):
            plan = admission.plan(request)
        if self.probe is not None and self.probe.probes_on_first_use != probed:
            # A head tail or a rung's layers were probed on first use while planning (below
            # the limit read before it): read the limit again after it and plan with that.
            release_memory()
            usable = self.usable_limit_bytes(held_bytes)
            request = self._request(pending, grad, usable, mode)
            with self._probing_below(usable):
                plan = admission.plan(request)
        _agree.check_same_plan(plan.agreement_key(usable))
        return request, plan

    def _request(self, pending: list[Item], grad: bool, usable: int, mode: PlanMode
                 ) -> PlanRequest:
        return PlanRequest(tuple(pending), grad, usable, mode,
                           self._unallocated_gradients() if grad else None,
                           self.step_times.fit() if grad else None)

    def _unallocated_gradients(self) -> UnallocatedGradients:
        return unallocated_gradients(self.model, self.provider.geometry.num_layers)

    @contextlib.contextmanager
    def _probing_below(self, usable: int) -> Iterator[None]:
        """A probe on first use while planning (a layer mode or a head tail) measures below
        this plan's limit, inside the fault protocol's guard for probes."""
        if self.probe is None:
            yield
            return
        before = self.probe.usable_bytes
        self.probe.usable_bytes = usable
        self.probe.guard = functools.partial(self.phases.probing, _agree.replica_size())
        try:
            yield
        finally:
            self.probe.usable_bytes = before
            self.probe.guard = contextlib.nullcontext

    def _micro_batch_loop(self, local: list[Item], grad: bool, call: CallOutcome, wave: Wave,
                          mode: PlanMode, admission: Admission, *, measure_caller: bool
                          ) -> Iterator[MicroBatch | ForwardReady]:
        pending = list(local)
        while pending:
            self.phases.check()  # a fault on any rank of the job ends the call here
            # Megatron's unfused-attention score buffer is priced inside every micro-batch:
            # release it so it is not also counted as live before this one.
            release_score_buffer()
            # The gradient snapshot (for a caller-backward OOM) is taken before the limit is
            # read, so what it holds is not also offered to the micro-batch.
            snapshot = (
                GradSnapshot(self.model) if grad and GradSnapshot.affordable(self.model) else None
            )
            with self.phases.collectives(PLAN, None):
                request, plan = self._plan(pending, grad,
                                           0 if snapshot is None else snapshot.nbytes, mode,
                                           admission)
            chosen = {item.index for item in plan.items}
            pending = [item for item in pending if item.index not in chosen]
            if plan.decision == DECLINED:
                snapshot = None  # not held while the next micro-batch takes its own
                call.decline(plan)
                continue
            if plan.escalate:
                logger.warning("escalating: %s", plan.note)
            if self.paired_forwards and mode is not PlanMode.NEXT:
                # Announced before it runs: its partners' forwards pair with it.
                yield ForwardReady(grad, decoder_passes(plan))
            context = micro_batch_context(plan, call.number, call.micro_batches,
                                          request.usable_bytes)
            call.micro_batches += 1
            oom = yield from self._run_plan(plan, request, context, call, wave, snapshot,
                                            measure_caller=measure_caller)
            if oom is not None:  # the items go back to the queue, smaller next time
                call.count_oom(plan, request.usable_bytes, oom, [i.index for i in pending],
                               self.options.max_oom_retries)
                pending = sorted([*plan.items, *pending], key=lambda it: it.index)

    def _run_plan(self, plan: Plan, request: PlanRequest, context: MicroBatchContext,
                  call: CallOutcome, wave: Wave, snapshot: GradSnapshot | None, *,
                  measure_caller: bool
                  ) -> Generator[MicroBatch, None, BaseException | None]:
        """Run and yield one plan: execute it, yield it to the caller, read what the caller's
        loss and backward peaked at, record the outcome. Returns the OOM when it ran out of
        memory and the replica is one rank (with several, ranks/phases.py ends the call on
        every rank). `snapshot`: the gradients as they were before the plan (grad plans of
        adapters)."""
        usable, grad = request.usable_bytes, request.grad
        replica = self._forward_ranks()
        path = self.compute_path
        with contextlib.ExitStack() as stack:
            if plan.recompute is not None:
                stack.enter_context(running_recompute(self.model, plan.recompute))
            meter = stack.enter_context(self._meter(usable))
            ooms_before = cuda_oom_count(self.device)
            started = time.perf_counter()
            executed = execute(path, plan, grad, context, replica)
            if executed.oom is not None:
                stack.close()
                return self._recovered(plan, request, executed, snapshot)
            if grad:
                self._grad_slots.update(trained_slots(plan))
                self.graphs.register(output_tensors(executed.outputs), f"items {plan.indices}")
            stats = plan_stats(self.admission, plan, usable, grad, call.retries, wave)
            micro_batch = MicroBatch(inputs=[item.value for item in plan.items],
                                     outputs=executed.outputs, indices=plan.indices,
                                     stats=stats)
            del executed
            with self.phases.caller_phase(context, replica):
                yield micro_batch
            caller = caller_peak(path, meter, ooms_before, usable, context, replica, started)
        return self._recorded(plan, request, micro_batch, caller, snapshot,
                              measure_caller=measure_caller)

    def _recovered(self, plan: Plan, request: PlanRequest, executed: Execution,
                   snapshot: GradSnapshot | None) -> BaseException:
        """A forward (or the packing before it) ran out of memory on this replica of one
        rank: record the miss, undo what it did, and hand the OOM back for a re-plan."""
        assert executed.oom is not None
        record_oom(self.admission, self.profiles, plan, request, executed.failed_sub_forward,
                   executed.oom)
        if executed.forward_started and snapshot is not None:
            snapshot.restore()
        release_memory()
        if executed.forward_started and request.grad and executed.sub_forwards_run > 0:
            # Sub-forwards whose graphs the caller's backward was to use already ran: the
            # call cannot be re-planned behind the caller's back.
            raise partial_execution(plan, executed.sub_forwards_run, request.usable_bytes,
                                    executed.oom) from executed.oom
        return executed.oom

    def _recorded(self, plan: Plan, request: PlanRequest, micro_batch: MicroBatch,
                  caller: CallerPeak, snapshot: GradSnapshot | None, *, measure_caller: bool
                  ) -> BaseException | None:
        """What the caller's phase left: a measured peak for the profile, or an OOM in the
        caller's loss/backward (its outputs void, its gradients restored, returned for a
        re-plan; raised when they cannot be restored)."""
        usable = request.usable_bytes
        if caller.out_of_memory:
            # These outputs are void (the items come again); drop their graphs now. The caller
            # must also drop its own references (e.g. `del loss`) before iterating on.
            micro_batch.outputs.clear()
            exc = torch.OutOfMemoryError(
                f"the caller's loss/backward ran out of memory at {caller.measured_peak_bytes} "
                f"bytes (usable {usable}) for items {plan.indices}"
            )
            self.profiles.record_miss(plan.signature, plan.shape.packed_tokens, usable,
                                      plan.pricing.model_peak_bytes)
            if snapshot is None:
                raise caller_oom_not_retried(plan, usable) from exc
            snapshot.restore()
            release_memory()
            return exc
        self.stats_history.append(replace(micro_batch.stats,
                                          measured_peak_bytes=caller.measured_peak_bytes))
        ladder = self.admission.ladder
        # Timed only where the caller's backward ran inside the micro-batch (not in
        # dp_rank_forward, whose backward comes after the call).
        if request.grad and measure_caller and ladder is not None and len(plan.sub_forwards) == 1:
            lengths = plan.shape.sequence_lengths_tokens
            self.step_times = self.step_times.with_time(MicroBatchTime(
                ladder.forward_flops(lengths), ladder.flops(plan.pricing.recompute, lengths),
                caller.seconds))
        if measure_caller:
            # A split's signature and size are its largest sub-forward's: nothing is kept
            # between sub-forwards without grad, so the measured peak is that one's.
            self.profiles.observe(plan.signature, plan.shape.packed_tokens,
                                  caller.measured_peak_bytes, plan.pricing.model_peak_bytes)
        return None

    def _merge_profiles_over_data_parallel(self) -> None:
        """Every DP rank took this call: each leaves it holding every replica's observations
        and misses, so all ranks plan the next call from the same profile."""
        if _agree.data_parallel_rank_and_size()[1] == 1:
            return
        with self.phases.collectives(PLAN, None):
            gathered = _agree.all_gather_over_data_parallel(self.profiles.profiles)
        self.profiles.merge_from(gathered)
        self._save_profiles()

    def _save_profiles(self) -> None:
        # One writer per replica (its ranks hold the same profiles); replicas merge on disk
        # under the file's lock, so no replica's observations are lost.
        if self.options.profile_path and _agree.is_replica_root():
            self.profiles.save()
