"""The longest fitting prefix of a queue: doubling and bisection over a price that grows with
the prefix, and the running sums that price a prefix without re-walking the items before it.
A call of many short items is then planned in a logarithmic number of estimates."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from art.trainer_rank._request import OutputRequest
from art.trainer_rank.compute.items import Item

T = TypeVar("T")


def largest_fitting_count(candidate: Callable[[int], T | None], known: int, most: int,
                          at_known: T) -> tuple[int, T]:
    """The largest count in [known, most] whose `candidate(count)` is not None, given that
    `known` fits (its value `at_known`) and that fitting is monotone in the count: doubling
    steps, then bisection. With the first count that does not fit probed directly first, a
    queue that stops early costs one probe past it."""
    if known >= most:
        return known, at_known
    value = candidate(known + 1)
    if value is None:
        return known, at_known
    lo, lo_value, step = known + 1, value, 1
    hi = most + 1  # the smallest count known not to fit (most + 1: none known)
    while lo < most:
        probe = min(most, lo + step)
        value = candidate(probe)
        if value is None:
            hi = probe
            break
        lo, lo_value, step = probe, value, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        value = candidate(mid)
        if value is None:
            hi = mid
        else:
            lo, lo_value = mid, value
    return lo, lo_value


class QueuePrefixes:
    """A queue's prefixes as the pricing reads them: running sums of shared tokens and of the
    outputs union, extended only as far as a decision asks (the doubling search stops near its
    answer), so a decision never walks the queue past what it looks at. A prefix's lengths are
    one tuple of all its sequences, which the memory model reads whole."""

    def __init__(self, queue: Sequence[Item]) -> None:
        self._queue = queue
        self._shared = [0]
        self._outputs: list[OutputRequest] = [OutputRequest(target_logprobs=False)]

    def _extend(self, count: int) -> None:
        for item in self._queue[len(self._shared) - 1:count]:
            self._shared.append(self._shared[-1] + item.shared_tokens)
            self._outputs.append(OutputRequest.union((self._outputs[-1], item.outputs)))

    def lengths(self, count: int) -> tuple[int, ...]:
        return tuple(n for item in self._queue[:count] for n in item.sequence_lengths_tokens)

    def shared(self, count: int) -> int:
        self._extend(count)
        return self._shared[count]

    def outputs(self, count: int) -> OutputRequest:
        self._extend(count)
        return self._outputs[count]
