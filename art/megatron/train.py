"""The training runtime: provider -> model chunks (base frozen, LoRA applied), wrapped in
Megatron-Core's DistributedDataParallel, and Megatron-Core's own optimizer.

`build_training_runtime` has upstream's signature and defaults; `build_runtime_for_provider`
does the same from a provider already in hand (tests, scripts with their own geometry).
On CPU the optimizer runs through `cpu_runtime.cuda_calls_on_cpu` (Megatron allocates a few
bookkeeping tensors on 'cuda' and compares `tensor.type()` with CUDA type names).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any, Literal

import torch
from megatron.core import parallel_state as ps  # noqa: F401 - upstream drivers read train.ps
from pydantic import BaseModel, ConfigDict

from art.megatron import cpu_runtime
from art.megatron.provider import Provider, get_provider

# Module-level names a driver written against upstream's train module reaches.
__all__ = [
    "DEFAULT_MODEL_IDENTIFIER",
    "TrainingRuntime",
    "build_training_runtime",
    "freeze_model",
    "get_provider",
    "print0",
    "ps",
]

DEFAULT_MODEL_IDENTIFIER = "Qwen/Qwen3-0.6B"
ENV_MODEL_IDENTIFIER = "MODEL_IDENTIFIER"
ENV_RANDOM_STATE = "ART_MEGATRON_RANDOM_STATE"
TRAINABLE_PARAMETER_MODES: tuple[str, ...] = ("lora", "base_model")
MODEL_INITIALIZATIONS: tuple[str, ...] = ("pretrained", "random")
# The adapter built when the caller passes none: rank 8, alpha 16, every linear.
DEFAULT_LORA_RANK = 8
DEFAULT_LORA_ALPHA = 16


class TrainingRuntime(BaseModel):
    """What TrainerRank runs on: upstream's fields first, ours (optional) after."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    provider: Any
    model: list[Any]  # model chunks; TrainerRank needs exactly one
    optimizer: Any | None = None
    optimizer_config: Any | None = None
    rank: int = 0
    world_size: int = 1
    # ours: TrainerRankOptions for this trainer (None: from ART_TRAINER_RANK_*), and a memory
    # model to price with instead of the probed one (tests, harness code).
    trainer_options: Any | None = None
    memory_model: Any | None = None
    seed: int = 0  # the seed the weights and adapters were drawn from

    @classmethod
    def for_model(cls, model: Any, provider: Provider, **fields: Any) -> TrainingRuntime:
        """A runtime around an already-built model (no DDP, no optimizer unless given)."""
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        return cls(provider=provider, model=[model], rank=rank, world_size=world, **fields)


def print0(rank: int, *values: Any) -> None:
    """print on global rank 0 only (upstream's helper)."""
    if rank == 0:
        print(*values)


def freeze_model(model_chunks: list[Any]) -> list[Any]:
    """Every parameter of the chunks frozen (requires_grad False); returns the chunks, so it
    can serve as a pre-wrap hook as upstream's does."""
    for chunk in model_chunks:
        for param in chunk.parameters():
            param.requires_grad = False
    return model_chunks


def random_state_from_env() -> int | None:
    """ART_MEGATRON_RANDOM_STATE as an int (None when unset or a none-word), parsed by its
    declaration in settings.py."""
    from art.megatron.settings import MEGATRON_ENV

    raw = os.environ.get(ENV_RANDOM_STATE)
    if raw is None:
        return None
    return MEGATRON_ENV.variable("RANDOM_STATE").parse(ENV_RANDOM_STATE, raw)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def default_optimizer_config(torch_dtype: torch.dtype = torch.bfloat16) -> Any:
    """Upstream's defaults: Adam, lr 5e-6, betas 0.9 / 0.99, clip 0.1, weight decay 0.1; bf16
    mixed precision when the model is bf16."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        bf16=torch_dtype == torch.bfloat16,
        fp16=torch_dtype == torch.float16,
        lr=5e-6,
        adam_beta1=0.9,
        adam_beta2=0.99,
        clip_grad=0.1,
        weight_decay=0.1,
    )


def default_lora_config() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=DEFAULT_LORA_RANK, lora_alpha=DEFAULT_LORA_ALPHA,
                      target_modules="all-linear")


def prepare_weights(provider: Provider, model_initialization: str) -> Any:
    """Check where the starting weights come from before anything is built: for "pretrained"
    the provider's local checkpoint folder, checked against its geometry (a shipped config
    name has no weights and is an error); None for "random"."""
    if model_initialization == "random":
        return None
    from art.megatron.weights import prepare_pretrained

    return prepare_pretrained(provider)


def initialize_weights(chunks: list[Any], prepared: Any) -> None:
    """Give the built chunks their starting weights: with a prepared checkpoint each rank
    loads its shards of it (every rank raises if any fails); without, the seeded random
    initialisation of the build stays."""
    if prepared is None:
        return
    from art.megatron.weights import load_into

    for chunk in chunks:
        load_into(chunk, prepared)


def build_training_runtime(
    *,
    model_identifier: str | None = None,
    provider_configure: Callable[[Any], None] | None = None,
    optimizer_config: Any | None = None,
    print_env: bool = True,
    build_optimizer: bool = True,
    trainable_parameter_mode: Literal["lora", "base_model"] = "lora",
    model_initialization: Literal["pretrained", "random"] = "pretrained",
    provider_torch_dtype: torch.dtype = torch.bfloat16,
    lora_config: Any | None = None,
    allow_unvalidated_arch: bool = False,
) -> TrainingRuntime:
    """Build the provider (from `model_identifier`, else $MODEL_IDENTIFIER, else the default
    model), let `provider_configure(provider)` change it, then build the runtime on it."""
    _check_modes(trainable_parameter_mode, model_initialization)
    seed = random_state_from_env()
    if seed is not None:
        seed_everything(seed)
    identifier = (model_identifier or os.environ.get(ENV_MODEL_IDENTIFIER)
                  or DEFAULT_MODEL_IDENTIFIER)
    provider = get_provider(identifier, torch_dtype=provider_torch_dtype,
                            allow_unvalidated_arch=allow_unvalidated_arch)
    if provider_configure is not None:
        provider_configure(provider)
    return build_runtime_for_provider(
        provider,
        optimizer_config=optimizer_config,
        print_env=print_env,
        build_optimizer=build_optimizer,
        trainable_parameter_mode=trainable_parameter_mode,
        model_initialization=model_initialization,
        lora_config=lora_config,
        seed=0 if seed is None else seed,
    )


def build_runtime_for_provider(
    provider: Provider,
    *,
    optimizer_config: Any | None = None,
    print_env: bool = False,
    build_optimizer: bool = True,
    trainable_parameter_mode: str = "lora",
    model_initialization: str = "random",
    lora_config: Any | None = None,
    seed: int = 0,
    trainer_options: Any | None = None,
    wrap_ddp: bool = True,
) -> TrainingRuntime:
    """Distributed start-up, model chunk (frozen base + LoRA, or a trainable base), weights,
    DDP and optimizer for a provider. Bad arguments fail before anything is built."""
    _check_modes(trainable_parameter_mode, model_initialization)
    if build_optimizer and not wrap_ddp:
        raise ValueError("build_optimizer=True needs wrap_ddp=True (Megatron's optimizer reads "
                         "the DDP gradient buffers)")
    if trainable_parameter_mode == "lora":
        if provider.lora_config is None:
            provider.lora_config = lora_config or default_lora_config()
            provider._validate()
    elif provider.lora_config is not None or lora_config is not None:
        raise ValueError("trainable_parameter_mode='base_model' trains the base weights; do not "
                         "pass a LoRA config (or use trainable_parameter_mode='lora')")
    prepared = prepare_weights(provider, model_initialization)
    state = provider.initialize_distributed()
    if print_env:
        print(provider.settings)
        print(provider.describe())
    model = provider.build_model(seed=seed)
    initialize_weights([model], prepared)
    chunks: list[Any] = [model]
    if wrap_ddp:
        chunks = [_wrap_ddp(model)]
    optimizer = config = None
    if build_optimizer:
        config = optimizer_config or default_optimizer_config(_torch_dtype(provider.dtype))
        optimizer = build_megatron_optimizer(config, chunks)
    return TrainingRuntime(
        provider=provider, model=chunks, optimizer=optimizer, optimizer_config=config,
        rank=state.rank, world_size=state.world_size, trainer_options=trainer_options,
        seed=seed,
    )


def build_megatron_optimizer(config: Any, chunks: list[Any]) -> Any:
    from megatron.core.optimizer import get_megatron_optimizer

    with cpu_runtime.cuda_calls_on_cpu():
        return get_megatron_optimizer(config, chunks)


def _wrap_ddp(model: Any) -> Any:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    cpu_runtime.install()
    return DistributedDataParallel(
        config=model.config, ddp_config=DistributedDataParallelConfig(), module=model)


def _torch_dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16,
            "float32": torch.float32}[name]


def _check_modes(trainable_parameter_mode: str, model_initialization: str) -> None:
    if trainable_parameter_mode not in TRAINABLE_PARAMETER_MODES:
        raise ValueError(
            f"trainable_parameter_mode={trainable_parameter_mode!r} is not one of "
            f"{', '.join(TRAINABLE_PARAMETER_MODES)}"
        )
    if model_initialization not in MODEL_INITIALIZATIONS:
        raise ValueError(
            f"model_initialization={model_initialization!r} is not one of "
            f"{', '.join(MODEL_INITIALIZATIONS)}"
        )
