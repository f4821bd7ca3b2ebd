"""torchrun worker: context parallel equals CP=1 on the same weights.

argv: out_dir, tp (CP = WORLD_SIZE / tp), model ("dense": a 2-layer Qwen3-shaped model;
"hybrid": the shipped tiny-qwen3_5, three Gated DeltaNet layers and an attention layer, whose
recurrence crosses the CP ranks' chunks). Phase 1 builds the model at TP=tp x CP and runs
every case through the trainer's own sub-forward (packed rows of independent sequences, prefix
trees of shared prompts, under selective and full recompute, with and without sequence
parallel at TP=2); the LoRA-free model's parameter gradients are summed over the CP ranks (what
the optimizer's data-parallel x CP reduction does for the LoRA factors, all inside the
decoder). Phase 2 rebuilds Megatron's parallel state at
CP=1 (the extra ranks become data parallel), loads the same TP shard, and runs the same cases.
Writes out_dir/rank<R>.json: the largest output and gradient differences per case.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from art.megatron.distributed import initialize_distributed, shutdown_distributed
from art.megatron.geometry import load_geometry
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.megatron.model_builder import RecomputeConfig, build_gpt_model, build_transformer_config
from art.trainer_rank._types import ForwardInput
from art.trainer_rank.compute.execute import run_sub_forward

from _shared_prefix import CASES, group
from _tiny import tiny_dense

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
        # is already whole on each; the decoder's parameters saw only this rank's rows.
        if cp_group is not None and not name.startswith("output_layer."):
            dist.all_reduce(grads[name], group=cp_group)
        if layout.sequence_parallel and getattr(param, "sequence_parallel", False):
            dist.all_reduce(grads[name], group=parallel_state.get_tensor_model_parallel_group())
    return [o for o in outputs], grads


def _phase(tp: int, cp: int, sequence_parallel: bool, recompute: str, state: dict | None,
           vocab_cases, model_kind: str) -> tuple[dict, list]:
    from megatron.core import parallel_state

    geometry = tiny_dense(num_layers=2) if model_kind == "dense" else load_geometry(
        "tiny-qwen3_5")
    layout = ParallelLayout(tensor_parallel=tp, context_parallel=cp,
                            sequence_parallel=sequence_parallel)
    config = build_transformer_config(geometry, layout=layout, recompute=RECOMPUTE[recompute],
                                      dtype="float32", implementation=IMPLEMENTATION)
    model = build_gpt_model(geometry, config, implementation=IMPLEMENTATION, seed=0)
    if state is not None:
        model.load_state_dict(state)
    state = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    assert parallel_state.get_context_parallel_world_size() == cp
    assert model.config.context_parallel_size == cp
    cp_group = parallel_state.get_context_parallel_group() if cp > 1 else None
    runs = [(name, *_run(model, leaves, groups, layout, cp_group))
            for name, leaves, groups in vocab_cases(geometry.vocab_size)]
    return state, runs


def _diff(a, b) -> float:
    if (a is None) != (b is None) or (a is not None and a.shape != b.shape):
        return float("inf")
    return 0.0 if a is None else (a - b).abs().max().item()


def main() -> None:
    from megatron.core import parallel_state

    out_dir, tp = sys.argv[1], int(sys.argv[2])
    model_kind = sys.argv[3] if len(sys.argv) > 3 else "dense"
    world = int(os.environ["WORLD_SIZE"])
    cp = world // tp
    variants = [("selective", tp > 1), ("full", False)]
    results = []
    for recompute, sequence_parallel in variants:
        initialize_distributed(tensor_parallel=tp, context_parallel=cp)
        state, split_runs = _phase(tp, cp, sequence_parallel, recompute, None, _cases,
                                   model_kind)
        parallel_state.destroy_model_parallel()
        initialize_distributed(tensor_parallel=tp, context_parallel=1)
        _, whole_runs = _phase(tp, 1, sequence_parallel, recompute, state, _cases, model_kind)
        parallel_state.destroy_model_parallel()
        for (name, split_out, split_grads), (_, whole_out, whole_grads) in zip(split_runs,
                                                                             whole_runs):
            diffs = {"case": name, "recompute": recompute, "tp": tp, "cp": cp,
                     "sequence_parallel": sequence_parallel, "outputs": len(split_out)}
            for key in ("target_logprobs", "logits", "hidden_states"):
                diffs[key] = max(_diff(getattr(a, key), getattr(b, key))
                                 for a, b in zip(split_out, whole_out))
            diffs["top_k"] = max(_diff(None if a.top_k is None else a.top_k.logprobs,
                                       None if b.top_k is None else b.top_k.logprobs)
                                 for a, b in zip(split_out, whole_out))
            scale = max(g.abs().max().item() for g in whole_grads.values())
            diffs["grad_names_equal"] = split_grads.keys() == whole_grads.keys()
            diffs["grad"] = max((split_grads[n] - whole_grads[n]).abs().max().item() / scale
                                for n in whole_grads if n in split_grads)
            diffs["grads"] = len(whole_grads)
            diffs["worst_grads"] = sorted(
                ((split_grads[n] - whole_grads[n]).abs().max().item() / scale, n)
                for n in whole_grads if n in split_grads)[-3:]
            results.append(diffs)
    rank = int(os.environ["RANK"])
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    shutdown_distributed()


if __name__ == "__main__":
    main()
