"""torchrun worker: loss and unsharded LoRA gradients of tiny models with a given adapter, at
TP = WORLD_SIZE (sequence parallel on by default when TP > 1, expert TP = TP): the adapters
`save_adapters` wrote in the test's process (TP=1) before the launch, under `ENV` with the
launch's TP size (two_ranks_worker.py's lora/ job)."""

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
MODELS = ("tiny-qwen3", "tiny-qwen3-moe")
ENV = {"ART_MEGATRON_RECOMPUTE_GRANULARITY": "full"}
SPECS = "specs.json"  # the adapters' "model=folder" specs, in save_adapters' folder


def provider_for(name: str) -> Provider:
    """The TP=1 provider of `name` the adapters are made and checked with."""
    from peft import LoraConfig

    from art.megatron.settings import load_settings

    return Provider(name, settings=load_settings(ENV), dtype="float32",
                    lora=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))


def save_adapters(folder: str) -> list[str]:
    """A non-trivial adapter (B random, not zero) for each of MODELS, exported to `folder`
    at TP=1; returns and writes (SPECS) their "model=folder" specs."""
    from art.megatron.lora_peft import export_adapter

    specs = []
    for name in MODELS:
        model = provider_for(name).build_model(seed=0)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for module in lora_modules(model):
                for b in module.lora_B.values():
                    b.copy_(torch.randn(b.shape, generator=g) * 0.2)
        adapter = os.path.join(folder, f"adapter-{name}")
        export_adapter(model, adapter)
        specs.append(f"{name}={adapter}")
    with open(os.path.join(folder, SPECS), "w") as f:
        json.dump(specs, f)
    return specs


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


def run_specs(out_dir: str, adapters: list[str]) -> None:
    """Every "model=folder" adapter at the layout the ART_MEGATRON_* environment sets; this
    rank's results to out_dir/rank<R>.json."""
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


def main() -> None:
    run_specs(sys.argv[1], sys.argv[2:])
    shutdown_distributed()


if __name__ == "__main__":
    main()
