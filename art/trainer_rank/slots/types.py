"""Public records of the checkpoint-slot API: a materialized checkpoint and the manifest of a
saved checkpoint (the selection sentinel and the misuse error live in _types)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NotRequired, TypedDict

from art.trainer_rank._types import AdapterSelection, TrainerRankSlotStateError, Unset

# One definition of the selection sentinel and the misuse error: the public types module's.
__all__ = ["AdapterSelection", "CheckpointManifest", "MaterializedCheckpoint",
           "OptimizerConfig", "TrainerRankSlotStateError", "Unset"]


@dataclass(frozen=True)
class MaterializedCheckpoint:
    """A logical checkpoint `path` (its name in the slot API) whose files this rank reads from
    `directory` (e.g. a local copy of remote storage)."""

    path: str
    directory: str


class OptimizerConfig(TypedDict):
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


class CheckpointManifest(TypedDict):
    """checkpoint.json of a saved checkpoint: what the files hold and their digests.

    parameters: peft tensor key -> [master, exp_avg, exp_avg_sq] file of its Adam state;
    steps: peft tensor key -> Adam step count; files: relative path -> blake2b-256 hex digest;
    digest: the digest of this manifest with digest = "".
    """

    format_version: Literal[1]
    base_model_name_or_path: str
    optimizer: OptimizerConfig | None
    parameters: dict[str, list[str]]
    steps: dict[str, float]
    files: dict[str, str]
    digest: str
    custom_tensors: NotRequired[dict[str, list[str]]]
