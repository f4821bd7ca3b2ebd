"""torchrun worker: context parallel equals CP=1 on the same weights.

argv: out_dir, tp (CP = WORLD_SIZE / tp), models (comma-separated, each with its EP size
after a colon, default 1: "moe:2"). Models: "dense" (a 2-layer
Qwen3-shaped model), "hybrid" (the shipped tiny-qwen3_5, three Gated DeltaNet layers and an
attention layer, whose recurrence crosses the CP ranks' chunks), "moe" (a 2-layer Qwen3-MoE
shape, 4 experts top-2) and "hybrid-moe" (the shipped tiny-qwen3_5-moe, 8 experts top-2 and a
shared expert). Phase 1 builds the model at TP=tp x CP=1 (the extra ranks data parallel, EP=1)
and runs every case through the trainer's own sub-forward (packed rows of independent
sequences, prefix trees of shared prompts, under selective and full recompute, with and
without sequence parallel at TP=2; MoE layers always with it at TP=2, which Megatron
requires). Phase 2 rebuilds Megatron's parallel state at TP=tp x CP (x EP=ep, whose group is
then the CP ranks), loads the same weights (under EP each rank its own experts) and runs the
same cases. The LoRA-free model's parameter gradients are summed over the CP ranks (what the
optimizer's data-parallel x CP reduction does for the LoRA factors, all inside the decoder;
an expert's over Megatron's expert data-parallel group, which folds CP in). Writes
out_dir/rank<R>-<model>-ep<ep>.json: the largest output and gradient differences per case,
and whether the one place (runnable_layouts) refuses the layout.
"""

from __future__ import annotations

import json
import os
import re
import sys

import torch
import torch.distributed as dist

from art.megatron.distributed import initialize_distributed, shutdown_distributed
from art.megatron.geometry import ModelGeometry, load_geometry
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.megatron.model_builder import RecomputeConfig, build_gpt_model, build_transformer_config
from art.megatron.runnable_layouts import Asker, refusal
from art.trainer_rank._types import ForwardInput
from art.trainer_rank.compute.execute import run_sub_forward

from _shared_prefix import CASES, group
from _tiny import tiny_dense, tiny_moe

IMPLEMENTATION = Implementation.cpu_local("flash")
RECOMPUTE = {"selective": RecomputeConfig("selective"),
             "full": RecomputeConfig("full", method="uniform", num_layers=1)}


def _independent(seed: int, vocab: int) -> list[ForwardInput]:
    """Sequences of odd lengths (the row needs padding), one longer than a CP chunk."""
    g = torch.Generator().manual_seed(seed)
    leaves = []
    for i, n in enumerate((37, 5, 90, 1, 22)):
        tokens = torch.randint(1, vocab, (n,), generator=g)
        targets = torch.cat([tokens[1:], tokens.new_full((1,), -100)])
        leaves.append(ForwardInput(input_tokens=tokens, target_tokens=targets,
                                   top_k=3 if i % 2 == 0 else None, logits=i == 1,
                                   hidden_states=i % 2 == 1))
    return leaves


def _cases(vocab: int) -> list[tuple[str, list[ForwardInput], list[int] | None]]:
    cases = [("independent", _independent(5, vocab), None)]
    for index in (1, 3, 4):
        leaves = group(CASES[index], vocab)
        cases.append((f"shared-prefix-{index}", leaves, [len(leaves)]))
    return cases


def _loss(outputs, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    total = torch.zeros(())
    for out in outputs:
        for value in (out.target_logprobs, out.logits, out.hidden_states,
                      None if out.top_k is None else out.top_k.logprobs):
            if value is not None:
                total = total + (value * torch.randn(value.shape, generator=g)).sum()
    return total


def _run(model, leaves, groups, layout: ParallelLayout, cp_group) -> tuple[list, dict]:
    from megatron.core import parallel_state

    model.zero_grad(set_to_none=True)
    outputs = run_sub_forward(model, leaves, implementation=IMPLEMENTATION, layout=layout,
                              device=torch.device("cpu"), head_chunk_tokens=16, groups=groups)
    _loss(outputs, 11).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for name, param in model.named_parameters():
        if name not in grads:
            continue
        # Every CP rank runs the output heads on the whole row, so the output layer's gradient
        # is already whole on each; the decoder's parameters saw only this rank's rows. An
        # expert saw the rows its EP group routed to it: those of the CP ranks outside its EP
        # group are summed over Megatron's expert data-parallel group (CP folded in).
        if cp_group is not None and not name.startswith("output_layer."):
            group = (cp_group if getattr(param, "allreduce", True)
                     else parallel_state.get_expert_data_parallel_group())
            dist.all_reduce(grads[name], group=group)
        if layout.sequence_parallel and getattr(param, "sequence_parallel", False):
            dist.all_reduce(grads[name], group=parallel_state.get_tensor_model_parallel_group())
    return [o for o in outputs], grads


EXPERT = re.compile(r"^(?P<head>.*local_experts\.)(?P<index>\d+)(?P<tail>\..*)$")


def _geometry(model_kind: str) -> ModelGeometry:
    if model_kind == "dense":
        return tiny_dense(num_layers=2)
    if model_kind == "moe":
        return tiny_moe(num_layers=2)
    return load_geometry({"hybrid": "tiny-qwen3_5", "hybrid-moe": "tiny-qwen3_5-moe"}[model_kind])


def _global_name(name: str, ep: int, num_experts: int) -> str:
    """A parameter's name at EP=1: local expert i on EP rank r is global expert r x E/EP + i."""
    from megatron.core import parallel_state

    match = EXPERT.match(name)
    if match is None or ep == 1:
        return name
    index = parallel_state.get_expert_model_parallel_rank() * num_experts // ep + int(
        match["index"])
    return f"{match['head']}{index}{match['tail']}"


def _phase(tp: int, cp: int, ep: int, sequence_parallel: bool, recompute: str,
           state: dict | None, vocab_cases, model_kind: str) -> tuple[dict, list]:
    from megatron.core import parallel_state

    geometry = _geometry(model_kind)
    layout = ParallelLayout(tensor_parallel=tp, context_parallel=cp, expert_parallel=ep,
                            expert_tensor_parallel=tp, sequence_parallel=sequence_parallel)
    config = build_transformer_config(geometry, layout=layout, recompute=RECOMPUTE[recompute],
                                      dtype="float32", implementation=IMPLEMENTATION)
    model = build_gpt_model(geometry, config, implementation=IMPLEMENTATION, seed=0)
    experts = geometry.num_experts
    if state is not None:
        mine = {name: state[_global_name(name, ep, experts)]
                for name, value in model.state_dict().items() if isinstance(value, torch.Tensor)}
        missing, unexpected = model.load_state_dict(mine, strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
    state = {_global_name(k, ep, experts): v.clone() for k, v in model.state_dict().items()
             if isinstance(v, torch.Tensor)}
    assert parallel_state.get_context_parallel_world_size() == cp
    assert parallel_state.get_expert_model_parallel_world_size() == ep
    assert model.config.context_parallel_size == cp
    refused = refusal(layout, IMPLEMENTATION, geometry, asker=Asker.PROVIDER)
    cp_group = parallel_state.get_context_parallel_group() if cp > 1 else None
    runs = []
    for name, leaves, groups in vocab_cases(geometry.vocab_size):
        outputs, grads = _run(model, leaves, groups, layout, cp_group)
        runs.append((name, outputs, {_global_name(n, ep, experts): g for n, g in grads.items()},
                     None if refused is None else refused.message()))
    return state, runs


def _diff(a, b) -> float:
    if (a is None) != (b is None) or (a is not None and a.shape != b.shape):
        return float("inf")
    return 0.0 if a is None else (a - b).abs().max().item()


def _compare(tp: int, cp: int, ep: int, model_kind: str) -> list[dict]:
    """Every case of one model at CP (x TP, x EP) against the same weights at CP=1."""
    from megatron.core import parallel_state

    # Megatron refuses MoE layers under TP without sequence parallel.
    variants = [("selective", tp > 1), ("full", tp > 1 and model_kind in ("moe", "hybrid-moe"))]
    results = []
    for recompute, sequence_parallel in variants:
        initialize_distributed(tensor_parallel=tp, context_parallel=1)
        state, whole_runs = _phase(tp, 1, 1, sequence_parallel, recompute, None, _cases,
                                   model_kind)
        parallel_state.destroy_model_parallel()
        initialize_distributed(tensor_parallel=tp, context_parallel=cp, expert_parallel=ep)
        _, split_runs = _phase(tp, cp, ep, sequence_parallel, recompute, state, _cases,
                               model_kind)
        parallel_state.destroy_model_parallel()
        for (name, split_out, split_grads, refused), (_, whole_out, whole_grads, _) in zip(
                split_runs, whole_runs):
            diffs = {"case": name, "recompute": recompute, "tp": tp, "cp": cp, "ep": ep,
                     "sequence_parallel": sequence_parallel, "outputs": len(split_out),
                     "refused": refused}
            for key in ("target_logprobs", "logits", "hidden_states"):
                diffs[key] = max(_diff(getattr(a, key), getattr(b, key))
                                 for a, b in zip(split_out, whole_out))
            diffs["top_k"] = max(_diff(None if a.top_k is None else a.top_k.logprobs,
                                       None if b.top_k is None else b.top_k.logprobs)
                                 for a, b in zip(split_out, whole_out))
            scale = max(g.abs().max().item() for g in whole_grads.values())
            # Under EP a rank holds its own experts' gradients only.
            diffs["grad_names_equal"] = split_grads.keys() == {
                n for n in whole_grads if ep == 1 or n in split_grads or not EXPERT.match(n)}
            diffs["expert_grads"] = sum(1 for n in split_grads if EXPERT.match(n))
            diffs["whole_expert_grads"] = sum(1 for n in whole_grads if EXPERT.match(n))
            diffs["grad"] = max((split_grads[n] - whole_grads[n]).abs().max().item() / scale
                                for n in whole_grads if n in split_grads)
            diffs["grads"] = len(whole_grads)
            diffs["worst_grads"] = sorted(
                ((split_grads[n] - whole_grads[n]).abs().max().item() / scale, n)
                for n in whole_grads if n in split_grads)[-3:]
            results.append(diffs)
    return results


def run(out_dir: str, tp: int, models: list[str]) -> None:
    """Each model ("kind" or "kind:ep") in turn at TP=tp x CP = WORLD_SIZE / tp."""
    world = int(os.environ["WORLD_SIZE"])
    cp = world // tp
    rank = int(os.environ["RANK"])
    for model in models:
        model_kind, _, ep = model.partition(":")
        results = _compare(tp, cp, int(ep or 1), model_kind)
        with open(os.path.join(out_dir, f"rank{rank}-{model_kind}-ep{ep or 1}.json"), "w") as f:
            json.dump(results, f)


def main() -> None:
    # One launch runs each model named (comma-separated), each at its EP size: a torchrun
    # start costs more than a tiny model's run on the CI's cores.
    run(sys.argv[1], int(sys.argv[2]), (sys.argv[3] if len(sys.argv) > 3 else "dense").split(","))
    shutdown_distributed()


if __name__ == "__main__":
    main()
