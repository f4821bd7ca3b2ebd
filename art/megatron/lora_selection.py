"""Which resident LoRA adapter the LoRA linears apply right now, and keeping that choice intact
through Megatron's activation recompute.

Every `LoraLinear` holds several adapters under short keys ("default" is the one the model was
built with). The forward applies the adapter named by `active_adapter()`; `None` applies none
(the base model). The choice is process-wide state set around a forward with `use_adapter`.

Recompute reruns a layer's forward inside the backward, long after `use_adapter` has exited:
without care it would rerun with whatever adapter is active then. `install()` wraps Megatron's
`tensor_parallel.checkpoint` (full recompute, selective `mlp`/`moe` recompute, and TE's
checkpoint when present) so that the rerun uses the adapter that was active when the
checkpointed forward first ran.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

DEFAULT_ADAPTER = "default"

_active: list[str | None] = [DEFAULT_ADAPTER]
_installed: list[bool] = [False]


def active_adapter() -> str | None:
    """The adapter key LoRA linears apply now; None means no adapter (the base model)."""
    return _active[0]


@contextlib.contextmanager
def use_adapter(key: str | None) -> Iterator[None]:
    """Apply adapter `key` (None: none) to every LoRA linear inside the block."""
    install()
    previous = _active[0]
    _active[0] = key
    try:
        yield
    finally:
        _active[0] = previous


def _keeping_selection(checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(checkpoint)
    def wrapped(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        captured = _active[0]

        def run(*inner: Any, **inner_kwargs: Any) -> Any:
            previous = _active[0]
            _active[0] = captured
            try:
                return function(*inner, **inner_kwargs)
            finally:
                _active[0] = previous

        return checkpoint(run, *args, **kwargs)

    wrapped._art_keeps_adapter_selection = True  # type: ignore[attr-defined]
    return wrapped


def install() -> None:
    """Wrap Megatron's checkpoint entry points once per process (idempotent)."""
    if _installed[0]:
        return
    from megatron.core import tensor_parallel
    from megatron.core.transformer import transformer_block

    if not getattr(tensor_parallel.checkpoint, "_art_keeps_adapter_selection", False):
        tensor_parallel.checkpoint = _keeping_selection(tensor_parallel.checkpoint)
    te_checkpoint = getattr(transformer_block, "te_checkpoint", None)
    if te_checkpoint is not None and not getattr(
        te_checkpoint, "_art_keeps_adapter_selection", False
    ):
        transformer_block.te_checkpoint = _keeping_selection(te_checkpoint)
    _installed[0] = True
