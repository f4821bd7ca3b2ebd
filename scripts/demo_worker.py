"""Demo worker (one per TP rank): a real forward + backward of a tiny Megatron GPT on CPU."""

from __future__ import annotations

import os
import time

import torch
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from art.megatron.distributed import initialize_distributed, shutdown_distributed
from art.megatron.geometry import geometry_from_hf_dict
from art.megatron.layout import ParallelLayout
from art.megatron.model_builder import RecomputeConfig, build_gpt_model, build_transformer_config


def main() -> None:
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    state = initialize_distributed(tensor_parallel=tp)
    geometry = geometry_from_hf_dict(
        dict(model_type="qwen3", num_hidden_layers=4, hidden_size=128, intermediate_size=384,
             num_attention_heads=8, num_key_value_heads=4, head_dim=16, vocab_size=512),
        name="tiny-qwen3",
    )
    recompute = RecomputeConfig("selective")
    config = build_transformer_config(
        geometry, layout=ParallelLayout(tensor_parallel=tp), recompute=recompute,
        dtype="float32",
    )
    model = build_gpt_model(geometry, config, seed=0)
    torch.manual_seed(0)
    tokens = torch.randint(0, geometry.vocab_size, (1, 256))
    start = time.perf_counter()
    logits = model(tokens, torch.arange(256)[None], attention_mask=None)
    loss = vocab_parallel_cross_entropy(
        logits.transpose(0, 1).float().contiguous(), tokens.t().contiguous()
    ).mean()
    loss.backward()
    if state.rank == 0:
        print(f"ran {geometry.name}: {geometry.num_layers} layers, hidden {geometry.hidden_size}, "
              f"TP={tp} ({state.backend}), selective recompute, 256 tokens: "
              f"loss {loss.item():.4f}, forward+backward {time.perf_counter() - start:.2f}s")
    shutdown_distributed()


if __name__ == "__main__":
    main()
