"""MemoryModel: geometry + layout + recompute + implementation + LoRA -> an itemised Estimate.

The chain composition (per pipeline stage, the busiest one):
- before the decoder: the packed inputs, the attention mask (local spec: bool [S, S]), the
  rotary table, the embedding output;
- forward through the layers: layer i starts with what layers < i kept plus its input and
  peaks at `forward` above that; a full-recompute unit keeps only its input and runs its
  layers without grad;
- the tail: final norm, the full hidden row (gathered under SP), the chunked vocab head
  (P's `compute_heads`: one chunk of [chunk, vocab/TP] fp32 logits at a time), the requested
  outputs, the caller loss;
- backward from the top: the head's backward (one chunk rebuilt), then each layer at
  `backward` above what it and the layers below keep; a full-recompute unit first rebuilds
  its layers with grad (what they keep without recompute) and then runs their backward.
Forward and backward peaks are each a sum of named terms; dynamic = max of the two + reserve.
Without grad nothing is kept: the forward peak is the inputs plus one layer's working set.

Per-layer numbers come from the probe when it measured that (layer kind, policy) and from the
formulas in `layers.py` otherwise; `coefficients_source` says which.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Any

from art.megatron.geometry import ModelGeometry
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.megatron.recompute import EffectiveRecompute, LayerRecompute
from art.trainer_rank._request import LoraShape, MicroBatchShape, OutputRequest, RecurrentRow
from art.trainer_rank.pricing.adapters import lora_params_per_rank, resident_adapter_terms
from art.trainer_rank.pricing.base_weights import params_per_rank
from art.trainer_rank.pricing.budget import AllocatorReserve
from art.trainer_rank.pricing.chunked import has_chunked_layers, padded_chunk_tokens, row_segments
from art.trainer_rank.pricing.coefficients import Coefficients, MeasuredTail, RecomputeMode
from art.trainer_rank.pricing.estimate import Estimate, Lifetime, Term, TermKind
from art.trainer_rank.pricing.layer_terms import Dims, LayerCost, PricedKind
from art.trainer_rank.pricing.layers import layer_kind, price_layer
from art.trainer_rank.pricing.layers_gdn import (
    conv_sequence_padding_bytes,
    prefix_tree_state_bytes,
)
from art.trainer_rank.pricing.passes import (
    BUFFERS_OF_ATTENTION,
    Unit,
    backward_terms,
    forward_pass,
    forward_terms,
    full_unit_peak,
    kept_note,
    pre_decoder_terms,
)
from art.trainer_rank.pricing.probe_reading import PaddedRow, ProbeReading, probe_tokens
from art.trainer_rank.pricing.row_changes import (
    ExpertShare,
    assumed_shares,
    expert_partner_s,
    measured_shares,
    routing_change,
    share_at,
    tree_change,
    unit_of_distinct_layers,
)
from art.trainer_rank.pricing.tail import (
    CALLER_LOSS_SCALARS_BYTES,
    TailCost,
    caller_per_token_loss_bytes,
    default_tail,
    gathered_logits_bytes,
    largest_allocation,
    shared_output_copies,
    tail_past_its_rows,
)

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
HEAD_CHUNK_TOKENS_DEFAULT = 2048
# LoRA training state per trainable parameter: fp32 Adam moments (2 x 4 bytes).
ADAM_STATE_BYTES = 8


def default_head_chunk_tokens() -> int:
    try:
        from art.trainer_rank.compute.heads import HEAD_CHUNK_TOKENS

        return int(HEAD_CHUNK_TOKENS)
    except ImportError:
        return HEAD_CHUNK_TOKENS_DEFAULT


@dataclass(frozen=True)
class MemoryModel:
    geometry: ModelGeometry
    _: KW_ONLY
    layout: ParallelLayout
    recompute: EffectiveRecompute
    implementation: Implementation
    lora: LoraShape
    dtype: str
    coefficients: Coefficients | None = None  # measured by the probe; None: formulas
    alloc_conf: str | None = None
    worst_case_routing: bool = False
    # Under expert parallel, the router's spread to price without a probe's measurement
    # (`estimate --expert-load`); None: the even share. A probe's measured spread wins.
    expert_load: ExpertShare | None = None
    head_chunk_tokens: int = 0  # 0: the compute path's HEAD_CHUNK_TOKENS
    # Derived from the fields above in __post_init__ (a copy made with `replace` derives its
    # own); not part of what the model is.
    dims: Dims = field(init=False, repr=False, compare=False)
    _kinds: tuple[PricedKind, ...] = field(init=False, repr=False, compare=False)
    _shares: tuple[ExpertShare, ...] = field(init=False, repr=False, compare=False)
    # Caches of what the model priced: (layer kind, modules, tokens, ...) -> layer cost and
    # whether the probe measured it; micro-batch -> estimate.
    _memo: dict[tuple[Any, ...], tuple[LayerCost, bool]] = field(
        init=False, repr=False, compare=False)
    _estimates: dict[MicroBatchShape, Estimate] = field(init=False, repr=False, compare=False)
    # The formulas read the way the probe reads a chunked layer (pricing/probe_reading.py).
    _readings: dict[tuple[Any, ...], Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        if len(self.recompute.layers) != self.geometry.num_layers:
            raise ValueError(
                f"recompute policy covers {len(self.recompute.layers)} layers but "
                f"{self.geometry.name} has {self.geometry.num_layers}; resolve it for this model"
            )
        derived: dict[str, Any] = {
            "head_chunk_tokens": self.head_chunk_tokens or default_head_chunk_tokens(),
            "dims": Dims(self.geometry, self.layout, self.implementation, self.dtype_bytes,
                         self.lora.rank, frozenset(self.lora.target_modules)),
            "_kinds": tuple(layer_kind(self.geometry, i)
                            for i in range(self.geometry.num_layers)),
            "_shares": (measured_shares(self.coefficients, self.layout)
                        or assumed_shares(self.expert_load, self.layout)),
            "_memo": {},
            "_estimates": {},
            "_readings": {},
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_provider(cls, provider: Any, *, coefficients: Coefficients | None = None
                     ) -> MemoryModel:
        import os

        lora_cfg = getattr(provider, "lora_config", None)
        lora = LoraShape()
        if lora_cfg is not None:
            targets = lora_cfg.target_modules
            if isinstance(targets, str):
                targets = (targets,)
            lora = LoraShape(rank=int(lora_cfg.r), target_modules=_megatron_targets(targets))
        return cls(
            provider.geometry, layout=provider.layout, recompute=provider.effective_recompute,
            implementation=provider.implementation, lora=lora, dtype=provider.dtype,
            coefficients=coefficients, alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        )

    def with_recompute(self, recompute: EffectiveRecompute) -> MemoryModel:
        return replace(self, recompute=recompute)

    def with_coefficients(self, coefficients: Coefficients | None) -> MemoryModel:
        return replace(self, coefficients=coefficients)

    def clear_caches(self) -> None:
        """Forget every estimate and layer cost priced so far (the next estimate is priced
        cold, as a benchmark of decisions on new items needs)."""
        self._memo.clear()
        self._estimates.clear()
        self._readings.clear()

    def allocator_reserve_bytes(self, dynamic_peak_bytes: int, largest_allocation_bytes: int
                                ) -> int:
        """The allocator reserve for a dynamic peak priced outside one estimate (several
        sub-forwards held together)."""
        return AllocatorReserve(self.implementation.device, self.alloc_conf).reserve_bytes(
            dynamic_peak_bytes, largest_allocation_bytes)

    # ------------------------------------------------------------------ sizes
    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def _layer_cost(self, index: int, modules: frozenset[str], s: int, grad: bool,
                    padded: int | None = None, sequences: int = 1,
                    recurrent: RecurrentRow | None = None, segments: int = 1,
                    expert_partner_s: int | None = None, rebuilt: bool = False
                    ) -> tuple[LayerCost, bool]:
        """`padded`: the row's tokens padded to whole kernel chunks (pricing/chunked.py);
        `sequences`: how many segments (sequences, or prefix-tree nodes) a recurrent layer
        runs the row as; `recurrent`: the row's calls when it holds prefix trees;
        `segments`: the row's segments as its delta rule runs them (its padded tail too);
        `expert_partner_s`: the EP partners' rows (`row_changes.expert_partner_s`), whose
        routed tokens a MoE layer's experts take beside this row's (`routing_change`);
        `rebuilt`: the layer as a full-recompute unit rebuilds it for its backward, when what
        it keeps is held beside its own backward only, at its own layer's share (the working
        share) rather than beside every layer's (the held share)."""
        kind = self._kinds[index]
        # Only a MoE layer's price under a measured spread depends on being rebuilt.
        rebuilt = rebuilt and kind.moe and bool(self._shares)
        memo_key = (kind, modules, s, grad, padded, sequences, recurrent, segments,
                    expert_partner_s, rebuilt)
        hit = self._memo.get(memo_key)
        if hit is not None:
            return hit
        result: tuple[LayerCost, bool] | None = None
        if self.coefficients is not None:
            cost = self.coefficients.layer_cost(
                kind, RecomputeMode(grad=grad, modules=modules).key,
                self._probe_tokens(kind, s), padded,
                self._segments_change(kind, modules, s, grad, padded, segments, sequences),
                segments)
            if cost is not None:
                result = (cost, True)
        if result is None:
            result = (price_layer(self.dims, kind, modules, s, grad=grad,
                                  worst_case_routing=self.worst_case_routing, padded=padded,
                                  segments=segments),
                      False)
        continued = recurrent.continued_segments if recurrent is not None else 0
        padding = (conv_sequence_padding_bytes(self.dims, kind, sequences, tree=continued > 0)
                   if grad else 0.0)
        forward_change = backward_change = 0.0
        held_change: float | None = 0.0
        if recurrent is not None and len(recurrent.calls) > 1 and kind.linear:
            forward_change, backward_change, held_change = tree_change(
                self.dims, kind, modules, s, grad, padded, recurrent, segments,
                self.worst_case_routing, self._probe_tokens(kind, s))
        kept_change = 0.0
        share = share_at(self._shares, s)
        if rebuilt:
            share = share._replace(held=share.working)
        if kind.moe and (expert_partner_s is not None or not share.even):
            routed = routing_change(self.dims, kind, modules, s, grad, padded, segments,
                                    self.worst_case_routing, expert_partner_s, share)
            kept_change = routed.kept
            forward_change += routed.forward
            backward_change += routed.backward
            if held_change is not None:
                held_change = (None if routed.backward_held is None
                               else held_change + routed.backward_held)
        if padding or kept_change or forward_change or backward_change or held_change:
            cost, used = result
            held = cost.backward_held
            if held is not None and held_change is not None:
                held = int(held + held_change)
            result = (replace(cost, kept=int(cost.kept + padding + kept_change),
                              forward=int(cost.forward + padding + forward_change),
                              backward=int(cost.backward + backward_change),
                              backward_held=held), used)
        if len(self._memo) > 4096:
            self._memo.clear()
        self._memo[memo_key] = result
        return result

    def _segments_change(self, kind: PricedKind, modules: frozenset[str], s: int, grad: bool,
                         padded: int | None, segments: int, sequences: int = 1
                         ) -> dict[str, float] | None:
        """What a Gated DeltaNet layer's backward over this row holds beside the probe's
        reading of its measurements, by the formulas (pricing/probe_reading.py)."""
        if not grad or padded is None or not kind.linear:
            return None
        return self._reading().layer_change(kind, modules,
                                            PaddedRow(s, padded, segments, sequences))

    def _reading(self) -> ProbeReading:
        return ProbeReading(self.dims, self.layout, self.coefficients, self.worst_case_routing,
                            self.geometry.hidden_size * self.dtype_bytes, self._readings)

    def _probed_unit(self, index: int, n: int, s: int, grad: bool = True,
                     padded: int | None = None, recurrent: RecurrentRow | None = None,
                     sequences: int = 1, segments: int = 1,
                     expert_partner_s: int | None = None) -> LayerCost | None:
        """The probe's cost of a full-recompute unit of `n` layers of one kind. Over a row of
        prefix trees a Gated DeltaNet unit's no-grad run changes as its layer's forward does,
        and its backward (the layer rebuilt with grad, then its backward) as the formulas'
        unit does (`full_unit_peak`) with the rule at its largest call. `sequences`,
        `segments` and `expert_partner_s` as in `_layer_cost`: a MoE unit beside partners'
        rows of another size is composed from its layers (None), which carry the change."""
        kind = self._kinds[index]
        if kind.moe and (expert_partner_s is not None or not share_at(self._shares, s).even):
            return None
        cost = self._probed_unit_cost(index, n, s, grad, padded, sequences, segments)
        if (cost is None or recurrent is None or len(recurrent.calls) < 2
                or not kind.linear):
            return cost
        x = self.dims.hidden_tokens(s) * self.geometry.hidden_size * self.dtype_bytes
        peaks = []
        for calls in (None, recurrent.calls):
            layer = price_layer(self.dims, kind, frozenset(), s, grad=True, padded=padded,
                                worst_case_routing=self.worst_case_routing, rule_calls=calls,
                                segments=segments)
            peaks.append(full_unit_peak(Unit(True, index, x, x, (layer,))))
        no_grad = tree_change(self.dims, kind, frozenset(), s, False, padded, recurrent, 1,
                              self.worst_case_routing, self._probe_tokens(kind, s))[0]
        return replace(cost, forward=int(cost.forward + no_grad),
                       backward=int(cost.backward + peaks[1] - peaks[0]))

    def _probed_unit_cost(self, index: int, n: int, s: int, grad: bool,
                          padded: int | None, sequences: int = 1, segments: int = 1
                          ) -> LayerCost | None:
        if self.coefficients is None:
            return None
        layers = self.recompute.layers
        if index > 0 and index < len(layers):
            here, before = layers[index], layers[index - 1]
            if (before.pipeline_stage, before.virtual_chunk, before.full_checkpoint_unit) == (
                    here.pipeline_stage, here.virtual_chunk, here.full_checkpoint_unit):
                # Not a unit's first layer: the rest of a unit mixing layer kinds (Gated
                # DeltaNet and attention), which is priced layer by layer.
                return None
        kinds = set(self._kinds[index:index + n])
        if len(kinds) != 1:
            return None
        kind = kinds.pop()
        change = (self._unit_segments_change(index, kind, n, s, padded, sequences, segments)
                  if grad else None)
        cost = self.coefficients.layer_cost(
            kind, RecomputeMode(grad=grad, full_layers=n).key, self._probe_tokens(kind, s),
            padded, change, segments)
        return cost if cost is None else unit_of_distinct_layers(self.dims, kind, n, s, cost)

    def _unit_segments_change(self, index: int, kind: PricedKind, n: int, s: int,
                              padded: int | None, sequences: int, segments: int
                              ) -> dict[str, float] | None:
        """`_segments_change` of a full-recompute unit of `n` Gated DeltaNet layers, which
        the probe measures whole on one sequence."""
        if padded is None or not kind.linear:
            return None
        return self._reading().unit_change(index, kind, n,
                                           PaddedRow(s, padded, segments, sequences))

    def _layers_holding_tree_states(self) -> int:
        """How many Gated DeltaNet layers hold their continued segments' initial states at
        once (what the rule saves for backward): every such layer outside a full-recompute
        unit, which keeps them until its backward, and the linear layers of the largest unit,
        whose forward runs without saving and which rebuilds them only for its own backward."""
        kept = 0
        units: dict[tuple[int, int, int], int] = {}
        for index, lr in self._stage_layers():
            if not self._kinds[index].linear:
                continue
            if lr.full_checkpoint_unit is None:
                kept += 1
            else:
                unit = (lr.pipeline_stage, lr.virtual_chunk, lr.full_checkpoint_unit)
                units[unit] = units.get(unit, 0) + 1
        return kept + max(units.values(), default=0)

    def _probe_tokens(self, kind: PricedKind, s: int) -> int:
        return probe_tokens(self.layout, kind, s)

    def _stage_layers(self) -> list[tuple[int, LayerRecompute]]:
        """The layers of the busiest pipeline stage (all of them without PP)."""
        by_stage: dict[int, list[tuple[int, LayerRecompute]]] = {}
        for i, lr in enumerate(self.recompute.layers):
            by_stage.setdefault(lr.pipeline_stage, []).append((i, lr))
        return max(by_stage.values(), key=len)

    def resident_terms(self) -> list[Term]:
        g, b, tp = self.geometry, self.dtype_bytes, self.layout.tensor_parallel
        pp = self.layout.pipeline_parallel
        params = params_per_rank(g, self.layout)
        terms = [Term(TermKind.WEIGHTS, "weights", int(params * b), Lifetime.RESIDENT,
                      f"{params / 1e9:.3f}B params/rank x {b} B (TP{tp}"
                      f"{f', PP{pp}' if pp > 1 else ''})")]
        if self.lora.rank:
            lora_params = lora_params_per_rank(g, self.lora, self.layout)
            terms.append(Term(TermKind.LORA_PARAMS, "LoRA params + grads",
                              int(lora_params * 2 * b), Lifetime.RESIDENT,
                              f"{lora_params:,} params x (param + grad) x {b} B"))
            terms.append(Term(TermKind.OPTIMIZER_STATE, "optimizer state (LoRA, Adam)",
                              int(lora_params * ADAM_STATE_BYTES), Lifetime.RESIDENT,
                              f"{lora_params:,} params x 2 fp32 moments"))
        terms += resident_adapter_terms(g, self.lora, self.layout, b)
        return terms

    # ------------------------------------------------------------------ the estimate
    def estimate(self, batch: MicroBatchShape) -> Estimate:
        cache = self._estimates
        hit = cache.get(batch)
        if hit is None:
            if len(cache) > 4096:
                cache.clear()
            hit = cache[batch] = self._estimate(batch)
        return hit

    def _estimate(self, batch: MicroBatchShape) -> Estimate:
        g, b = self.geometry, self.dtype_bytes
        S = batch.packed_tokens
        # CP: the load-balanced split gives every rank the same share; the busiest rank
        # holds ceil(S / CP) tokens of every activation and attends to the whole sequence.
        s = math.ceil(S / self.layout.context_parallel)
        grad = batch.grad_enabled
        hidden_local = self.dims.hidden_tokens(s) * g.hidden_size * b
        terms: list[Term] = list(self.resident_terms())
        resident = sum(t.bytes for t in terms)

        pre = pre_decoder_terms(
            g, self.implementation, b, self.layout.tensor_parallel, s, S, hidden_local,
            checkpointed_attention_layers=sum(
                1 for lr in self.recompute.layers if "core_attn" in lr.selective_modules))
        # Gated DeltaNet kernels pad each segment (a sequence, or a prefix-tree node) to whole
        # chunks (CP does not split them).
        recurrent = batch.recurrent
        segments = (recurrent.segment_lengths_tokens if recurrent is not None
                    else batch.sequence_lengths_tokens)
        continued = recurrent.continued_segments if recurrent is not None else 0
        if recurrent is not None and S > sum(segments):
            # The row's padding is a segment of its own, run with the last depth's call.
            *upper, last = recurrent.calls
            recurrent = RecurrentRow((*upper, (*last, S - sum(segments))))
        padded = None
        rule_segments = 1
        if has_chunked_layers(g):
            # Under CP the Gated DeltaNet layers run the whole row (its padded tail included).
            row = (row_segments(segments, self.layout, row_tokens=S,
                                implementation=self.implementation)
                   if recurrent is not None or self.layout.context_parallel > 1
                   else row_segments(segments, self.layout))
            padded, rule_segments = padded_chunk_tokens(row), len(row)
        partner = expert_partner_s(batch, s, g, self.layout)
        layers = self._layers_holding_tree_states()
        if grad and continued and layers:
            per_layer = prefix_tree_state_bytes(self.dims, continued)
            pre.append(Term(TermKind.PREFIX_TREE_STATES, "prefix-tree states handed on",
                            int(layers * per_layer), Lifetime.FORWARD,
                            f"{layers} Gated DeltaNet layer(s) x {continued} continued "
                            "segment(s) x [value heads/TP, dk, dv] fp32"))
        fp = forward_pass(self._stage_layers(), s, grad, hidden_local,
                          functools.partial(self._layer_cost, padded=padded,
                                            sequences=len(segments), recurrent=recurrent,
                                            segments=rule_segments, expert_partner_s=partner),
                          functools.partial(self._probed_unit, padded=padded,
                                            recurrent=recurrent, sequences=len(segments),
                                            segments=rule_segments, expert_partner_s=partner),
                          attention_layers=frozenset(
                              i for i, kind in enumerate(self._kinds) if not kind.linear),
                          attention_buffers=sum(t.bytes for t in pre
                                                if t.kind in BUFFERS_OF_ATTENTION),
                          moe_layers=frozenset(i for i, kind in enumerate(self._kinds)
                                               if kind.moe))
        tail, tail_probed = self._tail(batch, s, S)
        layer_kept_note = kept_note(fp.units, s)
        if g.is_moe:
            share = share_at(self._shares, s)
            routing = ("worst-case routing" if self.worst_case_routing
                       else "balanced routing" if share.even
                       else f"routing at {share.working:.3f} of the even share in a layer, "
                       f"{share.held:.3f} over the layers, its busiest expert at "
                       f"{share.expert:.3f} (" + ("its router's" if measured_shares(
                           self.coefficients, self.layout) else "assumed") + ")")
            layer_kept_note += f"; MoE: {routing} over EP{self.layout.expert_parallel}"
            if partner is not None:
                layer_kept_note += (f", the EP partners' rows at {batch.expert_partner_tokens}"
                                    " tokens")
        fwd_terms, forward_where = forward_terms(pre, fp, tail, layer_kept_note, grad)
        forward_peak = sum(t.bytes for t in fwd_terms)
        bwd_terms, backward_where, backward_layer = (
            backward_terms(pre, fp, tail, layer_kept_note) if grad else ([], "", None))
        backward_peak = sum(t.bytes for t in bwd_terms)

        dynamic_core = max(forward_peak, backward_peak)
        largest = largest_allocation(self, batch, s, S)
        reserve = AllocatorReserve(self.implementation.device, self.alloc_conf)
        reserve_bytes = reserve.reserve_bytes(dynamic_core, largest)
        terms += fwd_terms + bwd_terms
        terms.append(Term(TermKind.ALLOCATOR_RESERVE, "allocator reserve", int(reserve_bytes),
                          Lifetime.RESERVE, reserve.describe(dynamic_core, largest)))
        source = "defaults"
        if (fp.probe_used or tail_probed) and self.coefficients is not None:
            source = f"probe:{self.coefficients.key}"
            if self.coefficients.partial_for(self.geometry):
                source += " (+defaults for unprobed layer kinds)"
        score_buffer = sum(t.bytes for t in pre if t.kind is TermKind.SCORE_BUFFER)
        peak_at = (f"forward: {forward_where}" if forward_peak >= backward_peak
                   else f"backward: {backward_where}")
        return Estimate(
            terms=tuple(terms),
            resident_bytes=int(resident),
            forward_peak_bytes=int(forward_peak),
            backward_peak_bytes=int(backward_peak),
            reserve_bytes=int(reserve_bytes),
            largest_allocation_bytes=int(largest),
            recompute_summary=self.recompute.for_grad(grad).summary
            if grad else "no grad (nothing retained)",
            coefficients_source=source,
            batch=batch,
            peak_at=peak_at,
            backward_peak_layer=backward_layer,
            retained_after_forward_bytes=int(
                sum(t.bytes for t in pre) - score_buffer + fp.kept_total + fp.output
                + tail.kept + tail.saved) if grad else 0,
            outputs_bytes=int(tail.kept),
            score_buffer_bytes=int(score_buffer),
        )

    def _tail(self, batch: MicroBatchShape, s: int, S: int) -> tuple[TailCost, bool]:
        """The tail as the probe measured it for these outputs (at the whole row), else as
        the formulas price it, with the outputs' copies where sequences share a prefix
        (`shared_output_copies`); and whether the probe's was used."""
        tail, probed = self._row_tail(batch, s, S)
        return shared_output_copies(self, batch, tail), probed

    def _row_tail(self, batch: MicroBatchShape, s: int, S: int) -> tuple[TailCost, bool]:
        if self.coefficients is not None:
            probed = self.probed_tail(batch.outputs, batch.grad_enabled, S)
            if probed is not None:
                # The probe's kept is the outputs' storages; the caller's loss scalars too.
                kept = probed.kept_bytes + (CALLER_LOSS_SCALARS_BYTES
                                            if batch.grad_enabled else 0)
                forward = probed.forward_bytes
                # The probe measured its synthetic loss; a caller's per-token loss is more,
                # and lives through the head's backward.
                caller_loss = (caller_per_token_loss_bytes(batch.outputs, S)
                               if batch.grad_enabled else 0.0)
                # The probe measured the gather inside its forward: shown as its own term.
                gathered = min(float(forward), gathered_logits_bytes(self, batch, S))
                # What the head keeps for its own backward is not among the probe's curves:
                # the formulas' (a few bytes per token).
                saved = default_tail(self, batch, S).saved
                return TailCost(kept, forward - gathered, probed.backward_bytes + caller_loss,
                                "probe", gathered, saved, caller_loss,
                                head_backward=probed.head_backward_bytes + caller_loss), True
        return default_tail(self, batch, S), False

    def probed_tail(self, outputs: OutputRequest, grad: bool, s: int) -> MeasuredTail | None:
        """The probe's tail at `s` rows. Where its largest row is no longer than the head
        chunk and `s` is past it: its value there plus the formulas' growth from there to
        `s`, since past a chunk the head's working set stops growing, which a curve fitted
        below the chunk cannot know (a curve with rows past the chunk carries on as they
        grow)."""
        assert self.coefficients is not None
        probed = self.coefficients.tail_cost(outputs, grad, s)
        last = probed.measured_up_to_tokens if probed is not None else 0
        if probed is None or not 0 < last < s or last > self.head_chunk_tokens:
            return probed
        at_last = self.coefficients.tail_cost(outputs, grad, last)
        assert at_last is not None
        return tail_past_its_rows(self, at_last, outputs, grad, s)

    def max_tokens_that_fit(self, usable_bytes: int, *, outputs: OutputRequest,
                            grad_enabled: bool, sequences: int = 1) -> int:
        """Largest packed token count whose dynamic peak fits `usable_bytes` (0 if none)."""
        sequences = max(1, int(sequences))

        def fits(tokens: int) -> bool:
            per = max(1, tokens // sequences)
            lengths = [per] * sequences
            lengths[-1] += tokens - per * sequences
            batch = MicroBatchShape(tuple(lengths), outputs=outputs,
                                    grad_enabled=grad_enabled)
            return self.estimate(batch).dynamic_bytes <= usable_bytes

        if not fits(sequences):
            return 0
        return largest_fitting(fits, sequences, sequences * 2, cap=1 << 26)


def largest_fitting(fits: Callable[[int], bool], low: int, high: int, *, cap: int,
                    slack: Callable[[int], int] = lambda low: 1) -> int:
    """Largest token count n >= `low` with `fits(n)`, given that `fits(low)` holds: `high`
    doubles until it fails (the last fitting count is returned once `high` passes `cap`),
    then the bracket is bisected until it is within `slack(low)` tokens."""
    while fits(high):
        low, high = high, high * 2
        if high > cap:
            return low
    while high - low > slack(low):
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low


def _megatron_targets(targets: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    names = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv",
             "o_proj": "linear_proj", "gate_proj": "linear_fc1", "up_proj": "linear_fc1",
             "down_proj": "linear_fc2", "in_proj_qkvz": "in_proj", "out_proj": "out_proj"}
    if "all-linear" in targets:
        return ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj", "out_proj")
    return tuple(sorted({names.get(t, t) for t in targets}))
