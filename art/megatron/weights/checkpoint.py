"""A local Hugging Face checkpoint folder: config.json plus safetensors files, read lazily.

Opening a folder reads only the safetensors headers (names, shapes, dtypes) and checks that
each file is whole; tensor data is read later, one slice at a time, through safetensors'
`get_slice`, whose slices are views of the memory-mapped file: a rank copies only the rows
and columns it owns into its parameters and never holds the whole tensor in its own memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded as asked: the message names the path, tensor
    or file, the values seen, and what to do."""


@dataclass(frozen=True)
class TensorRecord:
    """One tensor of the checkpoint as its file header describes it."""

    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class HFCheckpoint:
    """A checkpoint folder whose headers have been read and checked."""

    path: Path
    config: Mapping[str, Any]
    tensors: Mapping[str, TensorRecord]

    @property
    def architecture(self) -> str:
        names = self.config.get("architectures") or []
        return str(names[0]) if names else str(self.config.get("model_type", "<unknown>"))

    @property
    def files(self) -> tuple[Path, ...]:
        return tuple(sorted({r.file for r in self.tensors.values()}))

    @property
    def total_bytes(self) -> int:
        return sum(_numel(r.shape) * _DTYPE_BYTES.get(r.dtype, 4) for r in self.tensors.values())

    @contextmanager
    def reader(self) -> Iterator[SliceReader]:
        """Open every file once (memory-mapped) for the duration of a load."""
        with ExitStack() as stack:
            yield SliceReader(self, stack)


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class SliceReader:
    """Lazy access to the checkpoint's tensors while its files are open."""

    def __init__(self, checkpoint: HFCheckpoint, stack: ExitStack) -> None:
        self._checkpoint = checkpoint
        self._stack = stack
        self._handles: dict[Path, Any] = {}

    def slice(self, name: str) -> Any:
        """safetensors' lazy slice of `name`; indexing it yields a view of the mapped file."""
        from safetensors import SafetensorError, safe_open

        record = self._checkpoint.tensors[name]
        handle = self._handles.get(record.file)
        if handle is None:
            try:
                handle = self._stack.enter_context(safe_open(str(record.file), framework="pt"))
            except (SafetensorError, OSError) as error:
                raise CheckpointError(
                    f"{record.file}: cannot be read ({error}); the file changed or is damaged "
                    "since its header was checked: copy the checkpoint again"
                ) from None
            self._handles[record.file] = handle
        return handle.get_slice(name)


def open_checkpoint(path: str | Path) -> HFCheckpoint:
    """Read config.json and every safetensors header of a local folder; no hub downloads."""
    folder = Path(path)
    if not folder.exists():
        raise CheckpointError(
            f"checkpoint folder {str(folder)!r} does not exist; pass a local folder holding "
            "config.json and *.safetensors (hub names are not downloaded)"
        )
    if not folder.is_dir():
        raise CheckpointError(
            f"{str(folder)!r} is a file; pass the checkpoint folder that holds config.json and "
            "*.safetensors"
        )
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{folder}: no {CONFIG_FILE}; this is not a Hugging Face checkpoint")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{config_path}: not valid JSON ({error})") from None
    files = _weight_files(folder)
    tensors: dict[str, TensorRecord] = {}
    for file in files:
        for record in _read_header(file):
            if record.name in tensors:
                raise CheckpointError(
                    f"{folder}: tensor {record.name!r} is in both {tensors[record.name].file.name}"
                    f" and {file.name}; a checkpoint holds each tensor once"
                )
            tensors[record.name] = record
    index = folder / INDEX_FILE
    if index.is_file():
        _check_index(index, tensors)
    return HFCheckpoint(path=folder, config=config, tensors=tensors)


def _weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as error:
            raise CheckpointError(f"{index}: not a safetensors index ({error})") from None
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists {missing} but the folder has no such file(s)")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = f" (found {others}: convert them to safetensors)" if others else ""
        raise CheckpointError(f"{folder}: no *.safetensors weight files{hint}")
    return files


def _read_header(file: Path) -> list[TensorRecord]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            return [
                TensorRecord(name, file, tuple(int(s) for s in sl.get_shape()), sl.get_dtype())
                for name in handle.keys()
                for sl in (handle.get_slice(name),)
            ]
    except SafetensorError as error:
        raise CheckpointError(
            f"{file}: not a complete safetensors file ({error}); it is truncated or damaged: "
            "copy or save the checkpoint again"
        ) from None


def _check_index(index: Path, tensors: Mapping[str, TensorRecord]) -> None:
    weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    for name, file_name in weight_map.items():
        record = tensors.get(name)
        if record is None:
            raise CheckpointError(
                f"{index} lists tensor {name!r} in {file_name}, but that file does not hold it"
            )
        if record.file.name != file_name:
            raise CheckpointError(
                f"{index} lists tensor {name!r} in {file_name}, but it is in {record.file.name}"
            )
