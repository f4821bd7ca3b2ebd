"""Predicted seconds of the GPU check's steps: FLOPs at an assumed effective rate plus fixed
per-step costs.

Every constant in `H200` is a stated assumption, set before any GPU run (an effective
bf16 rate well under the H200's measured ~790 TFLOP/s for one large product, since a
micro-batch also runs unfused RoPE, SwiGLU and fla's Triton kernels; start-up and kernel
compilation from what such stacks usually take). Each run writes every step's predicted and
taken seconds side by side (the CSV's `predicted_seconds` / `seconds`, the MD's time table;
bench/gpu holds the first run's, which reached few of the hybrid's steps),
so a later session can replace them with measured ones. `CPU` is sized from this repo's CPU
dry run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from art.megatron.geometry import LINEAR_ATTENTION, ModelGeometry
from art.megatron.recompute import EffectiveRecompute
from art.trainer_rank.pricing.chunked import (
    GDN_CHUNK_TOKENS,
    SPARSE_TOKENS_PER_CHUNK,
    chunk_tokens_of,
    sparse_row_lengths,
)
from art.trainer_rank.pricing.coefficients import LayerMode

# Backward over forward FLOPs with frozen base weights: linears and the head compute the
# input gradient only (LoRA's own products are negligible at rank 1); flash attention's
# backward recomputes its scores; the delta rule's backward runs about twice its forward.
LINEAR_BACKWARD = 1.0
ATTENTION_BACKWARD = 2.5
RECURRENT_BACKWARD = 2.0


@dataclass(frozen=True)
class Speeds:
    """How fast one machine runs the check's steps (see the module docstring)."""

    device: str
    flops_per_second: float  # effective bf16 rate over a whole micro-batch's products
    recurrent_derate: float  # fla's delta-rule kernels count this many times their FLOPs
    micro_batch_overhead_s: float  # tokens drawn, packing, pricing, syncs, cache emptied
    probe_run_overhead_s: float  # one probe run of a layer or the tail
    setup_s: float  # the parent's own: wheels installed, device checked, plan, reports
    process_start_s: float  # interpreter, torch (+ CUDA context), Megatron-Core, fla
    first_hybrid_warmup_s: float  # fla's Triton kernels compiled and autotuned, compiled norm
    later_hybrid_warmup_s: float  # the same from the disk caches an earlier process filled
    dense_warmup_s: float
    build_s: float  # one model built (random weights on the device), LoRA applied
    build_s_per_gparam: float


H200 = Speeds("cuda", flops_per_second=250e12, recurrent_derate=8.0,
              micro_batch_overhead_s=0.3, probe_run_overhead_s=0.05, setup_s=15.0,
              process_start_s=20.0,
              first_hybrid_warmup_s=90.0, later_hybrid_warmup_s=20.0, dense_warmup_s=5.0,
              build_s=4.0, build_s_per_gparam=0.5)
CPU = Speeds("cpu", flops_per_second=20e9, recurrent_derate=8.0, micro_batch_overhead_s=0.3,
             probe_run_overhead_s=0.1, setup_s=5.0, process_start_s=7.0, first_hybrid_warmup_s=0.0,
             later_hybrid_warmup_s=0.0, dense_warmup_s=0.0, build_s=1.0,
             build_s_per_gparam=1.0)


@dataclass(frozen=True)
class Row:
    """A packed row's token count and causal attention pairs (query, key) per head."""

    tokens: int
    pairs: int

    @classmethod
    def of(cls, lengths: Sequence[int], shared_prefix: int = 0) -> Row:
        """Sequences alone, or one group whose first `shared_prefix` tokens are laid out once
        (each sequence's own tokens attend to the prompt and to themselves)."""
        if not shared_prefix:
            return cls(sum(lengths), sum(n * (n + 1) // 2 for n in lengths))
        own = [n - shared_prefix for n in lengths]
        pairs = shared_prefix * (shared_prefix + 1) // 2 + sum(
            r * shared_prefix + r * (r + 1) // 2 for r in own)
        return cls(shared_prefix + sum(own), pairs)


def _mixer_linear_flops(g: ModelGeometry, kind: str) -> float:
    """Forward FLOPs per token of a layer's mixer projections."""
    h = g.hidden_size
    if kind == LINEAR_ATTENTION and g.linear_attention is not None:
        la = g.linear_attention
        key, value = la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim
        return 2.0 * h * (2 * key + 2 * value + 2 * la.num_value_heads) + 2.0 * value * h
    q = g.num_attention_heads * g.head_dim
    kv = g.num_query_groups * g.head_dim
    return 2.0 * h * (q * (2 if g.gated_attention_output else 1) + 2 * kv) + 2.0 * q * h


def _mlp_flops(g: ModelGeometry, moe: bool) -> float:
    """Forward FLOPs per token of a layer's MLP (MoE: the routed experts a token visits)."""
    width = (g.moe_router_topk * g.moe_ffn_hidden_size + g.shared_expert_ffn_hidden_size
             if moe else g.ffn_hidden_size)
    return 6.0 * g.hidden_size * width


def _core_flops(g: ModelGeometry, kind: str, row: Row, derate: float) -> float:
    """Forward FLOPs of a layer's core over the row: attention's QK^T and PV over the causal
    pairs, or the chunked delta rule per value head (derated, see `Speeds`)."""
    if kind == LINEAR_ATTENTION and g.linear_attention is not None:
        la = g.linear_attention
        per_head = (4 * la.key_head_dim * la.value_head_dim
                    + 2 * GDN_CHUNK_TOKENS * (la.key_head_dim + la.value_head_dim))
        return derate * row.tokens * la.num_value_heads * per_head
    return 4.0 * g.num_attention_heads * g.head_dim * row.pairs


def layer_flops(g: ModelGeometry, index: int, row: Row, *, grad: bool,
                recomputed: Iterable[str] = (), full: bool = False,
                derate: float = H200.recurrent_derate) -> float:
    """One layer's FLOPs over the row: forward, with grad its backward, and what its recompute
    runs again (a full checkpoint its whole forward; selective `core_attn` / `mlp`)."""
    kind = g.layer_types[index]
    linear = _mixer_linear_flops(g, kind) * row.tokens
    mlp = _mlp_flops(g, g.moe_layers[index]) * row.tokens
    core = _core_flops(g, kind, row, derate)
    if not grad:
        return linear + mlp + core
    core_backward = RECURRENT_BACKWARD if kind == LINEAR_ATTENTION else ATTENTION_BACKWARD
    total = (1 + LINEAR_BACKWARD) * (linear + mlp) + (1 + core_backward) * core
    if full:
        return total + linear + mlp + core
    modules = set(recomputed)
    if "core_attn" in modules and kind != LINEAR_ATTENTION:
        total += core
    if "mlp" in modules:
        total += mlp
    return total


def head_flops(g: ModelGeometry, tokens: int, *, grad: bool) -> float:
    """The output layer over `tokens` (the loss's softmax is memory-bound and small)."""
    return 2.0 * g.hidden_size * g.vocab_size * tokens * (1 + (LINEAR_BACKWARD if grad else 0))


def micro_batch_seconds(g: ModelGeometry, recompute: EffectiveRecompute, row: Row, *,
                        grad: bool, head: bool, speeds: Speeds) -> float:
    """One measured micro-batch: every layer under its recompute, the head when an output
    needs it, the caller's backward with grad."""
    flops = sum(layer_flops(g, i, row, grad=grad, recomputed=lr.selective_modules,
                            full=lr.full_checkpoint_unit is not None,
                            derate=speeds.recurrent_derate)
                for i, lr in enumerate(recompute.layers))
    if head:
        flops += head_flops(g, row.tokens, grad=grad)
    return speeds.micro_batch_overhead_s + flops / speeds.flops_per_second


def probe_seconds(g: ModelGeometry, modes: Iterable[LayerMode],
                  tails: Iterable[tuple[bool, bool]], points: Sequence[int], *,
                  speeds: Speeds) -> float:
    """The layer probe: each probed (layer kind, mode) at every point, a chunked layer also on
    its sparse rows (measuring/probe.py), and each (head needed, grad) tail at every point."""
    seconds = 0.0
    for mode in modes:
        index = g.layer_types.index(mode.kind.mixer)
        rows = [Row.of([t]) for t in points]
        chunk = chunk_tokens_of(mode.kind)
        rows += [Row.of(sparse_row_lengths(t, n, chunk)) for t in points
                 if chunk and t % chunk == 0 for n in SPARSE_TOKENS_PER_CHUNK]
        for row in rows:
            flops = layer_flops(g, index, row, grad=mode.mode.grad,
                                recomputed=mode.mode.modules,
                                full=mode.mode.full_layers > 0, derate=speeds.recurrent_derate)
            seconds += speeds.probe_run_overhead_s + flops / speeds.flops_per_second
    for head, grad in tails:
        for t in points:
            flops = head_flops(g, t, grad=grad) if head else 0.0
            seconds += speeds.probe_run_overhead_s + flops / speeds.flops_per_second
    return seconds


def build_seconds(parameters: float, speeds: Speeds) -> float:
    return speeds.build_s + speeds.build_s_per_gparam * parameters / 1e9
