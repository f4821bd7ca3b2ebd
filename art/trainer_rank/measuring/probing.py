"""Probe coefficients for one TrainerRank: layers and head tails, each on first use.

Coefficients measured on the built model by the layer probe price closer to real peaks than
the default formulas (bench/RESULTS.md, section 1, compares both on the calibration matrix).
So the trainer probes its own model, the first time an estimate asks for a layer mode: the
configured recompute policy's grad modes when the first grad micro-batch is priced, its
no-grad modes when the first no-grad one is, and the layer modes of the other rungs it may
run all of them together (with grad, or without), since a micro-batch that needs one rung is
priced under the others too. A job whose micro-batches all fit as configured never pays for
the rungs, and one that only scores (or only trains) never pays for the other grad mode.

The tail (final norm + chunked head + requested outputs + caller loss) depends on the output
request, and which mixes a run asks for is only known when items arrive (a packed micro-batch
requests the union of its items' outputs). `TrainerProbe.tail_cost` therefore probes a mix the
first time an estimate asks for it, and again, further out, the first time a longer row is
priced (each row measured once in a process). That is safe across TP and CP ranks: admission is
deterministic given the agreed inputs and limit, so every rank of a replica prices the same
shapes in the same order and reaches the same probe together. Layer modes are probed on first
use under the same rule, except under expert parallel: a MoE layer's probe exchanges tokens
with ranks of other replicas, which plan their own items (dp_rank_forward), so there every mode
is probed when the trainer is built.

Every rank of a replica uses the replica root's coefficients (broadcast), so no two ranks
ever price the same micro-batch differently.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from art.trainer_rank._request import MicroBatchShape, OutputRequest
from art.trainer_rank.compute.heads import HEAD_CHUNK_TOKENS
from art.trainer_rank.measuring import probe as probe_module
from art.trainer_rank.measuring.probe_runs import inner_model
from art.trainer_rank.measuring.probe_store import store_probe, stored_probe_text
from art.trainer_rank.pricing.chunked import fewest_chunked_points, has_chunked_layers
from art.trainer_rank.pricing.coefficients import LayerMode, MeasuredTail
from art.trainer_rank.pricing.layer_terms import LayerCost, PricedKind
from art.trainer_rank.pricing.row_changes import ExpertShare
from art.trainer_rank.pricing.tail import default_tail
from art.trainer_rank.ranks import agree as _agree


def _probe_tokens(model: Any, implementation: Any, geometry: Any) -> tuple[int, ...]:
    # The probe's own choice of token counts (it picks them when none are given); needed here
    # to name the cache key before deciding, on every rank together, whether to probe.
    device = next(inner_model(model).parameters()).device
    return probe_module.default_probe_tokens(device.type, implementation, geometry)


# The fewest probe points kept however small the limit: the probe's curves need three per
# end for their quadratics, and these four cost well under a second on the test models.
MIN_PROBE_POINTS = 4
LOGPROBS = OutputRequest(target_logprobs=True)


def probe_tokens_for_limit(model: Any, implementation: Any, default_memory_model: Any,
                           usable_bytes: int, *, grad: bool = False,
                           outputs: OutputRequest = LOGPROBS) -> tuple[int, ...]:
    """The probe's token counts whose whole micro-batch (priced by the default formulas for
    `grad` and `outputs`) fits `usable_bytes`, never fewer than MIN_PROBE_POINTS (and, for a
    model with chunked layers, never fewer than their fit needs: `fewest_chunked_points`).

    One layer or the head tail at t tokens holds less than the whole micro-batch at t, so
    the probe's own peak stays under the limit the trainer runs with (to within the defaults'
    error): probing is something the trainer allocates too. Sizes past the last point are
    still priced, by the quadratic through the last three points; a limit that cannot admit
    a point does not admit much beyond it either.
    """
    geometry = default_memory_model.geometry
    tokens = _probe_tokens(model, implementation, geometry)
    bound = default_memory_model.max_tokens_that_fit(usable_bytes, outputs=outputs,
                                                     grad_enabled=grad)
    inside = sum(1 for t in tokens if t <= bound)
    fewest = MIN_PROBE_POINTS
    if has_chunked_layers(geometry):
        fewest = max(fewest, fewest_chunked_points(tokens))
    return tokens[:max(inside, fewest)]


@contextlib.contextmanager
def _model_state_kept(model: Any) -> Iterator[None]:
    """The probe runs backward through real layers (their LoRA adapters accumulate .grad) and
    draws random inputs: park the trainable gradients and the RNG state, put both back after,
    so a probe between a caller's micro-batches changes nothing the caller can see."""
    parked: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
    for p in model.parameters():
        if p.requires_grad:
            main = getattr(p, "main_grad", None)
            parked.append((p, p.grad, None if main is None else main.detach().clone()))
            p.grad = None
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for p, grad, main in parked:
            p.grad = grad
            if main is not None:
                p.main_grad.copy_(main)


class TrainerProbe:
    """Duck-types `probe.ProbeCoefficients` for `MemoryModel` (key, layer_cost, tail_cost,
    partial_for); layer modes in groups and tails per (output mix, grad), on first use."""

    def __init__(self, provider: Any, model: Any, *, policies: Iterable[Any],
                 on_first_use: Iterable[Any] = (),
                 cache_dir: str | Path | None = None,
                 tokens: tuple[int, ...] | None = None,
                 default_model: Any = None, usable_bytes: int | None = None,
                 head_chunk_tokens: int = HEAD_CHUNK_TOKENS,
                 guard: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext
                 ) -> None:
        """`default_model` and `usable_bytes` (both or neither): probe only at points whose
        micro-batch the default formulas fit in the limit (grad and no-grad separately, and
        per output mix for the tails); the trainer updates `usable_bytes` before each plan,
        so a tail probed on first use stays under the limit read right before it. With them,
        a tail is also measured at the multiples of the head chunk (`head_chunk_tokens`, the
        one the trainer runs) out to the rows priced so far, never past the one whose tail
        the formulas fit in half the limit (`_tail_extent`).

        `policies` are probed now. The layer modes of the `on_first_use` policies are probed
        the first time an estimate asks for one of them (at the points the limit then
        admits), in groups: the first of those policies' modes with grad, its modes without,
        and the rest's with and without, each group whole, since a micro-batch priced under
        one of a group's modes is priced under the others too. A job that never runs a grad
        mode (or a no-grad one) never probes it."""
        self.provider = provider
        self.head_chunk_tokens = int(head_chunk_tokens)
        self.model = model
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.default_model = default_model
        self.usable_bytes = usable_bytes
        self.tokens = tokens or self._points(LOGPROBS, False)
        self.grad_tokens = self._points(LOGPROBS, True) if tokens is None else None
        lora = getattr(provider, "lora_config", None)
        self.lora_rank = int(lora.r) if lora is not None else 0
        modes = _layer_modes(provider.geometry, policies)
        self.modes = sorted(modes, key=lambda m: m.sort_key)
        later = list(on_first_use)
        first = _layer_modes(provider.geometry, later[:1]) - modes
        rest = _layer_modes(provider.geometry, later[1:]) - modes - first
        # Only modes the probe can switch on a layer (not the MoE-level ones, which the
        # formulas price) are worth waiting for.
        self.pending_groups: list[list[LayerMode]] = [
            group for group in (
                sorted((m for m in part if m.mode.grad == grad
                        and m.mode.modules <= probe_module.PROBED_MODULES),
                       key=lambda m: m.sort_key)
                for part in (first, rest) for grad in (True, False))
            if group]
        # What a probe runs inside: the fault protocol's guard (`PhaseAgreement.probing`),
        # `guard` for the policies probed now, and the one the trainer sets while it plans
        # for those probed on first use; so a failure on one rank of the ranks a probe's
        # collectives span ends every rank's call instead of leaving them in a collective.
        self.guard = guard
        self.layers = (self._agreed(modes=self.modes, outputs=(), tokens=self.tokens,
                                    grad_tokens=self.grad_tokens) if self.modes else
                       probe_module.ProbeCoefficients(
                           self._key((), (), self.tokens, self.grad_tokens), self.tokens,
                           (), ()))
        self.guard = contextlib.nullcontext
        # (output mix key, grad) -> (its tail probe, the largest row it was measured at past
        # the layers' points: `_tail_extent`)
        self.tails: dict[tuple[str, bool], tuple[Any, int | None]] = {}
        self._tail_ceilings: dict[tuple[str, bool, int], int | None] = {}
        self.probed_tails: list[str] = []
        self.probed_on_first_use: list[str] = []

    # -- the coefficients interface MemoryModel calls ----------------------------------------

    @property
    def key(self) -> str:
        return self.layers.key

    @property
    def expert_routing_shares(self) -> tuple[ExpertShare, ...]:
        return tuple(self.layers.expert_routing_shares)

    def layer_cost(self, kind: PricedKind, mode: str, s: int, padded: int | None = None,
                   segments_change: Mapping[str, float] | None = None, segments: int = 1
                   ) -> LayerCost | None:
        self._probe_if_pending(kind, mode)
        return self.layers.layer_cost(kind, mode, s, padded, segments_change, segments)

    def chunk_points(self, kind: PricedKind, mode: str) -> tuple[int, ...] | None:
        self._probe_if_pending(kind, mode)
        return self.layers.chunk_points(kind, mode)

    @property
    def probes_on_first_use(self) -> int:
        """How many probes estimates have run so far (tails and layer modes): a plan that
        ran one reads the limit again after it."""
        return len(self.probed_tails) + len(self.probed_on_first_use)

    def tail_cost(self, outputs: OutputRequest, grad: bool, s: int) -> MeasuredTail | None:
        """The tail of a row of `s` tokens, probed the first time its mix is priced and again,
        further, the first time a longer row than it was measured at is priced."""
        held = self.tails.get((outputs.key, grad))
        if held is None or (held[1] is not None and s > held[1]
                            and self._tail_extent(outputs, grad, s, held[1]) != held[1]):
            points = self._points(outputs, grad)
            extent = self._tail_extent(outputs, grad, s, None if held is None else held[1],
                                       points)
            tail = self._agreed(modes=(), outputs=((outputs, grad),), tokens=points,
                                tail_max_tokens=extent)
            held = self.tails[(outputs.key, grad)] = (tail, extent)
            self.probed_tails.append(f"{outputs.key}:{'grad' if grad else 'no-grad'}")
        return held[0].tail_cost(outputs, grad, s)

    def partial_for(self, geometry: Any) -> bool:
        return self.layers.partial_for(geometry)

    @property
    def pending_modes(self) -> list[LayerMode]:
        """The layer modes not probed yet, waiting for an estimate that asks for them."""
        return [m for group in self.pending_groups for m in group]

    def _probe_if_pending(self, kind: PricedKind, mode: str) -> None:
        """Probe the pending group (kind, mode) is in, if it is in one."""
        for group in self.pending_groups:
            if any(m.kind == kind and m.mode.key == mode for m in group):
                self._probe_pending_group(group)
                return

    def _probe_pending_group(self, group: list[LayerMode]) -> None:
        """One pending group, at the points the limit admits now, joined to the layers
        probed so far (a probe that fails leaves it pending)."""
        tokens, grad_tokens = self._points(LOGPROBS, False), self._points(LOGPROBS, True)
        probed = self._agreed(modes=group, outputs=(), tokens=tokens, grad_tokens=grad_tokens)
        self.pending_groups = [g for g in self.pending_groups if g is not group]
        key = f"{self.layers.key}+{probed.key}" if self.layers.layers else probed.key
        self.layers = replace(self.layers, key=key, layers=self.layers.layers + probed.layers,
                              expert_routing_shares=(self.layers.expert_routing_shares
                                                     or probed.expert_routing_shares))
        self.probed_on_first_use.extend(f"{m.kind}:{m.mode.key}" for m in group)

    def snapshot(self) -> Any:
        """Everything probed so far as one plain `ProbeCoefficients` (JSON-able)."""
        tails = tuple(t for c, _ in self.tails.values() for t in c.tails)
        return replace(self.layers, tails=tails)

    def _points(self, outputs: OutputRequest, grad: bool) -> tuple[int, ...]:
        if self.default_model is None or self.usable_bytes is None:
            return getattr(self, "tokens", None) or _probe_tokens(
                self.model, self.provider.implementation, self.provider.geometry)
        return probe_tokens_for_limit(self.model, self.provider.implementation,
                                      self.default_model, self.usable_bytes, grad=grad,
                                      outputs=outputs)

    def _tail_extent(self, outputs: OutputRequest, grad: bool, s: int, measured: int | None,
                     points: tuple[int, ...] | None = None) -> int | None:
        """The largest row a tail is measured at past the layers' points: the first multiple
        of the head chunk (`probe.CHUNK_MULTIPLES`) that reaches the rows priced so far
        (`measured`: the extent of the tail probed already; `s`: the row priced now), up to
        `_tail_max_tokens`. A job pays for the rows its micro-batches reach, not for every
        row the limit could admit. On its own (a replica of one rank), a tail probe stored
        further out is taken as it is (`points`: those the probe would run at)."""
        ceiling = self._tail_max_tokens(outputs, grad)
        if ceiling is None:
            return None
        multiples = [int(m * self.head_chunk_tokens) for m in probe_module.CHUNK_MULTIPLES
                     if int(m * self.head_chunk_tokens) <= ceiling]
        reach = max(s, measured or 0)
        extent = next((t for t in multiples if t >= reach), ceiling)
        if measured is not None and extent <= measured:
            return measured
        if points is not None and _agree.replica_size() == 1:
            for further in (t for t in multiples if t >= extent):
                key = self._key((), ((outputs, grad),), points, None, further)
                if key in probe_module._CACHE or self._stored(key):
                    return further
        return extent

    def _tail_max_tokens(self, outputs: OutputRequest, grad: bool) -> int | None:
        """The largest multiple of the head chunk (`probe.CHUNK_MULTIPLES`) whose tail alone
        the default formulas fit in half the limit: the tail probe allocates that much, and
        a row whose tail takes more than half the limit is rarely admitted. None: no limit
        known, or not one chunk fits."""
        if self.default_model is None or self.usable_bytes is None:
            return None
        key = (outputs.key, grad, self.usable_bytes)
        if key not in self._tail_ceilings:
            self._tail_ceilings[key] = self._largest_tail_fitting(outputs, grad)
        return self._tail_ceilings[key]

    def _largest_tail_fitting(self, outputs: OutputRequest, grad: bool) -> int | None:
        fitting = None
        for multiple in probe_module.CHUNK_MULTIPLES:
            tokens = int(multiple * self.head_chunk_tokens)
            tail = default_tail(self.default_model, MicroBatchShape(
                (tokens,), outputs=outputs, grad_enabled=grad), tokens)
            if max(tail.forward + tail.gathered_logits, tail.backward) > self.usable_bytes / 2:
                break
            fitting = tokens
        return fitting

    # -- probing, agreed over the replica ------------------------------------------------------

    def _key(self, modes: Iterable[LayerMode], outputs: Iterable[tuple[OutputRequest, bool]],
             tokens: tuple[int, ...] | None = None,
             grad_tokens: tuple[int, ...] | None = None,
             tail_max_tokens: int | None = None) -> str:
        # Mirrors how probe.probe() names its cache entry (same filtering of unprobeable modes).
        wanted = {m for m in modes if m.mode.modules <= probe_module.PROBED_MODULES}
        provider = self.provider
        return probe_module.cache_key(
            geometry=provider.geometry, implementation=provider.implementation,
            dtype=provider.dtype, layout=provider.layout, lora_rank=self.lora_rank,
            modes=[(m.kind, m.mode.key) for m in wanted],
            outputs=[f"{o.key}:{g}" for o, g in outputs], tokens=tokens or self.tokens,
            device=self._device_type,
            grad_tokens=grad_tokens, head_chunk_tokens=self.head_chunk_tokens,
            tail_max_tokens=tail_max_tokens,
        )

    def _agreed(self, *, modes: Iterable[LayerMode],
                outputs: Iterable[tuple[OutputRequest, bool]], tokens: tuple[int, ...],
                grad_tokens: tuple[int, ...] | None = None,
                tail_max_tokens: int | None = None) -> Any:
        modes, outputs = list(modes), list(outputs)
        provider = self.provider

        def run(cache_dir: Path | None, reuse_parts: bool) -> Any:
            with _model_state_kept(self.model):
                return probe_module.probe(
                    self.model, geometry=provider.geometry, layout=provider.layout,
                    implementation=provider.implementation, dtype=provider.dtype,
                    lora_rank=self.lora_rank, modes=modes, outputs=outputs,
                    tokens=tokens, grad_tokens=grad_tokens, cache_dir=cache_dir,
                    head_chunk_tokens=self.head_chunk_tokens,
                    tail_max_tokens=tail_max_tokens, reuse_parts=reuse_parts)

        with self.guard():
            agreed = self._agreed_run(run, modes, outputs, tokens, grad_tokens,
                                      tail_max_tokens)
        self._write(agreed)
        return agreed

    def _agreed_run(self, run: Callable[[Path | None, bool], Any], modes: list[LayerMode],
                    outputs: list[tuple[OutputRequest, bool]], tokens: tuple[int, ...],
                    grad_tokens: tuple[int, ...] | None, tail_max_tokens: int | None) -> Any:
        if _agree.replica_size() == 1:
            agreed = run(self.cache_dir, reuse_parts=True)
        else:
            # Several ranks run the probe's layers together (TP collectives): all of them probe
            # or none does. A cached copy counts only when every rank of the replica has one.
            key = self._key(modes, outputs, tokens, grad_tokens, tail_max_tokens)
            cached = key in probe_module._CACHE or self._stored(key)
            # Parts measured earlier are not reused: each rank's own would have to be agreed
            # on part by part, or one rank would skip a layer's collectives another runs.
            if _agree.min_over_replica(int(cached)):
                mine = run(self.cache_dir, reuse_parts=False)
            else:
                probe_module._CACHE.pop(key, None)
                mine = run(None, reuse_parts=False)
            agreed = _agree.broadcast_from_replica_root(mine)
            probe_module._CACHE[key] = agreed
        return agreed

    def _write(self, coefficients: Any) -> None:
        """Keep a copy in the cache directory (the probe writes only what it measured, not
        what it found in this process's cache), from the replica root only."""
        if self.cache_dir is None or not _agree.is_replica_root():
            return
        if not self._stored(coefficients.key):
            store_probe(coefficients, self.cache_dir, self._device_type)

    @property
    def _device_type(self) -> str:
        return next(inner_model(self.model).parameters()).device.type

    def _stored(self, key: str) -> bool:
        """Whether the cache directory holds a probe under `key` this software measured."""
        return (self.cache_dir is not None
                and stored_probe_text(self.cache_dir, key, self._device_type) is not None)


def _layer_modes(geometry: Any, policies: Iterable[Any]) -> set[LayerMode]:
    """Every (layer kind, recompute mode) an estimate under one of `policies` asks for, with
    grad and without."""
    return {m for policy in policies for grad in (True, False)
            for m in probe_module.modes_for(geometry, policy, grad)}
