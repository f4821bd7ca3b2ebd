"""The on-disk form of a checkpoint slot, and reading it back.

A saved checkpoint is a peft adapter directory plus what training needs to resume:

    adapter_config.json, adapter_model.safetensors   peft, loadable by peft/transformers/vLLM
    optimizer/{master,exp_avg,exp_avg_sq}.safetensors unsharded fp32 Adam state, peft keys
    checkpoint.json                                   CheckpointManifest: steps, file digests

A plain peft directory (no checkpoint.json) loads too, with fresh optimizer state.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from art.megatron.lora_peft import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, read_adapter_files
from art.trainer_rank.slots.types import (
    CheckpointManifest,
    MaterializedCheckpoint,
    OptimizerConfig,
)

MANIFEST_FILE = "checkpoint.json"
FORMAT_VERSION = 1
COMPONENTS = ("master", "exp_avg", "exp_avg_sq")


def component_file(component: str) -> str:
    return f"optimizer/{component}.safetensors"


@dataclass(frozen=True)
class CheckpointContents:
    """Everything read from a checkpoint directory, on CPU, before any slot changes."""

    directory: Path
    config: Any  # peft LoraConfig
    raw_config: dict[str, Any]
    adapter: dict[str, torch.Tensor]
    manifest: CheckpointManifest | None
    optimizer: dict[str, dict[str, torch.Tensor]] | None  # component -> peft key -> tensor

    @property
    def base_model_name_or_path(self) -> str | None:
        return self.raw_config.get("base_model_name_or_path")


def _file_digest(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=32)
    with path.open("rb") as handle:
        while chunk := handle.read(8 * 2**20):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_digest(manifest: dict[str, Any]) -> str:
    body = json.dumps({**manifest, "digest": ""}, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(body.encode(), digest_size=32).hexdigest()


def validate_checkpoint(path: str | Path, *, require_optimizer: bool = False
                        ) -> CheckpointManifest | None:
    """Check a checkpoint directory (files present, digests match, manifest consistent) and
    return its manifest; None for a plain peft adapter directory. Raises ValueError /
    FileNotFoundError saying what is wrong."""
    root = Path(path)
    for name in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
        if not (root / name).is_file():
            raise ValueError(f"checkpoint {str(root)!r} has no {name}; a checkpoint holds "
                             f"{ADAPTER_CONFIG_FILE} and {ADAPTER_WEIGHTS_FILE} (peft)")
    manifest_path = root / MANIFEST_FILE
    if not manifest_path.is_file():
        if require_optimizer:
            raise ValueError(f"{root} is a plain peft adapter: it holds no optimizer state")
        return None
    manifest: CheckpointManifest = json.loads(manifest_path.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{manifest_path}: format_version {manifest.get('format_version')!r}"
                         f" is not {FORMAT_VERSION}")
    if manifest_digest(dict(manifest)) != manifest.get("digest"):
        raise ValueError(f"{manifest_path}: its digest does not match its content (edited?)")
    for relative, expected in manifest["files"].items():
        file = root / relative
        if not file.is_file():
            raise FileNotFoundError(f"{file} is listed in {MANIFEST_FILE} but missing")
        if _file_digest(file) != expected:
            raise ValueError(f"{file}: content differs from the digest in {MANIFEST_FILE}")
    if require_optimizer and manifest["optimizer"] is None:
        raise ValueError(f"{root} holds no optimizer state (it was saved before any step)")
    return manifest


def read_checkpoint(directory: str | Path) -> CheckpointContents:
    """Validate and read a checkpoint directory into CPU tensors."""
    from safetensors.torch import load_file

    root = Path(directory)
    manifest = validate_checkpoint(root)
    config, adapter = read_adapter_files(root)
    raw = json.loads((root / ADAPTER_CONFIG_FILE).read_text())
    optimizer = None
    if manifest is not None and manifest["optimizer"] is not None:
        optimizer = {c: load_file(str(root / component_file(c))) for c in COMPONENTS}
        keys = set(adapter)
        for component, tensors in optimizer.items():
            if set(tensors) != keys or set(manifest["steps"]) != keys:
                raise ValueError(
                    f"{root}: optimizer {component} covers other tensors than the adapter "
                    f"(missing {sorted(keys - set(tensors))[:3]})"
                )
    return CheckpointContents(root, config, raw, adapter, manifest, optimizer)


def write_checkpoint(directory: Path, *, adapter: dict[str, torch.Tensor], r: int,
                     alpha: float, use_rslora: bool, base_model_name_or_path: str,
                     optimizer: dict[str, dict[str, torch.Tensor]] | None,
                     steps: dict[str, float], optimizer_config: OptimizerConfig | None) -> str:
    """Write a complete checkpoint into the empty `directory`; returns the manifest digest."""
    from safetensors.torch import save_file

    from art.megatron.lora_peft import write_adapter_files

    write_adapter_files(directory, adapter, r=r, alpha=alpha, use_rslora=use_rslora,
                        base_model_name_or_path=base_model_name_or_path)
    files = [ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE]
    if optimizer is not None:
        (directory / "optimizer").mkdir(exist_ok=True)
        for component in COMPONENTS:
            save_file({k: v.contiguous() for k, v in sorted(optimizer[component].items())},
                      str(directory / component_file(component)))
            files.append(component_file(component))
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "base_model_name_or_path": base_model_name_or_path,
        "optimizer": optimizer_config if optimizer is not None else None,
        "parameters": {k: [component_file(c) for c in COMPONENTS] for k in sorted(adapter)}
        if optimizer is not None else {},
        "steps": {k: steps[k] for k in sorted(adapter)} if optimizer is not None else {},
        "files": {f: _file_digest(directory / f) for f in files},
        "digest": "",
    }
    manifest["digest"] = manifest_digest(manifest)
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest["digest"]


def materialize_lora(path: str | Path, output_dir: str | Path | None = None, *,
                     require_optimizer: bool = False, expected_digest: str | None = None
                     ) -> MaterializedCheckpoint:
    """Copy the peft part of a checkpoint (adapter_config.json, adapter_model.safetensors)
    into the empty or absent `output_dir` (e.g. a rank-local copy, or for an inference
    server); returns the logical checkpoint and its local directory. Without `output_dir` it
    only validates."""
    manifest = validate_checkpoint(path, require_optimizer=require_optimizer)
    if expected_digest is not None:
        actual = manifest["digest"] if manifest is not None else None
        if actual != expected_digest:
            raise ValueError(f"{path}: checkpoint digest {actual} is not the expected "
                             f"{expected_digest}")
    if output_dir is None:
        return MaterializedCheckpoint(path=str(path), directory=str(path))
    out = Path(output_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; materialize into a new directory")
    out.mkdir(parents=True, exist_ok=True)
    for name in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
        shutil.copy2(Path(path) / name, out / name)
    return MaterializedCheckpoint(path=str(path), directory=str(out))
