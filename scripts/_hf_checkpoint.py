"""A random Hugging Face checkpoint made on the fly with transformers (its own model class and
save_pretrained), for the demo and the upstream-style driver to start from "pretrained"
weights the way a real job starts from a downloaded model.

    python scripts/_hf_checkpoint.py FOLDER [--family qwen3] [--layers 4] [--hidden 128] ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FAMILIES = ("qwen3", "llama", "qwen3_moe")


def save_random_checkpoint(folder: str | Path, *, family: str = "qwen3", layers: int = 4,
                           hidden: int = 128, vocab: int = 512, heads: int = 8,
                           kv_heads: int = 4, head_dim: int | None = None,
                           max_positions: int = 8192, seed: int = 0) -> Path:
    """Write config.json + model.safetensors (fp32) unless the folder already holds the same
    config; returns the folder."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=3 * hidden,
                  num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=head_dim or hidden // heads, vocab_size=vocab,
                  max_position_embeddings=max_positions, tie_word_embeddings=False)
    config = {
        "qwen3": lambda: Qwen3Config(**common),
        "llama": lambda: LlamaConfig(**common),
        "qwen3_moe": lambda: Qwen3MoeConfig(**common, moe_intermediate_size=hidden // 2,
                                            num_experts=4, num_experts_per_tok=2,
                                            norm_topk_prob=True),
    }[family]()
    folder = Path(folder)
    wanted = {**config.to_dict(), "dtype": "float32"}
    existing = folder / "config.json"
    if existing.is_file() and (folder / "model.safetensors").is_file():
        seen = json.loads(existing.read_text())
        if all(seen.get(k) == v for k, v in wanted.items() if k != "transformers_version"):
            return folder
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--family", choices=FAMILIES, default="qwen3")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(save_random_checkpoint(args.folder, family=args.family, layers=args.layers,
                                 hidden=args.hidden, vocab=args.vocab, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
