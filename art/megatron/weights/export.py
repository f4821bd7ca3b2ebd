"""Megatron-Core model -> Hugging Face tensors and folder, the loader's pieces run backwards.

Every rank cuts its shards into the same pieces the loader filled them from; global rank 0
gathers them and assembles whole HF tensors, checking that every element is covered exactly
by the layout (so a round trip is bit-identical, and a gap is an error, not zeros). With
`merge_lora=True` each trained adapter is folded into its base projection
(W + scaling * B @ A, computed in fp32), which is what transformers loads as a plain model.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from art.megatron.weights.checkpoint import CONFIG_FILE, CheckpointError
from art.megatron.weights.layouts import REPLICATED
from art.megatron.weights.load import PreparedCheckpoint, global_parameters, shard_pieces, split_of

WEIGHTS_FILE = "model.safetensors"
# Files of the source folder that describe the model to transformers besides its weights.
_COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model",
           "chat_template.jinja")
_Contribution = tuple[str, int, int, torch.Tensor]  # (hf name, dim, hf start, piece)


def _local_contributions(model: nn.Module, prepared: PreparedCheckpoint) -> list[_Contribution]:
    from megatron.core import parallel_state

    initialized = parallel_state.model_parallel_is_initialized()
    out: list[_Contribution] = []
    for name, param, is_expert in global_parameters(model):
        tmap, shard = shard_pieces(prepared.maps, name, param, is_expert, prepared.family.name)
        expert = tmap.expert or is_expert
        if initialized:
            # One copy of each piece travels: data-parallel replicas and (for replicated
            # tensors) the other split ranks hold the same values.
            dp_rank = (parallel_state.get_expert_data_parallel_rank() if expert
                       else parallel_state.get_data_parallel_rank())
            if dp_rank != 0 or (tmap.layout == REPLICATED and split_of(expert)[0] != 0):
                continue
        for piece in shard:
            value = param.detach().narrow(piece.dim, piece.local_start, piece.length)
            out.append((piece.hf_name, piece.dim, piece.hf_start,
                        value.cpu().clone() - tmap.offset if tmap.offset else value.cpu().clone()))
    return out


def hf_state_dict(model: nn.Module, prepared: PreparedCheckpoint, *,
                  merge_lora: bool = False) -> dict[str, torch.Tensor] | None:
    """Whole HF tensors on global rank 0 (None elsewhere). Collective when distributed."""
    contributions = _local_contributions(model, prepared)
    adapters = _adapter_tensors(model) if merge_lora else {}
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 \
            else None
        dist.gather_object((contributions, adapters), gathered, dst=0)
        if dist.get_rank() != 0:
            return None
        assert gathered is not None
        contributions = [c for part, _ in gathered for c in part]
        adapters = {k: v for _, part in gathered for k, v in part.items()}
    state = _assemble(contributions, prepared)
    if merge_lora:
        _merge(state, adapters, _lora_scaling(model))
    return state


def _assemble(contributions: list[_Contribution],
              prepared: PreparedCheckpoint) -> dict[str, torch.Tensor]:
    shapes = {t.name: t.shape for m in prepared.maps.values() for t in m.hf}
    state: dict[str, torch.Tensor] = {}
    spans: dict[str, tuple[int, list[tuple[int, int]]]] = {}
    for hf_name, dim, start, value in contributions:
        full = state.get(hf_name)
        if full is None:
            full = state[hf_name] = torch.empty(shapes[hf_name], dtype=value.dtype)
        full.narrow(dim, start, value.shape[dim]).copy_(value)
        spans.setdefault(hf_name, (dim, []))[1].append((start, value.shape[dim]))
    for name, shape in shapes.items():
        dim, ranges = spans.get(name, (0, []))
        # The pieces of one tensor lie along one dim and must tile it without a gap.
        reached = 0
        for start, length in sorted(ranges):
            if start > reached:
                break
            reached = max(reached, start + length)
        if reached < shape[dim]:
            raise CheckpointError(
                f"export: {name} {list(shape)} is held only up to {reached} along dim {dim}; "
                "every rank of the model must take part in the export"
            )
    return state


def _adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    from art.megatron.lora import lora_modules
    from art.megatron.lora_peft import adapter_state_dict

    if not lora_modules(model):
        raise CheckpointError("merge_lora=True but the model has no LoRA adapters")
    return {k: v.cpu() for k, v in adapter_state_dict(model).items()}


def _lora_scaling(model: nn.Module) -> float:
    from art.megatron.lora import lora_modules

    modules = lora_modules(model)
    return modules[0].scaling if modules else 1.0


def _merge(state: dict[str, torch.Tensor], adapters: Mapping[str, torch.Tensor],
           scaling: float) -> None:
    from art.megatron.lora_peft import PEFT_KEY_PREFIX

    for key, a in adapters.items():
        if not key.endswith(".lora_A.weight"):
            continue
        b = adapters[key.replace(".lora_A.", ".lora_B.")]
        target = "model.layers." + key[len(PEFT_KEY_PREFIX):].replace(".lora_A.weight",
                                                                       ".weight")
        if target not in state:
            raise CheckpointError(f"merge: adapter {key} has no base tensor {target}")
        base = state[target]
        merged = base.double() + scaling * (b.double() @ a.double())
        state[target] = merged.to(base.dtype)


def save_hf_checkpoint(model: nn.Module, directory: str | Path, prepared: PreparedCheckpoint,
                       *, merge_lora: bool = False, dtype: torch.dtype | None = None
                       ) -> Path | None:
    """Write a folder transformers loads: config.json (the source's, dtype updated), the
    tokenizer and generation files the source had, and model.safetensors. Collective;
    returns the folder on global rank 0, None elsewhere."""
    from safetensors.torch import save_file

    state = hf_state_dict(model, prepared, merge_lora=merge_lora)
    if state is None:
        return None
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    source = prepared.checkpoint
    config = dict(source.config)
    saved_dtype = next(iter(state.values())).dtype
    config["dtype"] = str(saved_dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in _COPIED:
        if (source.path / name).is_file():
            shutil.copyfile(source.path / name, folder / name)
    save_file({k: v.contiguous() for k, v in sorted(state.items())}, str(folder / WEIGHTS_FILE),
              metadata={"format": "pt"})
    return folder
