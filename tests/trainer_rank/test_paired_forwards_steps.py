"""The step rule of paired forwards (ranks/paired_forwards.py), rank by rank: what the
announcements agree, and what one rank runs in a step (its micro-batch, fillers up to the
step's passes, a grad filler's backward for later). The ranks themselves are exercised under
torchrun in tests/distributed/test_paired_forwards.py; here every branch of the rule is."""

from __future__ import annotations

from art.trainer_rank.ranks.paired_forwards import (
    ForwardReady,
    StepAgreement,
    announcement,
    run_step,
)


def _agree(*ready: ForwardReady | None) -> StepAgreement:
    """What the MAX all-reduce of the ranks' announcements gives."""
    rows = [announcement(r) for r in ready]
    return StepAgreement.of(max(r[0] for r in rows), max(r[1] for r in rows),
                            -max(r[2] for r in rows))


class _Rank:
    def __init__(self) -> None:
        self.ran: list[str] = []
        self.fillers: list[tuple[bool, int]] = []

    def run_ready(self) -> str:
        self.ran.append("micro-batch")
        return "micro-batch"

    def filler(self, grad: bool, forwards: int):
        self.fillers.append((grad, forwards))
        return (lambda: self.ran.append("filler backward")) if grad else None


def test_grad_micro_batches_run_first_and_a_rank_without_one_runs_a_grad_filler():
    grad, nograd = ForwardReady(True, 1), ForwardReady(False, 1)
    agreed = _agree(grad, nograd)
    assert agreed == StepAgreement(True, 1, 0)
    first, second = _Rank(), _Rank()
    out, used, backward = run_step(agreed, grad, first.run_ready, first.filler)
    assert (out, used, backward) == ("micro-batch", True, None) and first.fillers == []
    # The no-grad rank keeps its micro-batch for a later step and fills this one.
    out, used, backward = run_step(agreed, nograd, second.run_ready, second.filler)
    assert out is None and not used and second.fillers == [(True, 1)]
    assert second.ran == []
    backward()  # when its caller asks for the next micro-batch
    assert second.ran == ["filler backward"]


def test_a_split_no_grad_group_pairs_with_fillers_for_the_passes_the_others_lack():
    split, whole = ForwardReady(False, 3), ForwardReady(False, 1)
    agreed = _agree(split, whole, None)
    assert agreed == StepAgreement(False, 3, 0)
    ranks = [_Rank() for _ in range(3)]
    results = [run_step(agreed, ready, rank.run_ready, rank.filler)
               for ready, rank in zip((split, whole, None), ranks)]
    assert [r[1] for r in results] == [True, True, False]
    assert [rank.fillers for rank in ranks] == [[], [(False, 2)], [(False, 3)]]
    assert all(r[2] is None for r in results)  # no backward without grad


def test_the_fewest_grad_passes_are_agreed_too():
    # dp_rank_forward runs a grad step only when every rank announces the same passes.
    assert _agree(ForwardReady(True, 2), ForwardReady(True, 2)).fewest_grad_forwards == 2
    assert _agree(ForwardReady(True, 2), ForwardReady(True, 1)).fewest_grad_forwards == 1
    assert _agree(ForwardReady(True, 2), None).fewest_grad_forwards == 0
    assert _agree(None, None) == StepAgreement(False, 0, 0)


def test_a_micro_batch_announces_one_pass_per_sub_forward_and_adapter():
    """execute runs the decoder once per sub-forward and, within one, once per checkpoint
    slot its sequences use: the announcement counts those passes, or partners of a
    two-adapter micro-batch would meet one of its all-to-alls with nothing."""
    from types import SimpleNamespace

    from art.trainer_rank._micro_batch_run import decoder_passes

    def plan(slots_per_item, sub_forwards):
        items = [SimpleNamespace(checkpoints=tuple(s)) for s in slots_per_item]
        return SimpleNamespace(items=items, sub_forwards=sub_forwards)

    assert decoder_passes(plan([(None, None)], ((0, 1),))) == 1
    assert decoder_passes(plan([("a", None), ("a",)], ((0, 1, 2),))) == 2
    assert decoder_passes(plan([("a",), ("b",), ("a",)], ((0,), (1, 2)))) == 3
