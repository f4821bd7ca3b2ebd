"""Shared pieces for TrainerRank tests: a tiny fp32 model behind a real Provider, and an
unpacked one-sequence-at-a-time reference that uses GPTModel.forward (not the trainer's path)."""

from __future__ import annotations

import dataclasses

import torch

from art.megatron.implementation import Implementation
from art.megatron.provider import Provider
from art.megatron.settings import load_settings
from art.trainer_rank import ForwardInput

from _tiny import tiny_dense

VOCAB = 256


def provider(granularity: str = "selective", **env: str) -> Provider:
    settings = {"ART_MEGATRON_RECOMPUTE_GRANULARITY": granularity, **env}
    return Provider(
        tiny_dense(vocab=VOCAB),
        settings=load_settings(settings),
        dtype="float32",
        implementation=Implementation.cpu_local(),
    )


def make_inputs(lengths, *, seed: int = 0, top_k: int | None = 3, logits: bool = True,
                hidden_states: bool = True, no_grad: bool | None = None) -> list[ForwardInput]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        targets = torch.randint(0, VOCAB, (n,), generator=g)
        targets[0] = -100  # ignored positions give 0.0 and no gradient
        out.append(
            ForwardInput(
                input_tokens=torch.randint(0, VOCAB, (n,), generator=g), target_tokens=targets,
                top_k=top_k,
                logits=logits, hidden_states=hidden_states, no_grad=no_grad,
            )
        )
    return out


def reference(model, x: ForwardInput) -> dict[str, torch.Tensor]:
    """One sequence alone through GPTModel.forward; hidden states from the decoder's output."""
    captured = {}
    hook = model.decoder.register_forward_hook(lambda m, a, out: captured.setdefault("h", out))
    try:
        n = x.num_tokens
        logits = model(x.input_tokens.view(1, n), torch.arange(n).view(1, n),
                       attention_mask=None)[0].float()
    finally:
        hook.remove()
    logp = torch.log_softmax(logits, dim=-1)
    tgt = x.target_tokens
    picked = logp.gather(1, tgt.clamp(min=0).view(-1, 1)).squeeze(1)
    picked = torch.where(tgt == -100, torch.zeros_like(picked), picked)
    top = logp.topk(x.top_k, dim=-1) if x.top_k else None
    return {
        "target_logprobs": picked,
        "top_k_logprobs": None if top is None else top.values,
        "top_k_tokens": None if top is None else top.indices,
        "logits": logits,
        "hidden_states": captured["h"].reshape(n, -1),
    }


def loss_of(output, weight: float) -> torch.Tensor:
    return -(output.target_logprobs * weight).sum()


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def zero_grads(model) -> None:
    for p in model.parameters():
        p.grad = None


@dataclasses.dataclass
class StandInEstimate:
    """Used only where a test must force one decision (escalate, under-predict) regardless of
    the real memory model; each test says why."""

    dynamic_bytes: int
    resident_bytes: int = 0
    reserve_bytes: int = 0

    def table(self) -> str:
        return "stand-in estimate"


@dataclasses.dataclass
class StandInModel:
    bytes_per_token: dict[str, int]
    mode: str

    def estimate(self, shape):
        key = self.mode if shape.grad_enabled else "no-grad"
        return StandInEstimate(self.bytes_per_token[key] * shape.packed_tokens)

    def with_recompute(self, recompute):
        return StandInModel(self.bytes_per_token, recompute.mode)

    def max_tokens_that_fit(self, usable_bytes, *, outputs, grad_enabled, sequences=1):
        key = self.mode if grad_enabled else "no-grad"
        return usable_bytes // self.bytes_per_token[key]
