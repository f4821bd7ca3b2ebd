"""Admission: which whole items run next, under which recompute, or why they cannot run.

Prices candidates with the memory model (recompute-aware, itemised) and the learned profile
(max of the two inside the profile's trust window), and decides: cold-capped (no profile yet:
start with the smallest item), admitted, split (a no-grad group run as sub-forwards), escalated
(fits only under full recompute) or declined (with the remedies priced in the message).
Pure logic: no model, no tensors; the runtime hands it a memory model and a usable limit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
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
    TrainerRankMemoryError,
)
from art.trainer_rank.compute.items import Item, group_shared_tokens, outputs_union
from art.trainer_rank.compute.prefix_tree import TreeShape, row_levels, tree_shape
from art.trainer_rank.decide.decline import decline_error
from art.trainer_rank.decide.nograd_split import split_no_grad
from art.trainer_rank.decide.prefix_search import QueuePrefixes, largest_fitting_count
from art.trainer_rank.decide.priced import MemoryModelLike, Pricing, gib
from art.trainer_rank.decide.profiles import ProfileStore, signature
from art.trainer_rank.memory.model import largest_fitting

# After this many consecutive candidates that do not fit, stop looking further down the queue.
MAX_MISFITS_SCANNED = 8


class PlanMode(StrEnum):
    """How the trainer asks for its next plan: greedily from a queue (`next`), exactly a
    data-parallel wave's share (`wave`), or every grad item of one call at once (`call`)."""

    NEXT = "next"
    WAVE = "wave"
    CALL = "call"


@dataclass(frozen=True)
class Plan:
    """The next micro-batch. sub_forwards: for each sub-forward, indices into `leaves` (the
    flattened sequences of `items`, in order); one sub-forward unless decision is split."""

    decision: str
    items: tuple[Item, ...]
    pricing: Pricing  # of the whole micro-batch (split: of its largest sub-forward)
    shape: MicroBatchShape
    sub_forwards: tuple[tuple[int, ...], ...]
    signature: str
    escalate: bool = False
    # The rung this plan runs when it is not the configured policy (escalated above it, or
    # adaptive below it); None: the configured policy.
    recompute: EffectiveRecompute | None = None
    error: TrainerRankMemoryError | None = None
    note: str = ""
    # Larger candidates admission priced and turned down on the way to this plan.
    rejected_candidates: int = 0

    @cached_property
    def leaves(self) -> tuple[ForwardInput, ...]:
        # Cached: the runtime reads it once per leaf.
        return tuple(leaf for item in self.items for leaf in item.leaves)

    @property
    def indices(self) -> list[int]:
        return [item.index for item in self.items]

    def group_indices(self, sub: Sequence[int]) -> list[list[int]]:
        """`sub`'s leaf indices cut where the owning item changes: the groups whose shared
        prefixes one packed row may lay out once."""
        owner = self._leaf_owners
        groups: list[list[int]] = []
        for i in sub:
            if groups and owner[groups[-1][-1]] == owner[i]:
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups

    @cached_property
    def _leaf_owners(self) -> tuple[int, ...]:
        return tuple(k for k, item in enumerate(self.items) for _ in item.leaves)

    def groups(self, sub: Sequence[int]) -> tuple[int, ...]:
        return tuple(len(group) for group in self.group_indices(sub))


@dataclass
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


@dataclass
class Admission:
    """Decides micro-batches for one rank. `next_tp_model` prices the same item at the next
    TP size for the decline message (None when there is no next size to suggest)."""

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
    # Bytes of trainable gradients not allocated yet (the trainer sets it before each grad
    # plan); grad micro-batches carry it as their first_gradient_allocation_bytes term.
    unallocated_gradient_bytes: int = 0
    # The same per decoder layer (memory/device.UnallocatedGradients): a backward allocates
    # only the gradients of the layers above its peak by then. None: all of them count.
    unallocated_gradients: Any = None
    # Whether the packer lays a group's shared prefixes out once (the built attention takes a
    # tree): then a hybrid's recurrent layers run the row's prefix trees, priced as such.
    shares_prefixes: bool = False
    # The rungs a micro-batch may run instead of the configured policy (recompute_ladder.py);
    # None: full recompute (`full_recompute`) is the only other one.
    ladder: RecomputeLadder | None = None

    def __post_init__(self) -> None:
        self.clear_caches()

    def clear_caches(self) -> None:
        """Forget every cached price, signature and cap (benchmarks time cold decisions)."""
        # (recompute id, grad, lengths, outputs) -> (estimate, shape, signature); the
        # estimate and shape never change for a key, the profile's part is read fresh.
        self._priced: dict[tuple[Any, ...], tuple[Any, MicroBatchShape, str]] = {}
        self._signatures: dict[tuple[int, bool, OutputRequest], str] = {}
        # (outputs, grad, usable bytes) -> the memory model's largest admissible row.
        self._model_max: dict[tuple[OutputRequest, bool, int, int, int], int] = {}
        # id -> the recompute itself (kept alive, so its id is never reused while cached).
        self._recomputes: dict[int, EffectiveRecompute] = {}
        self._models: dict[int, MemoryModelLike] = {}

    def signature(self, recompute: EffectiveRecompute, grad: bool, outputs: OutputRequest) -> str:
        key = (id(recompute), grad, outputs)
        sig = self._signatures.get(key)
        if sig is None:
            self._recomputes[id(recompute)] = recompute
            sig = self._signatures[key] = signature(
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

    def price(
        self,
        leaves: Sequence[ForwardInput],
        grad: bool,
        recompute: EffectiveRecompute | None = None,
    ) -> tuple[Pricing, MicroBatchShape, str]:
        """`leaves`: sequences of one item (a split's sub-forward shares their prefixes)."""
        shared = group_shared_tokens(leaves)
        return self.price_lengths(tuple(leaf.num_tokens for leaf in leaves),
                                  outputs_union(leaves), grad, recompute,
                                  shared_tokens=shared,
                                  recurrent=self._recurrent([self._tree(leaves, shared)]))

    def price_items(self, items: Sequence[Item], grad: bool,
                    recompute: EffectiveRecompute | None = None
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
                                  recurrent=recurrent)

    @staticmethod
    def _item_tree(item: Item) -> TreeShape:
        if not item.shared_tokens:
            return TreeShape.sequences(item.sequence_lengths_tokens)
        return item.tree

    def price_lengths(self, lengths: tuple[int, ...], outputs: OutputRequest, grad: bool,
                      recompute: EffectiveRecompute | None = None, shared_tokens: int = 0,
                      recurrent: RecurrentRow | None = None,
                      ) -> tuple[Pricing, MicroBatchShape, str]:
        recompute = recompute or self.recompute
        key = (id(recompute), grad, lengths, outputs, shared_tokens, recurrent)
        hit = self._priced.get(key)
        if hit is None:
            model = self.model_for(recompute)
            shape = MicroBatchShape(sequence_lengths_tokens=lengths, outputs=outputs,
                                    grad_enabled=grad,
                                    padded_tokens=self.packed_length(lengths, shared_tokens),
                                    recurrent=recurrent)
            if len(self._priced) > 8192:  # an Estimate holds its terms: bound the memory
                self._priced.clear()
            hit = self._priced[key] = (model.estimate(shape), shape,
                                       self.signature(recompute, grad, outputs))
        estimate, shape, sig = hit
        reserve = int(estimate.reserve_bytes)
        profile = self.profiles.predict(sig, shape.packed_tokens, self.policy.trust_window,
                                        int(estimate.dynamic_bytes) - reserve)
        profile_dynamic = None if profile is None else profile + reserve
        first_gradients = 0
        if grad and self.unallocated_gradients is not None:
            first_gradients = self.unallocated_gradients.allocated_down_to(
                getattr(estimate, "backward_peak_layer", None))
        elif grad:
            first_gradients = self.unallocated_gradient_bytes
        return Pricing(estimate, profile_dynamic, recompute,
                       first_gradient_allocation_bytes=first_gradients), shape, sig

    def model_for(self, recompute: EffectiveRecompute) -> MemoryModelLike:
        if recompute is self.recompute:
            return self.memory_model
        model = self._models.get(id(recompute))
        if model is None:
            self._recomputes[id(recompute)] = recompute
            model = self._models[id(recompute)] = self.memory_model.with_recompute(recompute)
        return model

    def model_max_tokens(self, usable_bytes: int, outputs: OutputRequest, grad: bool, *,
                          start_tokens: int = 1,
                          recompute: EffectiveRecompute | None = None) -> int:
        """The largest one-sequence row the memory model admits, to within 1/32 and never
        above it: the cold cap is a fraction of it, so a coarse bound saves half the
        estimates of an exact bisection (a cold decision's main cost)."""
        recompute = recompute or self.recompute
        key = (outputs, grad, usable_bytes, self.unallocated_gradient_bytes if grad else 0,
               id(recompute))
        hit = self._model_max.get(key)
        if hit is not None:
            return hit

        def fits(tokens: int) -> bool:
            pricing = self.price_lengths((tokens,), outputs, grad, recompute)[0]
            return pricing.model_dynamic_bytes <= usable_bytes

        start = max(1, start_tokens)
        lo = 0
        if fits(start):
            lo = largest_fitting(fits, start, 2 * start, cap=1 << 26,
                                 slack=lambda low: max(1, low // 32))
        elif start_tokens > 1:
            lo = self.model_for(recompute).max_tokens_that_fit(usable_bytes, outputs=outputs,
                                                               grad_enabled=grad)
        if len(self._model_max) > 4096:
            self._model_max.clear()
        self._model_max[key] = lo
        return lo

    # -- the decision -------------------------------------------------------------------------

    def plan_next(self, pending: Sequence[Item], grad: bool, usable_bytes: int) -> Plan:
        """The next micro-batch from `pending` (never empty). The caller removes the plan's
        items from its queue whatever the decision (a declined item is reported, not retried)."""
        if not pending:
            raise ValueError("plan_next needs at least one pending item")
        return self._plan_next(pending, grad, usable_bytes,
                               self._packing_rung(pending[0], grad, usable_bytes))

    def _packing_rung(self, first: Item, grad: bool, usable_bytes: int) -> EffectiveRecompute:
        """The rung the queue is packed under: the configured policy; adaptive, the least-work
        rung under which the first item fits alone (more items then fit only as that rung
        allows, so the micro-batch recomputes as little as its first item needs)."""
        for rung in self.rungs_below(first.sequence_lengths_tokens) if grad else ():
            if self.price_items([first], grad, rung)[0].dynamic_bytes <= usable_bytes:
                return rung
        return self.recompute

    def _plan_next(self, pending: Sequence[Item], grad: bool, usable_bytes: int,
                   recompute: EffectiveRecompute) -> Plan:
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
                                               recompute=recompute)
            cap_tokens = max(
                smallest.num_tokens, int(self.policy.cold_start_fraction * model_max)
            )
        else:
            cap_tokens = self.growth_cap(first_sig, grad, pending[0].outputs)
        first = queue[0]
        pricing, shape, sig = self.price_items([first], grad, recompute)
        if pricing.dynamic_bytes > usable_bytes:
            if recompute is not self.recompute:  # the smallest item does not fit that rung
                return self._plan_next(pending, grad, usable_bytes, self.recompute)
            return self._does_not_fit(first, grad, usable_bytes, pricing, shape, sig)

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
                                        recurrent=recurrent)
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
        return self._admitted(chosen, pricing, shape, sig, cold, cap_tokens, rejected,
                              grad=grad, usable_bytes=usable_bytes, recompute=recompute)

    def _admitted(self, chosen: Sequence[Item], pricing: Pricing, shape: MicroBatchShape,
                  sig: str, cold: bool, cap_tokens: int | None, rejected: int = 0, *,
                  grad: bool, usable_bytes: int,
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

    def _cap(self, items: Sequence[Item], grad: bool, usable_bytes: int, sig: str,
             outputs: OutputRequest, recompute: EffectiveRecompute | None = None
             ) -> tuple[bool, int | None]:
        """(cold, cap in packed tokens or None): an unprofiled signature starts at a fraction
        of what the memory model alone admits (at least its smallest item); a profile that saw
        the model under-predict grows only to the edge of its trust window."""
        if not self.profiles.has_profile(sig):
            smallest = min(items, key=lambda it: (it.num_tokens, it.index))
            model_max = self.model_max_tokens(usable_bytes, smallest.outputs, grad,
                                               start_tokens=smallest.num_tokens,
                                               recompute=recompute)
            return True, max(smallest.num_tokens,
                             int(self.policy.cold_start_fraction * model_max))
        return False, self.growth_cap(sig, grad, outputs)

    def fits_together(self, items: Sequence[Item], grad: bool, usable_bytes: int) -> bool:
        """Whether `items` run as one micro-batch under the rung they are packed under (the
        configured policy; adaptive: the least-work rung their first item fits alone). One
        item always has a plan of its own (admitted, split, escalated or declined)."""
        if len(items) <= 1:
            return True
        rung = self._packing_rung(items[0], grad, usable_bytes)
        pricing, shape, sig = self.price_items(items, grad, rung)
        if pricing.dynamic_bytes > usable_bytes:
            return False
        _, cap = self._cap(items, grad, usable_bytes, sig, shape.outputs, rung)
        return cap is None or shape.packed_tokens <= cap

    def fitting_prefix(self, items: Sequence[Item], usable_bytes: Callable[[bool], int]) -> int:
        """How many leading `items` run together: their grad items as one micro-batch and
        their no-grad items as another, each fitting (`usable_bytes(grad)`)."""
        def fits(count: int) -> bool | None:
            head = items[:count]
            return all(self.fits_together([it for it in head if it.grad == grad], grad,
                                          usable_bytes(grad))
                       for grad in {it.grad for it in head}) or None

        # By bisection (fitting together is monotone in the count): a wave of many short
        # items costs a logarithmic number of prices, not one per item.
        return largest_fitting_count(fits, 0, len(items), True)[0]

    def plan_group(self, items: Sequence[Item], grad: bool, usable_bytes: int) -> Plan:
        """The plan that runs exactly `items` (which fit together) as one micro-batch; one item
        is planned as `plan_next` plans it."""
        if len(items) == 1 or not self.fits_together(items, grad, usable_bytes):
            return self.plan_next(items, grad, usable_bytes)
        rung = self._packing_rung(items[0], grad, usable_bytes)
        chosen = sorted(items, key=lambda it: it.index)
        pricing, shape, sig = self.price_items(chosen, grad, rung)
        cold, cap = self._cap(chosen, grad, usable_bytes, sig, shape.outputs, rung)
        return self._admitted(chosen, pricing, shape, sig, cold, cap, grad=grad,
                              usable_bytes=usable_bytes, recompute=rung)

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

    def _does_not_fit(
        self,
        item: Item,
        grad: bool,
        usable_bytes: int,
        pricing: Pricing,
        shape: MicroBatchShape,
        sig: str,
    ) -> Plan:
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
            rung_pricing, rung_shape, rung_sig = self.price(item.leaves, grad, rung)
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
        error = decline_error(self, item, grad, usable_bytes, pricing, shape, full_pricing)
        return Plan(
            decision=DECLINED,
            items=(item,),
            pricing=pricing,
            shape=shape,
            sub_forwards=(),
            signature=sig,
            error=error,
        )
