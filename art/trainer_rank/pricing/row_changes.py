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
from typing import Any

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


def share_at(shares: Sequence[tuple[int, float]], tokens: int) -> float:
    """The share to price a row of `tokens` (this rank's) at: the largest measured at that
    length or longer, the longest row's past it (1: none measured)."""
    if not shares:
        return 1.0
    longer = [share for n, share in shares if n >= tokens]
    return max(longer) if longer else shares[-1][1]


def measured_shares(coefficients: Any, layout: ParallelLayout
                    ) -> tuple[tuple[int, float], ...]:
    """The router's spread the probe measured under expert parallel, by row length, which the
    experts' pairs are priced at (`share_at`; none: the even share)."""
    if coefficients is None or layout.expert_parallel == 1:
        return ()
    return tuple(getattr(coefficients, "expert_routing_shares", ()))


def routing_change(d: Dims, kind: PricedKind, modules: frozenset[str], s: int, grad: bool,
                   padded: int | None, segments: int, worst_case_routing: bool,
                   partner_s: int | None, share: float) -> LayerCost:
    """A MoE layer's price beside EP partners' rows of `partner_s` tokens (None: this row's
    size), its experts taking `share` of the even share, less its price beside partners of
    this row's size at the even share, quantity by quantity."""
    def layer(partner: int | None, at: float) -> LayerCost:
        return price_layer(d, kind, modules, s, grad=grad, padded=padded,
                           worst_case_routing=worst_case_routing, segments=segments,
                           expert_partner_s=partner, expert_routing_share=at)

    there, here = layer(partner_s, share), layer(None, 1.0)
    held = (None if there.backward_held is None or here.backward_held is None
            else there.backward_held - here.backward_held)
    return LayerCost(kept=there.kept - here.kept, forward=there.forward - here.forward,
                     backward=there.backward - here.backward,
                     output=there.output - here.output, saves_input=there.saves_input,
                     backward_held=held)
