"""The records and shared terms of the per-layer formulas: what a block and a layer cost.

`PricedKind` is what a layer is priced (and probed) as, `Block` one step of a layer in execution
order, `LayerCost` what the layer composition (`layers.py`) makes of its blocks, `Dims` the
per-rank sizes every formula reads. The terms here
are the ones several layer kinds share: the norm block, and what a LoRA adapter on a linear
keeps and allocates.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from art.megatron.geometry import LayerKind, ModelGeometry
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout

FP32 = 4
INT64 = 8


class PricedKind(enum.StrEnum):
    """What a layer is priced and probed as: its mixer and whether its MLP is a mixture of
    experts. The value is the probe files' key."""

    ATTENTION = "attention"
    ATTENTION_MOE = "attention_moe"
    LINEAR_ATTENTION = "linear_attention"
    LINEAR_ATTENTION_MOE = "linear_attention_moe"

    @classmethod
    def of(cls, mixer: LayerKind, moe: bool) -> PricedKind:
        return cls(f"{LayerKind(mixer)}{'_moe' if moe else ''}")

    @property
    def mixer(self) -> LayerKind:
        return LayerKind.LINEAR_ATTENTION if self.linear else LayerKind.ATTENTION

    @property
    def linear(self) -> bool:
        """A Gated DeltaNet (linear attention) layer."""
        return self in (PricedKind.LINEAR_ATTENTION, PricedKind.LINEAR_ATTENTION_MOE)

    @property
    def moe(self) -> bool:
        return self in (PricedKind.ATTENTION_MOE, PricedKind.LINEAR_ATTENTION_MOE)


@dataclass(frozen=True)
class LayerCost:
    kept: int
    forward: int
    backward: int
    output: int
    saves_input: bool
    # The backward's peak when the incoming gradient stays referenced until the backward
    # returns, as a full-recompute checkpoint holds it (None: not measured).
    backward_held: int | None = None


class BlockRole(enum.Enum):
    """The blocks the layer composition looks up to price what lives across blocks (a
    block's name is for display only)."""

    RESIDUAL_ADD = "residual add"  # ends a norm's reach (`layers._norm_rebuilt_for`)
    # A norm whose output is its own tensor, the sub-layer's input (attention's or the
    # MLP's), which the transformer layer's frame holds until the sub-layer has returned.
    SUB_LAYER_INPUT = "sub-layer input"
    QKV = "qkv"  # the fused QKV buffer, which core attention keeps alive (V is a view)
    OUTPUT_GATE = "output gate"  # a gated attention's gate, a copy out of the QKV buffer
    ACTIVATION = "activation"  # an MLP's SwiGLU, which `moe_act` recomputes in experts
    # A MoE layer's router, whose routing state the token dispatcher keeps past the layer's
    # backward (`layers_mlp.moe_dispatcher_state`); its token dispatch and combine: the
    # dispatch's output is the experts' input, which the layer's frame (Megatron's
    # `routed_experts_compute`) holds through the combine.
    ROUTER = "router"
    DISPATCH = "dispatch"
    COMBINE = "combine"
    # What a Gated DeltaNet's rule runs on without grad: views of in_proj's and the conv's
    # outputs and the repeated q, k, gates and decay inputs, then the rule itself.
    RULE_INPUT = "rule input"
    RULE_INPUT_COPIES = "rule input copies"
    DELTA_RULE = "delta rule"


@dataclass(frozen=True)
class Block:
    name: str
    module: str | None  # selective recompute module that covers it
    internal: float
    output: float
    output_saved: bool
    temp: float = 0.0
    grad_temp: float = 0.0
    role: BlockRole | None = None
    # The residual-stream bytes live beside this block's forward (None: the layer's input
    # row); a Gated DeltaNet mixer under CP runs beside its whole-row gathered input too. Its
    # backward holds the layer's own rows' gradients only (`layers.price_layer`).
    stream: float | None = None
    # Without grad, what the block holds at its highest moment in place of `temp + internal`
    # (None: those two): a Gated DeltaNet rule over a row of prefix trees runs one call at a
    # time, and without grad nothing of a call outlives it but its output.
    no_grad_work: float | None = None
    # Without grad, everything the block's highest moment holds beside the residual stream,
    # in place of the previous block's output, its own and its work (None: those): a MoE
    # layer's routed experts, whose tensors outlive the blocks they are made in
    # (`layers_mlp.routed_no_grad_bytes`); 0 for the blocks whose moments that one covers.
    no_grad_held: float | None = None



@dataclass(frozen=True)
class Dims:
    """Per-rank sizes for one micro-batch; `s` tokens of the packed row on this CP rank."""

    geometry: ModelGeometry
    layout: ParallelLayout
    implementation: Implementation
    dtype_bytes: int
    lora_rank: int
    lora_targets: frozenset[str]

    @property
    def tp(self) -> int:
        return self.layout.tensor_parallel

    def hidden_tokens(self, s: int) -> float:
        """Tokens of the residual stream on this rank (sequence parallel splits it over TP)."""
        return s / self.tp if self.layout.sequence_parallel else float(s)


def norm_block(d: Dims, s: int, name: str, fused_into_next: bool, saves_out: bool) -> Block:
    g, b = d.geometry, d.dtype_bytes
    rows = d.hidden_tokens(s)
    if fused_into_next or d.implementation.norm == "fused":
        # Fused kernels keep the fp32 inverse rms per token; the input is kept by the caller.
        internal = rows * FP32
    else:
        # torch's composite rms_norm: fp32 upcast of the input (bf16/fp16 only), the squared
        # mean and rsqrt per row, and the normalised fp32 rows the weight multiply keeps when
        # the weight trains (with LoRA it is frozen and the multiply keeps nothing).
        upcast = rows * g.hidden_size * FP32 if b < FP32 else 0.0
        normalised = 0.0 if d.lora_rank else rows * g.hidden_size * FP32
        internal = upcast + rows * FP32 + normalised
    out = rows * g.hidden_size * b
    return Block(name, "layernorm", internal, out, saves_out, temp=rows * g.hidden_size * FP32,
                 role=None if fused_into_next else BlockRole.SUB_LAYER_INPUT)


# LoRA adapters per fused Megatron linear: one A/B pair per HF projection in it.
LORA_PROJECTIONS = {"linear_qkv": 3, "linear_fc1": 2}


def lora_saved(d: Dims, s: float, target: str, adapters: int = 1) -> float:
    """What a LoRA adapter on `target` keeps besides its input: the rank intermediate of
    every projection ([s, projections x r], one storage the B matmuls keep whole) and, when
    the linear fuses several projections, their A weights concatenated each forward (a new
    tensor the A matmul keeps), once per adapter (`adapters`: local experts)."""
    if not d.lora_rank or target not in d.lora_targets:
        return 0.0
    projections = LORA_PROJECTIONS.get(target, 1)
    saved = float(s) * projections * d.lora_rank * d.dtype_bytes
    if projections > 1:
        saved += (adapters * projections * d.lora_rank * d.geometry.hidden_size
                  * d.dtype_bytes)
    return saved


def lora_temp(d: Dims, target: str, output_bytes: float) -> float:
    """Transient bytes a LoRA adapter adds while its linear runs, each as big as the fused
    output: the per-projection deltas, their concatenation in the fused layout, the scaled
    copy (the sum with the base output is the output itself)."""
    if not d.lora_rank or target not in d.lora_targets:
        return 0.0
    return 3 * output_bytes


def linear_input_saved(d: Dims, s: int, target: str, column: bool) -> bool:
    """The frozen base linear keeps nothing (Megatron's frozen-weight path saves only the
    weight); a LoRA adapter on it keeps the input."""
    return bool(d.lora_rank) and target in d.lora_targets

