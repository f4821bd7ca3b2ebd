"""torchrun worker: loss and gradients of the tiny hybrids (Gated DeltaNet + attention, dense
and MoE) in several recompute modes at TP = WORLD_SIZE; `hybrid_cases` also runs in-process
at TP=1 for the reference."""

from __future__ import annotations

import json
import os
import sys

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from art.megatron.geometry import load_geometry
from art.megatron.layout import ParallelLayout
from art.megatron.model_builder import RecomputeConfig, build_gpt_model, build_transformer_config

CASES: list[tuple[str, RecomputeConfig]] = [
    ("tiny-qwen3_5", RecomputeConfig()),
    ("tiny-qwen3_5", RecomputeConfig("selective", modules=("core_attn", "mlp", "layernorm"))),
    ("tiny-qwen3_5", RecomputeConfig("full", "uniform", 2)),
    ("tiny-qwen3_5-moe", RecomputeConfig("selective", modules=("moe", "layernorm"))),
    ("tiny-qwen3_5-moe", RecomputeConfig("full", "block", 4)),
]
# 150 tokens: two full 64-token chunks of the delta rule and a partial one.
TOKENS = 150


def layout(tp: int) -> ParallelLayout:
    """The layout every case runs at: TP = `tp`, sequence parallel above TP=1."""
    return ParallelLayout(tensor_parallel=tp, sequence_parallel=tp > 1)


def hybrid_cases(tp: int) -> list[dict]:
    rows = []
    for name, recompute in CASES:
        geometry = load_geometry(name)
        config = build_transformer_config(geometry, layout=layout(tp), recompute=recompute,
                                          dtype="float32")
        model = build_gpt_model(geometry, config, seed=0)
        torch.manual_seed(1)
        tokens = torch.randint(0, geometry.vocab_size, (1, TOKENS))
        logits = model(tokens, torch.arange(TOKENS)[None], attention_mask=None)
        loss = vocab_parallel_cross_entropy(
            logits.transpose(0, 1).float().contiguous(), tokens.t().contiguous()).mean()
        loss.backward()
        if tp > 1:
            # Each rank holds a partial gradient of the sequence-parallel norm weights and of
            # the q/k norms; Megatron sums them over TP (finalize_model_grads) before a step.
            for param_name, p in model.named_parameters():
                if p.grad is not None and (getattr(p, "sequence_parallel", False)
                                           or "q_layernorm" in param_name
                                           or "k_layernorm" in param_name):
                    torch.distributed.all_reduce(
                        p.grad, group=parallel_state.get_tensor_model_parallel_group())
        sharded = sum(float(p.grad.pow(2).sum()) for p in model.parameters()
                      if p.grad is not None and getattr(p, "tensor_model_parallel", False))
        replicated = sum(float(p.grad.pow(2).sum()) for p in model.parameters()
                         if p.grad is not None
                         and not getattr(p, "tensor_model_parallel", False))
        sharded_t = torch.tensor([sharded], dtype=torch.float64)
        if tp > 1:
            torch.distributed.all_reduce(
                sharded_t, group=parallel_state.get_tensor_model_parallel_group())
        rows.append({"model": name, "recompute": str(recompute), "loss": loss.item(),
                     "sharded_grad_sq": sharded_t.item(), "replicated_grad_sq": replicated,
                     "dispatcher_state_bytes": dispatcher_state_bytes(model)})
    return rows


def dispatcher_state_bytes(model) -> int | None:
    """What the first MoE layer's token dispatcher still references after the step (the
    routing state it keeps until its next call): its tensor attributes' storages, each once.
    None for a model without MoE layers."""
    for layer in model.decoder.layers:
        dispatcher = getattr(layer.mlp, "token_dispatcher", None)
        if dispatcher is None:
            continue
        storages = {}
        for value in vars(dispatcher).values():
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())
    return None


def probe_reruns(tp: int) -> dict:
    """A probe point on a TP layer when only one rank's run leaves allocations behind: the
    tiny hybrid's attention layer at TP = `tp`, measured once (every rank's first run creates
    the layer's grads), then again after this rank (the last one) drops its grads. Returns
    how many runs each point took on this rank and whether the repeated point measured what
    the first did."""
    from art.megatron.implementation import Implementation
    from art.trainer_rank.measuring import probe_runs

    geometry = load_geometry("tiny-qwen3_5")
    implementation = Implementation.cpu_local()
    config = build_transformer_config(geometry, layout=layout(tp),
                                      recompute=RecomputeConfig(), dtype="float32")
    model = build_gpt_model(geometry, config, implementation=implementation, seed=0)
    layer = model.decoder.layers[3]
    runs: list[int] = []
    handle = layer.register_forward_hook(lambda *_: runs.append(1))
    inputs = probe_runs.probe_inputs(model, TOKENS, layout(tp), implementation,
                                     torch.device("cpu"))
    counts, rows = [], []
    for point in range(2):
        if point == 1 and torch.distributed.get_rank() == tp - 1:
            for param in layer.parameters():
                param.grad = None
        runs.clear()
        torch.manual_seed(5)
        rows.append(probe_runs.measure_layer(layer, inputs, geometry.hidden_size,
                                             torch.float32, torch.device("cpu"), True))
        counts.append(len(runs))
    handle.remove()
    return {"runs": counts, "same_row": rows[0] == rows[1]}


def run(out_dir: str) -> None:
    """`hybrid_cases` and `probe_reruns` at TP = WORLD_SIZE; this rank's rows to out_dir."""
    from art.megatron.distributed import initialize_distributed

    tp = int(os.environ.get("WORLD_SIZE", "1"))
    initialize_distributed(tensor_parallel=tp)
    rows = hybrid_cases(tp)
    rank = int(os.environ.get("RANK", 0))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)
    with open(os.path.join(out_dir, f"probe-reruns-rank{rank}.json"), "w") as f:
        json.dump(probe_reruns(tp), f)


def main() -> None:
    from art.megatron.distributed import shutdown_distributed

    run(sys.argv[1])
    shutdown_distributed()


if __name__ == "__main__":
    main()
