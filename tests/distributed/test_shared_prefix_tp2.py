"""TP=2 under torchrun (one launch): a group packed as a prefix tree gives the same outputs
and gradient shards as its sequences run alone, with segmented flash attention (with and
without sequence parallel) and with the unfused dense tree mask, on a dense model and on a
Gated DeltaNet hybrid (trees of depth 1-3, up to 16 children, across 64-token chunks)."""

from __future__ import annotations

from _shared_prefix import CASES, HYBRID_CASES
from _torchrun import rank_records


def test_shared_prefix_equals_unshared_at_tp2(two_rank_launch):
    # shared_prefix_worker.py, in a launch shared with other modules (conftest.py).
    for rank, results in enumerate(rank_records(two_rank_launch / "shared_prefix")):
        assert len(results) == len(CASES) + 2 + len(HYBRID_CASES) + 1
        assert {r["geometry"] for r in results} == {"tiny-dense-2x64", "tiny-qwen3_5"}
        assert any(r["shared_tokens"] > 0 for r in results)
        for r in results:
            label = f"rank {rank} {r}"
            assert r["present"] and r["top_k_tokens_equal"], label
            for key in ("logprobs", "top_k", "logits", "hidden"):
                assert r[key] < 1e-5, label
            assert r["grad"] < 1e-5, label
            if r["sequence_parallel"]:
                assert r["packed_tokens"] % 2 == 0, label
            assert r["packed_tokens"] <= r["logical_tokens"] - r["shared_tokens"] + 1, label
