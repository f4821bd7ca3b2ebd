"""Load a Hugging Face checkpoint into a built Megatron-Core model, each rank its own shards.

Two steps, so that bad input fails before any model is built: `prepare_checkpoint` reads the
folder's headers and checks them against the geometry (architecture, config settings, every
tensor present, none extra, every shape what the config implies); `load_into` then copies this
rank's slices into the model's parameters and checks that every parameter was filled. If any
rank fails, every rank raises, so a partly loaded model is never returned to be trained.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from art.megatron.geometry import ModelGeometry
from art.megatron.weights.checkpoint import CheckpointError, HFCheckpoint, open_checkpoint
from art.megatron.weights.family import Family, text_config
from art.megatron.weights.layouts import VOCAB, Piece, TensorMap, pieces
from art.megatron.weights.registry import family_for

# Tensors some checkpoints carry that the model recomputes or shares; never loaded.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class PreparedCheckpoint:
    """A checkpoint folder checked against a geometry: ready to load on any layout."""

    checkpoint: HFCheckpoint
    family: Family
    geometry: ModelGeometry
    maps: Mapping[str, TensorMap]

    @property
    def path(self) -> Path:
        return self.checkpoint.path


@dataclass(frozen=True)
class LoadReport:
    """What one rank loaded."""

    path: Path
    family: str
    parameters: int
    shard_bytes: int  # bytes of this rank's loaded parameter shards


def prepare_checkpoint(path: str | Path | HFCheckpoint,
                       geometry: ModelGeometry) -> PreparedCheckpoint:
    """Check a checkpoint folder against the geometry the model will be built from."""
    checkpoint = path if isinstance(path, HFCheckpoint) else open_checkpoint(path)
    family = family_for(checkpoint.config)
    family.check_config(checkpoint.config, geometry)
    maps = family.tensor_maps(geometry)
    expected = {t.name: t.shape for m in maps.values() for t in m.hf}
    present = {n: r for n, r in checkpoint.tensors.items() if not _IGNORED.search(n)}
    if geometry.tied_embeddings:
        # Tied checkpoints sometimes store the head anyway; the embedding is what is used.
        present.pop("lm_head.weight", None)
    stored_layers = int(text_config(checkpoint.config).get("num_hidden_layers") or 0)
    if geometry.num_layers < stored_layers:
        # A provider told to build fewer layers (provider_configure shrinking a model) takes
        # the first ones; the later layers' tensors are not loaded.
        present = {n: r for n, r in present.items()
                   if not ((m := _HF_LAYER.match(n)) and int(m.group(1)) >= geometry.num_layers)}
    missing = sorted(set(expected) - set(present))
    extra = sorted(set(present) - set(expected))
    where = f"{checkpoint.path} ({checkpoint.architecture}, model {geometry.name})"
    if missing:
        raise CheckpointError(
            f"{where}: {len(missing)} tensor(s) the config implies are missing, e.g. "
            f"{_some(missing, expected)}; the folder is incomplete or its config.json belongs "
            "to another model"
        )
    if extra:
        raise CheckpointError(
            f"{where}: {len(extra)} tensor(s) the config does not account for, e.g. "
            f"{_some(extra, {n: present[n].shape for n in extra})}; config.json and the weights "
            "disagree (layer or expert count, tied embeddings)"
        )
    for name, shape in expected.items():
        record = present[name]
        if tuple(record.shape) != tuple(shape):
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {list(record.shape)} in "
                f"{record.file.name}, but config.json implies {list(shape)}; the config and the "
                "weights disagree"
            )
        if record.dtype not in _FLOAT_DTYPES:
            raise CheckpointError(
                f"{where}: tensor {name!r} is {record.dtype} in {record.file.name}; "
                f"expected one of {', '.join(_FLOAT_DTYPES)} (quantised checkpoints are not "
                "loaded)"
            )
    return PreparedCheckpoint(checkpoint, family, geometry, maps)


def _some(names: list[str], shapes: Mapping[str, tuple[int, ...]], n: int = 4) -> str:
    listed = ", ".join(f"{name} {list(shapes[name])}" for name in names[:n])
    return listed + (f" and {len(names) - n} more" if len(names) > n else "")


# ---------------------------------------------------------------------- names on this rank
_TE_NORMS = {
    ".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
    ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight",
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def unwrap(model: nn.Module) -> nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def global_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter, bool]]:
    """(global Megatron name, parameter, is_expert) for every base-model parameter this rank
    holds; LoRA factors are skipped, wrappers and TE's fused norm names translated."""
    from megatron.core import parallel_state

    inner = unwrap(model)
    decoder = getattr(inner, "decoder", None)
    layers = list(getattr(decoder, "layers", []))
    ep_rank = (parallel_state.get_expert_model_parallel_rank()
               if parallel_state.model_parallel_is_initialized() else 0)
    for name, param in inner.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        name = name.replace(".base.", ".")
        for te, local in _TE_NORMS.items():
            if name.endswith(te):
                name = name[: -len(te)] + local
        match = _LAYER.match(name)
        layer = None
        if match:
            layer = layers[int(match.group(1))]
            name = f"decoder.layers.{int(layer.layer_number) - 1}." + name[match.end():]
        expert = _LOCAL_EXPERT.search(name)
        if expert and layer is not None:
            local = len(layer.mlp.experts.local_experts)
            number = ep_rank * local + int(expert.group(1))
            name = f"{name[: expert.start()]}.mlp.experts.{number}.{name[expert.end():]}"
        yield name, param, bool(expert) or not getattr(param, "allreduce", True)


def split_of(is_expert: bool) -> tuple[int, int]:
    """(rank, size) of the group a parameter is split over: expert-TP for experts, else TP."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    if is_expert:
        return (parallel_state.get_expert_tensor_parallel_rank(),
                parallel_state.get_expert_tensor_parallel_world_size())
    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size())


def shard_pieces(prepared_maps: Mapping[str, TensorMap], name: str, param: torch.Tensor,
                 is_expert: bool, family: str) -> tuple[TensorMap, list[Piece]]:
    tmap = prepared_maps.get(name)
    if tmap is None:
        raise CheckpointError(
            f"the model has parameter {name!r} {list(param.shape)} that the {family} mapping "
            "has no checkpoint tensor for; the model was built with another spec than the "
            "checkpoint's family"
        )
    rank, size = split_of(tmap.expert or is_expert)
    return tmap, pieces(tmap, rank=rank, size=size, local_shape=tuple(param.shape))


def _source(reader: Any, piece: Piece) -> torch.Tensor:
    sl = reader.slice(piece.hf_name)
    stop = piece.hf_start + piece.length
    return sl[piece.hf_start:stop] if piece.dim == 0 else sl[:, piece.hf_start:stop]


# ---------------------------------------------------------------------- loading
def load_into(model: nn.Module, prepared: PreparedCheckpoint) -> LoadReport:
    """Copy this rank's slices of the checkpoint into `model`. Collective when distributed:
    if any rank fails, all raise."""
    error: BaseException | None = None
    count = nbytes = 0
    try:
        count, nbytes = _copy_all(model, prepared)
    except Exception as exc:  # re-raised below, after the other ranks know
        error = exc
    _agree_on_failure(model, error)
    return LoadReport(prepared.path, prepared.family.name, count, nbytes)


def _copy_all(model: nn.Module, prepared: PreparedCheckpoint) -> tuple[int, int]:
    count = nbytes = 0
    with prepared.checkpoint.reader() as reader, torch.no_grad():
        for name, param, is_expert in global_parameters(model):
            tmap, shard = shard_pieces(prepared.maps, name, param, is_expert,
                                       prepared.family.name)
            covered = 0
            for piece in shard:
                target = param.data.narrow(piece.dim, piece.local_start, piece.length)
                source = _source(reader, piece)
                target.copy_(source)
                # Checked on the copy this rank keeps (its own slice, already read), so the
                # file is never read a second time; a value that overflows the model's dtype
                # in the copy is caught too.
                if not _all_finite(target):
                    raise _non_finite(prepared, piece, source, target)
                if tmap.offset:
                    target.add_(tmap.offset)  # e.g. zero-centred norm weights: 1 + w
                covered += piece.length
            if tmap.layout == VOCAB and covered < param.shape[0]:
                param.data[covered:].zero_()  # padded vocabulary rows
            count += 1
            nbytes += param.numel() * param.element_size()
    if count == 0:
        raise CheckpointError("the model has no parameters to load; was it built?")
    return count, nbytes


# Elements checked at once: the check's bool temporary stays at 16 MiB however large the
# shard (an embedding shard holds billions of elements).
_FINITE_CHUNK = 1 << 24


def _all_finite(tensor: torch.Tensor) -> bool:
    flat = tensor.reshape(-1) if tensor.is_contiguous() else None
    if flat is not None:
        return all(bool(torch.isfinite(part).all()) for part in flat.split(_FINITE_CHUNK))
    rows = max(1, _FINITE_CHUNK // max(1, tensor[0].numel())) if tensor.dim() else 1
    return all(bool(torch.isfinite(part).all()) for part in tensor.split(rows))


def _non_finite(prepared: PreparedCheckpoint, piece: Piece, source: torch.Tensor,
                target: torch.Tensor) -> CheckpointError:
    """The error for a slice whose copy is not finite: stored so in the file, or finite
    there and out of the model dtype's range (only this error path looks at the file again)."""
    record = prepared.checkpoint.tensors[piece.hf_name]
    span = (f"{'rows' if piece.dim == 0 else 'columns'} {piece.hf_start}-"
            f"{piece.hf_start + piece.length - 1}")
    stored = ~torch.isfinite(source)
    if bool(stored.any()):
        nan = int(torch.isnan(source).sum())
        what = (f"holds {int(stored.sum())} non-finite value(s) ({nan} NaN, "
                f"{int(stored.sum()) - nan} inf)")
        remedy = "re-save or re-download the checkpoint"
    else:
        dtype = str(target.dtype).removeprefix("torch.")
        what = (f"holds {int((~torch.isfinite(target)).sum())} value(s) beyond the range of "
                f"{dtype}, the dtype the model is built in")
        remedy = "build the model in a wider dtype (e.g. bfloat16 or float32)"
    return CheckpointError(
        f"{prepared.path}: tensor {piece.hf_name!r} in {record.file.name}, {span} (the slice "
        f"this rank loads), {what}; a model with them computes NaN: {remedy}")


def _agree_on_failure(model: nn.Module, error: BaseException | None) -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = next(unwrap(model).parameters()).device
        flag = torch.tensor([0 if error is None else dist.get_rank() + 1], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed = int(flag.item())
        if failed and error is None:
            raise CheckpointError(
                f"loading weights failed on rank {failed - 1} (its error says why); this "
                "rank's model is not usable either"
            )
    if error is not None:
        raise error


def load_pretrained(model: nn.Module, path: str | Path | PreparedCheckpoint,
                    geometry: ModelGeometry) -> LoadReport:
    """`prepare_checkpoint` (unless given prepared) then `load_into`."""
    prepared = path if isinstance(path, PreparedCheckpoint) else prepare_checkpoint(path, geometry)
    return load_into(model, prepared)
