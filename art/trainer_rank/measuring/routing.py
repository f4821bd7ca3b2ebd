"""How a probe routes MoE layers under expert parallel, and how far the model's router strays.

Under expert parallel a MoE layer's experts on one rank take the token-expert pairs the
router sends them, and the memory model prices them at the even share (pricing/layers_mlp.py).
The probe measures a layer on random hidden states, whose routing by the model's router is one
draw: this rank's share at one point can sit several percent off the even share and off the
next point's, and its curves would carry that noise between their points. So a probe runs its
MoE layers under an even round-robin routing (`even_routing`: token t's top-k experts are
t * k, ..., t * k + k - 1 modulo the experts, the router's scores kept as its probabilities),
and measures the router's spread apart (`routing_shares`): per row length, the largest share
of the even share any rank's experts took in any MoE layer, on a no-grad forward of the whole
model over a random-token row. The spread shrinks as rows grow (more pairs average out), down
to what the router favours whatever the tokens; the memory model prices a row's experts' pairs
at the largest share measured at its length or longer (`row_changes.share_at`).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist


def even_routing_map(self: Any, logits: torch.Tensor, padding_mask: Any = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`TopKRouter.routing` under even routing: each token to `topk` consecutive experts,
    round-robin, its scores (softmax) kept on them as the probabilities."""
    logits = logits.view(-1, self.config.num_moe_experts)
    tokens, experts = logits.shape
    index = (torch.arange(tokens, device=logits.device).unsqueeze(1) * self.topk
             + torch.arange(self.topk, device=logits.device)) % experts
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, index, True)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32) * routing_map
    return probs.type_as(logits), routing_map


def _routers(module: Any) -> list[Any]:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in module.modules() if isinstance(m, TopKRouter)]


@contextlib.contextmanager
def even_routing(module: Any) -> Iterator[None]:
    """Every router inside `module` routes evenly (`even_routing_map`) until the block ends."""
    routers = _routers(module)
    for router in routers:
        router.routing = types.MethodType(even_routing_map, router)
    try:
        yield
    finally:
        for router in routers:
            del router.routing


def routing_shares(model: Any, rows: Sequence[int], layout: Any, implementation: Any,
                   device: torch.device, seed: int = 0) -> tuple[tuple[int, float], ...]:
    """(row length, share) for each length in `rows` (this rank's tokens): the largest share
    of the even share any EP rank's experts took in any MoE layer on a no-grad forward of
    `model` over one random-token row drawn from `seed` (every rank calls this: the layers'
    all-to-alls and the maximum span the job)."""
    from megatron.core import parallel_state

    from art.trainer_rank.compute.forward import decoder_hidden_states, unwrap_model
    from art.trainer_rank.compute.packing import pack_sequences

    inner = unwrap_model(model)
    routers = _routers(inner)
    if not routers or layout.expert_parallel == 1:
        return ()
    counts: list[torch.Tensor] = []

    def count(router: Any, inputs: Any, output: Any) -> None:
        counts.append(output[1].sum(dim=0).to(torch.float64))

    hooks = [router.register_forward_hook(count) for router in routers]
    generator = torch.Generator().manual_seed(seed)
    try:
        with torch.no_grad():
            for n in rows:
                tokens = torch.randint(0, inner.vocab_size, (n * layout.context_parallel,),
                                       generator=generator).to(device)
                batch = pack_sequences([tokens], implementation=implementation,
                                       layout=layout, device=device)
                decoder_hidden_states(model, batch)
    finally:
        for hook in hooks:
            hook.remove()
    # [router calls, experts]: every EP rank's pairs per expert, in one collective.
    per_expert = torch.stack(counts).to(device)
    dist.all_reduce(per_expert, group=parallel_state.get_expert_model_parallel_group())
    ep, rank = layout.expert_parallel, parallel_state.get_expert_model_parallel_rank()
    local = per_expert.shape[1] // ep
    even = per_expert.sum(dim=1) / ep
    mine = per_expert[:, rank * local:(rank + 1) * local].sum(dim=1)
    share = torch.where(even > 0, mine / even.clamp_min(1e-30), torch.ones_like(even))
    # Each row's calls, one per router: its largest share, at least the even share.
    shares = share.view(len(rows), -1).amax(dim=1).clamp_min(1.0)
    dist.all_reduce(shares, op=dist.ReduceOp.MAX)
    return tuple((int(n), round(float(share), 6)) for n, share in zip(rows, shares.tolist()))
