"""Layer probe: measure one real layer of the built model, fit per-token and per-token^2 terms.

Formulas drift from kernels, so the probe runs a real transformer layer of the built model
(same spec, dtype, LoRA adapters, device) under each recompute mode the policy uses, at three
small token counts, and measures with the memory meter (CPU: live storages; GPU: allocator stats):
- kept: what the layer holds for backward (its input when it saves it, not its output);
  without grad, what it leaves referenced when it returns (a MoE layer's token dispatcher
  keeps its routing state until its next call);
- forward: the peak above the state at the layer's start (input live);
- backward: the peak above the state right before its backward, incoming gradient included
  (materialised inside the measurement by a scalar-multiply node, as in the real chain);
- backward_held (the layer without recompute, the mode a full-recompute unit mixing layer
  kinds is composed from): the same with the incoming gradient referenced until the backward
  returns, as Megatron's checkpoint (CheckpointFunction.backward) holds its unit's.
Each quantity is fitted exactly by c0 + c1 s + c2 s^2 over the three token counts. The tail
(final norm + chunked head + requested outputs + caller loss + backward) is probed the same
way per output request, with the trainer's head chunk, at the layers' points and at multiples
of the chunk (`tail_points`), its backward as two moments (the caller's ops, the head's).
The selective modes are switched on the built layer through the
attributes Megatron sets from the config at construction (`recompute_mlp`,
`recompute_input_layernorm`, `recompute_pre_mlp_layernorm`, `checkpoint_core_attention`), and
restored afterwards. MoE-level modules (moe, moe_act, shared_experts) are not probed: those
modes use the default formulas, and the estimate says so.

Megatron's attention score buffer (global memory buffer, persists at the largest size seen) is
allocated before each measurement, so it is not part of a layer; the memory model prices it
once as its own term.

Results are cached per (geometry, implementation, dtype, layout, LoRA, policy modes, device)
in memory and, when a directory is given, as JSON files.

Here: the fitted records, their keys, the driver and the modes a policy needs; the runs under
the meter are in `probe_runs.py`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from art.megatron.geometry import ModelGeometry
from art.trainer_rank._request import OutputRequest
from art.trainer_rank.compute.heads import HEAD_CHUNK_TOKENS
from art.trainer_rank.measuring.meter import release_score_buffer
from art.trainer_rank.measuring.probe_runs import (
    inner_model,
    measure_mode,
    measure_tail,
    probe_inputs,
    restore_modes,
    set_modes,
    tail_inputs,
)
from art.trainer_rank.measuring.probe_store import store_probe, stored_probe_text
from art.trainer_rank.measuring.routing import even_routing, routing_shares
from art.trainer_rank.pricing.chunked import (
    GDN_CHUNK_TOKENS,
    QUANTITIES,
    SPARSE_TOKENS_PER_CHUNK,
    SparseChunks,
    WithinChunk,
    chunk_tokens_of,
    has_chunked_layers,
    sparse_row_lengths,
    split_points,
    with_points_inside_chunks,
)
from art.trainer_rank.pricing.coefficients import LayerMode, MeasuredTail, RecomputeMode
from art.trainer_rank.pricing.fit import Fit, Poly
from art.trainer_rank.pricing.layer_terms import Dims, LayerCost, PricedKind
from art.trainer_rank.pricing.layers import layer_kind
from art.trainer_rank.pricing.layers_gdn import conv_sequence_padding_bytes
from art.trainer_rank.pricing.row_changes import ExpertShare

# Probe token counts (see `Fit`). Which op sets a layer's peak changes with the token count,
# so a few small counts do not predict large ones; the points span the sizes the estimates are
# used for, about 1.5x apart: between neighbours the curve is interpolated, and the wider the
# gap the looser the chord where two local quadratics disagree.
PROBE_TOKENS: tuple[int, ...] = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
PROBE_TOKENS_CUDA: tuple[int, ...] = (1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384,
                                      24576, 32768)
# Unfused attention on GPU keeps [heads, s, s] scores: stay where one layer fits easily.
PROBE_TOKENS_CUDA_UNFUSED: tuple[int, ...] = (512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
PROBED_MODULES = frozenset({"core_attn", "mlp", "layernorm"})


@dataclass(frozen=True)
class ProbedLayer:
    kept: Fit
    forward: Fit
    backward: Fit
    output: Fit
    saves_input: bool
    # Chunked kernels: the fits run over whole-chunk rows (pricing/chunked.py).
    within_chunk: WithinChunk | None = None
    backward_held: Fit | None = None
    # Chunked kernels: rows of one short sequence per chunk (pricing/chunked.py).
    sparse_chunks: SparseChunks | None = None

    def cost(self, s: int, padded: int | None = None,
             segments_change: Mapping[str, float] | None = None,
             segments: int = 1) -> LayerCost:
        """At `s` tokens; `padded`: the row's tokens padded to whole kernel chunks (None: one
        sequence of `s`); `segments_change`: per quantity, what the row's segments change on
        the full-chunk line; `segments`: the row's segments as its kernel runs them
        (pricing/chunked.py)."""
        chunk = self.within_chunk
        change = segments_change or {}

        def at(name: str) -> int:
            fit: Fit = getattr(self, name)
            if chunk is None:
                return max(0, fit.at(s))
            value = chunk.value(fit.at, name, s, padded, change.get(name, 0.0))
            sparse = (self.sparse_chunks.value(name, s, padded, fit.at, segments)
                      if self.sparse_chunks is not None else None)
            return max(0, value if sparse is None else max(value, sparse))

        return LayerCost(
            kept=at("kept"), forward=at("forward"), backward=at("backward"),
            output=at("output"), saves_input=self.saves_input,
            backward_held=at("backward_held") if self.backward_held is not None else None,
        )


@dataclass(frozen=True)
class ProbedTail:
    """The tail's curves over the whole row's tokens; the backward as its two moments
    (`measure_tail`): the caller's own ops, then the head's and the final norm's."""

    kept: Fit
    forward: Fit
    caller_backward: Fit
    head_backward: Fit


# What one probe file holds and how it was measured; a change makes every older file a
# cache miss and an error to load (2: the no-recompute modes carry `backward_held`; 3: the
# no-grad modes measure `kept`; 4: the tail's backward in two moments, its points past the
# head chunk and run with the trainer's chunk).
PROBE_FORMAT_VERSION = 4

# Tail points past the probe's own, as multiples of the head chunk: past one chunk the tail
# grows by what a token adds (its outputs, its gradient rows), not by the chunk's working set,
# which a curve fitted below the chunk would carry on per token.
CHUNK_MULTIPLES: tuple[float, ...] = (1, 1.5, 2, 3, 4, 6, 8)


def tail_points(points: Iterable[int], head_chunk_tokens: int, max_tokens: int | None
                ) -> tuple[int, ...]:
    """The row token counts a tail is measured at: `points`, and the head chunk's multiples up
    to `max_tokens` (None: none), so that sizes past the chunk are interpolated between
    measured rows instead of extrapolated from below it."""
    extra = set()
    if max_tokens is not None:
        extra = {int(m * head_chunk_tokens) for m in CHUNK_MULTIPLES
                 if int(m * head_chunk_tokens) <= max_tokens}
    return tuple(sorted(set(points) | extra))


@dataclass(frozen=True)
class ProbeCoefficients:
    key: str
    tokens: tuple[int, ...]
    layers: tuple[tuple[PricedKind, str, ProbedLayer], ...]  # (layer kind, mode key, fit)
    tails: tuple[tuple[str, bool, ProbedTail], ...]  # (outputs key, grad, fit)
    format: int = PROBE_FORMAT_VERSION
    # Under expert parallel: the MoE layers were measured under even routing, and these are
    # the router's spread at the no-grad points (measuring/routing.py), which the memory
    # model prices the experts' pairs at.
    expert_routing_shares: tuple[ExpertShare, ...] = ()

    def layer_cost(self, kind: PricedKind, mode: str, s: int, padded: int | None = None,
                   segments_change: Mapping[str, float] | None = None, segments: int = 1
                   ) -> LayerCost | None:
        for k, m, fit in self.layers:
            if k == kind and m == mode:
                return fit.cost(s, padded, segments_change, segments)
        return None

    def tail_cost(self, outputs: OutputRequest, grad: bool, s: int) -> MeasuredTail | None:
        for key, g, fit in self.tails:
            if key == outputs.key and g == grad:
                caller = max(0, fit.caller_backward.at(s))
                head = max(0, fit.head_backward.at(s))
                return MeasuredTail(kept_bytes=max(0, fit.kept.at(s)),
                                    forward_bytes=max(0, fit.forward.at(s)),
                                    backward_bytes=max(caller, head),
                                    head_backward_bytes=head,
                                    measured_up_to_tokens=int(fit.forward.tokens[-1]))
        return None

    def chunk_points(self, kind: PricedKind, mode: str) -> tuple[int, ...] | None:
        """The points a chunked layer mode was measured at (its whole-chunk ones and those
        inside a chunk below them), or None: not measured, or not a chunked kernel."""
        for k, m, fit in self.layers:
            if k == kind and m == mode and fit.within_chunk is not None:
                last = fit.backward.tokens[-1]
                return tuple(t for t in self.tokens if t <= last)
        return None

    def partial_for(self, geometry: ModelGeometry) -> bool:
        kinds = {layer_kind(geometry, i) for i in range(geometry.num_layers)}
        return not kinds <= {k for k, _, _ in self.layers}

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ProbeCoefficients:
        raw = json.loads(text)
        found = raw.get("format", 1)
        if found != PROBE_FORMAT_VERSION:
            raise ValueError(
                f"probe file {raw.get('key', '?')} has format {found}, this code reads format "
                f"{PROBE_FORMAT_VERSION}: it was measured by older code and its coefficients "
                "would price differently; measure the probe again (delete the file, or "
                "re-probe the calibration's probes) instead of reusing it")

        def poly(d: dict[str, Any]) -> Fit:
            return Fit(tuple(d["tokens"]), tuple(d["values"]), Poly(**d["head"]),
                       Poly(**d["tail"]))

        def within(d: dict[str, Any]) -> WithinChunk:
            # Extra fields are ignored: older files carry a largest-allocation slope too.
            known = {f.name for f in fields(WithinChunk)}
            return WithinChunk(**{k: v for k, v in d.items() if k in known})

        def sparse(d: dict[str, Any]) -> SparseChunks:
            return SparseChunks(int(d["chunk_tokens"]), tuple(d["tokens_per_chunk"]),
                                tuple((q, poly(a), poly(b)) for q, a, b in d["quantities"]))

        layers = tuple(
            (PricedKind(k), m, ProbedLayer(poly(f["kept"]), poly(f["forward"]), poly(f["backward"]),
                               poly(f["output"]), bool(f["saves_input"]),
                               within(f["within_chunk"]) if f.get("within_chunk") else None,
                               poly(f["backward_held"]) if f.get("backward_held") else None,
                               sparse(f["sparse_chunks"]) if f.get("sparse_chunks") else None))
            for k, m, f in raw["layers"]
        )
        tails = tuple((k, bool(g), ProbedTail(poly(f["kept"]), poly(f["forward"]),
                                               poly(f["caller_backward"]),
                                               poly(f["head_backward"])))
                      for k, g, f in raw["tails"])
        return cls(raw["key"], tuple(raw["tokens"]), layers, tails, found,
                   tuple(ExpertShare.stored(x) for x in raw.get("expert_routing_shares", ())))


_CACHE: dict[str, ProbeCoefficients] = {}
# One layer mode's or one tail's fit, under the key of a probe of just that part: a probe for
# another policy of the same model, layout and build measures only the parts this process has
# not measured yet (the ladder's rungs make most of them common to every policy).
_PARTS: dict[str, Any] = {}
# The router's spread (routing.py) of a model, layout and build at a probe's no-grad points.
_SHARES: dict[str, tuple[ExpertShare, ...]] = {}
# One tail's measurement at one row, under the key of that tail's probe at no extent past
# the layers' points: a tail measured further out (a longer row priced) measures only its
# new rows.
_TAIL_ROWS: dict[tuple[str, int], dict[str, float]] = {}


def forget_in_process_probes() -> None:
    """Drop every probe and probed part this process holds (as a new process would start);
    the cache folder is untouched."""
    _CACHE.clear()
    _PARTS.clear()
    _SHARES.clear()
    _TAIL_ROWS.clear()


def cache_key(*, geometry: ModelGeometry, implementation: Any, dtype: str, layout: Any,
              lora_rank: int, modes: Iterable[tuple[str, str]], outputs: Iterable[str],
              tokens: tuple[int, ...], device: str,
              grad_tokens: tuple[int, ...] | None = None,
              head_chunk_tokens: int = HEAD_CHUNK_TOKENS,
              tail_max_tokens: int | None = None) -> str:
    fields = {
        "format": PROBE_FORMAT_VERSION,
        "geometry": geometry.to_dict() | {"source": ""},
        "implementation": implementation.key, "dtype": dtype, "layout": layout.summary,
        "lora": lora_rank, "modes": sorted(set(modes)), "outputs": sorted(set(outputs)),
        "tokens": list(tokens), "device": device, "head_chunk_tokens": head_chunk_tokens,
        "tail_max_tokens": tail_max_tokens,
    }
    if grad_tokens is not None and tuple(grad_tokens) != tuple(tokens):
        fields["grad_tokens"] = list(grad_tokens)
    if layout.context_parallel > 1:
        # The tail's final norm runs on this CP rank's rows and its output is gathered over
        # CP, as the trainer's path runs it: other tail curves than a norm on the whole row.
        fields["tail_norm"] = "context-parallel-local"
    if has_chunked_layers(geometry):
        # Fitted by chunks, with sparse-chunk rows: other coefficients.
        fields["chunked_fit"] = [GDN_CHUNK_TOKENS, list(SPARSE_TOKENS_PER_CHUNK)]
    if geometry.is_moe and layout.expert_parallel > 1:
        # MoE layers measured under even routing, the router's share measured apart.
        fields["moe_routing"] = "round-robin through the router's own routing; its shares"
    payload = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def default_probe_tokens(device: str, implementation: Any,
                         geometry: ModelGeometry | None = None) -> tuple[int, ...]:
    """The token counts `probe` measures at when none are given (for `geometry`: a model
    with chunked layers also gets points inside a chunk, which its fit needs)."""
    if device != "cuda":
        tokens = PROBE_TOKENS
    else:
        tokens = (PROBE_TOKENS_CUDA if implementation.attention == "flash"
                  else PROBE_TOKENS_CUDA_UNFUSED)
    if geometry is not None and has_chunked_layers(geometry):
        tokens = with_points_inside_chunks(tokens)
    return tokens


def _probed_modes(modes: Iterable[LayerMode]) -> list[LayerMode]:
    return sorted({m for m in modes if m.mode.modules <= PROBED_MODULES},
                  key=lambda m: m.sort_key)


def probe_key(*, geometry: ModelGeometry, layout: Any, implementation: Any, dtype: str,
              lora_rank: int, modes: Iterable[LayerMode],
              outputs: Iterable[tuple[OutputRequest, bool]], device: str,
              tokens: tuple[int, ...] | None = None,
              grad_tokens: tuple[int, ...] | None = None,
              head_chunk_tokens: int = HEAD_CHUNK_TOKENS,
              tail_max_tokens: int | None = None) -> str:
    """The key `probe` stores its coefficients under for these arguments, without a model:
    a stored probe whose key differs was measured for other inputs or by another version of
    the probe."""
    tails = sorted({(o.key, g) for o, g in outputs})
    return cache_key(geometry=geometry, implementation=implementation, dtype=dtype,
                     layout=layout, lora_rank=lora_rank,
                     modes=[(m.kind, m.mode.key) for m in _probed_modes(modes)],
                     outputs=[f"{k}:{g}" for k, g in tails],
                     tokens=tokens or default_probe_tokens(device, implementation, geometry),
                     device=device, grad_tokens=grad_tokens,
                     head_chunk_tokens=head_chunk_tokens, tail_max_tokens=tail_max_tokens)


def _without_conv_padding(rows: dict[tuple[int, int], dict[str, float]],
                          geometry: ModelGeometry, layout: Any, implementation: Any,
                          dtype_bytes: int, kind: PricedKind, chunk: int) -> None:
    """Takes out of sparse rows what their many sequences add to the causal convolution's
    saved input: the memory model adds it for the row's own sequence count."""
    # Adapters do not enter the convolution's padding.
    dims = Dims(geometry, layout, implementation, dtype_bytes, 0, frozenset())
    for (padded, _), row in rows.items():
        padding = conv_sequence_padding_bytes(dims, kind, padded // chunk)
        row["kept"] -= padding
        row["forward"] -= padding


def _sparse_chunks(rows: dict[tuple[int, int], dict[str, float]], chunk: int
                   ) -> SparseChunks:
    first, second = SPARSE_TOKENS_PER_CHUNK
    padded = sorted({t for t, _ in rows})
    names = [q for q in QUANTITIES if q in rows[(padded[0], first)]]
    return SparseChunks(chunk, SPARSE_TOKENS_PER_CHUNK, tuple(
        (q, Fit.fit(padded, [rows[(t, first)][q] for t in padded]),
         Fit.fit(padded, [rows[(t, second)][q] for t in padded])) for q in names))



def _parsed(text: str) -> ProbeCoefficients | None:
    """A cached probe's coefficients, or None when the file does not hold a whole probe (a
    cache entry never fails a run: the probe measures again)."""
    try:
        return ProbeCoefficients.from_json(text)
    except (ValueError, KeyError, TypeError):
        return None


def probe(model: Any, *, geometry: ModelGeometry, layout: Any, implementation: Any,
          dtype: str, lora_rank: int,
          modes: Iterable[LayerMode],
          outputs: Iterable[tuple[OutputRequest, bool]] = (),
          tokens: tuple[int, ...] | None = None, cache_dir: str | Path | None = None,
          progress: Callable[[str], None] | None = None,
          grad_tokens: tuple[int, ...] | None = None,
          head_chunk_tokens: int = HEAD_CHUNK_TOKENS,
          tail_max_tokens: int | None = None,
          reuse_parts: bool = True) -> ProbeCoefficients:
    """Probe (layer kind, recompute mode) pairs and (outputs, grad) tails.

    `reuse_parts`: take a part this process already measured for another probe (same key
    but for the other parts) instead of measuring it again. Ranks that probe together must
    all reuse the same parts, so the caller turns it off unless it knows they do.

    `grad_tokens` (a prefix of `tokens`): the points grad modes and grad tails are measured at
    when fewer than `tokens` fit a memory limit (a grad peak is higher than a no-grad one).
    `head_chunk_tokens`: the head chunk the tails run with (the trainer's); `tail_max_tokens`:
    the largest row the tails are also measured at, past the layers' points (`tail_points`).

    Modes whose modules include ones the probe cannot switch (MoE-level) are skipped: the
    memory model falls back to its formulas for them.
    """
    inner = inner_model(model)
    device = next(inner.parameters()).device
    tokens = tokens or default_probe_tokens(device.type, implementation, geometry)
    torch_dtype = inner.config.params_dtype
    modes, outputs = list(modes), list(outputs)
    wanted = _probed_modes(modes)
    tails = sorted({(o.key, o, g) for o, g in outputs}, key=lambda t: (t[0], t[2]))
    key = probe_key(geometry=geometry, layout=layout, implementation=implementation,
                    dtype=dtype, lora_rank=lora_rank, modes=modes, outputs=outputs,
                    tokens=tokens, device=device.type, grad_tokens=grad_tokens,
                    head_chunk_tokens=head_chunk_tokens, tail_max_tokens=tail_max_tokens)
    points = {False: tuple(tokens), True: tuple(grad_tokens or tokens)}
    if not set(points[True]) <= set(points[False]):
        raise ValueError(f"grad_tokens {points[True]} must be a subset of tokens {tokens}")
    if key in _CACHE:
        return _CACHE[key]
    stored = stored_probe_text(cache_dir, key, device.type) if cache_dir else None
    coefficients = _parsed(stored) if stored is not None else None
    if coefficients is not None:
        _CACHE[key] = coefficients
        return coefficients

    def part_key(part_modes: list[LayerMode], part_outputs: list[tuple[OutputRequest, bool]],
                 grad: bool, extent: int | None = None) -> str:
        """The key of a probe of one part at the points it is measured at (a layer mode does
        not depend on the tails' chunk and largest row; a tail's rows are measured past the
        layers' points up to `extent`)."""
        tail = bool(part_outputs)
        return probe_key(geometry=geometry, layout=layout, implementation=implementation,
                         dtype=dtype, lora_rank=lora_rank, modes=part_modes,
                         outputs=part_outputs, tokens=points[grad], device=device.type,
                         head_chunk_tokens=head_chunk_tokens if tail else HEAD_CHUNK_TOKENS,
                         tail_max_tokens=extent if tail else None)

    layer_by_kind: dict[PricedKind, Any] = {}
    for layer in inner.decoder.layers:
        layer_by_kind.setdefault(layer_kind(geometry, layer.layer_number - 1), layer)
    was_training = inner.training
    inner.train()
    fitted_layers: list[tuple[PricedKind, str, ProbedLayer]] = []
    fitted_tails: list[tuple[str, bool, ProbedTail]] = []
    try:
        per_tokens = {t: probe_inputs(model, t, layout, implementation, device)
                      for t in tokens}
        for layer_mode in wanted:
            kind, mode = layer_mode.kind, layer_mode.mode
            layer_key = part_key([layer_mode], [], mode.grad)
            if reuse_parts and layer_key in _PARTS:
                fitted_layers.append(_PARTS[layer_key])
                continue
            mods, grad, full_layers = mode.modules, mode.grad, mode.full_layers
            layer = layer_by_kind.get(kind)
            if layer is None:
                continue
            # A full-recompute unit of several layer kinds is composed from this mode.
            held = grad and not mods and not full_layers
            measure = functools.partial(
                measure_mode, layer, hidden=inner.config.hidden_size, dtype=torch_dtype,
                device=device, grad=grad, full_layers=full_layers, held=held)
            at = points[grad]
            chunk = chunk_tokens_of(kind)
            # Under CP a Gated DeltaNet layer runs the whole row: its points are whole rows.
            whole = bool(chunk) and layout.context_parallel > 1
            inputs_at = ({t: probe_inputs(model, t, layout, implementation, device,
                                          whole_row=True) for t in at}
                         if whole else per_tokens)
            old = set_modes(layer, mods)
            # Under expert parallel, the experts' share the formulas price (routing.py).
            routed_evenly = (even_routing(layer) if kind.moe and layout.expert_parallel > 1
                             else contextlib.nullcontext())
            try:
                with routed_evenly:
                    rows = [measure(inputs_at[t]) for t in at]
                    sparse_rows = {
                        (t, n): measure(probe_inputs(model, sparse_row_lengths(t, n, chunk),
                                                     layout, implementation, device,
                                                     whole_row=whole))
                        for t in at if chunk and t % chunk == 0
                        for n in SPARSE_TOKENS_PER_CHUNK}
            finally:
                restore_modes(layer, old)
            within = sparse = None
            if chunk:
                if grad:
                    _without_conv_padding(sparse_rows, geometry, layout, implementation,
                                          torch_dtype.itemsize, kind, chunk)
                sparse = _sparse_chunks(sparse_rows, chunk)
                at, rows, within = split_points(
                    at, rows, chunk, lambda ts, vs: Fit.fit(ts, vs).at)
            fit = ProbedLayer(
                kept=Fit.fit(at, [r["kept"] for r in rows]),
                forward=Fit.fit(at, [r["forward"] for r in rows]),
                backward=Fit.fit(at, [r["backward"] for r in rows]),
                output=Fit.fit(at, [r["output"] for r in rows]),
                saves_input=all(r["saves_input"] for r in rows),
                within_chunk=within,
                backward_held=Fit.fit(at, [r["backward_held"] for r in rows]) if held else None,
                sparse_chunks=sparse,
            )
            fitted_layers.append((kind, mode.key, fit))
            _PARTS[layer_key] = fitted_layers[-1]
            if progress:
                progress(f"probed {kind} {mode.key}")
        # The tail runs on the whole row: under CP, the rows of the layers' points (each
        # point's local tokens times CP).
        cp = layout.context_parallel
        tail_rows = {t: per_tokens[t] for t in tokens} if cp == 1 else {}
        for okey, request, grad in tails:
            tail_key = part_key([], [(request, grad)], grad, tail_max_tokens)
            if reuse_parts and tail_key in _PARTS:
                fitted_tails.append(_PARTS[tail_key])
                continue
            row_tokens = tail_points((t * cp for t in points[grad]), head_chunk_tokens,
                                     tail_max_tokens)
            rows_key = part_key([], [(request, grad)], grad)
            rows = []
            for n in row_tokens:
                measured = _TAIL_ROWS.get((rows_key, n)) if reuse_parts else None
                if measured is None:
                    if n not in tail_rows:
                        tail_rows[n] = tail_inputs(model, n, layout, implementation, device)
                    measured = _TAIL_ROWS[(rows_key, n)] = measure_tail(
                        model, tail_rows[n], request, torch_dtype, device, grad,
                        head_chunk_tokens)
                rows.append(measured)
            fitted_tails.append((okey, grad, ProbedTail(
                kept=Fit.fit(row_tokens, [r["kept"] for r in rows]),
                forward=Fit.fit(row_tokens, [r["forward"] for r in rows]),
                caller_backward=Fit.fit(row_tokens, [r["caller_backward"] for r in rows]),
                head_backward=Fit.fit(row_tokens, [r["head_backward"] for r in rows]))))
            _PARTS[tail_key] = fitted_tails[-1]
        shares: tuple[tuple[int, float], ...] = ()
        if layout.expert_parallel > 1 and any(k.moe for k, _, _ in fitted_layers):
            share_key = part_key([], [], False)
            if not (reuse_parts and share_key in _SHARES):
                _SHARES[share_key] = routing_shares(model, points[False], layout,
                                                    implementation, device)
            shares = _SHARES[share_key]
    finally:
        release_score_buffer()
        inner.train(was_training)
    coefficients = ProbeCoefficients(key, tuple(tokens), tuple(fitted_layers),
                                     tuple(fitted_tails), expert_routing_shares=shares)
    _CACHE[key] = coefficients
    if cache_dir:
        store_probe(coefficients, cache_dir, device.type)
    return coefficients


def modes_for(geometry: ModelGeometry, recompute: Any, grad: bool) -> list[LayerMode]:
    """The (layer kind, recompute mode) pairs an estimate under `recompute` will ask for (a
    full unit is probed whole, and its layers without recompute too)."""
    modes: set[LayerMode] = set()
    for i, lr in enumerate(recompute.layers):
        kind = layer_kind(geometry, i)
        modes.add(LayerMode(kind, RecomputeMode(grad=False)))
        if not grad:
            if lr.full_checkpoint_unit is not None and lr.full_unit_layers > 1:
                # Megatron still runs the unit as one checkpoint: its layers' outputs meet.
                modes.add(LayerMode(kind, RecomputeMode(grad=False,
                                                        full_layers=lr.full_unit_layers)))
            continue
        if lr.full_checkpoint_unit is not None:
            modes.add(LayerMode(kind, RecomputeMode(grad=True)))
            modes.add(LayerMode(kind, RecomputeMode(grad=True, full_layers=lr.full_unit_layers)))
        else:
            modes.add(LayerMode(kind, RecomputeMode(grad=True,
                                                    modules=frozenset(lr.selective_modules))))
    return sorted(modes, key=lambda m: m.sort_key)


def probe_for_provider(provider: Any, model: Any, *,
                       outputs: Iterable[tuple[OutputRequest, bool]],
                       grad_modes: Iterable[bool] = (True, False),
                       tokens: tuple[int, ...] | None = None,
                       cache_dir: str | Path | None = None) -> ProbeCoefficients:
    """Probe the provider's built model for its effective recompute policy (and no grad).

    Use: `MemoryModel.for_provider(provider, coefficients=probe_for_provider(provider, model,
    outputs=[(OutputRequest(target_logprobs=True), True)]))`. Every rank must call it (the
    layer runs its TP collectives).
    """
    geometry = provider.geometry
    modes = {m for grad in grad_modes
             for m in modes_for(geometry, provider.effective_recompute, grad)}
    lora = getattr(provider, "lora_config", None)
    return probe(model, geometry=geometry, layout=provider.layout,
                 implementation=provider.implementation, dtype=provider.dtype,
                 lora_rank=int(lora.r) if lora is not None else 0, modes=modes,
                 outputs=outputs, tokens=tokens, cache_dir=cache_dir)
