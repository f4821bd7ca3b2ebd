"""TP=2 (and TP=2 + sequence parallel) under torchrun: the packed compute path returns the
TP=1 outputs, full rows on every rank, and the TP=1 gradients, for the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.megatron.model_builder import RecomputeConfig, build_gpt_model, build_transformer_config
from art.trainer_rank.compute.forward import decoder_hidden_states
from art.trainer_rank.compute.heads import compute_heads
from art.trainer_rank.compute.packing import next_token_targets, pack_sequences, unpack

from _tiny import tiny_dense
from _torchrun import rank_records, run_torchrun

WORKER = Path(__file__).with_name("heads_tp_worker.py")
TOP_K = 5  # as in the worker


def _reference(path: Path) -> None:
    """TP=1 outputs and gradients of the worker's loss, saved with the weights."""
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
    hidden = decoder_hidden_states(model, batch)
    heads = compute_heads(
        model, hidden, target_tokens=next_token_targets(batch), top_k=TOP_K, logits=True
    )
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


@pytest.mark.torchrun
def test_tp2_and_sequence_parallel_match_tp1(megatron_process, tmp_path):
    reference = tmp_path / "reference.pt"
    _reference(reference)
    run_torchrun(WORKER, str(reference), str(tmp_path), nproc=2, timeout_s=120)
    rows = rank_records(tmp_path)
    for rank, row in enumerate(rows):
        for variant in ("tp", "sp"):
            result = row[variant]
            label = f"rank {rank} {variant}: {result}"
            assert result["padded_tokens"] == (22 if variant == "sp" else 21), label
            for key in ("hidden", "logprobs", "top_k_logprobs", "logits"):
                assert result[f"{key}_max_abs_diff"] < 2e-5, label
            assert result["top_k_tokens_equal"], label
            assert result["loss_abs_diff"] < 1e-3, label
            assert result["grads_compared"] > 10, label
            assert result["grad_max_rel_diff"] < 1e-4, label
            assert result["meter_peak_bytes"] > 0, label
