"""The rows beside which this rank's experts run: its expert-parallel partners' in other replicas.

With expert parallel carved from the data-parallel ranks (`agree.experts_cross_replicas`), a
MoE layer's experts on this rank take the tokens every rank of its EP group routes to them,
and the ranks of other model replicas run rows of their own, of any size. So a micro-batch is
priced beside the longest row a partner can run in the same step
(`MicroBatchShape.expert_partner_tokens`), which bounds what the partners' rows add here:
- in `forward_micro_batches` a partner runs at most its share of the same wave and autograd
  mode, and every rank deals every share from the same items (`in_wave`);
- in `dp_rank_forward` at most its call's items of that mode, exchanged when the call starts
  with the ranks' limits; without grad also no longer than one row the largest partner's
  limit admits (`in_call`);
- a partner without a micro-batch of the step's mode runs a one-token filler
  (ranks/paired_forwards.py), and a rank of this replica in the group runs this rank's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from art.trainer_rank._request import OutputRequest
from art.trainer_rank.compute.items import Item
from art.trainer_rank.ranks import agree as _agree
from art.trainer_rank.ranks.lockstep import widest_wave

# (sequence lengths, tokens shared as prefixes) -> packed row length (Admission.packed_length)
PackedLength = Callable[..., int]


def share_tokens(items: Sequence[Item], grad: bool, packed_length: PackedLength) -> int:
    """The packed row of `items`' ones of autograd mode `grad` (0: none)."""
    share = [item for item in items if item.grad == grad]
    if not share:
        return 0
    lengths = tuple(n for item in share for n in item.sequence_lengths_tokens)
    return int(packed_length(lengths, sum(item.shared_tokens for item in share)))


def longest_no_grad_row(admission: Any, usable_bytes: int) -> int:
    """The longest no-grad row `admission` admits in `usable_bytes` beside one-token EP
    partners, with the cheapest outputs (log-probs, or hidden states without the head): no
    partner with that limit runs a longer one (each prices its rows as this rank does)."""
    alone = admission.with_expert_partners(1)
    return max(alone.model_max_tokens(usable_bytes, OutputRequest(**{output: True}), False)
               for output in ("target_logprobs", "hidden_states"))


@dataclass(frozen=True)
class ExpertPartners:
    """This rank's place among the data-parallel ranks and its EP partners' there."""

    dp_rank: int
    dp_size: int
    # The data-parallel ranks of the other replicas in this rank's expert-parallel group.
    dp_ranks: tuple[int, ...]
    # Whether a rank of this replica is in the group too (it runs this rank's rows).
    own_replica: bool

    @classmethod
    def of_this_rank(cls) -> ExpertPartners:
        """Exchanged over the expert-parallel group (every rank of it calls this)."""
        from megatron.core import parallel_state

        dp_rank, dp_size = _agree.data_parallel_rank_and_size()
        group = parallel_state.get_expert_model_parallel_group()
        ranks: list[int] = [0] * dist.get_world_size(group)
        dist.all_gather_object(ranks, dp_rank, group=group)
        return cls(dp_rank, dp_size, tuple(sorted({q for q in ranks if q != dp_rank})),
                   ranks.count(dp_rank) > 1)

    def _most(self, tokens_of: Callable[[int], int]) -> int:
        """The longest of the partners' rows (`tokens_of(dp rank)`), this rank's among them
        when a rank of its replica is a partner; at least a filler's one token."""
        most = max((tokens_of(q) for q in self.dp_ranks), default=0)
        return max(1, most, tokens_of(self.dp_rank) if self.own_replica else 0)

    def in_wave(self, items: Sequence[Item], start: int, stop: int, grad: bool,
                packed_length: PackedLength) -> int:
        """The longest row a partner runs in the wave [start, stop) of `items`, of mode
        `grad`: its share's (rank r runs items start + r, start + r + D, ...)."""
        def tokens_of(q: int) -> int:
            return share_tokens([items[i] for i in range(start + q, stop, self.dp_size)],
                                grad, packed_length)

        return self._most(tokens_of)

    def for_proposal(self, items: Sequence[Item], start: int, packed_length: PackedLength
                     ) -> Callable[[int, bool], int]:
        """`in_wave` for the wave in which this rank's share is its first `count` items
        (`lockstep.widest_wave`), as `Admission.fitting_prefix` asks for it."""
        mine = len(range(start + self.dp_rank, len(items), self.dp_size))

        def tokens(count: int, grad: bool) -> int:
            width = widest_wave(start, len(items), self.dp_rank, self.dp_size, count, mine)
            return self.in_wave(items, start, start + width, grad, packed_length)

        return tokens

    def in_call(self, items: Sequence[Item], admission: Any, usable_bytes: int
                ) -> Callable[[bool], int]:
        """The longest row a partner runs in a `dp_rank_forward` call whose items on this
        rank are `items`, this rank's limit `usable_bytes` (both exchanged over the
        data-parallel ranks: every rank calls this); a partner's no-grad rows no longer than
        `longest_no_grad_row` at the largest partner's limit."""
        mine = (*(share_tokens(items, grad, admission.packed_length) for grad in (True, False)),
                int(usable_bytes))
        every = _agree.all_gather_over_data_parallel(mine)
        cap = (longest_no_grad_row(admission, max(every[q][2] for q in self.dp_ranks))
               if self.dp_ranks and any(every[q][1] for q in self.dp_ranks) else 0)

        def tokens(grad: bool) -> int:
            def tokens_of(q: int) -> int:
                return every[q][0] if grad else min(every[q][1], cap)

            return self._most(tokens_of)

        return tokens
