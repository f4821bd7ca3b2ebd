"""What the GPU machine lacks, installed from wheels carried in the repo's ignored `.whl/`,
and the device the check runs on.

The GPU machine starts bare (CUDA torch, transformers, peft, safetensors, numpy, matplotlib:
no Megatron-Core, no fla, no network). `prepare` installs the carried wheels with pip offline
(`--no-index --no-deps`) into a target folder unless every module the check imports is
already importable, puts that folder and the repo root first on sys.path and on PYTHONPATH
(which the worker processes inherit), and reports the versions found. Our package is not
installed: the repo root on the path is the package. `DOWNLOAD_COMMAND` is the line that
fetches the wheels on a machine with network (README, "GPU check").
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEEL_DIR = ROOT / ".whl"
TARGET_DIR = Path("/tmp/art-gpu-check-site")

# Distribution -> (version, the module the check imports from it). Only what the device
# image lacks on the check's import path: Megatron-Core (its own needs, torch, numpy and
# packaging, are there), fla-core (einops and triton are there), and pydantic with its own
# needs for the seed's call (art.megatron.train, the runtime builder, imports it), with the
# typing-extensions pydantic-core asks for (>= 4.16, newer than the image may hold).
WHEELS: dict[str, tuple[str, str]] = {
    "megatron-core": ("0.16.1", "megatron.core"),
    "fla-core": ("0.6.0", "fla"),
    "pydantic": ("2.14.4", "pydantic"),
    "pydantic-core": ("2.50.5", "pydantic_core"),
    "annotated-types": ("0.8.0", "annotated_types"),
    "typing-inspection": ("0.4.5", "typing_inspection"),
    "typing-extensions": ("4.16.0", "typing_extensions"),
}
# CPU runs (the dry run) take Gated DeltaNet from art/megatron/cpu_gated_delta.py, not fla.
CPU_MODULES: tuple[str, ...] = ("megatron.core",)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
DOWNLOAD_COMMAND = (
    "python -m pip download --no-deps --only-binary=:all: --python-version 3.12 "
    "--implementation cp " + " ".join(f"--platform {p}" for p in PLATFORMS) + " -d .whl "
    + " ".join(f"{name}=={version}" for name, (version, _) in WHEELS.items()))


class SetupError(RuntimeError):
    """The check cannot start: a module missing with no wheel for it, or no GPU."""


@dataclass(frozen=True)
class Setup:
    installed: tuple[str, ...]  # wheel files installed now (empty: all were importable)
    target: str  # where they went ("" when nothing was installed)
    versions: dict[str, str]  # distribution -> version importable now


def missing_modules(modules: Sequence[str]) -> list[str]:
    found = []
    for name in modules:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            found.append(name)
    return found


def on_path(folder: Path) -> None:
    """`folder` first on sys.path and on PYTHONPATH (for the processes this one starts)."""
    text = str(folder)
    if text not in sys.path:
        sys.path.insert(0, text)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if text not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([text, *parts])
    importlib.invalidate_caches()


def install_wheels(wheels: Sequence[Path], target: Path) -> None:
    """pip, offline, without dependencies, into `target` (the device call's recipe)."""
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
               "--no-compile", "--no-cache-dir", "--upgrade", "--disable-pip-version-check",
               "--target", str(target), *map(str, wheels)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = " ".join((done.stderr or done.stdout).split())[-600:]
        raise SetupError(f"pip could not install {len(wheels)} wheel(s) from "
                         f"{wheels[0].parent} into {target}: {tail}")


def prepare(modules: Sequence[str], *, wheel_dir: Path = WHEEL_DIR,
            target: Path = TARGET_DIR) -> Setup:
    """Make `modules` importable here and in child processes (see the module docstring)."""
    on_path(ROOT)
    installed: tuple[str, ...] = ()
    used_target = ""
    missing = missing_modules(modules)
    if missing:
        wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
        if not wheels:
            raise SetupError(
                f"modules {', '.join(missing)} are not importable and {wheel_dir} holds no "
                f"wheels; fetch them on a machine with network: {DOWNLOAD_COMMAND}")
        install_wheels(wheels, target)
        on_path(target)
        installed, used_target = tuple(w.name for w in wheels), str(target)
        still = missing_modules(modules)
        if still:
            raise SetupError(f"after installing {', '.join(installed)} into {target}, "
                             f"{', '.join(still)} still cannot be imported")
    return Setup(installed, used_target, versions())


def versions() -> dict[str, str]:
    """The versions of what the check runs on that are importable here."""
    found = {}
    for name in ("torch", *WHEELS, "transformers", "peft", "triton", "matplotlib"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


@dataclass(frozen=True)
class DeviceInfo:
    device: str  # "cuda" | "cpu"
    name: str
    total_bytes: int
    free_bytes: int
    detail: str  # compute capability and CUDA version, or the CPU count


def device_info(device: str) -> DeviceInfo:
    """The device the check measures on. CUDA: torch must see a GPU (else SetupError), with
    its name, total and free memory; CPU: the processor and the memory available to this
    process's machine, read the same way the dry run then runs."""
    import torch

    if device == "cuda":
        if not torch.cuda.is_available():
            raise SetupError("torch.cuda.is_available() is False: no GPU is visible to torch "
                             f"{torch.__version__} (the dry run needs none: --dry-run)")
        index = torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(index)
        props = torch.cuda.get_device_properties(index)
        return DeviceInfo("cuda", torch.cuda.get_device_name(index), int(total), int(free),
                          f"compute capability {props.major}.{props.minor}, CUDA "
                          f"{torch.version.cuda}, {props.multi_processor_count} SMs")
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return DeviceInfo("cpu", platform.processor() or platform.machine(), int(pages), int(free),
                      f"{os.cpu_count()} CPUs, torch {torch.__version__}")
