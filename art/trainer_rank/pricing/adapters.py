"""LoRA parameters per rank, and the resident terms of checkpoint slots: adapters loaded beside
the runtime's own (trainable: factors, gradients, fp32 Adam state) and forward-only snapshots
(factors only)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from art.megatron.geometry import LayerKind
from art.trainer_rank.pricing.estimate import Lifetime, Term, TermKind

if TYPE_CHECKING:
    from art.megatron.geometry import ModelGeometry
    from art.megatron.layout import ParallelLayout
    from art.trainer_rank._request import LoraShape


def resident_adapter_terms(g: ModelGeometry, lora: LoraShape, layout: ParallelLayout,
                            b: int) -> list[Term]:
    """Checkpoint slots beside the runtime's adapter: a trainable one holds its factors,
    their gradients and fp32 master + 2 moments; a snapshot only its factors."""
    rank = lora.resident_adapter_rank or lora.rank
    if not rank or not (lora.resident_adapters or lora.resident_snapshots):
        return []
    per = lora_params_per_rank(g, replace(lora, rank=rank), layout)
    terms = []
    if lora.resident_adapters:
        n = lora.resident_adapters
        terms.append(Term(TermKind.RESIDENT_ADAPTERS, "resident adapters (slots)",
                          int(n * per * (2 * b + 12)), Lifetime.RESIDENT,
                          f"{n} x {per:,} params (r={rank}) x (param + grad {2 * b} B + fp32 "
                          "master + 2 moments 12 B)"))
    if lora.resident_snapshots:
        n = lora.resident_snapshots
        terms.append(Term(TermKind.RESIDENT_SNAPSHOTS, "resident snapshots (forward-only)",
                          int(n * per * b), Lifetime.RESIDENT,
                          f"{n} x {per:,} params (r={rank}) x {b} B"))
    return terms


def lora_params_per_rank(g: ModelGeometry, lora: LoraShape, layout: ParallelLayout) -> int:
    """LoRA parameters one rank holds for one adapter: A and B of every targeted linear, the
    TP-split factor sliced, the other replicated."""
    r, h, tp = lora.rank, g.hidden_size, layout.tensor_parallel
    q = g.num_attention_heads * g.head_dim
    kv = g.num_query_groups * g.head_dim
    gate = q if g.gated_attention_output else 0  # q_proj's B also covers the gate heads
    per_target = {
        "linear_qkv": 3 * r * h + r * (q + gate + 2 * kv) / tp,  # A replicated per projection
        "linear_proj": r * q / tp + h * r,
        "linear_fc1": 2 * r * h + r * 2 * g.ffn_hidden_size / tp,
        "linear_fc2": r * g.ffn_hidden_size / tp + h * r,
    }
    total = 0.0
    for i in range(g.num_layers):
        for t in lora.target_modules:
            if t in ("linear_qkv", "linear_proj") and g.layer_types[i] != LayerKind.ATTENTION:
                continue
            total += per_target.get(t, 0.0)
    return int(total)
