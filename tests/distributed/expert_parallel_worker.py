"""torchrun worker (gloo): a MoE model at EP=2 against EP=1 on the same weights, at TP=1 (2
ranks) or TP=2 with sequence parallel (4 ranks: TP=2 x EP=2, experts TP-sharded as Megatron's
expert TP defaults to TP).

argv: out_dir, then TP:ETP layouts (default 1:1), compared one after the other in this
launch (Megatron's parallel state is rebuilt for each). With etp 1 at TP=2 (2 ranks:
upstream's default for a MoE family without CP, EP = TP = the GPUs, expert TP 1) the EP
group is the TP group: the ranks hold
different halves of the sequence (sequence parallel), so an expert's gradient at EP=2 is the
sum of its two TP ranks' parts at EP=1 (expert TP 1, every expert whole on both).

Phase 1 builds the model at EP=1 on every rank (every expert local) and keeps
its weights; phase 2 rebuilds Megatron's parallel state at EP=2 and loads them, each rank
taking its own experts (`local_experts.i` on EP rank r is global expert r x E/EP + i). Both
ranks feed the same tokens, so at EP=2 every expert receives the tokens of both ranks: its
gradient is the sum of the two ranks' parts, twice EP=1's; the other parameters' gradients
and the logits are EP=1's. Writes out_dir/rank<R>-tp<TP>-etp<ETP>.json with the largest
differences.
"""

from __future__ import annotations

import json
import os
import re
import sys

import torch
import torch.distributed as dist

from art.megatron.distributed import initialize_distributed, shutdown_distributed
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.megatron.model_builder import RecomputeConfig, build_gpt_model, build_transformer_config

from _tiny import tiny_moe

IMPLEMENTATION = Implementation.cpu_local()
EXPERT = re.compile(r"^(?P<head>.*local_experts\.)(?P<index>\d+)(?P<tail>\..*)$")


def _run(ep: int, state: dict | None, tp: int, etp: int) -> tuple[dict, torch.Tensor, dict]:
    from megatron.core import parallel_state

    geometry = tiny_moe(num_layers=2)
    layout = ParallelLayout(tensor_parallel=tp, expert_parallel=ep, sequence_parallel=tp > 1,
                            expert_tensor_parallel=etp,
                            data_parallel=dist.get_world_size() // tp)
    config = build_transformer_config(geometry, layout=layout,
                                      recompute=RecomputeConfig("selective"),
                                      dtype="float32", implementation=IMPLEMENTATION)
    model = build_gpt_model(geometry, config, implementation=IMPLEMENTATION, seed=0)
    local = geometry.num_experts // ep
    rank = parallel_state.get_expert_model_parallel_rank()
    if state is not None:
        mine = {}
        for name, value in model.state_dict().items():
            if not isinstance(value, torch.Tensor):
                continue  # TE-style extra state: nothing to carry
            match = EXPERT.match(name)
            source = name if match is None else (
                f"{match['head']}{rank * local + int(match['index'])}{match['tail']}")
            mine[name] = state[source]
        missing, unexpected = model.load_state_dict(mine, strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
    full = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    tokens = torch.randint(0, geometry.vocab_size, (1, 48),
                           generator=torch.Generator().manual_seed(3))
    logits = model(tokens, torch.arange(48)[None], attention_mask=None)
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(4))
    (logits * weights).sum().backward()
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        match = EXPERT.match(name)
        key = name if match is None else (
            f"{match['head']}{rank * local + int(match['index'])}{match['tail']}")
        grads[key] = param.grad.clone()
    return full, logits.detach(), grads


def _compare(out_dir: str, tp: int, etp: int) -> None:
    """EP=1 then EP=2 at (TP, expert TP); writes out_dir/rank<R>-tp<TP>-etp<ETP>.json."""
    from megatron.core import parallel_state

    initialize_distributed(tensor_parallel=tp, expert_parallel=1, expert_tensor_parallel=etp)
    state, whole_logits, whole_grads = _run(1, None, tp, etp)
    parallel_state.destroy_model_parallel()
    initialize_distributed(tensor_parallel=tp, expert_parallel=2, expert_tensor_parallel=etp)
    _, split_logits, split_grads = _run(2, state, tp, etp)
    # Who feeds an expert at EP=2: both data-parallel ranks the same tokens (twice EP=1's
    # gradient), or, with the EP group inside the TP group, the TP ranks their own halves.
    over_tp = etp == 1 and tp > 1
    if over_tp:
        for name, grad in whole_grads.items():
            if EXPERT.match(name):
                dist.all_reduce(grad)
    factor = 1 if over_tp else 2
    scale = max(g.abs().max().item() for g in whole_grads.values())
    expert_diff = other_diff = 0.0
    experts = others = 0
    for name, grad in split_grads.items():
        if EXPERT.match(name):
            experts += 1
            expert_diff = max(expert_diff, (grad - factor * whole_grads[name]).abs().max().item())
        else:
            others += 1
            other_diff = max(other_diff, (grad - whole_grads[name]).abs().max().item())
    rank = int(os.environ["RANK"])
    with open(os.path.join(out_dir, f"rank{rank}-tp{tp}-etp{etp}.json"), "w") as f:
        json.dump({"logits": (split_logits - whole_logits).abs().max().item(),
                   "logit_scale": whole_logits.abs().max().item(),
                   "expert_grad": expert_diff / scale, "other_grad": other_diff / scale,
                   "experts": experts, "others": others,
                   "expert_parallel": parallel_state.get_expert_model_parallel_world_size(),
                   "tensor_parallel": parallel_state.get_tensor_model_parallel_world_size(),
                   "expert_tensor_parallel":
                       parallel_state.get_expert_tensor_parallel_world_size()},
                  f)
    parallel_state.destroy_model_parallel()


def run(out_dir: str, layouts: list[tuple[int, int]]) -> None:
    """Each (TP, ETP) layout compared in turn."""
    for tp, etp in layouts:
        _compare(out_dir, tp, etp)


def main() -> None:
    """argv: the output folder, then one or more TP:ETP layouts (default 1:1), each compared
    in turn in this one launch."""
    layouts = []
    for layout in sys.argv[2:] or ["1:1"]:
        tp, etp = (int(x) for x in layout.split(":"))
        layouts.append((tp, etp))
    run(sys.argv[1], layouts)
    shutdown_distributed()


if __name__ == "__main__":
    main()
