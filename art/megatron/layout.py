"""ParallelLayout: how one model is split over ranks (TP, SP, CP, PP, VPP, EP, ETP, DP)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelLayout:
    tensor_parallel: int = 1
    context_parallel: int = 1
    pipeline_parallel: int = 1
    virtual_pipeline_parallel: int = 1
    expert_parallel: int = 1
    expert_tensor_parallel: int = 1
    sequence_parallel: bool = False
    data_parallel: int = 1

    def __post_init__(self) -> None:
        for name in (
            "tensor_parallel",
            "context_parallel",
            "pipeline_parallel",
            "virtual_pipeline_parallel",
            "expert_parallel",
            "expert_tensor_parallel",
            "data_parallel",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelLayout.{name} must be an integer >= 1, got {value!r}")
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ValueError("sequence_parallel needs tensor_parallel > 1")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel * self.context_parallel * self.pipeline_parallel

    @property
    def summary(self) -> str:
        parts = [f"TP{self.tensor_parallel}"]
        if self.sequence_parallel:
            parts.append("SP")
        for label, value in (
            ("CP", self.context_parallel),
            ("PP", self.pipeline_parallel),
            ("VPP", self.virtual_pipeline_parallel),
            ("EP", self.expert_parallel),
            ("DP", self.data_parallel),
        ):
            if value > 1:
                parts.append(f"{label}{value}")
        return " ".join(parts)
