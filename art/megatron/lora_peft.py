"""peft adapter files for the resident adapters of a LoRA'd Megatron model.

One adapter directory holds adapter_config.json + adapter_model.safetensors with peft's keys
(`base_model.model.model.layers.<i>.<hf path>.<proj>.lora_<A|B>.weight`) and unsharded
tensors, so it loads into peft/transformers unchanged and an HF-trained adapter loads here
exactly. Every function takes the adapter key it reads or writes ("default": the adapter the
model was built with).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from art.megatron.lora import (
    LoraLinear,
    apply_lora,
    lora_modules,
    lora_scaling,
    requested_projections,
)
from art.megatron.lora_selection import DEFAULT_ADAPTER

if TYPE_CHECKING:
    from peft import LoraConfig

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_KEY_PREFIX = "base_model.model.model.layers."
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(.+)\.(\w+)\.lora_([AB])\.weight$"
)


def _peft_key(module: LoraLinear, name: str, factor: str) -> str:
    return f"{PEFT_KEY_PREFIX}{module.layer_index}.{module.hf_path}.{name}.lora_{factor}.weight"


def adapter_state_dict(model: nn.Module, adapter: str = DEFAULT_ADAPTER
                       ) -> dict[str, torch.Tensor]:
    """Unsharded tensors of one adapter under peft keys. Collective: every rank must call it;
    the result holds what this rank's pipeline stage / expert shard owns."""
    state: dict[str, torch.Tensor] = {}
    for module in lora_modules(model):
        if adapter not in module.adapters:
            continue
        for name in module.adapter(adapter).names:
            full_a, full_b = module.gather_full(name, adapter=adapter)
            state[_peft_key(module, name, "A")] = full_a.contiguous()
            state[_peft_key(module, name, "B")] = full_b.contiguous()
    return state


def gather_to_rank0(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Merge every rank's part of an adapter state on global rank 0 (None elsewhere)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        everything: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everything, {k: v.cpu() for k, v in state.items()})
        state = {k: v for part in everything for k, v in part.items()}
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return state


def adapter_shape(model: nn.Module, adapter: str = DEFAULT_ADAPTER) -> tuple[int, float]:
    """(r, scaling) of a resident adapter."""
    for module in lora_modules(model):
        if adapter in module.adapters:
            holder = module.adapter(adapter)
            return holder.r, holder.scaling
    raise KeyError(f"no LoRA linear holds adapter {adapter!r}")


def write_adapter_files(directory: Path, state: dict[str, torch.Tensor], *, r: int,
                        alpha: float, use_rslora: bool,
                        base_model_name_or_path: str | None,
                        extra_config: dict[str, Any] | None = None) -> None:
    """adapter_config.json (peft's LoraConfig) + adapter_model.safetensors, sorted keys."""
    from peft import LoraConfig as PeftLoraConfig
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    present = sorted({k.split(".")[-3] for k in state})
    peft_config = PeftLoraConfig(
        r=r, lora_alpha=alpha, target_modules=present, lora_dropout=0.0, bias="none",
        use_rslora=use_rslora, task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name_or_path,
    )
    peft_config.save_pretrained(str(directory))
    if extra_config:
        path = directory / ADAPTER_CONFIG_FILE
        config = json.loads(path.read_text())
        config.update(extra_config)
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.cpu().contiguous() for k, v in sorted(state.items())},
              str(directory / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})


def export_adapter(model: nn.Module, directory: str | Path, config: LoraConfig | None = None,
                   *, base_model_name_or_path: str | None = None,
                   adapter: str = DEFAULT_ADAPTER) -> Path | None:
    """Write one adapter as adapter_config.json + adapter_model.safetensors (peft format) on
    global rank 0. Collective over all ranks (TP gathers, then pipeline stages / expert
    shards merged). Returns the directory on rank 0, None elsewhere."""
    modules = lora_modules(model)
    if not modules:
        raise ValueError("the model has no LoRA adapters to export")
    state = gather_to_rank0(adapter_state_dict(model, adapter))
    if state is None:
        return None
    r, scaling = adapter_shape(model, adapter)
    base_config = config or (getattr(model, "_art_lora_config", None)
                             if adapter == DEFAULT_ADAPTER else None)
    if base_config is not None:
        alpha = base_config.lora_alpha
        use_rslora = bool(getattr(base_config, "use_rslora", False))
    else:
        alpha, use_rslora = scaling * r, False
    directory = Path(directory)
    write_adapter_files(directory, state, r=r, alpha=alpha, use_rslora=use_rslora,
                        base_model_name_or_path=base_model_name_or_path)
    return directory


def read_adapter_files(directory: str | Path) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """The peft config and tensors of an adapter directory (no model involved)."""
    from peft import LoraConfig as PeftLoraConfig
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path = directory / ADAPTER_CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} is missing; expected a peft adapter directory")
    weights = directory / ADAPTER_WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} is missing; expected a peft adapter directory")
    known = {"r", "lora_alpha", "target_modules", "use_rslora", "lora_dropout", "bias",
             "use_dora", "base_model_name_or_path", "task_type"}
    raw = json.loads(config_path.read_text())
    config = PeftLoraConfig(**{k: v for k, v in raw.items() if k in known})
    return config, load_file(str(weights))


def load_adapter(model: nn.Module, directory: str | Path, *, seed: int = 0,
                 adapter: str = DEFAULT_ADAPTER, trainable: bool = True) -> LoraConfig:
    """Load a peft adapter directory into resident adapter `adapter` of `model`.

    The default adapter must match the model's LoRA (r, alpha; LoRA is applied first if the
    model has none). Another key is created on every LoRA linear with the file's r and alpha
    (it must not exist yet). Each rank keeps its own shards; keys for layers this rank does
    not hold (other pipeline stages / experts) are skipped.
    """
    config, tensors = read_adapter_files(directory)
    return load_adapter_state(model, config, tensors, source=str(directory), seed=seed,
                              adapter=adapter, trainable=trainable)


def load_adapter_state(model: nn.Module, config: LoraConfig, tensors: dict[str, torch.Tensor],
                       *, source: str, seed: int = 0, adapter: str = DEFAULT_ADAPTER,
                       trainable: bool = True) -> LoraConfig:
    """`load_adapter` from an already-read config and tensor dict (see there)."""
    from art.megatron.lora import validate_lora_config

    validate_lora_config(config)
    parsed: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        match = _KEY.match(key)
        if not match:
            raise ValueError(f"{source}: tensor {key!r} is not a peft LoRA key")
        layer, path, proj, factor = match.groups()
        parsed.setdefault((int(layer), path, proj), {})[factor] = value
    if adapter == DEFAULT_ADAPTER and not lora_modules(model):
        apply_lora(model, config, seed=seed)
    modules = lora_modules(model)
    if not modules:
        raise ValueError(f"{source}: the model has no LoRA linears to load an adapter into")
    expected_scaling = lora_scaling(config)
    r = int(config.r)
    if adapter == DEFAULT_ADAPTER:
        for module in modules:
            if abs(module.scaling - expected_scaling) > 1e-9 or module.r != r:
                raise ValueError(
                    f"{source}: adapter r={config.r}, alpha={config.lora_alpha} differs from the "
                    f"model's LoRA (r={module.r}, scaling={module.scaling}); rebuild the model"
                )
    else:
        wanted = requested_projections(config.target_modules)
        carried = {p.name for m in modules for p in m.parts}
        if wanted - carried:
            raise ValueError(
                f"{source}: the adapter targets {sorted(wanted - carried)}, which this model has "
                f"no LoRA linear for (it wraps {sorted(carried)}); build the runtime with those "
                "target_modules"
            )
        if any(adapter in m.adapters for m in modules):
            raise ValueError(f"adapter {adapter!r} is already resident; remove it first")
        try:
            for module in modules:
                module.add_adapter(adapter, r=r, scaling=expected_scaling, projections=wanted,
                                   seed=seed, trainable=trainable)
            _fill(modules, parsed, adapter, source)
        except BaseException:
            remove_adapter(model, adapter)
            raise
        return config
    _fill(modules, parsed, adapter, source)
    return config


def _fill(modules: list[LoraLinear], parsed: dict[tuple[int, str, str], dict[str, torch.Tensor]],
          adapter: str, source: str) -> None:
    used: set[tuple[int, str, str]] = set()
    for module in modules:
        for name in module.adapter(adapter).names:
            key = (module.layer_index, module.hf_path, name)
            if key not in parsed or set(parsed[key]) != {"A", "B"}:
                raise ValueError(
                    f"{source}: no lora_A/lora_B for layer {key[0]} {key[1]}.{key[2]}"
                )
            module.load_full(name, parsed[key]["A"], parsed[key]["B"], adapter=adapter)
            used.add(key)
    local_layers = {m.layer_index for m in modules}
    stray = sorted(k for k in parsed if k not in used and k[0] in local_layers)
    if stray:
        raise ValueError(
            f"{source}: adapters {stray[:4]} match no LoRA module of this model; were they "
            "trained for other target_modules?"
        )


def remove_adapter(model: nn.Module, adapter: str) -> None:
    """Drop a resident adapter from every LoRA linear that holds it."""
    for module in lora_modules(model):
        if adapter in module.adapters:
            module.remove_adapter(adapter)


def copy_adapter(model: nn.Module, source: str, destination: str, *, trainable: bool) -> None:
    """A resident copy of adapter `source` under `destination` (same shards, detached)."""
    modules = [m for m in lora_modules(model) if source in m.adapters]
    try:
        for module in modules:
            holder = module.adapter(source)
            copy = module.add_adapter(destination, r=holder.r, scaling=holder.scaling,
                                      projections=holder.names, trainable=trainable)
            with torch.no_grad():
                for name in holder.names:
                    copy.lora_A[name].copy_(holder.lora_A[name])
                    copy.lora_B[name].copy_(holder.lora_B[name])
    except BaseException:
        remove_adapter(model, destination)
        raise
