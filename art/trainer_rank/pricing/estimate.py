"""The estimate: a peak that is a sum of terms in bytes, each of a kind and a lifetime, printable
as a table by their display names."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from art.trainer_rank._request import MicroBatchShape

GIB = 1024**3


class Lifetime(enum.StrEnum):
    """Which part of the peak a term is live in: the whole job (resident), the forward's peak,
    the backward's, or the allocator's reserve above them. The value is the table's and the
    JSON's word."""

    RESIDENT = "resident"
    FORWARD = "forward"
    BACKWARD = "backward"
    RESERVE = "reserve"


class TermKind(enum.StrEnum):
    """What a term is. The composition finds terms by kind (which it drops, halves or sums);
    a term's name is for display only."""

    # resident
    WEIGHTS = "weights"
    LORA_PARAMS = "lora params"  # the runtime adapter's factors and their gradients
    OPTIMIZER_STATE = "optimizer state"
    RESIDENT_ADAPTERS = "resident adapters"  # trainable checkpoint slots
    RESIDENT_SNAPSHOTS = "resident snapshots"  # forward-only checkpoint slots
    # before the decoder, live through forward and backward
    PACKED_INPUTS = "packed inputs"
    ATTENTION_MASK = "attention mask"
    SCORE_BUFFER = "score buffer"  # Megatron's unfused-attention global buffer
    ROTARY_TABLE_AND_INDEX = "rotary table and index"  # the cached table + per-token index
    ROTARY_TABLE = "rotary table"  # the cached table alone (CP: the whole row's)
    ROTARY_INDEX = "rotary index"  # the per-token index alone (CP: this rank's)
    MASK_TYPE_TENSORS = "mask-type tensors"  # checkpointed core attention's, one per layer
    EMBEDDING_OUTPUT = "embedding output"
    PREFIX_TREE_STATES = "prefix-tree states"  # Gated DeltaNet states handed on
    # the forward peak
    LAYERS_KEPT = "layers kept"  # every layer's kept activations
    DECODER_OUTPUT = "decoder output"
    HEAD_FORWARD = "head forward"  # the head and outputs' forward working set
    GATHERED_LOGITS = "gathered logits"
    LAYER_FORWARD_EXCESS = "layer forward excess"
    LAYER_STATE_KEPT = "layer state kept"  # without grad: MoE dispatchers' routing state
    LAYER_WORKING_SET = "layer working set"  # without grad: the largest layer's
    # the backward peak
    HEAD_BACKWARD = "head backward"
    KEPT_BELOW = "kept below"  # what the layers below the peak's keep
    HELD_ABOVE = "held above"  # what MoE layers above it left referenced
    LAYER_KEPT = "layer kept"  # the peak layer's own kept activations
    LAYER_BACKWARD = "layer backward"
    UNIT_INPUT = "unit input"  # a full-recompute unit's checkpointed input
    UNIT_BACKWARD = "unit backward"  # a full-recompute unit's rebuild and backward
    OUTPUTS_HELD = "outputs held"  # the requested outputs the caller still holds
    # the reserve
    ALLOCATOR_RESERVE = "allocator reserve"


_LIFETIMES = tuple(Lifetime)


@dataclass(frozen=True)
class Term:
    kind: TermKind
    name: str  # for display only
    bytes: int
    lifetime: Lifetime
    note: str = ""  # how it was computed

    def __post_init__(self) -> None:
        if self.lifetime not in _LIFETIMES:
            raise ValueError(f"term {self.name!r}: lifetime {self.lifetime!r} is not one of "
                             f"{', '.join(Lifetime)}")


@dataclass(frozen=True)
class Estimate:
    terms: tuple[Term, ...]
    resident_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    reserve_bytes: int
    largest_allocation_bytes: int
    recompute_summary: str
    coefficients_source: str  # "defaults" or "probe:<cache key>"
    batch: MicroBatchShape
    # Which phase sets the dynamic peak, and where in it (e.g. "backward: head").
    peak_at: str = ""
    # The first layer (index) of the layer or full-recompute unit whose backward sets the
    # backward peak; None: the head's backward (or no grad).
    backward_peak_layer: int | None = None
    # With grad: what the forward leaves live when it returns, until its backward (the inputs
    # and buffers before the decoder, every layer's kept activations, the decoder output and
    # the requested outputs); of it, the requested outputs, which the caller still holds after
    # the backward. Several sub-forwards of one call hold these for each other.
    retained_after_forward_bytes: int = 0
    outputs_bytes: int = 0
    # Megatron's unfused-attention score buffer: one per process, kept at the largest size
    # any forward asked for, so sub-forwards share it (not part of what each one retains).
    score_buffer_bytes: int = 0

    @property
    def dynamic_bytes(self) -> int:
        """What admission compares with the usable limit (limit minus what is live before)."""
        return max(self.forward_peak_bytes, self.backward_peak_bytes) + self.reserve_bytes

    @property
    def peak_bytes(self) -> int:
        return self.resident_bytes + self.dynamic_bytes

    def phase_terms(self, lifetime: Lifetime) -> tuple[Term, ...]:
        return tuple(t for t in self.terms if t.lifetime == lifetime)

    def table(self) -> str:
        """Plain-text term table, one line per term, phase sums and the peak at the end."""
        unit, scale = ("GiB", GIB) if self.peak_bytes >= GIB else ("MiB", 2**20)
        lines = [
            f"{self.recompute_summary}; {len(self.batch.sequence_lengths_tokens)} sequence(s), "
            f"{self.batch.packed_tokens} packed tokens, outputs {self.batch.outputs.key}, "
            f"{'grad' if self.batch.grad_enabled else 'no grad'}"
            + (f", beside EP partners' rows of {self.batch.expert_partner_tokens} packed tokens"
               if self.batch.expert_partner_tokens else "")
            + f"; coefficients: {self.coefficients_source}",
            f"{'phase':<9} {'term':<44} {unit:>10}  note",
        ]
        for term in self.terms:
            lines.append(
                f"{term.lifetime:<9} {term.name[:44]:<44} {term.bytes / scale:>10.3f}  {term.note}"
            )
        lines += [
            f"{'':<9} {'resident':<44} {self.resident_bytes / scale:>10.3f}",
            f"{'':<9} {'forward peak (dynamic)':<44} {self.forward_peak_bytes / scale:>10.3f}",
            f"{'':<9} {'backward peak (dynamic)':<44} {self.backward_peak_bytes / scale:>10.3f}",
            f"{'':<9} {'allocator reserve':<44} {self.reserve_bytes / scale:>10.3f}",
            f"{'':<9} {'dynamic = max(fwd, bwd) + reserve':<44} {self.dynamic_bytes / scale:>10.3f}"
            f"  peak at {self.peak_at or '-'}",
            f"{'':<9} {'peak = resident + dynamic':<44} {self.peak_bytes / scale:>10.3f}",
        ]
        return "\n".join(lines)

    def named_terms(self) -> dict[str, int]:
        """name -> bytes; a name that appears in two phases (the inputs live through forward
        and backward) is suffixed with its phase the second time."""
        named: dict[str, int] = {}
        for t in self.terms:
            key = t.name if t.name not in named else f"{t.name} ({t.lifetime})"
            named[key] = t.bytes
        return named

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "dynamic_bytes": self.dynamic_bytes,
            "resident_bytes": self.resident_bytes,
            "forward_peak_bytes": self.forward_peak_bytes,
            "backward_peak_bytes": self.backward_peak_bytes,
            "reserve_bytes": self.reserve_bytes,
            "largest_allocation_bytes": self.largest_allocation_bytes,
            "recompute": self.recompute_summary,
            "coefficients": self.coefficients_source,
            "peak_at": self.peak_at,
            "packed_tokens": self.batch.packed_tokens,
            "logical_tokens": self.batch.logical_tokens,
            "sequences": len(self.batch.sequence_lengths_tokens),
            "outputs": self.batch.outputs.key,
            "grad_enabled": self.batch.grad_enabled,
            "terms": self.named_terms(),
            "term_details": [
                {"name": t.name, "bytes": t.bytes, "phase": str(t.lifetime), "note": t.note}
                for t in self.terms
            ],
        }
