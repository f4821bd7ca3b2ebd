"""torchrun worker: the packed compute path at TP = WORLD_SIZE (with and without sequence
parallel) on the TP=1 model's weights, compared with the TP=1 reference `save_reference` saved
in the test's process.

argv: reference.pt out_dir. Writes out_dir/rank<R>.json with the largest differences seen.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from megatron.core import parallel_state

from art.megatron.distributed import initialize_distributed, shutdown_distributed
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.megatron.model_builder import RecomputeConfig, build_gpt_model, build_transformer_config
from art.trainer_rank.compute.forward import decoder_hidden_states
from art.trainer_rank.compute.heads import compute_heads
from art.trainer_rank.compute.packing import (
    PackedBatch,
    next_token_targets,
    pack_sequences,
    unpack,
)
from art.trainer_rank.measuring.meter import MemoryMeter

from _tiny import tiny_dense

TOP_K = 5
CHUNK_TOKENS = 6


def shard_of(name: str, full: torch.Tensor, param: torch.Tensor, rank: int, tp: int):
    """This rank's piece of a TP=1 tensor, by Megatron's partition attributes."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if name.endswith("linear_fc1.weight"):
        # Gated MLP: every rank holds [gate_r; up_r], not a contiguous slice of [gate; up].
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    return full.chunk(tp, dim=dim)[rank]


def needs_tp_sum(name: str, param: torch.Tensor) -> bool:
    """Replicated weights whose gradient each rank sees only part of (Megatron's
    finalize_model_grads all-reduces these): norms on sequence shards, q/k norms on a rank's
    heads."""
    return bool(getattr(param, "sequence_parallel", False)) or (
        "q_layernorm" in name or "k_layernorm" in name
    )


def outputs_and_loss(model: torch.nn.Module, batch: PackedBatch,
                     chunk_tokens: int | None = None) -> tuple[dict, torch.Tensor]:
    """The packed path's outputs per sequence and a loss that reaches every one of them (the
    reference and each TP variant run the same)."""
    hidden = decoder_hidden_states(model, batch)
    heads = compute_heads(model, hidden, target_tokens=next_token_targets(batch), top_k=TOP_K,
                          logits=True, **({"chunk_tokens": chunk_tokens} if chunk_tokens else {}))
    outputs = {
        "hidden": unpack(hidden, batch),
        "logprobs": unpack(heads.target_logprobs, batch),
        "top_k_logprobs": unpack(heads.top_k_logprobs, batch),
        "top_k_tokens": unpack(heads.top_k_tokens, batch),
        "logits": unpack(heads.logits, batch),
    }
    loss = sum(
        lp.sum() + 0.1 * top.sum() + 0.01 * logits.pow(2).sum() + 0.1 * h.pow(2).sum()
        for h, lp, top, logits in zip(
            outputs["hidden"], outputs["logprobs"], outputs["top_k_logprobs"], outputs["logits"]
        )
    )
    return outputs, loss


def run(reference: dict, sequence_parallel: bool, rank: int, tp: int) -> dict:
    geometry = tiny_dense(num_layers=2)
    layout = ParallelLayout(tensor_parallel=tp, sequence_parallel=sequence_parallel)
    config = build_transformer_config(
        geometry, layout=layout, recompute=RecomputeConfig("selective"), dtype="float32"
    )
    model = build_gpt_model(geometry, config, seed=123)  # other weights; the reference's loaded
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            piece = shard_of(name, reference["weights"][name], param, rank, tp)
            assert piece.shape == param.shape, (name, piece.shape, param.shape)
            param.copy_(piece)

    batch = pack_sequences(
        reference["sequences"], implementation=Implementation.cpu_local(), layout=layout
    )
    with MemoryMeter(device="cpu") as meter:
        outputs, loss = outputs_and_loss(model, batch, chunk_tokens=CHUNK_TOKENS)
        loss.backward()
    result: dict = {"padded_tokens": batch.padded_tokens, "meter_peak_bytes": meter.peak_bytes}
    for key, pieces in outputs.items():
        if key == "top_k_tokens":
            result["top_k_tokens_equal"] = all(
                torch.equal(got, want) for got, want in zip(pieces, reference[key])
            )
        else:
            result[f"{key}_max_abs_diff"] = max(
                float((got.detach() - want).abs().max())
                for got, want in zip(pieces, reference[key])
            )
    result["loss_abs_diff"] = abs(float(loss) - reference["loss"])
    group = parallel_state.get_tensor_model_parallel_group()
    worst, worst_name = 0.0, ""
    for name, param in params.items():
        grad = param.grad.detach().clone()
        if needs_tp_sum(name, param):
            torch.distributed.all_reduce(grad, group=group)
        want = shard_of(name, reference["grads"][name], param, rank, tp)
        diff = float((grad - want).abs().max() / (want.abs().max() + 1e-12))
        if diff > worst:
            worst, worst_name = diff, name
    result["grad_max_rel_diff"] = worst
    result["grad_worst_param"] = worst_name
    result["grads_compared"] = len(params)
    return result


def save_reference(path: str) -> None:
    """TP=1 outputs and gradients of `run`'s loss, saved with the weights (in the test's
    process, at TP=1, before the launch)."""
    geometry = tiny_dense(num_layers=2)
    config = build_transformer_config(
        geometry, layout=ParallelLayout(), recompute=RecomputeConfig("selective"), dtype="float32"
    )
    model = build_gpt_model(geometry, config, seed=0)
    generator = torch.Generator().manual_seed(3)
    # 21 tokens: sequence parallel pads the row to 22.
    sequences = [
        torch.randint(0, geometry.vocab_size, (n,), generator=generator) for n in (11, 3, 7)
    ]
    batch = pack_sequences(sequences, implementation=Implementation.cpu_local(),
                           layout=ParallelLayout())
    outputs, loss = outputs_and_loss(model, batch)
    loss.backward()
    torch.save(
        {
            "sequences": sequences,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
            "loss": float(loss),
            **{k: [t.detach().clone() for t in v] for k, v in outputs.items()},
        },
        path,
    )


def run_variants(reference_path: str, out_dir: str) -> None:
    """Both variants at TP = WORLD_SIZE against the saved reference; this rank's rows to
    out_dir."""
    tp = int(os.environ["WORLD_SIZE"])
    state = initialize_distributed(tensor_parallel=tp)
    reference = torch.load(reference_path, weights_only=False)
    rows = {}
    for sequence_parallel in (False, True):
        rows["sp" if sequence_parallel else "tp"] = run(
            reference, sequence_parallel, parallel_state.get_tensor_model_parallel_rank(), tp
        )
    with open(os.path.join(out_dir, f"rank{state.rank}.json"), "w") as f:
        json.dump(rows, f)


def main() -> None:
    run_variants(sys.argv[1], sys.argv[2])
    shutdown_distributed()


if __name__ == "__main__":
    main()
