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

import math
from dataclasses import dataclass, replace
from typing import Any

from art.megatron.geometry import ModelGeometry
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.megatron.recompute import EffectiveRecompute, LayerRecompute
from art.trainer_rank._request import LoraShape, MicroBatchShape, OutputRequest
from art.trainer_rank.memory.adapters import lora_params_per_rank, resident_adapter_terms
from art.trainer_rank.memory.budget import AllocatorReserve
from art.trainer_rank.memory.estimate import Estimate, Term
from art.trainer_rank.memory.layers import FP32, Dims, LayerCost, layer_kind, price_layer

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
HEAD_CHUNK_TOKENS_DEFAULT = 2048
INT64 = 8
# The head backward's per-token side tensors: masks, clamped ids, fp32 per-token weights.
HEAD_BOOKKEEPING_BYTES_PER_TOKEN = 32
# LoRA training state per trainable parameter: fp32 Adam moments (2 x 4 bytes).
ADAM_STATE_BYTES = 8


def default_head_chunk_tokens() -> int:
    try:
        from art.trainer_rank.compute.heads import HEAD_CHUNK_TOKENS

        return int(HEAD_CHUNK_TOKENS)
    except ImportError:
        return HEAD_CHUNK_TOKENS_DEFAULT


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB"


def mode_key(modules: frozenset[str], grad: bool, full_layers: int = 0) -> str:
    if not grad:
        return f"nograd:full:{full_layers}" if full_layers else "nograd"
    if full_layers:
        return f"full:{full_layers}"
    return "sel:" + "+".join(sorted(modules)) if modules else "none"


@dataclass(frozen=True)
class MemoryModel:
    geometry: ModelGeometry
    layout: ParallelLayout
    recompute: EffectiveRecompute
    implementation: Implementation
    lora: LoraShape
    dtype: str
    coefficients: Any = None  # probe.ProbeCoefficients or None
    alloc_conf: str | None = None
    worst_case_routing: bool = False
    head_chunk_tokens: int = 0  # 0: the compute path's HEAD_CHUNK_TOKENS

    def __init__(self, geometry: ModelGeometry, *, layout: ParallelLayout,
                 recompute: EffectiveRecompute, implementation: Implementation,
                 lora: LoraShape, dtype: str, coefficients: Any = None,
                 alloc_conf: str | None = None, worst_case_routing: bool = False,
                 head_chunk_tokens: int = 0) -> None:
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        if len(recompute.layers) != geometry.num_layers:
            raise ValueError(
                f"recompute policy covers {len(recompute.layers)} layers but {geometry.name} "
                f"has {geometry.num_layers}; resolve it for this model"
            )
        for name, value in (("geometry", geometry), ("layout", layout),
                            ("recompute", recompute), ("implementation", implementation),
                            ("lora", lora), ("dtype", dtype), ("coefficients", coefficients),
                            ("alloc_conf", alloc_conf),
                            ("worst_case_routing", worst_case_routing),
                            ("head_chunk_tokens",
                             head_chunk_tokens or default_head_chunk_tokens())):
            object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_provider(cls, provider: Any, *, coefficients: Any = None) -> MemoryModel:
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

    def with_coefficients(self, coefficients: Any) -> MemoryModel:
        return replace(self, coefficients=coefficients)

    # ------------------------------------------------------------------ sizes
    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def dims(self) -> Dims:
        cached = self.__dict__.get("_dims_cache")
        if cached is not None:
            return cached
        cached = Dims(self.geometry, self.layout, self.implementation, self.dtype_bytes,
                      self.lora.rank, frozenset(self.lora.target_modules))
        object.__setattr__(self, "_dims_cache", cached)
        return cached

    def _layer_cost(self, index: int, modules: frozenset[str], s: int, grad: bool
                    ) -> tuple[LayerCost, bool]:
        kind = self._kinds[index]
        memo_key = (kind, modules, s, grad)
        hit = self._memo.get(memo_key)
        if hit is not None:
            return hit
        result: tuple[LayerCost, bool] | None = None
        if self.coefficients is not None:
            cost = self.coefficients.layer_cost(kind, mode_key(modules, grad), s)
            if cost is not None:
                result = (cost, True)
        if result is None:
            result = (price_layer(self.dims, kind, modules, s, grad=grad,
                                  worst_case_routing=self.worst_case_routing), False)
        if len(self._memo) > 4096:
            self._memo.clear()
        self._memo[memo_key] = result
        return result

    @property
    def _kinds(self) -> tuple[str, ...]:
        kinds = self.__dict__.get("_kinds_cache")
        if kinds is None:
            kinds = tuple(layer_kind(self.geometry, i) for i in range(self.geometry.num_layers))
            object.__setattr__(self, "_kinds_cache", kinds)
        return kinds

    @property
    def _memo(self) -> dict[tuple[Any, ...], tuple[LayerCost, bool]]:
        memo = self.__dict__.get("_memo_cache")
        if memo is None:
            memo = {}
            object.__setattr__(self, "_memo_cache", memo)
        return memo

    def _probed_unit(self, index: int, n: int, s: int, grad: bool = True) -> LayerCost | None:
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
        kinds = {layer_kind(self.geometry, j) for j in range(index, index + n)}
        if len(kinds) != 1:
            return None
        return self.coefficients.layer_cost(kinds.pop(), mode_key(frozenset(), grad, n), s)

    def _stage_layers(self) -> list[tuple[int, LayerRecompute]]:
        """The layers of the busiest pipeline stage (all of them without PP)."""
        by_stage: dict[int, list[tuple[int, LayerRecompute]]] = {}
        for i, lr in enumerate(self.recompute.layers):
            by_stage.setdefault(lr.pipeline_stage, []).append((i, lr))
        return max(by_stage.values(), key=len)

    def resident_terms(self) -> list[Term]:
        g, b, tp = self.geometry, self.dtype_bytes, self.layout.tensor_parallel
        pp = self.layout.pipeline_parallel
        params = _params_per_rank(g, self.layout)
        terms = [Term("weights", int(params * b), "resident",
                      f"{params / 1e9:.3f}B params/rank x {b} B (TP{tp}"
                      f"{f', PP{pp}' if pp > 1 else ''})")]
        if self.lora.rank:
            lora_params = lora_params_per_rank(g, self.lora, self.layout)
            terms.append(Term("LoRA params + grads", int(lora_params * 2 * b), "resident",
                              f"{lora_params:,} params x (param + grad) x {b} B"))
            terms.append(Term("optimizer state (LoRA, Adam)",
                              int(lora_params * ADAM_STATE_BYTES), "resident",
                              f"{lora_params:,} params x 2 fp32 moments"))
        terms += resident_adapter_terms(g, self.lora, self.layout, b)
        return terms

    # ------------------------------------------------------------------ the estimate
    def estimate(self, batch: MicroBatchShape) -> Estimate:
        cache = self.__dict__.get("_estimate_cache")
        if cache is None:
            cache = {}
            object.__setattr__(self, "_estimate_cache", cache)
        hit = cache.get(batch)
        if hit is None:
            if len(cache) > 4096:
                cache.clear()
            hit = cache[batch] = self._estimate(batch)
        return hit

    def _estimate(self, batch: MicroBatchShape) -> Estimate:
        g, b, tp, cp = self.geometry, self.dtype_bytes, self.layout.tensor_parallel, \
            self.layout.context_parallel
        d = self.dims
        S = batch.packed_tokens
        # CP: the load-balanced split gives every rank the same share; the busiest rank
        # holds ceil(S / CP) tokens of every activation and attends to the whole sequence.
        s = math.ceil(S / cp)
        grad = batch.grad_enabled
        hidden_local = d.hidden_tokens(s) * g.hidden_size * b
        terms: list[Term] = list(self.resident_terms())
        resident = sum(t.bytes for t in terms)
        probe_used = False

        # ---- before the decoder (live through forward and backward)
        pre: list[Term] = []
        pre.append(Term("packed inputs", int(s * INT64 * 3), "forward",
                        f"tokens, positions, targets: 3 x {s} x int64"))
        unfused = self.implementation.attention == "unfused"
        if unfused:
            pre.append(Term("packed attention mask", int(s * S), "forward",
                            f"bool [{s}, {S}] block-diagonal causal (local spec)"))
            heads = g.num_attention_heads // tp
            pre.append(Term("attention score buffer", int(heads * s * S * b), "forward",
                            f"Megatron global memory buffer [{heads} x {s} x {S}] x {b} B; "
                            "persists at the largest size seen, priced as new"))
        if "attention" in g.layer_types:
            rope_dim = g.head_dim
            pre.append(Term("rotary table", int(2 * s * rope_dim * FP32), "forward",
                            f"table + per-token index [{s}, {rope_dim}] fp32"))

        # The compute path keeps the embedding output referenced for the whole decoder call,
        # so it is live throughout; the first layer's saved input is that same storage.
        pre.append(Term("embedding output", int(hidden_local), "forward",
                        "decoder input, referenced until the decoder returns"))

        layers = self._stage_layers()
        # ---- forward through the layers
        kept_total = 0.0
        fwd_layers_peak = 0.0
        fwd_peak_where = ""
        x = hidden_local  # the embedding output, then each layer's output
        units: list[dict[str, Any]] = []
        i = 0
        while i < len(layers):
            index, lr = layers[i]
            first = i == 0
            x_in = 0.0 if first else x  # the first input is the embedding output (pre term)
            if grad and lr.full_checkpoint_unit is not None:
                n = lr.full_unit_layers
                members = layers[i:i + n]
                probed_unit = self._probed_unit(index, n, s)
                if probed_unit is not None:
                    # The probe measured this very checkpoint unit: use it as one "layer".
                    probe_used = True
                    peak = kept_total + x_in + probed_unit.forward
                    if peak > fwd_layers_peak:
                        fwd_layers_peak = peak
                        fwd_peak_where = f"layers {index + 1}-{index + n} (no-grad run)"
                    kept = probed_unit.kept - (x if first and probed_unit.saves_input else 0)
                    units.append(dict(kind="layer", start=index, kept=kept, input=x,
                                      costs=[replace(probed_unit, kept=int(kept))]))
                    kept_total += kept
                    x = probed_unit.output
                    i += n
                    continue
                nograd = [self._layer_cost(j, frozenset(), s, False) for j, _ in members]
                full = [self._layer_cost(j, frozenset(), s, True) for j, _ in members]
                probe_used |= any(u for _, u in nograd + full)
                peak = kept_total + x_in + max(c.forward for c, _ in nograd)
                if peak > fwd_layers_peak:
                    fwd_layers_peak, fwd_peak_where = peak, f"layer {index + 1} (no-grad run)"
                units.append(dict(kind="full", start=index, kept=x_in, input=x,
                                  costs=[c for c, _ in full]))
                kept_total += x_in
                i += n
                continue
            if not grad and lr.full_checkpoint_unit is not None and lr.full_unit_layers > 1:
                # Without grad Megatron still runs a full unit as one checkpoint (training
                # mode): priced whole when the probe measured it.
                n = lr.full_unit_layers
                unit_cost = self._probed_unit(index, n, s, grad=False)
                if unit_cost is not None:
                    probe_used = True
                    peak = kept_total + x_in + unit_cost.forward
                    if peak > fwd_layers_peak:
                        fwd_layers_peak = peak
                        fwd_peak_where = f"layers {index + 1}-{index + n} (no grad)"
                    units.append(dict(kind="layer", start=index, kept=0, input=x,
                                      costs=[unit_cost]))
                    x = unit_cost.output
                    i += n
                    continue
                # Formulas: the unit's input stays referenced by the checkpoint while its
                # later layers run.
                members = layers[i:i + n]
                costs = [self._layer_cost(j, frozenset(), s, False) for j, _ in members]
                probe_used |= any(u for _, u in costs)
                for k, (cost, _) in enumerate(costs):
                    peak = kept_total + x_in + cost.forward + (x_in if k else 0.0)
                    if peak > fwd_layers_peak:
                        fwd_layers_peak = peak
                        fwd_peak_where = f"layer {index + k + 1} (no grad, checkpoint unit)"
                units.append(dict(kind="layer", start=index, kept=0, input=x,
                                  costs=[costs[-1][0]]))
                x = costs[-1][0].output
                i += n
                continue
            modules = lr.selective_modules if grad else frozenset()
            cost, used = self._layer_cost(index, modules, s, grad)
            probe_used |= used
            peak = kept_total + x_in + cost.forward
            if peak > fwd_layers_peak:
                fwd_layers_peak, fwd_peak_where = peak, f"layer {index + 1}"
            kept = cost.kept - (x if first and cost.saves_input else 0)
            units.append(dict(kind="layer", start=index, kept=kept, input=x,
                              costs=[replace(cost, kept=int(kept))]))
            kept_total += kept
            x = cost.output
            i += 1

        # ---- the tail: final norm, hidden row, head, outputs, caller loss
        tail = _tail_terms(self, batch, s, S)
        probe_tail = None
        if self.coefficients is not None:
            probe_tail = self.coefficients.tail_cost(batch.outputs, grad, S)
        if probe_tail is not None:
            probe_used = True
            tail_kept, tail_fwd, tail_bwd = probe_tail
            tail_note = "probe"
        else:
            tail_kept, tail_fwd, tail_bwd = tail["kept"], tail["forward"], tail["backward"]
            tail_note = tail["note"]

        layer_kept_note = _kept_note(units, s)
        if g.is_moe:
            routing = "worst-case" if self.worst_case_routing else "balanced"
            layer_kept_note += f"; MoE: {routing} routing over EP{self.layout.expert_parallel}"
        if grad:
            fwd_terms = [
                *pre,
                Term("layer activations kept (all layers)", int(kept_total), "forward",
                     layer_kept_note),
                Term("decoder output", int(x), "forward", "last layer output"),
                Term("head + outputs (forward working set)", int(tail_fwd), "forward",
                     tail_note),
            ]
            fwd_tail_peak = kept_total + x + tail_fwd
            layer_fwd_excess = fwd_layers_peak - fwd_tail_peak
            forward_where = "head"
            if layer_fwd_excess > 0:
                fwd_terms.append(Term("layer forward excess over head", int(layer_fwd_excess),
                                      "forward", fwd_peak_where))
                forward_where = fwd_peak_where
        else:
            fwd_layer_work = fwd_layers_peak - 0.0
            tail_peak = x + tail_fwd
            fwd_terms = [*pre]
            if fwd_layer_work >= tail_peak:
                fwd_terms.append(Term("largest layer working set (no grad)",
                                      int(fwd_layer_work), "forward", fwd_peak_where))
                forward_where = fwd_peak_where
            else:
                fwd_terms.append(Term("decoder output", int(x), "forward", "last layer output"))
                fwd_terms.append(Term("head + outputs (no grad)", int(tail_fwd), "forward",
                                      tail_note))
                forward_where = "head"
        forward_peak = sum(t.bytes for t in fwd_terms)

        bwd_terms: list[Term] = []
        backward_peak = 0
        backward_where = ""
        if grad:
            # LoRA gradients are priced as resident (they exist from the first step on).
            # Backward through the tail, then the layers top-down.
            best = kept_total + x + tail_bwd
            where = "head backward"
            best_parts = [("layer activations kept (all layers)", kept_total, layer_kept_note),
                          ("decoder output", x, "last layer output"),
                          ("head + outputs + caller loss (backward)", tail_bwd, tail_note)]
            outputs_held = tail_kept
            below = kept_total
            for unit in reversed(units):
                below -= unit["kept"]
                if unit["kind"] == "layer":
                    cost = unit["costs"][0]
                    peak = below + cost.kept + cost.backward + outputs_held
                    if peak > best:
                        best, where = peak, f"layer {unit['start'] + 1} backward"
                        best_parts = [
                            ("activations kept by layers below", below, ""),
                            ("this layer's kept activations", cost.kept, ""),
                            ("layer backward working set", cost.backward,
                             "incoming grad, grads, rebuilt checkpoints"),
                            ("outputs held by the caller", outputs_held, ""),
                        ]
                    continue
                # A full-recompute unit: rebuild its layers with grad, then their backward.
                costs: list[LayerCost] = unit["costs"]
                dy = unit["input"]  # incoming gradient, the size of a hidden tensor
                rebuilt = 0.0
                unit_peak = 0.0
                for k, cost in enumerate(costs):
                    kept_k = cost.kept - (unit["input"] if k == 0 and cost.saves_input else 0)
                    unit_peak = max(unit_peak, rebuilt + cost.forward + dy)
                    rebuilt += kept_k
                # Megatron's checkpoint backward holds the rebuilt unit output while it runs
                # the backward of every layer of the unit.
                held = costs[-1].output
                for k in reversed(range(len(costs))):
                    cost = costs[k]
                    kept_k = cost.kept - (unit["input"] if k == 0 and cost.saves_input else 0)
                    rebuilt -= kept_k
                    unit_peak = max(unit_peak, rebuilt + kept_k + cost.backward + held)
                peak = below + unit["kept"] + unit_peak + outputs_held
                if peak > best:
                    first, last = unit["start"] + 1, unit["start"] + len(costs)
                    span = f"layer {first}" if first == last else f"layers {first}-{last}"
                    best, where = peak, f"{span} backward (full recompute unit)"
                    best_parts = [
                        ("activations kept by layers below", below, "checkpoint inputs"),
                        ("checkpoint unit input", unit["kept"], ""),
                        ("full unit recompute + backward", unit_peak,
                         f"{len(costs)} layer(s) rebuilt with grad + incoming grad"),
                        ("outputs held by the caller", outputs_held, ""),
                    ]
            bwd_terms = [replace(t, phase="backward") for t in pre]
            bwd_terms += [Term(n, int(v), "backward", note) for n, v, note in best_parts]
            backward_peak = sum(t.bytes for t in bwd_terms)
            backward_where = where

        dynamic_core = max(forward_peak, backward_peak)
        largest = _largest_allocation(self, batch, s, S)
        reserve = AllocatorReserve(self.implementation.device, self.alloc_conf)
        reserve_bytes = reserve.reserve_bytes(dynamic_core, largest)
        terms += fwd_terms + bwd_terms
        terms.append(Term("allocator reserve", int(reserve_bytes), "reserve",
                          reserve.describe(dynamic_core, largest)))
        source = "defaults"
        if probe_used and self.coefficients is not None:
            source = f"probe:{self.coefficients.key}"
            if self.coefficients.partial_for(self.geometry):
                source += " (+defaults for unprobed layer kinds)"
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
        )

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
        lo, hi = sequences, sequences * 2
        while fits(hi):
            lo, hi = hi, hi * 2
            if hi > 1 << 26:
                return lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return lo


def _default_cost(d: Dims, kind: str, modules: frozenset[str], s: int, grad: bool,
                  worst_case_routing: bool) -> LayerCost:
    return price_layer(d, kind, modules, s, grad=grad, worst_case_routing=worst_case_routing)


def _kept_note(units: list[dict[str, Any]], s: int) -> str:
    counts: dict[str, list[float]] = {}
    for unit in units:
        label = "full checkpoint inputs" if unit["kind"] == "full" else "layers"
        counts.setdefault(label, []).append(unit["kept"])
    parts = []
    for label, values in counts.items():
        per_tok = sum(values) / len(values) / max(1, s)
        parts.append(f"{len(values)} {label} x {per_tok / 1024:.2f} KiB/tok avg")
    return "; ".join(parts) + f" x {s} tok"


def _tail_terms(model: MemoryModel, batch: MicroBatchShape, s: int, S: int) -> dict[str, Any]:
    """Default pricing of final norm + head + outputs + caller loss, read from P's head.

    `kept`: what stays live through the layers' backward (the hidden row the caller's frame
    holds, the requested outputs); `forward` / `backward`: peaks above the decoder output.
    """
    g, b, tp = model.geometry, model.dtype_bytes, model.layout.tensor_parallel
    out = batch.outputs
    grad = batch.grad_enabled
    rows = s  # the decoder output is gathered to the full row on every TP rank
    hidden_row = rows * g.hidden_size * b
    # The final norm's weight is frozen, so its multiply keeps nothing: the inverse rms per
    # row, plus torch's fp32 upcast of the input in low precision.
    norm_internal = rows * FP32 + (rows * g.hidden_size * FP32
                                   if model.implementation.norm == "torch" and b < FP32 else 0)
    uses_head = bool(out.target_logprobs or out.top_k or out.logits)
    vocab_local = g.vocab_size / tp
    chunk = min(model.head_chunk_tokens, rows)
    # One chunk: [chunk, vocab/TP] logits in the model dtype, upcast to fp32 (a copy only in
    # low precision; shift and exp run in place on it); top-k: the shard's values and ids,
    # gathered over TP, their top-k and the ids gathered at it.
    upcast = chunk * vocab_local * FP32 if b < FP32 else 0.0
    top_k = chunk * out.top_k * ((FP32 + INT64) * (tp + 1) + INT64)
    chunk_fwd = chunk * vocab_local * b + upcast + top_k if uses_head else 0.0
    held = hidden_row
    if out.target_logprobs:
        held += rows * FP32
    if out.top_k:
        held += rows * out.top_k * (FP32 + INT64)
    if out.logits:
        held += rows * g.vocab_size * FP32
    saved_head = rows * FP32 if uses_head else 0.0  # the log-normaliser kept for backward
    bookkeeping = rows * HEAD_BOOKKEEPING_BYTES_PER_TOKEN if uses_head else 0.0
    forward = held + saved_head + chunk_fwd + bookkeeping + (norm_internal if grad else 0.0)
    note = f"head chunk {chunk} tok x vocab/TP {int(vocab_local)}; outputs {out.key}"
    backward = 0.0
    if grad:
        caller = 0.0
        if out.hidden_states:
            # The caller's fp32 mean-square: an fp32 copy (low precision) and its gradient.
            caller = rows * g.hidden_size * FP32 * (2 if b < FP32 else 1)
            forward += rows * g.hidden_size * FP32 if b < FP32 else 0.0
        if out.logits:
            caller += rows * g.vocab_size * FP32
        # Head backward, per chunk: the logits rebuilt (the softmax and its gradient run in
        # place on them; in low precision an fp32 copy and the gradient cast back for the
        # matmul), the chunk's input gradient; plus the zero-initialised gradient of the whole
        # hidden row and per-token bookkeeping (target masks, clamped ids, fp32 weights).
        low = FP32 + b if b < FP32 else 0
        chunk_bwd = (chunk * vocab_local * (b + low) + chunk * g.hidden_size * b
                     if uses_head else 0.0)
        # The caller's gradient of the top-k log-probs and its fp32 sum over k.
        top_k_grads = rows * out.top_k * FP32 * 2
        grads = hidden_row + bookkeeping + top_k_grads
        backward = held + saved_head + norm_internal + chunk_bwd + grads + caller
    return {"kept": held, "forward": forward, "backward": backward, "note": note}


def d_hidden_local(model: MemoryModel, s: int) -> float:
    return model.dims.hidden_tokens(s) * model.geometry.hidden_size * model.dtype_bytes


def _largest_allocation(model: MemoryModel, batch: MicroBatchShape, s: int, S: int) -> int:
    g, b, tp = model.geometry, model.dtype_bytes, model.layout.tensor_parallel
    sizes = [s * g.hidden_size * b]
    out = batch.outputs
    if out.target_logprobs or out.top_k or out.logits:
        chunk = min(model.head_chunk_tokens, s)
        sizes.append(chunk * g.vocab_size / tp * FP32)
    if out.logits:
        sizes.append(s * g.vocab_size * FP32)
    if model.implementation.attention == "unfused":
        sizes.append(g.num_attention_heads / tp * s * S * FP32)
    sizes.append(s * 2 * g.ffn_hidden_size / tp * b)
    return int(max(sizes))


def _params_per_rank(g: ModelGeometry, layout: ParallelLayout) -> float:
    tp, pp, ep = layout.tensor_parallel, layout.pipeline_parallel, layout.expert_parallel
    etp = layout.expert_tensor_parallel
    h = g.hidden_size
    total = 0.0
    for i in range(g.num_layers):
        if g.layer_types[i] == "linear_attention" and g.linear_attention is not None:
            la = g.linear_attention
            key = la.num_key_heads * la.key_head_dim
            value = la.num_value_heads * la.value_head_dim
            mixer = h * (2 * key + 2 * value + 2 * la.num_value_heads) + value * h
            mixer += (2 * key + value) * la.conv_kernel_size
        else:
            q = g.num_attention_heads * g.head_dim
            kv = g.num_query_groups * g.head_dim
            gate = q if g.gated_attention_output else 0
            mixer = h * (q + gate + 2 * kv) + q * h
            if g.qk_layernorm:
                mixer += 2 * g.head_dim * tp  # per-head q/k norms, replicated over TP
        if g.moe_layers[i]:
            # Experts are split over expert-TP, not TP (the /tp below is undone by * tp).
            experts = g.num_experts / ep * 3 * h * g.moe_ffn_hidden_size * tp / etp
            shared = 3 * h * g.shared_expert_ffn_hidden_size
            mlp = experts + shared + h * g.num_experts * tp  # router replicated
        else:
            mlp = 3 * h * g.ffn_hidden_size
        total += mixer + mlp + 2 * h * tp  # norms are replicated over TP
    total /= tp
    embed = g.vocab_size * h / tp
    heads = embed if g.tied_embeddings else 2 * embed
    # The final norm (replicated) lives on the last stage, with the output layer.
    return total / pp + (heads + h if pp == 1 else embed + h)


def _megatron_targets(targets: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    names = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv",
             "o_proj": "linear_proj", "gate_proj": "linear_fc1", "up_proj": "linear_fc1",
             "down_proj": "linear_fc2", "in_proj_qkvz": "in_proj", "out_proj": "out_proj"}
    if "all-linear" in targets:
        return ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj", "out_proj")
    return tuple(sorted({names.get(t, t) for t in targets}))
