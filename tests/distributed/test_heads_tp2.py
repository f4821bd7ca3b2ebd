"""TP=2 (and TP=2 + sequence parallel) under torchrun: the packed compute path returns the
TP=1 outputs, full rows on every rank, and the TP=1 gradients, for the same weights."""

from __future__ import annotations

import pytest

from _torchrun import rank_records


@pytest.mark.torchrun
def test_tp2_and_sequence_parallel_match_tp1(two_rank_launch):
    # heads_tp_worker.py's save_reference (TP=1, in this process) and its run at TP=2, in a
    # launch shared with other modules (conftest.py).
    rows = rank_records(two_rank_launch / "heads")
    for rank, row in enumerate(rows):
        for variant in ("tp", "sp"):
            result = row[variant]
            label = f"rank {rank} {variant}: {result}"
            assert result["padded_tokens"] == (22 if variant == "sp" else 21), label
            for key in ("hidden", "logprobs", "top_k_logprobs", "logits"):
                assert result[f"{key}_max_abs_diff"] < 2e-5, label
            assert result["top_k_tokens_equal"], label
            assert result["loss_abs_diff"] < 1e-3, label
            assert result["grads_compared"] > 10, label
            assert result["grad_max_rel_diff"] < 1e-4, label
            assert result["meter_peak_bytes"] > 0, label
