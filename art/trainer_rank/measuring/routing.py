"""How a probe routes MoE layers under expert parallel, and how far the model's router strays.

Under expert parallel a MoE layer's experts on one rank take the token-expert pairs the
router sends them, and the memory model prices them at the even share (pricing/layers_mlp.py).
The probe measures a layer on random hidden states, whose routing by the model's router is one
draw: this rank's share at one point can sit several percent off the even share and off the
next point's, and its curves would carry that noise between their points. So a probe runs its
MoE layers under an even round-robin routing (`even_routing`: token t's top-k experts are
t * k, ..., t * k + k - 1 modulo the experts, chosen through Megatron's own routing code by its
router-replay hook, so the router keeps what it keeps when it chooses by its scores),
and measures the router's spread apart (`routing_shares`), per row length, on no-grad
forwards of the whole model over `ROUTING_DRAWS` random-token rows, as three shares of the even
share (`ExpertShare`):
- working: the largest any rank's experts took in any one MoE layer, what a layer's own
  moment (its experts' working set, its backward) holds at most;
- held: the largest any rank's experts took on average over the MoE layers, what a rank
  holds of every layer's saved pairs at once (a row's layers do not all favour one rank
  alike, so pricing every layer at the busiest one's share counts the spread once a layer);
- expert: the largest any one expert took in any MoE layer, over the even count per expert,
  what the expert that runs last holds at once without grad (Megatron's SequentialMLP runs
  a rank's experts one at a time).
Each is the largest over the rows: one row is one draw of a router's spread, which another row
of the same length can exceed by several percent (scripts/routing_spread.py). The spread
shrinks as rows grow (more pairs average out), down to what the router favours whatever the
tokens; the memory model prices a row's experts' pairs at the largest shares measured at its
length or longer (`row_changes.share_at`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from art.trainer_rank.pricing.row_changes import ExpertShare

# Random-token rows per length the router's spread is read from (see the module docstring).
ROUTING_DRAWS = 4


class RoundRobinReplay:
    """Megatron's router-replay hook (the `get_replay_topk` that
    `topk_routing_with_score_function` calls in place of its top-k) choosing experts
    round-robin: token t to experts t*k .. t*k+k-1 modulo the experts, their scores gathered
    as a replay gathers them. The router runs its own code around it, so what it keeps for
    backward is what it keeps when it chooses by its scores."""

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None, default_compute_topk: Any = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        index = round_robin_experts(scores.shape[0], topk, scores.shape[1], scores.device)
        return _PickAsTopK.apply(scores, index), index


class _PickAsTopK(torch.autograd.Function):
    """scores.gather(1, index), keeping for backward what torch.topk keeps: the indices and
    the scores' shape (a gather would keep the scores themselves, [tokens, experts])."""

    @staticmethod
    def forward(ctx: Any, scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.scores_shape = scores.shape
        return scores.gather(1, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.scores_shape).scatter(1, index, grad), None


def round_robin_experts(tokens: int, topk: int, experts: int,
                        device: torch.device | str = "cpu") -> torch.Tensor:
    """[tokens, topk] expert indices of the even routing: token t to t*k .. t*k+k-1 mod E."""
    return ((torch.arange(tokens, device=device).unsqueeze(1) * topk
             + torch.arange(topk, device=device)) % experts)


def moe_routers(module: Any) -> list[Any]:
    """Megatron's top-k routers inside `module`, in module order (one per MoE layer)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in module.modules() if isinstance(m, TopKRouter)]


@contextlib.contextmanager
def even_routing(module: Any) -> Iterator[None]:
    """Every router inside `module` routes evenly until the block ends: its own routing, its
    replay hook set to `RoundRobinReplay`. The fused top-k kernel (Transformer Engine's,
    `moe_router_fusion`) takes no replay, so the routers run unfused inside the block."""
    routers = moe_routers(module)
    missing = [r for r in routers if not hasattr(r, "router_replay")]
    if missing:
        raise RuntimeError(
            "this Megatron-Core's TopKRouter has no router_replay hook, which even routing "
            "sets; use megatron-core 0.16.1 or newer")
    saved = [(r, r.router_replay, r.config.moe_router_fusion) for r in routers]
    replay = RoundRobinReplay()
    for router in routers:
        router.router_replay = replay
        router.config.moe_router_fusion = False
    try:
        yield
    finally:
        for router, hook, fusion in reversed(saved):
            router.router_replay = hook
            router.config.moe_router_fusion = fusion


@contextlib.contextmanager
def router_counts(module: Any) -> Iterator[list[torch.Tensor]]:
    """The pairs each router call inside `module` sends to each expert (float64, one tensor
    of [experts] per call, in call order), recorded until the block ends."""
    counts: list[torch.Tensor] = []

    def count(router: Any, inputs: Any, output: Any) -> None:
        counts.append(output[1].sum(dim=0).to(torch.float64))

    hooks = [router.register_forward_hook(count) for router in moe_routers(module)]
    try:
        yield counts
    finally:
        for hook in hooks:
            hook.remove()


def spread(per_expert: torch.Tensor, expert_parallel: int) -> torch.Tensor:
    """[3, rows]: working, held and expert shares (`ExpertShare`) of each row from its pairs
    per expert, [draws, rows, MoE layers, experts] summed over the EP group: the largest over
    the ranks and the draws, at least the even share."""
    per_rank = per_expert.view(*per_expert.shape[:3], expert_parallel, -1).sum(dim=-1)
    share = _over_even(per_rank)
    working = share.amax(dim=(2, 3)).amax(dim=0)
    held = share.mean(dim=2).amax(dim=2).amax(dim=0)
    busiest = _over_even(per_expert).amax(dim=(2, 3)).amax(dim=0)
    return torch.stack([working, held, busiest]).clamp_min(1.0)


def _over_even(counts: torch.Tensor) -> torch.Tensor:
    """Each count over the mean along the last dimension (1 where nothing was routed)."""
    even = counts.sum(dim=-1, keepdim=True) / counts.shape[-1]
    return torch.where(even > 0, counts / even.clamp_min(1e-30), torch.ones_like(counts))


def _expert_shares(rows: Sequence[int], per_expert: torch.Tensor, layout: Any
                   ) -> tuple[ExpertShare, ...]:
    """`spread` of [draws, rows, layers, experts] counts of this rank's router calls, summed
    over the EP group and the largest over the job (every rank calls this)."""
    from megatron.core import parallel_state

    dist.all_reduce(per_expert, group=parallel_state.get_expert_model_parallel_group())
    shares = spread(per_expert, layout.expert_parallel)
    dist.all_reduce(shares, op=dist.ReduceOp.MAX)
    return tuple(ExpertShare(int(n), round(float(w), 6), round(float(h), 6), round(float(e), 6))
                 for n, w, h, e in zip(rows, *shares.tolist()))


def row_routing(counts: Sequence[torch.Tensor], moe_layers: int, tokens: int, layout: Any
                ) -> ExpertShare:
    """The shares (`ExpertShare`) a row's own forward routed its `moe_layers` MoE layers at,
    from `router_counts` over its micro-batch (a recomputed layer routes again: the forward's
    calls come first and only those count; every rank calls this)."""
    if len(counts) < moe_layers:
        raise ValueError(f"{len(counts)} router calls recorded, fewer than the {moe_layers} MoE "
                         "layers: record the whole forward of the row")
    forward = torch.stack(list(counts[:moe_layers]))
    return _expert_shares([tokens], forward.view(1, 1, *forward.shape), layout)[0]


def routing_shares(model: Any, rows: Sequence[int], layout: Any, implementation: Any,
                   device: torch.device, seed: int = 0, draws: int = ROUTING_DRAWS
                   ) -> tuple[ExpertShare, ...]:
    """The router's spread (`ExpertShare`) for each length in `rows` (this rank's tokens):
    the largest over `draws` no-grad forwards of `model`, each over a random-token row drawn
    from `seed` onwards (every rank calls this: the layers' all-to-alls and the maximum span
    the job)."""
    from art.trainer_rank.compute.forward import decoder_hidden_states, unwrap_model
    from art.trainer_rank.compute.packing import pack_sequences

    inner = unwrap_model(model)
    routers = moe_routers(inner)
    if not routers or layout.expert_parallel == 1 or not rows:
        return ()
    with router_counts(inner) as counts, torch.no_grad():
        for draw in range(draws):
            generator = torch.Generator().manual_seed(seed + draw)
            for n in rows:
                tokens = torch.randint(0, inner.vocab_size, (n * layout.context_parallel,),
                                       generator=generator).to(device)
                batch = pack_sequences([tokens], implementation=implementation,
                                       layout=layout, device=device)
                decoder_hidden_states(model, batch)
    per_expert = torch.stack(counts).to(device).view(draws, len(rows), len(routers), -1)
    return _expert_shares(rows, per_expert, layout)
