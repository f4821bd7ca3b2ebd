"""torchrun worker: loss and unsharded LoRA gradients of tiny models with a given adapter, at
TP = WORLD_SIZE (sequence parallel on by default when TP > 1, expert TP = TP)."""

from __future__ import annotations

import json
import os
import sys

import torch
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from art.megatron.distributed import shutdown_distributed
from art.megatron.lora import lora_modules
from art.megatron.lora_peft import load_adapter
from art.megatron.model_builder import build_gpt_model
from art.megatron.provider import Provider

TOKENS = 16


def run(provider: Provider, adapter_dir: str) -> dict:
    """Build the base model, load the adapter, forward + backward; everything unsharded."""
    model = build_gpt_model(provider.geometry, provider.transformer_config(),
                            implementation=provider.implementation, seed=0)
    load_adapter(model, adapter_dir)
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, provider.geometry.vocab_size, (1, TOKENS), generator=g)
    logits = model(tokens, torch.arange(TOKENS)[None], attention_mask=None)
    loss = vocab_parallel_cross_entropy(
        logits.transpose(0, 1).float().contiguous(), tokens.t().contiguous()
    ).mean()
    loss.backward()
    grads = {}
    for module in lora_modules(model):
        for part in module.parts:
            if part.present:
                a, b = module.gather_full(part.name, grad=True)
                key = f"{module.layer_index}.{module.hf_path}.{part.name}"
                grads[key + ".A"] = a.flatten().tolist()
                grads[key + ".B"] = b.flatten().tolist()
    return {"loss": loss.item(), "grads": grads}


def main() -> None:
    out_dir, adapters = sys.argv[1], sys.argv[2:]
    results = {}
    for spec in adapters:
        model_name, adapter_dir = spec.split("=", 1)
        provider = Provider.from_env(model_name, dtype="float32")
        provider.initialize_distributed()
        results[model_name] = run(provider, adapter_dir)
        results[model_name]["layout"] = provider.layout.summary
    rank = int(os.environ.get("RANK", 0))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    shutdown_distributed()


if __name__ == "__main__":
    main()
