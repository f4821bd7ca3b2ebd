"""Tiny random Hugging Face models saved to a folder (transformers' own classes and
save_pretrained), and our logprobs vs theirs on the same tokens.

Weights are drawn larger than transformers' default init (std 0.25, norm weights around 1):
with tiny weights every logit is near zero and a swapped gate/up or a misordered QKV group
would hide inside the tolerance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

FAMILIES = ("qwen3", "llama", "qwen3_moe")


def hf_config(family: str, *, num_layers: int = 2, hidden: int = 64, vocab: int = 256,
              tied: bool = False) -> Any:
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(
        num_hidden_layers=num_layers, hidden_size=hidden, intermediate_size=2 * hidden,
        num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 4, vocab_size=vocab,
        max_position_embeddings=512, tie_word_embeddings=tied, rms_norm_eps=1e-6,
    )
    if family == "qwen3":
        return Qwen3Config(**common)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**common, moe_intermediate_size=hidden // 2, num_experts=4,
                              num_experts_per_tok=2, norm_topk_prob=True)
    raise ValueError(family)


def make_hf_model(family: str, seed: int = 0, **config_kwargs: Any) -> Any:
    from transformers import AutoModelForCausalLM

    config = hf_config(family, **config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.ndim == 1:  # norms
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(0.25 * noise / param.shape[-1] ** 0.5 * 4)
    return model.eval()


def save_hf_model(family: str, folder: Path, seed: int = 0, **config_kwargs: Any) -> Path:
    make_hf_model(family, seed, **config_kwargs).save_pretrained(folder)
    return folder


def save_qwen3_5(folder: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3.5 (3 Gated DeltaNet layers, 1 gated full-attention layer) saved by
    transformers. Large random weights, zero-centred norms away from zero: a swapped gate
    head, a misplaced in_proj section or a missing +1 moves the logprobs far."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, max_position_embeddings=512, tie_word_embeddings=False)
    config.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.ndim > 1:
                param.copy_(noise / param.shape[-1] ** 0.5)
            elif name.endswith("linear_attn.norm.weight"):  # the gated norm is not centred
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(0.3 * noise)
    model.eval().save_pretrained(folder)
    return folder


def hf_logprobs(folder: Path, sequences: list[torch.Tensor], adapter: Path | None = None
                ) -> list[torch.Tensor]:
    """transformers' target logprobs (each token's next token) for each sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    out = []
    with torch.no_grad():
        for seq in sequences:
            logits = model(input_ids=seq[None]).logits[0].float()
            out.append(torch.log_softmax(logits, -1)[:-1].gather(-1, seq[1:, None])[:, 0])
    return out


def our_logprobs(model: Any, sequences: list[torch.Tensor], *, implementation: Any,
                 layout: Any) -> list[torch.Tensor]:
    """The trainer's packed forward and target-logprob head on a Megatron model."""
    from art.trainer_rank.compute.forward import decoder_hidden_states
    from art.trainer_rank.compute.heads import compute_heads
    from art.trainer_rank.compute.packing import next_token_targets, pack_sequences, unpack

    batch = pack_sequences(sequences, implementation=implementation, layout=layout)
    with torch.no_grad():
        hidden = decoder_hidden_states(model, batch)
        heads = compute_heads(model, hidden, target_tokens=next_token_targets(batch))
    return [lp[:-1] for lp in unpack(heads.target_logprobs, batch)]


def token_sequences(vocab: int, lengths: tuple[int, ...] = (13, 5, 9), seed: int = 7
                    ) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]


def runtime_logprobs(runtime: Any, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    """Target logprobs through the public API: TrainerRank(runtime).forward_micro_batches."""
    from art.trainer_rank import ForwardInput, TrainerRank

    rank = TrainerRank(runtime)
    inputs = [ForwardInput(input_tokens=s[:-1], target_tokens=s[1:]) for s in sequences]
    out: dict[int, torch.Tensor] = {}
    for micro in rank.forward_micro_batches(inputs, no_grad=True):
        for index, output in zip(micro.indices, micro.outputs):
            out[index] = output.target_logprobs.detach().float()
    return [out[i] for i in range(len(sequences))]


def pretrained_runtime(folder: Any) -> Any:
    """build_training_runtime on a local checkpoint folder, fp32, default LoRA, no optimizer."""
    from art.megatron.train import build_training_runtime

    return build_training_runtime(model_identifier=str(folder), print_env=False,
                                  model_initialization="pretrained", build_optimizer=False,
                                  provider_torch_dtype=torch.float32)
