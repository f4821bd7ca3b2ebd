"""The recompute ladder: the policies one micro-batch may run, ordered by the work they redo.

Every rung is a per-layer policy Megatron-Core 0.16.1 can run on a model built with any
other: the selective flags are module attributes read at forward time and full recompute is
read from the shared config at forward time (decide/escalation.py switches both). The rungs:
- no recompute;
- selective `core_attn`, selective `core_attn,mlp`, and where the layers have them selective
  `core_attn,moe` (and `core_attn,mlp,moe` with dense and MoE layers both; `moe_act` is no
  rung: it needs grouped GEMM experts, which this build does not make);
- full recompute of the first N layers of each chunk (`recompute_method=block`), the other
  layers keeping the base policy: the configured one when it is selective or none, else
  selective `core_attn`; N = 1 .. layers per chunk - 1;
- full recompute, uniform, one layer per checkpoint.

Work is the forward FLOPs backward re-runs, from the geometry (matmuls and attention
products; norms and activations count their elementwise work), at the micro-batch's
sequence lengths: attention grows with each sequence squared, the rest with its tokens, so
the order of the selective rungs against the block rungs depends on the shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from art.megatron.geometry import LINEAR_ATTENTION, ModelGeometry
from art.megatron.recompute import EffectiveRecompute, LayerRecompute


class RecomputeChoice(StrEnum):
    """Which rung a grad micro-batch runs (`ART_TRAINER_RANK_RECOMPUTE`): the configured
    policy or a decline; the configured policy when it fits, else the least-work rung above it
    that fits; or the least-work rung that fits, below the configured one too."""

    CONFIGURED = "configured"
    ESCALATE = "escalate"
    ADAPTIVE = "adaptive"


@dataclass(frozen=True)
class RecomputeRung:
    """One policy of the ladder. `name` is what stats, errors and `plan` print."""

    name: str
    recompute: EffectiveRecompute

    def recomputed_flops(self, geometry: ModelGeometry, sequence_lengths_tokens: Sequence[int],
                         tensor_parallel: int = 1) -> float:
        return recomputed_flops(geometry, self.recompute, sequence_lengths_tokens,
                                tensor_parallel)


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs of one layer's parts at one micro-batch (per tensor-parallel rank)."""

    projections: float  # attention / Gated DeltaNet input and output projections
    core_attn: float  # the attention products, or the Gated DeltaNet recurrence
    mlp: float  # dense MLP, or routed + shared experts and the router
    norms: float  # the layer's two norms

    @property
    def layer(self) -> float:
        return self.projections + self.core_attn + self.mlp + self.norms


def layer_flops(geometry: ModelGeometry, index: int, sequence_lengths_tokens: Sequence[int],
                tensor_parallel: int = 1) -> LayerFlops:
    """The forward FLOPs of layer `index` (0-based) over a packed row of these sequences."""
    g = geometry
    s = float(sum(sequence_lengths_tokens))
    squares = float(sum(n * n for n in sequence_lengths_tokens))
    h = g.hidden_size
    if g.layer_types[index] == LINEAR_ATTENTION and g.linear_attention is not None:
        la = g.linear_attention
        qk = la.num_key_heads * la.key_head_dim
        v = la.num_value_heads * la.value_head_dim
        # in_proj: q, k, v, z, and the per-head beta and decay gate; out_proj: v -> h.
        projections = 2 * s * h * (2 * qk + 2 * v + 2 * la.num_value_heads) + 2 * s * v * h
        # The delta rule's state update and read-out: a [dk, dv] state per value head.
        conv = 2 * s * (2 * qk + v) * la.conv_kernel_size
        core = 4 * s * la.num_value_heads * la.key_head_dim * la.value_head_dim + conv
    else:
        q = g.num_attention_heads * g.head_dim
        kv = g.num_query_groups * g.head_dim
        gate = q if g.gated_attention_output else 0
        projections = 2 * s * h * (q + 2 * kv + gate) + 2 * s * q * h
        # QK^T and scores x V, causal: half of each sequence's square.
        core = 2 * q * squares
    if g.moe_layers[index]:
        experts = g.moe_router_topk * 3 * 2 * s * h * g.moe_ffn_hidden_size
        shared = 3 * 2 * s * h * g.shared_expert_ffn_hidden_size
        mlp = experts + shared + 2 * s * h * g.num_experts
    else:
        mlp = 3 * 2 * s * h * g.ffn_hidden_size  # SwiGLU: gate, up and down
    norms = 2 * 4 * s * h
    tp = float(tensor_parallel)
    return LayerFlops(projections / tp, core / tp, mlp / tp, norms)


def forward_flops(geometry: ModelGeometry, sequence_lengths_tokens: Sequence[int],
                  tensor_parallel: int = 1) -> float:
    """The forward FLOPs of a micro-batch over a packed row of these sequences: every layer
    and the output layer's logits (per tensor-parallel rank)."""
    layers = sum(layer_flops(geometry, i, sequence_lengths_tokens, tensor_parallel).layer
                 for i in range(geometry.num_layers))
    tokens = float(sum(sequence_lengths_tokens))
    head = 2 * tokens * geometry.hidden_size * geometry.vocab_size / tensor_parallel
    return layers + head


def recomputed_flops(geometry: ModelGeometry, recompute: EffectiveRecompute,
                     sequence_lengths_tokens: Sequence[int], tensor_parallel: int = 1) -> float:
    """The forward FLOPs a grad micro-batch re-runs in backward under `recompute`."""
    total = 0.0
    for i, lr in enumerate(recompute.layers):
        f = layer_flops(geometry, i, sequence_lengths_tokens, tensor_parallel)
        if lr.full_checkpoint_unit is not None:
            total += f.layer
            continue
        mods = lr.selective_modules
        if "core_attn" in mods:
            total += f.core_attn
        if "mlp" in mods or "moe" in mods:
            total += f.mlp
        if "layernorm" in mods:
            total += f.norms * len(lr.recomputed_norms) / 2
    return total


def block_over(base: EffectiveRecompute, blocks: int) -> EffectiveRecompute:
    """Full recompute of the first `blocks` layers of every model chunk, one checkpoint each,
    `base`'s per-layer policy on the others (Megatron's block method; inside a checkpointed
    layer no selective flag is left on)."""
    layers: list[LayerRecompute] = []
    position: dict[tuple[int, int], int] = {}
    for lr in base.layers:
        chunk = (lr.pipeline_stage, lr.virtual_chunk)
        i = position.get(chunk, 0)
        position[chunk] = i + 1
        if i < blocks:
            lr = replace(lr, full_checkpoint_unit=i, full_unit_layers=1,
                         selective_modules=frozenset(), recomputed_norms=frozenset())
        layers.append(lr)
    return replace(base, granularity="full", method="block", num_layers=blocks,
                   layers=tuple(layers))


def rung_name(recompute: EffectiveRecompute) -> str:
    if recompute.granularity == "full" and recompute.method == "block":
        base = "+".join(recompute.modules) if recompute.modules else "none"
        return f"full block {recompute.num_layers} (selective {base} on the rest)" \
            if recompute.modules else f"full block {recompute.num_layers}"
    if recompute.granularity == "full":
        return f"full {recompute.method} {recompute.num_layers}"
    if recompute.granularity == "selective":
        return "selective " + ("+".join(recompute.modules) or "nothing")
    return "none"


def build_ladder(configured: EffectiveRecompute,
                 resolve: Callable[..., EffectiveRecompute]) -> tuple[RecomputeRung, ...]:
    """Every rung for this model, the configured policy first (deduplicated by what each
    layer runs). `resolve(granularity, method, num_layers, modules)` is the provider's
    `recompute_as`: it validates a rung exactly as Megatron would."""
    candidates: list[EffectiveRecompute] = [configured]
    for granularity, modules in ((None, None), ("selective", ("core_attn",)),
                                 ("selective", ("core_attn", "mlp")),
                                 ("selective", ("core_attn", "moe")),
                                 ("selective", ("core_attn", "mlp", "moe"))):
        try:
            candidates.append(resolve(granularity, None, None, modules))
        except ValueError:
            continue
    if configured.granularity in (None, "selective"):
        base = configured
    else:
        base = resolve("selective", None, None, ("core_attn",))
    per_chunk = min(len(configured.chunk_layers(stage, chunk))
                    for stage in range(configured.pipeline_stages)
                    for chunk in range(configured.virtual_chunks))
    for blocks in range(1, per_chunk):
        candidates.append(block_over(base, blocks))
    try:
        candidates.append(resolve("full", "uniform", 1, None))
    except ValueError:
        pass
    rungs: list[RecomputeRung] = []
    seen: set[tuple[object, ...]] = set()
    for recompute in candidates:
        # Two settings that run the same per layer (mlp on MoE layers is ignored) are one rung.
        runs = tuple((lr.full_checkpoint_unit, lr.full_unit_layers, lr.selective_modules,
                      lr.recomputed_norms) for lr in recompute.layers)
        if runs in seen:
            continue
        seen.add(runs)
        rungs.append(RecomputeRung(rung_name(recompute), recompute))
    return tuple(rungs)


@dataclass(frozen=True)
class RecomputeLadder:
    """The rungs of one model, and their order by recomputed work at a micro-batch's shape."""

    rungs: tuple[RecomputeRung, ...]
    geometry: ModelGeometry
    tensor_parallel: int = 1

    @property
    def configured(self) -> RecomputeRung:
        return self.rungs[0]

    def flops(self, recompute: EffectiveRecompute, lengths: Sequence[int]) -> float:
        return recomputed_flops(self.geometry, recompute, lengths, self.tensor_parallel)

    def forward_flops(self, lengths: Sequence[int]) -> float:
        return forward_flops(self.geometry, lengths, self.tensor_parallel)

    def ordered(self, lengths: Sequence[int]) -> list[tuple[float, RecomputeRung]]:
        """Every rung with its recomputed FLOPs at `lengths`, least work first (ties: ladder
        order)."""
        priced = [(self.flops(r.recompute, lengths), i, r) for i, r in enumerate(self.rungs)]
        return [(flops, rung) for flops, _, rung in sorted(priced, key=lambda t: t[:2])]

    def above(self, lengths: Sequence[int]) -> list[RecomputeRung]:
        """The rungs that redo more work than the configured one at `lengths`, least first."""
        here = self.flops(self.configured.recompute, lengths)
        return [rung for flops, rung in self.ordered(lengths)
                if flops > here and rung is not self.configured]

    def below(self, lengths: Sequence[int]) -> list[RecomputeRung]:
        """The rungs that redo less work than the configured one at `lengths`, least first."""
        here = self.flops(self.configured.recompute, lengths)
        return [rung for flops, rung in self.ordered(lengths)
                if flops < here and rung is not self.configured]

    def by_key(self, key: str) -> RecomputeRung | None:
        return next((rung for rung in self.rungs if rung.recompute.key == key), None)
