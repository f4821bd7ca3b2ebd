"""What the memory model is asked to price: layout, implementation, outputs, one micro-batch.

These plain frozen objects are the contract between the admission code (which builds them
from a live model and a candidate micro-batch) and the estimator (which prices them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout

__all__ = [
    "FieldError",
    "Implementation",
    "LoraShape",
    "MicroBatchShape",
    "OutputRequest",
    "RecurrentRow",
    "ParallelLayout",
]


class FieldError(ValueError):
    """A value its field's rule refuses. `field`, `value` and `rule` let a caller name the
    input the way its user gave it (`named`: a command-line flag instead of the field)."""

    def __init__(self, owner: str, field: str, value: object, rule: str) -> None:
        super().__init__(f"{owner}.{field}={value!r}: {rule}")
        self.field, self.value, self.rule = field, value, rule

    def named(self, name: str, value: object | None = None) -> ValueError:
        shown = self.value if value is None else value
        return ValueError(f"{name} {shown}: {self.rule}")


@dataclass(frozen=True)
class OutputRequest:
    """Outputs requested for one micro-batch (the union over its sequences)."""

    target_logprobs: bool = False
    top_k: int = 0
    logits: bool = False
    hidden_states: bool = False

    def __post_init__(self) -> None:
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def uses_head(self) -> bool:
        """Whether the output layer runs (every output but the hidden states needs it)."""
        return bool(self.target_logprobs or self.top_k or self.logits)

    @property
    def key(self) -> str:
        parts = []
        if self.target_logprobs:
            parts.append("logprobs")
        if self.top_k:
            parts.append(f"top_k={self.top_k}")
        if self.logits:
            parts.append("logits")
        if self.hidden_states:
            parts.append("hidden_states")
        return ",".join(parts) or "none"

    @classmethod
    def union(cls, requests: Iterable[OutputRequest]) -> OutputRequest:
        """What a packed micro-batch computes: every output any of `requests` asks for."""
        target = logits = hidden = False
        top_k = 0
        for r in requests:
            target |= r.target_logprobs
            top_k = max(top_k, r.top_k)
            logits |= r.logits
            hidden |= r.hidden_states
        return cls(target_logprobs=target, top_k=top_k, logits=logits, hidden_states=hidden)

    @classmethod
    def parse(cls, text: str) -> OutputRequest:
        """Parse 'logprobs,top_k=20,hidden_states' (the CLI form)."""
        kwargs: dict[str, object] = {}
        for raw in filter(None, (p.strip() for p in text.split(","))):
            name, _, value = raw.partition("=")
            if name in ("logprobs", "target_logprobs"):
                kwargs["target_logprobs"] = True
            elif name == "top_k":
                if not value.isdigit() or int(value) < 1:
                    raise ValueError(f"outputs: top_k needs an integer >= 1, got {raw!r}")
                kwargs["top_k"] = int(value)
            elif name in ("logits", "hidden_states"):
                kwargs[name] = True
            elif name != "none":
                raise ValueError(
                    f"outputs: unknown output {name!r}; allowed: logprobs, top_k=K, logits, "
                    "hidden_states, none"
                )
        return cls(**kwargs)  # type: ignore[arg-type]


def output_request_problem(outputs: OutputRequest, *, grad: bool,
                           vocab_size: int) -> str | None:
    """What is wrong with asking a model of `vocab_size` ids for `outputs` (with or without
    grad), or None: the one rule TrainerRank applies to every item and the command line to
    its --outputs."""
    if outputs.top_k > vocab_size:
        return (f"asks for top_k={outputs.top_k}, more than the model's vocabulary of "
                f"{vocab_size} ids; request at most top_k={vocab_size}")
    if grad and outputs.key == "none":
        return ("requests no output (no target_tokens, top_k, logits or hidden_states) and "
                "runs with grad, so there is nothing to differentiate; request an output, or "
                "run it without grad (no_grad=True, or --no-grad on the command line)")
    return None


@dataclass(frozen=True)
class LoraShape:
    rank: int = 0  # 0 = no adapter
    target_modules: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    # Checkpoint slots resident beside the runtime's adapter (each with its own gradients and
    # fp32 Adam state), and forward-only snapshots; their rank (0: `rank`).
    resident_adapters: int = 0
    resident_snapshots: int = 0
    resident_adapter_rank: int = 0

    def __post_init__(self) -> None:
        for name, rule in (("rank", "a LoRA rank is an integer >= 0 (0: no adapter)"),
                           ("resident_adapters", "a count of slots is an integer >= 0"),
                           ("resident_snapshots", "a count of snapshots is an integer >= 0"),
                           ("resident_adapter_rank",
                            "a LoRA rank is an integer >= 0 (0: the adapter's own rank)")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise FieldError("LoraShape", name, value, rule)


@dataclass(frozen=True)
class RecurrentRow:
    """How a row with shared prefixes runs through recurrent (Gated DeltaNet) layers: the
    segment lengths of each varlen call (one per depth of the row's prefix trees; every
    sequence alone is a root), the first call's segments starting from zero states and every
    later one's from its parent's final state."""

    calls: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.calls or any(not call or min(call) < 1 for call in self.calls):
            raise ValueError(f"a recurrent row needs calls of segments >= 1 token, got "
                             f"{self.calls}")

    @property
    def segment_lengths_tokens(self) -> tuple[int, ...]:
        return tuple(n for call in self.calls for n in call)

    @property
    def continued_segments(self) -> int:
        return sum(len(call) for call in self.calls[1:])


@dataclass(frozen=True)
class MicroBatchShape:
    """One candidate micro-batch: the sequences packed into one row."""

    sequence_lengths_tokens: tuple[int, ...]
    outputs: OutputRequest = field(default_factory=OutputRequest)
    grad_enabled: bool = True
    # Tokens in the packed row (after TP/SP/CP padding, or after prefix sharing); 0 = the sum.
    padded_tokens: int = 0
    # With shared prefixes: the row's segments as a recurrent layer runs them; None: one
    # segment per sequence.
    recurrent: RecurrentRow | None = None
    # With expert parallel across model replicas: the most packed tokens the row of another
    # rank of this rank's expert-parallel group holds beside this micro-batch (its experts
    # take their routed tokens too); 0: every rank of the group runs this row's size.
    expert_partner_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.sequence_lengths_tokens or min(self.sequence_lengths_tokens) < 1:
            raise FieldError(
                "MicroBatchShape", "sequence_lengths_tokens", self.sequence_lengths_tokens,
                "a micro-batch needs one or more sequences of >= 1 token each")
        if self.padded_tokens < 0:
            raise FieldError("MicroBatchShape", "padded_tokens", self.padded_tokens,
                             "a packed row holds >= 0 tokens (0: the sum of the sequences)")
        if self.expert_partner_tokens < 0:
            raise FieldError("MicroBatchShape", "expert_partner_tokens",
                             self.expert_partner_tokens,
                             "a partner's row holds >= 0 tokens (0: as many as this one)")

    @property
    def logical_tokens(self) -> int:
        return sum(self.sequence_lengths_tokens)

    @property
    def packed_tokens(self) -> int:
        return self.padded_tokens or self.logical_tokens
