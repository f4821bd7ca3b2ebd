"""Admission's memos: prices, signatures and longest rows, and the memory models under the
rungs other than the configured recompute."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from art.megatron.recompute import EffectiveRecompute
from art.trainer_rank._request import MicroBatchShape, OutputRequest
from art.trainer_rank.decide.priced import MemoryModelLike


@dataclass
class PriceCaches:
    """Admission's memos. `recomputes` keeps every recompute whose id keys an entry alive, so
    an id is never reused while it is cached."""

    # (recompute id, grad, lengths, outputs, shared, recurrent, EP partners' tokens) ->
    # (estimate, shape, signature); the profile's part is read fresh on every price.
    priced: dict[tuple[Any, ...], tuple[Any, MicroBatchShape, str]] = field(default_factory=dict)
    signatures: dict[tuple[int, bool, OutputRequest], str] = field(default_factory=dict)
    # (outputs, grad, usable, gradient bytes, recompute id, EP partners' tokens, by the
    # formulas) -> the largest admissible row
    model_max: dict[tuple[OutputRequest, bool, int, int, int, int, bool], int] = field(
        default_factory=dict)
    recomputes: dict[int, EffectiveRecompute] = field(default_factory=dict)
    models: dict[int, MemoryModelLike] = field(default_factory=dict)
    formulas: dict[int, MemoryModelLike] = field(default_factory=dict)

    def clear(self) -> None:
        for memo in (self.priced, self.signatures, self.model_max, self.recomputes,
                     self.models, self.formulas):
            memo.clear()

    def under(self, memo: dict[int, MemoryModelLike], base: MemoryModelLike,
              recompute: EffectiveRecompute, configured: EffectiveRecompute
              ) -> MemoryModelLike:
        """`base` (a model priced under `configured`) under `recompute`, kept in `memo`."""
        if recompute is configured:
            return base
        model = memo.get(id(recompute))
        if model is None:
            self.recomputes[id(recompute)] = recompute
            model = memo[id(recompute)] = base.with_recompute(recompute)
        return model
