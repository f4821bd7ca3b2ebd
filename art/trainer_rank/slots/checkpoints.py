"""Adapter checkpoints on disk: what a peft LoRA folder holds (validated), a rank-local copy of
it (materialised), and a pushed selection (a context that makes an adapter the default).

A checkpoint folder is what peft writes: `adapter_config.json` (r, lora_alpha, target_modules)
and `adapter_model.safetensors`. Validation reads the config and the safetensors header only.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from art.megatron.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE


@dataclass(frozen=True)
class CheckpointManifest:
    """What a checkpoint folder holds, read without loading its tensors."""

    directory: str
    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    tensor_names: tuple[str, ...]
    adapter_config: dict[str, Any]


@dataclass(frozen=True)
class MaterializedCheckpoint:
    """A logical checkpoint (`path`, the name callers use) and its rank-local folder."""

    path: str
    directory: str


def validate_checkpoint(path: str | Path) -> CheckpointManifest:
    """Check that `path` is a peft LoRA folder this trainer can read; ValueError says what is
    missing or malformed."""
    directory = Path(path)
    config_file = directory / ADAPTER_CONFIG_FILE
    weights_file = directory / ADAPTER_WEIGHTS_FILE
    if not directory.is_dir():
        raise ValueError(f"checkpoint {str(path)!r} is not a folder")
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise ValueError(f"checkpoint {str(path)!r} has no {needed.name}; a LoRA checkpoint "
                             f"holds {ADAPTER_CONFIG_FILE} and {ADAPTER_WEIGHTS_FILE}")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_file}: not valid JSON ({exc})") from None
    r = config.get("r")
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"{config_file}: r must be an integer >= 1, got {r!r}")
    targets = config.get("target_modules") or []
    targets = (targets,) if isinstance(targets, str) else tuple(sorted(targets))
    from safetensors import safe_open

    try:
        with safe_open(str(weights_file), framework="pt") as handle:
            names = tuple(sorted(handle.keys()))
    except Exception as exc:  # noqa: BLE001 - any unreadable header is the same user error
        raise ValueError(f"{weights_file}: not a readable safetensors file ({exc})") from None
    if not names:
        raise ValueError(f"{weights_file}: holds no tensors")
    lora = [n for n in names if ".lora_A." in n or ".lora_B." in n]
    if len(lora) != len(names):
        odd = [n for n in names if n not in lora][:3]
        raise ValueError(f"{weights_file}: tensors that are not LoRA factors: {odd}")
    return CheckpointManifest(
        directory=str(directory), r=r, lora_alpha=float(config.get("lora_alpha", r)),
        target_modules=targets, tensor_names=names, adapter_config=config,
    )


def materialize_lora(path: str | Path, directory: str | Path | None = None
                     ) -> MaterializedCheckpoint:
    """Validate the checkpoint at `path` and, when `directory` is given, copy its two files
    there (a rank-local copy that later loads read without touching shared storage)."""
    validate_checkpoint(path)
    if directory is None:
        return MaterializedCheckpoint(path=str(path), directory=str(path))
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    for name in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
        shutil.copyfile(Path(path) / name, target / name)
    return MaterializedCheckpoint(path=str(path), directory=str(target))


@dataclass
class PushedCheckpoint:
    """An adapter made the default for forwards while the context is open (returned by
    `TrainerRank.push_checkpoint`; `pop_checkpoint` or leaving the context undoes it)."""

    trainer: Any
    path: str | None
    closed: bool = False

    def __enter__(self) -> PushedCheckpoint:
        return self

    def __exit__(self, *exc: object) -> bool:
        self.close()
        return False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.trainer.pop_checkpoint()
