"""The chain composition's term builders: what lives before the decoder, the forward pass
through the layers of the busiest stage, the forward peak's terms, and the backward pass from
the top. MemoryModel.estimate sums what they return (see model.py for the chain)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from art.megatron.geometry import ATTENTION, ModelGeometry
from art.megatron.implementation import Implementation
from art.megatron.recompute import LayerRecompute
from art.trainer_rank.pricing.estimate import Lifetime, Term, TermKind
from art.trainer_rank.pricing.layer_terms import FP32, LayerCost
from art.trainer_rank.pricing.layers import moe_checkpoint_retained
from art.trainer_rank.pricing.tail import INT64, TailCost

INT32 = 4
FORWARD, BACKWARD = Lifetime.FORWARD, Lifetime.BACKWARD
# Pre-decoder terms the first attention layer's call allocates: Megatron's global buffer for
# unfused attention scores (one per process, reused) and the checkpointed core attention's
# mask-type tensors.
BUFFERS_OF_ATTENTION = frozenset({TermKind.SCORE_BUFFER, TermKind.MASK_TYPE_TENSORS})
# Without grad, the pre-decoder terms the decoder call frees when it returns.
FREED_WITH_THE_DECODER = frozenset({TermKind.EMBEDDING_OUTPUT, TermKind.MASK_TYPE_TENSORS,
                                    TermKind.ROTARY_INDEX})

# (layer index, selective modules, tokens, grad[, rebuilt=...]) -> (cost, whether the probe
# measured it); `rebuilt`: the layer as its full-recompute unit rebuilds it for its backward
LayerPricer = Callable[..., tuple[LayerCost, bool]]
# (first layer index, layers in the unit, tokens, grad) -> the probe's cost of the whole unit
UnitPricer = Callable[..., LayerCost | None]


@dataclass(frozen=True)
class Unit:
    """One step of the forward chain, in the order the backward undoes it: a layer (or a
    checkpoint unit the probe measured as one), or a full-recompute unit whose layers are
    rebuilt with grad in the backward (`full`)."""

    full: bool
    start: int  # index of its first layer
    kept: float  # what it keeps for backward (a full unit: its input and `stale_state`)
    input: float  # its input's bytes (a full unit: also the incoming gradient's)
    costs: tuple[LayerCost, ...]
    # What stays referenced after its backward returns, until the next micro-batch reaches
    # it: a MoE layer's routing state (`retained_by_moe_checkpoint` for a checkpoint unit,
    # which also keeps its input and that input's gradient: `retains_input_gradient`).
    retained: float = 0.0
    retains_input_gradient: bool = False
    # A full unit: the routing state each of its layers' dispatchers keeps from the no-grad
    # run (part of `kept`), until the rebuild of that layer calls the dispatcher again.
    stale_state: tuple[float, ...] = ()


@dataclass
class ForwardPass:
    units: list[Unit] = field(default_factory=list)
    kept_total: float = 0.0  # kept by all layers when the decoder returns
    peak: float = 0.0  # the layers' forward peak (above the pre-decoder terms)
    peak_where: str = ""
    output: float = 0.0  # the decoder output's bytes
    probe_used: bool = False
    peak_kept: float = 0.0  # of `peak`, what earlier layers kept
    # Whether an attention layer has run by the layers' peak: Megatron allocates its score
    # buffer on the first attention layer's call, so a peak before it does not hold it.
    attention_run: bool = False
    peak_after_attention: bool = True
    attention_buffers: float = 0.0  # what the first attention layer's call allocates
    peak_with_buffers: float = 0.0

    def reach(self, peak: float, where: str) -> None:
        with_buffers = peak + (self.attention_buffers if self.attention_run else 0.0)
        if with_buffers > self.peak_with_buffers:
            self.peak, self.peak_where, self.peak_kept = peak, where, self.kept_total
            self.peak_after_attention = self.attention_run
            self.peak_with_buffers = with_buffers


def pre_decoder_terms(g: ModelGeometry, implementation: Implementation, b: int, tp: int,
                      s: int, S: int, hidden_local: float,
                      checkpointed_attention_layers: int = 0) -> list[Term]:
    """Live through forward and backward: packed inputs, the unfused mask and score buffer,
    the rotary table, the embedding output, the checkpointed attention's mask-type tensors."""
    # Under context parallel (s < S) the packer's tokens, positions and targets span the
    # whole row, and this rank's tokens and positions are copies of its two chunks.
    split = S > s and implementation.attention != "unfused"
    pre = [Term(TermKind.PACKED_INPUTS, "packed inputs",
                int((3 * S + 2 * s if split else 3 * s) * INT64), FORWARD,
                f"tokens, positions, targets: 3 x {S} x int64 + this CP rank's 2 x {s}"
                if split else f"tokens, positions, targets: 3 x {s} x int64")]
    if implementation.attention == "unfused":
        pre.append(Term(TermKind.ATTENTION_MASK, "packed attention mask", int(s * S), FORWARD,
                        f"bool [{s}, {S}] block-diagonal causal (local spec)"))
        heads = g.num_attention_heads // tp
        pre.append(Term(TermKind.SCORE_BUFFER, "attention score buffer",
                        int(heads * s * S * b), FORWARD,
                        f"Megatron global memory buffer [{heads} x {s} x {S}] x {b} B; "
                        "persists at the largest size seen, priced as new"))
    if ATTENTION in g.layer_types:
        rope_dim = g.head_dim
        if split:
            # The table spans the longest position (at most the row); the index is this
            # CP rank's rows.
            pre.append(Term(TermKind.ROTARY_TABLE, "rotary table (whole row)",
                            int(S * rope_dim * FP32), FORWARD,
                            f"[{S}, {rope_dim}] fp32, cached by Megatron's rotary module"))
            pre.append(Term(TermKind.ROTARY_INDEX, "rotary index (this CP rank)",
                            int(s * rope_dim * FP32), FORWARD,
                            f"[{s}, {rope_dim}] fp32, this CP rank's positions"))
        else:
            pre.append(Term(TermKind.ROTARY_TABLE_AND_INDEX, "rotary table",
                            int(2 * s * rope_dim * FP32), FORWARD,
                            f"table + per-token index [{s}, {rope_dim}] fp32"))
    if checkpointed_attention_layers:
        # Megatron's checkpointed core attention passes the mask type as a new one-element
        # int32 tensor per layer (transformer/attention.py, _checkpointed_attention_forward);
        # the checkpoint keeps it until backward, and without grad one outlives its layer.
        pre.append(Term(TermKind.MASK_TYPE_TENSORS, "checkpointed attention mask-type tensors",
                        int(checkpointed_attention_layers * INT32), FORWARD,
                        f"{checkpointed_attention_layers} layer(s) x 1 int32"))
    # The compute path keeps the embedding output referenced for the whole decoder call,
    # so it is live throughout; the first layer's saved input is that same storage.
    pre.append(Term(TermKind.EMBEDDING_OUTPUT, "embedding output", int(hidden_local), FORWARD,
                    "decoder input, referenced until the decoder returns"))
    return pre


def retained_by_moe_checkpoint(members: list[int], moe_layers: frozenset[int],
                               unit_input: float, routing_state: float) -> float:
    """A full-recompute checkpoint unit with a MoE layer outlives its backward: the layer's
    token dispatcher keeps the routing state it computed while the unit was rebuilt
    (`routing_state`) until its next call, and the routing probabilities' graph reaches back
    to the unit input Megatron's checkpoint detached and made a leaf
    (CheckpointFunction.backward), which holds that input's storage and its gradient."""
    if not any(j in moe_layers for j in members):
        return 0.0
    return moe_checkpoint_retained(unit_input) + routing_state


def forward_pass(layers: list[tuple[int, LayerRecompute]], s: int, grad: bool,
                 hidden_local: float, layer_cost: LayerPricer,
                 probed_unit: UnitPricer,
                 attention_layers: frozenset[int] = frozenset(),
                 attention_buffers: float = 0.0,
                 moe_layers: frozenset[int] = frozenset()) -> ForwardPass:
    """Layer i starts with what layers < i kept plus its input and peaks at its `forward`
    above that; a full-recompute unit keeps only its input and runs its layers without grad.
    `attention_layers`: the indices of the (softmax) attention layers, whose first call
    allocates `attention_buffers` (pre-decoder terms, `BUFFERS_OF_ATTENTION`); `moe_layers`:
    the indices of the MoE layers."""
    fp = ForwardPass(output=hidden_local,  # the embedding output, then each layer's output
                     attention_buffers=attention_buffers,
                     attention_run=not attention_layers)
    i = 0
    while i < len(layers):
        index, lr = layers[i]
        first = i == 0
        x = fp.output
        x_in = 0.0 if first else x  # the first input is the embedding output (pre term)
        # A unit's peak is not placed inside it: count its attention layers as run.
        span = lr.full_unit_layers if lr.full_checkpoint_unit is not None else 1
        attention_before = fp.attention_run
        fp.attention_run |= any(j in attention_layers for j, _ in layers[i:i + max(1, span)])
        if grad and lr.full_checkpoint_unit is not None:
            n = lr.full_unit_layers
            members = layers[i:i + n]
            member_indices = [j for j, _ in members]
            unit_cost = probed_unit(index, n, s)
            if unit_cost is not None:
                # The probe measured this very checkpoint unit: use it as one "layer".
                fp.probe_used = True
                fp.reach(fp.kept_total + x_in + unit_cost.forward,
                         f"layers {index + 1}-{index + n} (no-grad run)")
                kept = unit_cost.kept - (x if first and unit_cost.saves_input else 0)
                # What the unit keeps beside its input is its dispatchers' routing state.
                retained = retained_by_moe_checkpoint(
                    member_indices, moe_layers, x,
                    max(0.0, unit_cost.kept - (x if unit_cost.saves_input else 0)))
                fp.units.append(Unit(False, index, kept, x, (replace(unit_cost, kept=int(kept)),),
                                     retained, bool(retained)))
                fp.kept_total += kept
                fp.output = unit_cost.output
                i += n
                continue
            nograd = [layer_cost(j, frozenset(), s, False) for j, _ in members]
            full = [layer_cost(j, frozenset(), s, True, rebuilt=True) for j, _ in members]
            fp.probe_used |= any(u for _, u in nograd + full)
            fp.reach(fp.kept_total + x_in + max(c.forward for c, _ in nograd),
                     f"layer {index + 1} (no-grad run)")
            # Without grad a layer keeps only its dispatcher's routing state: the no-grad run
            # leaves it referenced beside the unit input until the rebuild calls the
            # dispatcher again.
            states = tuple(float(c.kept) for c, _ in nograd)
            retained = retained_by_moe_checkpoint(member_indices, moe_layers, x, sum(states))
            fp.units.append(Unit(True, index, x_in + sum(states), x,
                                 tuple(c for c, _ in full), retained, bool(retained), states))
            fp.kept_total += x_in + sum(states)
            i += n
            continue
        if not grad and lr.full_checkpoint_unit is not None and lr.full_unit_layers > 1:
            # Without grad Megatron still runs a full unit as one checkpoint (training
            # mode): priced whole when the probe measured it.
            n = lr.full_unit_layers
            unit_cost = probed_unit(index, n, s, grad=False)
            if unit_cost is not None:
                fp.probe_used = True
                fp.reach(fp.kept_total + x_in + unit_cost.forward,
                         f"layers {index + 1}-{index + n} (no grad)")
                fp.units.append(Unit(False, index, unit_cost.kept, x, (unit_cost,)))
                fp.kept_total += unit_cost.kept
                fp.output = unit_cost.output
                i += n
                continue
            # Formulas: the unit's input stays referenced by the checkpoint while its
            # later layers run.
            members = layers[i:i + n]
            costs = [layer_cost(j, frozenset(), s, False) for j, _ in members]
            fp.probe_used |= any(u for _, u in costs)
            unit_kept = 0.0
            for k, (cost, _) in enumerate(costs):
                # Priced layer by layer, so each peak is placed: the attention buffers exist
                # once an attention layer of the unit (or before it) has run.
                run_so_far = attention_before or any(
                    j in attention_layers for j, _ in members[:k + 1])
                fp.attention_run = run_so_far
                fp.reach(fp.kept_total + x_in + cost.forward + (x_in if k else 0.0),
                         f"layer {index + k + 1} (no grad, checkpoint unit)")
                fp.kept_total += cost.kept
                unit_kept += cost.kept
            fp.units.append(Unit(False, index, unit_kept, x, (costs[-1][0],)))
            fp.output = costs[-1][0].output
            i += n
            continue
        modules = lr.selective_modules if grad else frozenset()
        cost, used = layer_cost(index, modules, s, grad)
        fp.probe_used |= used
        fp.reach(fp.kept_total + x_in + cost.forward, f"layer {index + 1}")
        kept = cost.kept - (x if first and cost.saves_input else 0)
        # A MoE layer's dispatcher keeps its routing state past the layer's backward, what the
        # layer keeps without grad; under the `moe` checkpoint also the checkpoint's detached
        # input (the pre-MLP norm's output, a hidden tensor) and its gradient.
        retained = 0.0
        if grad and index in moe_layers:
            retained = layer_cost(index, frozenset(), s, False)[0].kept
            if "moe" in modules:
                retained += moe_checkpoint_retained(cost.output)
        fp.units.append(Unit(False, index, kept, x, (replace(cost, kept=int(kept)),),
                             retained))
        fp.kept_total += kept
        fp.output = cost.output
        i += 1
    return fp


def kept_note(units: list[Unit], s: int) -> str:
    counts: dict[str, list[float]] = {}
    for unit in units:
        label = "full checkpoint inputs" if unit.full else "layers"
        counts.setdefault(label, []).append(unit.kept)
    parts = []
    for label, values in counts.items():
        per_tok = sum(values) / len(values) / max(1, s)
        parts.append(f"{len(values)} {label} x {per_tok / 1024:.2f} KiB/tok avg")
    return "; ".join(parts) + f" x {s} tok"


def _gather_terms(tail: TailCost) -> list[Term]:
    if not tail.gathered_logits:
        return []
    return [Term(TermKind.GATHERED_LOGITS, "gathered logits chunk (TP all-gather)",
                 int(tail.gathered_logits), FORWARD,
                 "TP pieces [chunk, vocab/TP] + their concatenation [chunk, vocab], fp32")]


def live_after_decoder(pre: list[Term]) -> list[Term]:
    """Without grad, what of `pre` is still live at the head: the decoder call has returned,
    so the embedding output, the per-token rotary index and the mask-type tensors are gone;
    Megatron's rotary module caches its table, and the packed inputs and score buffer stay."""
    live = []
    for t in pre:
        if t.kind in FREED_WITH_THE_DECODER:
            continue
        if t.kind is TermKind.ROTARY_TABLE_AND_INDEX:
            t = replace(t, bytes=t.bytes // 2, note="cached table (per-token index freed)")
        live.append(t)
    return live


def _state_terms(kept: float, whose: str) -> list[Term]:
    """Without grad, what layers leave referenced after they return (a MoE layer's token
    dispatcher keeps its routing state until its next call)."""
    if kept <= 0:
        return []
    return [Term(TermKind.LAYER_STATE_KEPT, f"state kept by {whose} (no grad)", int(kept),
                 FORWARD, "MoE token dispatchers' routing state, held until their next call")]


def forward_terms(pre: list[Term], fp: ForwardPass, tail: TailCost, layer_kept_note: str,
                  grad: bool) -> tuple[list[Term], str]:
    """The forward peak as terms, and where it is. With grad: everything kept, the decoder
    output and the head's working set, plus how far a layer's own peak rises above that.
    Without grad nothing is kept: the larger of one layer's working set and the head's, whose
    input is the final norm's output (the decoder's own output is freed with its call)."""
    x = fp.output
    head = tail.forward + tail.gathered_logits
    # Before the first attention layer runs, Megatron's score buffer does not exist yet.
    absent = 0.0 if fp.peak_after_attention else fp.attention_buffers
    at_layer = [t for t in pre if fp.peak_after_attention or t.kind not in BUFFERS_OF_ATTENTION]
    if grad:
        terms = [
            *pre,
            Term(TermKind.LAYERS_KEPT, "layer activations kept (all layers)",
                 int(fp.kept_total), FORWARD, layer_kept_note),
            Term(TermKind.DECODER_OUTPUT, "decoder output", int(x), FORWARD,
                 "last layer output"),
            Term(TermKind.HEAD_FORWARD, "head + outputs (forward working set)",
                 int(tail.forward), FORWARD, tail.note),
            *_gather_terms(tail),
        ]
        layer_excess = fp.peak - absent - (fp.kept_total + x + head)
        if layer_excess > 0:
            terms.append(Term(TermKind.LAYER_FORWARD_EXCESS, "layer forward excess over head",
                              int(layer_excess), FORWARD, fp.peak_where))
            return terms, fp.peak_where
        return terms, "head"
    layer_terms = [*at_layer, *_state_terms(fp.peak_kept, "earlier layers"),
                   Term(TermKind.LAYER_WORKING_SET, "largest layer working set (no grad)",
                        int(fp.peak - fp.peak_kept), FORWARD, fp.peak_where)]
    head_terms = [*live_after_decoder(pre), *_state_terms(fp.kept_total, "the layers"),
                  Term(TermKind.HEAD_FORWARD, "head + outputs (no grad)", int(tail.forward),
                       FORWARD, tail.note),
                  *_gather_terms(tail)]
    if sum(t.bytes for t in layer_terms) >= sum(t.bytes for t in head_terms):
        return layer_terms, fp.peak_where
    return head_terms, "head"


def _held_backward(cost: LayerCost, incoming: float) -> float:
    """A layer's backward with its incoming gradient referenced until it returns: measured
    (`backward_held`), else its backward with that gradient added (an upper bound)."""
    return cost.backward_held if cost.backward_held is not None else cost.backward + incoming


def full_unit_peak(unit: Unit) -> float:
    """A full-recompute unit's backward: its layers rebuilt with grad, then their backward
    while Megatron's checkpoint holds the rebuilt unit output and the unit's incoming gradient
    (CheckpointFunction.backward keeps both referenced until the unit's backward returns).
    A layer's routing state from the no-grad run (`Unit.stale_state`, priced here, not in
    the unit's `kept`) is live until that layer's rebuild replaces it: counted through the
    rebuilt layer's own forward, whose dispatch is where it is replaced."""
    costs = unit.costs
    stale = list(unit.stale_state) + [0.0] * (len(costs) - len(unit.stale_state))
    dy = unit.input  # incoming gradient, the size of a hidden tensor
    rebuilt = 0.0
    peak = 0.0
    for k, cost in enumerate(costs):
        kept_k = cost.kept - (unit.input if k == 0 and cost.saves_input else 0)
        # A rebuilt layer's input is the one before it's output (the unit's first layer's is
        # the unit input, a term of its own): live while it runs, not part of its `forward`.
        layer_input = costs[k - 1].output if k else 0.0
        peak = max(peak, rebuilt + layer_input + cost.forward + dy + sum(stale[k:]))
        rebuilt += kept_k
    held = costs[-1].output
    for k in reversed(range(len(costs))):
        cost = costs[k]
        kept_k = cost.kept - (unit.input if k == 0 and cost.saves_input else 0)
        rebuilt -= kept_k
        # The last layer's incoming gradient is the unit's, held through its whole backward;
        # a lower layer's own incoming gradient is freed after its first use, like the probe
        # measures it, while the unit's stays held beside it.
        backward = _held_backward(cost, dy) if k == len(costs) - 1 else cost.backward + dy
        peak = max(peak, rebuilt + kept_k + backward + held)
    return peak


def backward_terms(pre: list[Term], fp: ForwardPass, tail: TailCost, layer_kept_note: str
                   ) -> tuple[list[Term], str, int | None]:
    """The backward peak as terms, where it is, and the first layer (index) of the layer or
    unit whose backward sets it (None: the head's): the head's backward, then each layer
    top-down at its `backward` above what it and the layers below keep. LoRA gradients are
    priced as resident (they exist from the first step on)."""
    best = fp.kept_total + fp.output + tail.backward
    where = "head backward"
    peak_layer: int | None = None
    parts = [(TermKind.LAYERS_KEPT, "layer activations kept (all layers)", fp.kept_total,
              layer_kept_note),
             (TermKind.DECODER_OUTPUT, "decoder output", fp.output, "last layer output"),
             (TermKind.HEAD_BACKWARD, "head + outputs + caller loss (backward)", tail.backward,
              tail.note)]
    outputs_held = tail.kept
    below = fp.kept_total
    retained = 0.0  # left referenced by the units whose backward has run
    incoming = 0.0  # of it, the gradient the next unit receives (priced in its backward)
    for unit in reversed(fp.units):
        below -= unit.kept
        above = retained - incoming
        held_above = [(TermKind.HELD_ABOVE, "held by MoE layers above", above,
                       "routing state; a checkpoint unit's detached input and its gradient")
                      ] if above else []
        retained += unit.retained
        incoming = unit.input if unit.retains_input_gradient else 0.0
        if not unit.full:
            cost = unit.costs[0]
            peak = below + above + cost.kept + cost.backward + outputs_held
            if peak > best:
                best, where, peak_layer = peak, f"layer {unit.start + 1} backward", unit.start
                parts = [
                    (TermKind.KEPT_BELOW, "activations kept by layers below", below, ""),
                    *held_above,
                    (TermKind.LAYER_KEPT, "this layer's kept activations", cost.kept, ""),
                    (TermKind.LAYER_BACKWARD, "layer backward working set", cost.backward,
                     "incoming grad, grads, rebuilt checkpoints"),
                    (TermKind.OUTPUTS_HELD, "outputs held by the caller", outputs_held, ""),
                ]
            continue
        unit_peak = full_unit_peak(unit)
        unit_input = unit.kept - sum(unit.stale_state)  # the stale state is in `unit_peak`
        peak = below + above + unit_input + unit_peak + outputs_held
        if peak > best:
            first, last = unit.start + 1, unit.start + len(unit.costs)
            span = f"layer {first}" if first == last else f"layers {first}-{last}"
            best, where, peak_layer = peak, f"{span} backward (full recompute unit)", unit.start
            parts = [
                (TermKind.KEPT_BELOW, "activations kept by layers below", below,
                 "checkpoint inputs"),
                *held_above,
                (TermKind.UNIT_INPUT, "checkpoint unit input", unit_input, ""),
                (TermKind.UNIT_BACKWARD, "full unit recompute + backward", unit_peak,
                 f"{len(unit.costs)} layer(s) rebuilt with grad + incoming grad"),
                (TermKind.OUTPUTS_HELD, "outputs held by the caller", outputs_held, ""),
            ]
    terms = [replace(t, lifetime=BACKWARD) for t in pre]
    terms += [Term(kind, n, int(v), BACKWARD, note) for kind, n, v, note in parts]
    return terms, where, peak_layer
