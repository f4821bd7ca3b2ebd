"""The recompute rungs of one micro-batch as `estimate` and `plan` print them: each rung's
recomputed work and predicted peak, and which rung each ART_TRAINER_RANK_RECOMPUTE setting
would run under a memory limit (the same choice admission makes, from the memory model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from art.megatron.recompute_ladder import RecomputeChoice, RecomputeLadder, build_ladder
from art.trainer_rank._request import MicroBatchShape


@dataclass(frozen=True)
class RungRow:
    name: str
    summary: str
    recomputed_gflops: float  # forward FLOPs backward re-runs, per rank
    peak_bytes: int  # resident + dynamic peak + allocator reserve, per rank
    configured: bool

    def fits(self, limit_bytes: int | None) -> bool | None:
        return None if limit_bytes is None else self.peak_bytes <= limit_bytes


@dataclass(frozen=True)
class RungChoices:
    """The rungs least work first, and what each setting picks (None: it declines)."""

    rows: tuple[RungRow, ...]
    limit_bytes: int | None

    @property
    def configured(self) -> RungRow:
        return next(row for row in self.rows if row.configured)

    def pick(self, choice: RecomputeChoice) -> RungRow | None:
        if self.limit_bytes is None:
            return None
        fitting = [row for row in self.rows if row.fits(self.limit_bytes)]
        if choice == RecomputeChoice.ADAPTIVE:
            return fitting[0] if fitting else None
        here = self.configured
        if here.fits(self.limit_bytes):
            return here
        if choice == RecomputeChoice.CONFIGURED:
            return None
        above = [row for row in fitting if row.recomputed_gflops > here.recomputed_gflops]
        return above[0] if above else None

    def lines(self) -> list[str]:
        width = max(len(row.name) for row in self.rows)
        out = ["recompute rungs (least work first; `ART_TRAINER_RANK_RECOMPUTE` chooses "
               "among them per micro-batch):"]
        for row in self.rows:
            fits = row.fits(self.limit_bytes)
            verdict = "" if fits is None else ("  fits" if fits else "  does not fit")
            mark = "  <- configured" if row.configured else ""
            out.append(f"  {row.name.ljust(width)}  {row.recomputed_gflops:10.1f} GFLOP "
                       f"recomputed  {row.peak_bytes / 2**30:9.3f} GiB{verdict}{mark}")
        if self.limit_bytes is None:
            out.append("  (give the GPU memory to see which rung each setting runs)")
            return out
        for choice in RecomputeChoice:
            row = self.pick(choice)
            out.append(f"  {choice.value}: " + ("declines" if row is None else row.name))
        return out

    def to_dict(self) -> dict[str, Any]:
        picks = {choice.value: (None if (row := self.pick(choice)) is None else row.name)
                 for choice in RecomputeChoice} if self.limit_bytes is not None else None
        return {
            "rungs": [{"name": row.name, "summary": row.summary,
                       "recomputed_gflops": row.recomputed_gflops,
                       "peak_bytes": row.peak_bytes, "configured": row.configured,
                       "fits": row.fits(self.limit_bytes)} for row in self.rows],
            "picks": picks,
        }


def price_rungs(provider: Any, memory_model: Any, batch: MicroBatchShape,
                limit_bytes: int | None) -> RungChoices | None:
    """Every rung of `provider`'s model priced for `batch` with `memory_model` (which prices
    the configured policy); None without grad (no rung keeps anything for backward)."""
    if not batch.grad_enabled:
        return None
    configured = provider.effective_recompute
    ladder = RecomputeLadder(build_ladder(configured, provider.recompute_as),
                             provider.geometry, provider.layout.tensor_parallel)
    rows = []
    for flops, rung in ladder.ordered(batch.sequence_lengths_tokens):
        model = memory_model if rung.recompute is configured else (
            memory_model.with_recompute(rung.recompute))
        rows.append(RungRow(rung.name, rung.recompute.summary, flops / 1e9,
                            int(model.estimate(batch).peak_bytes),
                            rung.recompute is configured))
    return RungChoices(tuple(rows), limit_bytes)
