"""What a row changes in a layer's price beside the plain row the probe measured: its prefix
trees' recurrent calls, and how its experts' pairs are routed (EP partners' rows, the
router's share); and what a probed full-recompute unit of MoE layers lacks.

The probe measures a layer on plain rows with every rank of its group running the same row,
MoE layers routed evenly; the formulas price the same, and each change here is the formulas'
layer over this row less the formulas' layer over the plain one, added to the probe's layer
as to the formulas'.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from art.megatron.geometry import ModelGeometry
from art.megatron.layout import ParallelLayout
from art.trainer_rank._request import MicroBatchShape, RecurrentRow
from art.trainer_rank.pricing.layer_terms import Dims, LayerCost, PricedKind
from art.trainer_rank.pricing.layers import price_layer
from art.trainer_rank.pricing.layers_gdn import prefix_tree_extra_forward_bytes
from art.trainer_rank.pricing.layers_mlp import moe_dispatcher_state


def tree_change(d: Dims, kind: PricedKind, modules: frozenset[str], s: int, grad: bool,
                padded: int | None, recurrent: RecurrentRow, segments: int,
                worst_case_routing: bool, probe_tokens: int
                ) -> tuple[float, float, float | None]:
    """(forward, backward, held backward) change of a Gated DeltaNet layer over a row of
    prefix trees from its price over the same row as plain sequences: the formulas' layer
    with the rule at its largest call's working sets (one call per depth; without grad, the
    calls one at a time) against the formulas' layer over the row, plus, with grad, what the
    calls' outputs and states hold (`prefix_tree_extra_forward_bytes` at the `probe_tokens`
    the layer's curves are read at)."""
    plain = price_layer(d, kind, modules, s, grad=grad, padded=padded,
                        worst_case_routing=worst_case_routing, segments=segments)
    tree = price_layer(d, kind, modules, s, grad=grad, padded=padded,
                       worst_case_routing=worst_case_routing, rule_calls=recurrent.calls)
    extra = (prefix_tree_extra_forward_bytes(d, kind, probe_tokens, recurrent.calls)
             if grad else 0.0)
    held = (None if plain.backward_held is None or tree.backward_held is None
            else float(tree.backward_held - plain.backward_held))
    return (float(tree.forward - plain.forward) + extra,
            float(tree.backward - plain.backward) if grad else 0.0, held)


def unit_of_distinct_layers(d: Dims, kind: PricedKind, n: int, s: int, cost: LayerCost
                            ) -> LayerCost:
    """A probed full-recompute unit of `n` layers as the model's `n` distinct layers run it.
    The probe runs one layer `n` times, whose MoE token dispatcher keeps only its latest call's
    routing state; each of the model's layers keeps its own until its next call, so beside
    the last one the other `n` - 1 states are live through the unit's run, what it keeps
    and its backward."""
    if not kind.moe or n < 2:
        return cost
    states = (n - 1) * moe_dispatcher_state(d, s)
    return replace(cost, kept=int(cost.kept + states), forward=int(cost.forward + states),
                   backward=int(cost.backward + states),
                   backward_held=None if cost.backward_held is None
                   else int(cost.backward_held + states))


def expert_partner_s(batch: MicroBatchShape, s: int, geometry: ModelGeometry,
                     layout: ParallelLayout) -> int | None:
    """The EP partners' rows (`MicroBatchShape.expert_partner_tokens`) in this rank's tokens
    as `s` counts them; None: they run this row's size, or no layer exchanges tokens."""
    if not batch.expert_partner_tokens or not geometry.is_moe or layout.expert_parallel == 1:
        return None
    partner = math.ceil(batch.expert_partner_tokens / layout.context_parallel)
    return None if partner == s else partner


class ExpertShare(NamedTuple):
    """The router's spread under expert parallel at one row length (this rank's tokens), as
    shares of the even share, >= 1 (measuring/routing.py measures them)."""

    tokens: int
    working: float  # the busiest rank's experts in one MoE layer: a layer's own moment
    held: float  # the busiest rank's experts averaged over the MoE layers: their saved pairs
    # The busiest expert's pairs in one MoE layer over the even count per expert: what the
    # expert that runs last holds at once without grad (its experts run one at a time).
    expert: float = 1.0

    @property
    def even(self) -> bool:
        return self.working == self.held == self.expert == 1.0

    @classmethod
    def stored(cls, values: Sequence[float]) -> ExpertShare:
        """From a probe file: (tokens, working, held, expert), or (tokens, share) as files
        that measured one share for all three store it."""
        tokens, *shares = values
        working, held, expert = shares if len(shares) == 3 else shares * 3
        return cls(int(tokens), float(working), float(held), float(expert))


# The length an assumed share stands at: longer than any row, so `share_at` reads it for all.
ANY_ROW_TOKENS = 2**62


def share_at(shares: Sequence[ExpertShare], tokens: int) -> ExpertShare:
    """The shares to price a row of `tokens` (this rank's) at: each the largest measured at
    that length or longer, the longest row's past it (the even share: none measured)."""
    longer = [x for x in shares if x.tokens >= tokens] or list(shares[-1:])
    if not longer:
        return ExpertShare(tokens, 1.0, 1.0)
    return ExpertShare(tokens, max(x.working for x in longer), max(x.held for x in longer),
                       max(x.expert for x in longer))


def measured_shares(coefficients: Any, layout: ParallelLayout) -> tuple[ExpertShare, ...]:
    """The router's spread the probe measured under expert parallel, by row length, which the
    experts' pairs are priced at (`share_at`; none: the even share)."""
    if coefficients is None or layout.expert_parallel == 1:
        return ()
    return tuple(getattr(coefficients, "expert_routing_shares", ()))


def assumed_shares(load: ExpertShare | None, layout: ParallelLayout) -> tuple[ExpertShare, ...]:
    """A router's spread given rather than measured (the formulas have no router to measure),
    at every row length: `load`'s three shares, under expert parallel only."""
    if load is None or layout.expert_parallel == 1:
        return ()
    return (load._replace(tokens=ANY_ROW_TOKENS),)


def routing_change(d: Dims, kind: PricedKind, modules: frozenset[str], s: int, grad: bool,
                   padded: int | None, segments: int, worst_case_routing: bool,
                   partner_s: int | None, share: ExpertShare) -> LayerCost:
    """A MoE layer's price beside EP partners' rows of `partner_s` tokens (None: this row's
    size), its experts taking the router's `share` of the even share (what it keeps at the
    held share, its own moments at the working share and its busiest expert's), less its
    price beside partners of this row's size at the even share, quantity by quantity."""
    def layer(partner: int | None, at: float, busiest: float) -> LayerCost:
        return price_layer(d, kind, modules, s, grad=grad, padded=padded,
                           worst_case_routing=worst_case_routing, segments=segments,
                           expert_partner_s=partner, expert_routing_share=at,
                           busiest_expert_share=busiest)

    there, here = layer(partner_s, share.working, share.expert), layer(None, 1.0, 1.0)
    kept = (there if share.held == share.working
            else layer(partner_s, share.held, share.expert)).kept
    held = (None if there.backward_held is None or here.backward_held is None
            else there.backward_held - here.backward_held)
    return LayerCost(kept=kept - here.kept, forward=there.forward - here.forward,
                     backward=there.backward - here.backward,
                     output=there.output - here.output, saves_input=there.saves_input,
                     backward_held=held)
