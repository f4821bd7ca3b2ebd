"""Helpers around measuring a micro-batch's peak (the meter itself: `memory/meter.py`)."""

from __future__ import annotations


def release_score_buffer() -> None:
    """Drop Megatron's global memory buffer (unfused attention's [heads, s, s] score buffer).

    It persists at the largest size seen; the memory model prices it inside every micro-batch,
    so it is released before each one: measured from the state before, it is then really
    allocated inside the micro-batch, and on GPU it is not also counted as live before."""
    from megatron.core import parallel_state

    buffer = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    if buffer is not None:
        buffer.buffer.clear()
