"""Admission: which whole items run next, under which recompute, or why they cannot run.

Prices candidates with the memory model (recompute-aware, itemised) and the learned profile
(max of the two inside the profile's trust window), and decides: cold-capped (no profile yet:
start with the smallest item), admitted, split (a no-grad group run as sub-forwards), escalated
(fits only under full recompute) or declined (with the remedies priced in the message).
Pure logic: no model, no tensors; the runtime hands it a memory model and a usable limit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from art.megatron.recompute import EffectiveRecompute
from art.megatron.recompute_ladder import RecomputeChoice, RecomputeLadder
from art.trainer_rank._request import MicroBatchShape, OutputRequest, RecurrentRow
from art.trainer_rank._types import (
    ADMITTED,
    COLD_CAPPED,
    DECLINED,
    ESCALATED,
    SPLIT,
    ForwardInput,
)
from art.trainer_rank.compute.items import Item, group_shared_tokens, outputs_union
from art.trainer_rank.compute.prefix_tree import TreeShape, row_levels, tree_shape
from art.trainer_rank.decide.adaptive import (
    least_work_rung_plan,
    packed_wave_noted,
    packs_two_ways,
    quicker_of_next,
    quicker_wave,
)
from art.trainer_rank.decide.decline import decline_error
from art.trainer_rank.decide.held_split import plan_call
from art.trainer_rank.decide.nograd_split import split_no_grad
from art.trainer_rank.decide.plan import Plan, PlanMode, PlanRequest
from art.trainer_rank.decide.prefix_search import QueuePrefixes, largest_fitting_count
from art.trainer_rank.decide.price_caches import PriceCaches
from art.trainer_rank.decide.priced import MemoryModelLike, Pricing, gib
from art.trainer_rank.decide.profiles import ProfileStore, signature
from art.trainer_rank.decide.step_time import StepTimeFit
from art.trainer_rank.measuring.device import UnallocatedGradients
from art.trainer_rank.pricing.model import largest_fitting

# After this many consecutive candidates that do not fit, stop looking further down the queue.
MAX_MISFITS_SCANNED = 8


@dataclass(frozen=True)
class AdmissionPolicy:
    escalate_to_full_recompute: bool = True
    cold_start_fraction: float = 0.25
    trust_window: float = 2.0
    recompute: RecomputeChoice = RecomputeChoice.ESCALATE

    @property
    def choice(self) -> RecomputeChoice:
        """The rung choice in force (escalate_to_full_recompute=False: configured only)."""
        if not self.escalate_to_full_recompute:
            return RecomputeChoice.CONFIGURED
        return self.recompute


@dataclass(frozen=True)
class Admission:
    """Decides micro-batches for one rank: `plan(PlanRequest) -> Plan`, and the prices behind
    it. Frozen: what it decides with is fixed when it is built; everything a decision depends
    on beside that comes in the request. `next_tp_model` prices the same item at the next TP
    size for the decline message (None when there is no next size to suggest)."""

    memory_model: MemoryModelLike
    profiles: ProfileStore
    recompute: EffectiveRecompute
    topology: str
    adapter: str
    # (sequence lengths, tokens shared as prefixes) -> packed row length
    packed_length: Callable[..., int]
    full_recompute: EffectiveRecompute | None = None
    # Bytes of the outputs one sub-forward leaves behind (held until the item is yielded);
    # None prices splits as if nothing were held.
    held_output_bytes: Callable[[MicroBatchShape], int] | None = None
    next_tp_model: Callable[[], tuple[int, MemoryModelLike] | None] | None = None
    policy: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    # The default formulas at this TP size when `memory_model` prices with measured (probe)
    # coefficients: the next TP size can only be priced by the formulas, so its price is
    # corrected by what the probe measured against them here (see `_next_tp_dynamic`).
    default_memory_model: MemoryModelLike | None = None
    # Whether the packer lays a group's shared prefixes out once (the built attention takes a
    # tree): then a hybrid's recurrent layers run the row's prefix trees, priced as such.
    shares_prefixes: bool = False
    # The rungs a micro-batch may run instead of the configured policy (recompute_ladder.py);
    # None: full recompute (`full_recompute`) is the only other one.
    ladder: RecomputeLadder | None = None
    # With expert parallel across model replicas: the most packed tokens an EP partner's row
    # holds beside the micro-batches priced (`MicroBatchShape.expert_partner_tokens`; 0: as
    # many as each one). Set per wave and autograd mode by `with_expert_partners`.
    expert_partner_tokens: int = 0
    # Memos of pure functions of the fields above and their arguments (never of a request's
    # limit or gradients, which come with each call): see `clear_caches`.
    _caches: PriceCaches = field(default_factory=lambda: PriceCaches(), init=False,
                                  repr=False, compare=False)

    def clear_caches(self) -> None:
        """Forget every cached price, signature and cap (benchmarks time cold decisions)."""
        self._caches.clear()

    def with_expert_partners(self, tokens: int) -> Admission:
        """This admission pricing every micro-batch beside EP partners' rows of at most
        `tokens` packed tokens (0: of the micro-batch's own size); the memos are shared
        (their keys hold the partners' tokens)."""
        if tokens == self.expert_partner_tokens:
            return self
        other = replace(self, expert_partner_tokens=tokens)
        object.__setattr__(other, "_caches", self._caches)
        return other

    def signature(self, recompute: EffectiveRecompute, grad: bool, outputs: OutputRequest) -> str:
        caches = self._caches
        key = (id(recompute), grad, outputs)
        sig = caches.signatures.get(key)
        if sig is None:
            caches.recomputes[id(recompute)] = recompute
            sig = caches.signatures[key] = signature(
                topology=self.topology,
                recompute_key=recompute.for_grad(grad).key,
                grad_enabled=grad,
                outputs_key=outputs.key,
                adapter=self.adapter,
            )
        return sig

    def shape(self, leaves: Sequence[ForwardInput], grad: bool) -> MicroBatchShape:
        lengths = tuple(leaf.num_tokens for leaf in leaves)
        shared = group_shared_tokens(leaves)
        return MicroBatchShape(
            sequence_lengths_tokens=lengths,
            outputs=outputs_union(leaves),
            grad_enabled=grad,
            padded_tokens=self.packed_length(lengths, shared),
            recurrent=self._recurrent([self._tree(leaves, shared)]),
            expert_partner_tokens=self.expert_partner_tokens,
        )

    def _tree(self, leaves: Sequence[ForwardInput], shared: int) -> TreeShape:
        if not shared:
            return TreeShape.sequences([leaf.num_tokens for leaf in leaves])
        return tree_shape([leaf.input_tokens for leaf in leaves])

    def _recurrent(self, trees: Sequence[TreeShape]) -> RecurrentRow | None:
        """The row's recurrent calls when some prefix is laid out once, else None."""
        if not self.shares_prefixes or not any(t.continued_segments for t in trees):
            return None
        return RecurrentRow(row_levels(trees))

    # -- prices -------------------------------------------------------------------------------
    # `gradients`: the trainable gradients not allocated yet (a request's `gradients`); a grad
    # micro-batch's backward allocates them, priced as its first_gradient_allocation_bytes.

    def price(
        self,
        leaves: Sequence[ForwardInput],
        grad: bool,
        recompute: EffectiveRecompute | None = None,
        *,
        gradients: UnallocatedGradients | None = None,
    ) -> tuple[Pricing, MicroBatchShape, str]:
        """`leaves`: sequences of one item (a split's sub-forward shares their prefixes)."""
        shared = group_shared_tokens(leaves)
        return self.price_lengths(tuple(leaf.num_tokens for leaf in leaves),
                                  outputs_union(leaves), grad, recompute,
                                  shared_tokens=shared,
                                  recurrent=self._recurrent([self._tree(leaves, shared)]),
                                  gradients=gradients)

    def price_items(self, items: Sequence[Item], grad: bool,
                    recompute: EffectiveRecompute | None = None, *,
                    gradients: UnallocatedGradients | None = None,
                    ) -> tuple[Pricing, MicroBatchShape, str]:
        lengths: tuple[int, ...] = ()
        for item in items:
            lengths += item.sequence_lengths_tokens
        shared = sum(it.shared_tokens for it in items)
        recurrent = None
        if shared and self.shares_prefixes:
            recurrent = self._recurrent([self._item_tree(it) for it in items])
        outputs = OutputRequest.union(it.outputs for it in items)
        return self.price_lengths(lengths, outputs, grad, recompute, shared_tokens=shared,
                                  recurrent=recurrent, gradients=gradients)

    @staticmethod
    def _item_tree(item: Item) -> TreeShape:
        if not item.shared_tokens:
            return TreeShape.sequences(item.sequence_lengths_tokens)
        return item.tree

    def price_lengths(self, lengths: tuple[int, ...], outputs: OutputRequest, grad: bool,
                      recompute: EffectiveRecompute | None = None, shared_tokens: int = 0,
                      recurrent: RecurrentRow | None = None, *,
                      gradients: UnallocatedGradients | None = None,
                      ) -> tuple[Pricing, MicroBatchShape, str]:
        recompute = recompute or self.recompute
        priced = self._caches.priced
        key = (id(recompute), grad, lengths, outputs, shared_tokens, recurrent,
               self.expert_partner_tokens)
        hit = priced.get(key)
        if hit is None:
            model = self.model_for(recompute)
            shape = self._row_shape(lengths, outputs, grad, shared_tokens, recurrent)
            if len(priced) > 8192:  # an Estimate holds its terms: bound the memory
                priced.clear()
            hit = priced[key] = (model.estimate(shape), shape,
                                 self.signature(recompute, grad, outputs))
        estimate, shape, sig = hit
        reserve = int(estimate.reserve_bytes)
        profile = self.profiles.predict(sig, shape.packed_tokens, self.policy.trust_window,
                                        int(estimate.dynamic_bytes) - reserve)
        profile_dynamic = None if profile is None else profile + reserve
        return Pricing(estimate, profile_dynamic, recompute,
                       first_gradient_allocation_bytes=_first_gradients(estimate, grad,
                                                                        gradients)
                       ), shape, sig

    def _row_shape(self, lengths: tuple[int, ...], outputs: OutputRequest, grad: bool,
                   shared_tokens: int, recurrent: RecurrentRow | None) -> MicroBatchShape:
        return MicroBatchShape(sequence_lengths_tokens=lengths, outputs=outputs,
                               grad_enabled=grad,
                               padded_tokens=self.packed_length(lengths, shared_tokens),
                               recurrent=recurrent,
                               expert_partner_tokens=self.expert_partner_tokens)

    def _formulas_for(self, recompute: EffectiveRecompute) -> MemoryModelLike | None:
        """The default formulas under `recompute` (None: the memory model has no others)."""
        if self.default_memory_model is None:
            return None
        return self._caches.under(self._caches.formulas, self.default_memory_model, recompute,
                                  self.recompute)

    def model_for(self, recompute: EffectiveRecompute) -> MemoryModelLike:
        return self._caches.under(self._caches.models, self.memory_model, recompute,
                                  self.recompute)

    def model_max_tokens(self, usable_bytes: int, outputs: OutputRequest, grad: bool, *,
                          start_tokens: int = 1,
                          recompute: EffectiveRecompute | None = None,
                          gradients: UnallocatedGradients | None = None,
                          by_formulas: bool = False) -> int:
        """The largest one-sequence row the memory model admits, to within 1/32 and never
        above it: the cold cap is a fraction of it, so a coarse bound saves half the
        estimates of an exact bisection (a cold decision's main cost). `by_formulas`: the
        default formulas' (`default_memory_model`, where the memory model prices with
        measured coefficients): the search prices rows up to the limit, which the probe
        would otherwise measure though no micro-batch asked for them."""
        recompute = recompute or self.recompute
        model_max = self._caches.model_max
        held = gradients.total_bytes if grad and gradients is not None else 0
        formulas = self._formulas_for(recompute) if by_formulas else None
        key = (outputs, grad, usable_bytes, held, id(recompute), self.expert_partner_tokens,
               formulas is not None)
        hit = model_max.get(key)
        if hit is not None:
            return hit

        def fits(tokens: int) -> bool:
            if formulas is None:
                pricing = self.price_lengths((tokens,), outputs, grad, recompute,
                                             gradients=gradients)[0]
                return pricing.model_dynamic_bytes <= usable_bytes
            estimate = formulas.estimate(self._row_shape((tokens,), outputs, grad, 0, None))
            return (int(estimate.dynamic_bytes) + _first_gradients(estimate, grad, gradients)
                    <= usable_bytes)

        start = max(1, start_tokens)
        lo = 0
        if fits(start):
            lo = largest_fitting(fits, start, 2 * start, cap=1 << 26,
                                 slack=lambda low: max(1, low // 32))
        elif start_tokens > 1:
            lo = (formulas or self.model_for(recompute)).max_tokens_that_fit(
                usable_bytes, outputs=outputs, grad_enabled=grad)
        if len(model_max) > 4096:
            model_max.clear()
        model_max[key] = lo
        return lo

    # -- the decision -------------------------------------------------------------------------

    def plan(self, request: PlanRequest) -> Plan:
        """The next micro-batch for `request`. The caller removes the plan's items from its
        queue whatever the decision (a declined item is reported, not retried).

        `next`: greedily from the queue; `wave`: exactly the pending items (a data-parallel
        wave's share, which `fitting_prefix` found to fit together; one item is planned as
        `next` plans it); `call` with grad: every pending item at once, their graphs held
        together until the caller's backward (held_split.py)."""
        if request.mode == PlanMode.CALL and request.grad:
            return plan_call(self, request)
        if request.mode == PlanMode.WAVE:
            return self._plan_group(request)
        least_work = self._plan_next(request, self._packing_rung(request.pending[0], request))
        if not packs_two_ways(self, request.pending):
            return least_work
        return quicker_of_next(self, request, least_work,
                               self._plan_next(request, self.recompute))

    def _packing_rung(self, first: Item, request: PlanRequest) -> EffectiveRecompute:
        """The rung the queue is packed under: the configured policy; adaptive, the least-work
        rung under which the first item fits alone (more items then fit only as that rung
        allows, so the micro-batch recomputes as little as its first item needs)."""
        grad = request.grad
        for rung in self.rungs_below(first.sequence_lengths_tokens) if grad else ():
            pricing = self.price_items([first], grad, rung, gradients=request.gradients)[0]
            if pricing.dynamic_bytes <= request.usable_bytes:
                return rung
        return self.recompute

    def _plan_next(self, request: PlanRequest, recompute: EffectiveRecompute) -> Plan:
        pending, grad, usable_bytes = request.pending, request.grad, request.usable_bytes
        gradients = request.gradients
        first_sig = self.signature(recompute, grad, pending[0].outputs)
        cold = not self.profiles.has_profile(first_sig)
        queue = list(pending)
        cap_tokens: int | None = None
        if cold:
            # No measurement yet for this signature: start with the smallest item, and only
            # add more up to a fraction of what the model alone would admit.
            at = min(range(len(queue)), key=lambda i: (queue[i].num_tokens, queue[i].index))
            smallest = queue.pop(at)
            queue.insert(0, smallest)
            model_max = self.model_max_tokens(usable_bytes, smallest.outputs, grad,
                                               start_tokens=smallest.num_tokens,
                                               recompute=recompute, gradients=gradients,
                                               by_formulas=True)
            cap_tokens = max(
                smallest.num_tokens, int(self.policy.cold_start_fraction * model_max)
            )
        else:
            cap_tokens = self.growth_cap(first_sig, grad, pending[0].outputs)
        first = queue[0]
        pricing, shape, sig = self.price_items([first], grad, recompute, gradients=gradients)
        if pricing.dynamic_bytes > usable_bytes:
            if recompute is not self.recompute:  # the smallest item does not fit that rung
                return self._plan_next(request, self.recompute)
            return self._does_not_fit(first, request, pricing, shape, sig)

        # The longest fitting prefix of the queue, by bisection (the price grows with the
        # prefix): a call of many short items packs them in a logarithmic number of estimates
        # instead of one per item. From the first item that does not fit, the greedy scan
        # goes on down the queue (smaller items behind it may still fit).
        prefix = QueuePrefixes(queue)

        def fitting(chosen: Sequence[Item], lengths: tuple[int, ...], shared: int,
                    outputs: OutputRequest) -> tuple[Pricing, MicroBatchShape, str] | None:
            """`chosen` as one micro-batch, priced, or None when it is over the cap or the
            usable limit."""
            if cap_tokens is not None and self.packed_length(lengths, shared) > cap_tokens:
                return None
            recurrent = (self._recurrent([self._item_tree(it) for it in chosen])
                         if shared and self.shares_prefixes else None)
            priced = self.price_lengths(lengths, outputs, grad, recompute, shared_tokens=shared,
                                        recurrent=recurrent, gradients=gradients)
            return priced if priced[0].dynamic_bytes <= usable_bytes else None

        count, best = largest_fitting_count(
            lambda n: fitting(queue[:n], prefix.lengths(n), prefix.shared(n), prefix.outputs(n)),
            1, len(queue), (pricing, shape, sig))
        pricing, shape, sig = best
        chosen = list(queue[:count])
        lengths = prefix.lengths(count)
        outputs = prefix.outputs(count)
        shared = prefix.shared(count)
        misfits = rejected = 0
        for item in queue[count:]:
            cand_lengths = lengths + item.sequence_lengths_tokens
            cand_shared = shared + item.shared_tokens
            cand_outputs = OutputRequest.union((outputs, item.outputs))
            priced = fitting((*chosen, item), cand_lengths, cand_shared, cand_outputs)
            if priced is None:
                misfits += 1
                rejected += 1
                if misfits >= MAX_MISFITS_SCANNED:
                    break
                continue
            misfits = 0
            chosen.append(item)
            lengths, outputs, shared = cand_lengths, cand_outputs, cand_shared
            pricing, shape, sig = priced
        return self.admitted(chosen, pricing, shape, sig, cold, cap_tokens, rejected,
                              recompute=recompute)

    def admitted(self, chosen: Sequence[Item], pricing: Pricing, shape: MicroBatchShape,
                 sig: str, cold: bool, cap_tokens: int | None, rejected: int = 0, *,
                 recompute: EffectiveRecompute | None = None) -> Plan:
        """`chosen` as one micro-batch, cold-capped or admitted, with the cap in its note,
        under `recompute` (None: the configured policy; else the rung below it that adaptive
        packed under)."""
        chosen = sorted(chosen, key=lambda it: it.index)
        note = ""
        if cold:
            note = f"no profile for this signature yet: capped at {cap_tokens} tokens"
        elif cap_tokens is not None:
            note = (f"measured above the memory model: growing at most x"
                    f"{self.policy.trust_window:g} per micro-batch (cap {cap_tokens} tokens)")
        lower = recompute if recompute is not None and recompute is not self.recompute else None
        if lower is not None:
            note = "; ".join(n for n in (
                f"adaptive: {lower.summary} fits, less recompute than "
                f"{self.recompute.summary}", note) if n)
        return Plan(
            decision=COLD_CAPPED if cold else ADMITTED,
            items=tuple(chosen),
            pricing=pricing,
            shape=shape,
            sub_forwards=(tuple(range(sum(len(it.leaves) for it in chosen))),),
            signature=sig,
            recompute=lower,
            note=note,
            rejected_candidates=rejected,
        )

    # -- a given set of items as one micro-batch (a data-parallel wave's share) ---------------

    def cap(self, items: Sequence[Item], request: PlanRequest, sig: str,
            outputs: OutputRequest, recompute: EffectiveRecompute | None = None
            ) -> tuple[bool, int | None]:
        """(cold, cap in packed tokens or None): an unprofiled signature starts at a fraction
        of what the memory model alone admits (at least its smallest item); a profile that saw
        the model under-predict grows only to the edge of its trust window."""
        if not self.profiles.has_profile(sig):
            smallest = min(items, key=lambda it: (it.num_tokens, it.index))
            model_max = self.model_max_tokens(request.usable_bytes, smallest.outputs,
                                               request.grad, start_tokens=smallest.num_tokens,
                                               recompute=recompute,
                                               gradients=request.gradients, by_formulas=True)
            return True, max(smallest.num_tokens,
                             int(self.policy.cold_start_fraction * model_max))
        return False, self.growth_cap(sig, request.grad, outputs)

    def fits_together(self, request: PlanRequest, *, as_configured: bool = False) -> bool:
        """Whether the pending items run as one micro-batch under the rung they are packed
        under (the configured policy; adaptive: the least-work rung their first item fits
        alone, or with `as_configured` any rung up to the configured one, within its cap).
        One item always has a plan of its own (admitted, split, escalated or declined)."""
        items = request.pending
        if len(items) <= 1:
            return True
        if as_configured:
            return least_work_rung_plan(self, items, request) is not None
        rung = self._packing_rung(items[0], request)
        pricing, shape, sig = self.price_items(items, request.grad, rung,
                                               gradients=request.gradients)
        if pricing.dynamic_bytes > request.usable_bytes:
            return False
        _, cap = self.cap(items, request, sig, shape.outputs, rung)
        return cap is None or shape.packed_tokens <= cap

    def fitting_prefix(self, items: Sequence[Item], usable_bytes: Mapping[bool, int],
                       unallocated_gradients: UnallocatedGradients | None = None,
                       step_time: StepTimeFit | None = None,
                       expert_partner_tokens: Callable[[int, bool], int] | None = None) -> int:
        """How many leading `items` run together: their grad items as one micro-batch and
        their no-grad items as another, each fitting its limit (`usable_bytes[grad]`).
        Adaptive weighs its two packings of the grad items by `step_time` (adaptive.py).
        `expert_partner_tokens(count, grad)`: the EP partners' rows beside the first `count`
        items' micro-batch of that autograd mode (None: partners of its own size)."""
        def fits(count: int, as_configured: bool = False) -> bool | None:
            head = items[:count]

            def together(grad: bool) -> bool:
                request = PlanRequest(tuple(it for it in head if it.grad == grad), grad,
                                      usable_bytes[grad], PlanMode.WAVE, unallocated_gradients)
                admission = (self if expert_partner_tokens is None else
                             self.with_expert_partners(expert_partner_tokens(count, grad)))
                if as_configured and grad:
                    return admission.fits_together(request, as_configured=True)
                return admission.fits_together(request)

            return all(together(grad) for grad in {it.grad for it in head}) or None

        # By bisection (fitting together is monotone in the count): a wave of many short
        # items costs a logarithmic number of prices, not one per item.
        count = largest_fitting_count(fits, 0, len(items), True)[0]
        if not packs_two_ways(self, items):
            return count
        packed = largest_fitting_count(lambda n: fits(n, True), 0, len(items), True)[0]
        if packed <= count:
            return count
        return quicker_wave(self, items[:count], items[:packed], PlanRequest(
            tuple(it for it in items[:packed] if it.grad), True, usable_bytes[True],
            PlanMode.WAVE, unallocated_gradients, step_time))

    def _plan_group(self, request: PlanRequest) -> Plan:
        """The plan that runs exactly the pending items (which fit together) as one
        micro-batch; one item is planned as `next` plans it. Adaptive runs them under the
        least-work rung they fit together."""
        items = request.pending
        if request.grad and len(items) > 1 and packs_two_ways(self, items):
            lowest = least_work_rung_plan(self, items, request)
            if lowest is not None:
                return packed_wave_noted(self, lowest, self._packing_rung(items[0], request),
                                         request.step_time)
        if len(items) == 1 or not self.fits_together(request):
            return self._plan_next(request, self._packing_rung(items[0], request))
        rung = self._packing_rung(items[0], request)
        chosen = sorted(items, key=lambda it: it.index)
        pricing, shape, sig = self.price_items(chosen, request.grad, rung,
                                               gradients=request.gradients)
        cold, cap = self.cap(chosen, request, sig, shape.outputs, rung)
        return self.admitted(chosen, pricing, shape, sig, cold, cap, recompute=rung)

    # -- the recompute rungs ---------------------------------------------------------------

    def rungs_above(self, lengths: Sequence[int]) -> list[EffectiveRecompute]:
        """The rungs a grad micro-batch of `lengths` may escalate to, least work first."""
        if self.policy.choice == RecomputeChoice.CONFIGURED:
            return []
        if self.ladder is not None:
            return [rung.recompute for rung in self.ladder.above(lengths)]
        full = self.full_recompute
        return [full] if full is not None and full.key != self.recompute.key else []

    def rungs_below(self, lengths: Sequence[int]) -> list[EffectiveRecompute]:
        """Adaptive only: the rungs that redo less work than the configured one, least first."""
        if self.policy.choice != RecomputeChoice.ADAPTIVE or self.ladder is None:
            return []
        return [rung.recompute for rung in self.ladder.below(lengths)]

    def growth_cap(self, sig: str, grad: bool, outputs: OutputRequest) -> int | None:
        """Where the profile has seen the memory model under-predict, sizes may grow only to
        the edge of the trust window (largest size seen x trust_window), each step measured,
        instead of jumping to what the corrected model alone would admit (the error may grow
        with the size). None: no cap."""
        profile = self.profiles.get(sig)
        if profile is None or not profile.observations:
            return None
        if profile.correction()[0] <= 1.0:
            return None
        return int(max(t for t, _, _ in profile.observations) * self.policy.trust_window)

    def _does_not_fit(self, item: Item, request: PlanRequest, pricing: Pricing,
                      shape: MicroBatchShape, sig: str) -> Plan:
        grad, usable_bytes = request.grad, request.usable_bytes
        if not grad and len(item.leaves) > 1:
            split = split_no_grad(self, item, usable_bytes)
            if split is not None:
                groups, worst, worst_shape, worst_sig = split
                return Plan(
                    decision=SPLIT,
                    items=(item,),
                    pricing=worst,
                    shape=worst_shape,
                    sub_forwards=groups,
                    signature=worst_sig,
                    note=f"{len(item.leaves)} sequences in {len(groups)} sub-forwards",
                )
        full = self.full_recompute
        full_pricing: Pricing | None = None
        for rung in self.rungs_above(shape.sequence_lengths_tokens) if grad else ():
            rung_pricing, rung_shape, rung_sig = self.price(item.leaves, grad, rung,
                                                            gradients=request.gradients)
            if full is not None and rung.key == full.key:
                full_pricing = rung_pricing
            if rung_pricing.dynamic_bytes <= usable_bytes:
                return Plan(
                    decision=ESCALATED,
                    items=(item,),
                    pricing=rung_pricing,
                    shape=rung_shape,
                    sub_forwards=(tuple(range(len(item.leaves))),),
                    signature=rung_sig,
                    escalate=True,
                    recompute=rung,
                    note=f"{self.recompute.summary} needs {gib(pricing.dynamic_bytes)}; "
                    f"escalated to {rung.summary}, the least recompute above it that fits",
                )
        error = decline_error(self, item, grad, usable_bytes, pricing, shape, full_pricing,
                              gradients=request.gradients)
        return Plan(
            decision=DECLINED,
            items=(item,),
            pricing=pricing,
            shape=shape,
            sub_forwards=(),
            signature=sig,
            error=error,
        )


def _first_gradients(estimate: Any, grad: bool, gradients: UnallocatedGradients | None) -> int:
    """The LoRA gradients a grad micro-batch's backward allocates for the first time, down to
    the layer its backward peaks at (0 without grad or without unallocated gradients)."""
    if not grad or gradients is None:
        return 0
    return gradients.allocated_down_to(getattr(estimate, "backward_peak_layer", None))
