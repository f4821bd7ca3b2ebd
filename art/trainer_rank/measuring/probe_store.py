"""Where probe coefficients live on disk, and whether a stored probe may be reused.

A stored probe is reused only when the software that measured it is the software running now:
the file records a fingerprint of this package's source, torch, Megatron-Core and the optional
kernels (Transformer Engine, fla), and of the GPU model on CUDA. The probe's key names what was
measured (model, layout, policy, outputs, token points); the fingerprint names what measured
it. A file that is missing, unreadable, of another format or of another fingerprint is not a
cached probe: the probe runs again and replaces it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import warnings
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Protocol

import art

# Distributions whose version changes what a probe measures (kernels, saved tensors).
_MEASURING_DISTRIBUTIONS: tuple[str, ...] = (
    "torch", "megatron-core", "transformer-engine", "transformer_engine", "flash-linear-attention",
    "fla-core")
ENV_XDG_CACHE_HOME = "XDG_CACHE_HOME"
CACHE_FOLDER = Path("art-trainer-rank") / "probes"


class StoredCoefficients(Protocol):
    key: str

    def to_json(self) -> str: ...


def default_probe_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The user cache folder for probes: $XDG_CACHE_HOME/art-trainer-rank/probes, else
    ~/.cache/art-trainer-rank/probes."""
    env = os.environ if environ is None else environ
    base = env.get(ENV_XDG_CACHE_HOME) or str(Path.home() / ".cache")
    return Path(base) / CACHE_FOLDER


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    """A digest of every Python file of the installed `art` package: any edit to the model
    build, the CPU stand-ins or the probe itself makes earlier probes stale."""
    root = Path(art.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=4)
def software_fingerprint(device: str) -> str:
    """What measured a probe on `device` ("cpu", "cuda"): source digest, library versions and,
    on CUDA, the GPU model (its kernels' workspaces differ)."""
    fields: dict[str, str | None] = {"art": _source_digest()}
    fields.update({d: _version(d) for d in _MEASURING_DISTRIBUTIONS})
    if device == "cuda":
        import torch

        fields["gpu"] = torch.cuda.get_device_name()
    payload = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def probe_file(directory: str | Path, key: str) -> Path:
    """Where a probe stored under `key` lives in `directory`."""
    return Path(directory) / f"probe-{key}.json"


def store_probe(coefficients: StoredCoefficients, directory: str | Path,
                device: str = "cpu") -> Path | None:
    """Write `coefficients` to its file in `directory` whole (through a temporary file of this
    process, so a reader, another rank or another run, never sees part of one), with the
    fingerprint of the software that measured it. A directory that cannot be written keeps
    the probe in memory only, with a warning: a cache never stops a run."""
    path = probe_file(directory, coefficients.key)
    record = json.loads(coefficients.to_json())
    record["software"] = software_fingerprint(device)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record, sort_keys=True))
        tmp.replace(path)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        warnings.warn(f"probe {coefficients.key} not cached in {directory}: {error}; it is "
                      "kept in memory for this process (set ART_TRAINER_RANK_PROBE_CACHE_DIR "
                      "to a writable directory, or ART_TRAINER_RANK_PROBE_CACHE=false)",
                      stacklevel=2)
        return None
    return path


def stored_probe_text(directory: str | Path, key: str, device: str) -> str | None:
    """The stored probe under `key` as JSON text when this software measured it, else None
    (missing, unreadable, not JSON, or measured by other software)."""
    path = probe_file(directory, key)
    try:
        text = path.read_text()
        record = json.loads(text)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("software") != software_fingerprint(device):
        return None
    return text
