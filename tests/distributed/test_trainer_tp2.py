"""TrainerRank under torchrun (gloo, CPU): TP=2 outputs and gradients, with and without
sequence parallel, equal TP=1 on every rank,
the replica agrees on the smallest usable limit; DP=2 deals whole items without overlap, a
mismatched call raises on every rank instead of hanging, and after a call where only rank 1
ran out of memory both ranks hold the same profile, that miss included."""

from __future__ import annotations

import pytest

from _torchrun import rank_records


@pytest.fixture(scope="module")
def two_ranks(two_rank_launch) -> list[dict]:
    """trainer_worker.py's records, from a launch shared with other modules (conftest.py)."""
    return rank_records(two_rank_launch / "trainer")


@pytest.fixture(scope="module")
def tp1(megatron_process) -> dict:
    """The worker's "tp" run in this process: TP=1, same seed, same inputs."""
    import trainer_worker

    return trainer_worker.run("tp")


@pytest.mark.torchrun
def test_adaptive_at_tp2_runs_one_rung_per_micro_batch_on_every_rank(two_ranks, tp1):
    """Built with full recompute, adaptive runs less on both ranks alike (the rung is part
    of the plan the replica agrees on), with the outputs of the selective TP=1 reference.
    Both ranks hold the same step times (the slowest rank's, agreed with the peak), so they
    fit the same step-time line and weigh adaptive's packings alike."""
    rows = [row["tp_adaptive"] for row in two_ranks]
    assert rows[0]["recompute"] == rows[1]["recompute"]
    assert rows[0]["step_times"] and rows[0]["step_times"] == rows[1]["step_times"]
    assert all(seconds > 0 for _, _, seconds in rows[0]["step_times"])
    assert "no recompute" in rows[0]["recompute"]
    assert not any(r.startswith("full recompute (uniform") for r in rows[0]["recompute"])
    for row in rows:
        assert sorted(row["seen"]) == sorted(tp1["seen"])
        for index, leaves in tp1["seen"].items():
            for want, got in zip(leaves, row["seen"][index]):
                assert got["logprobs"] == pytest.approx(want["logprobs"], abs=2e-5)
                assert got["hidden_sum"] == pytest.approx(want["hidden_sum"], rel=1e-4, abs=1e-3)
        assert all(m is not None and m <= u for m, u in zip(row["measured"], row["usable"]))


@pytest.mark.torchrun
@pytest.mark.parametrize("mode", ["tp", "tp_sp"])
def test_tp2_equals_tp1_and_ranks_agree(two_ranks, tp1, mode):
    tp2 = [row[mode] for row in two_ranks]
    for row in tp2:
        assert row["tp"] == 2
        assert row["usable"] and set(row["usable"]) == {30 * 2**20}  # min over the replica
        assert row["decisions"] == tp2[0]["decisions"]
        # Every rank prices with the replica root's probe coefficients (layers and tails).
        assert row["probe_digest"] == tp2[0]["probe_digest"]
        assert row["probe_tails"] == ["logprobs,top_k=4,logits,hidden_states:grad"]
        assert row["probed"] and all(row["probed"])
        assert "planned different micro-batches" in row["plan_mismatch_error"]
        assert sorted(row["seen"]) == sorted(tp1["seen"]) == ["0", "1", "2", "3", "4"]
        for index, leaves in tp1["seen"].items():
            for want, got in zip(leaves, row["seen"][index]):
                assert got["logprobs"] == pytest.approx(want["logprobs"], abs=2e-5)
                assert got["top_tokens"] == want["top_tokens"]
                flat = [v for row_ in got["top_logprobs"] for v in row_]
                assert flat == pytest.approx([v for r in want["top_logprobs"] for v in r], abs=2e-5)
                assert got["logits_shape"] == want["logits_shape"]  # gathered over TP
                assert got["logits_sum"] == pytest.approx(want["logits_sum"], rel=1e-4, abs=1e-3)
                assert got["hidden_sum"] == pytest.approx(want["hidden_sum"], rel=1e-4, abs=1e-3)
        if mode == "tp":
            assert row["final_norm_grad"] == pytest.approx(tp1["final_norm_grad"], rel=1e-4,
                                                           abs=1e-6)
    if mode == "tp_sp":
        # Under sequence parallel each rank's norm sees its token shard; Megatron all-reduces
        # these grads over TP when it finalizes gradients, so the ranks' sum is the TP=1 grad.
        summed = [a + b for a, b in zip(tp2[0]["final_norm_grad"], tp2[1]["final_norm_grad"])]
        assert summed == pytest.approx(tp1["final_norm_grad"], rel=1e-4, abs=1e-6)


@pytest.mark.torchrun
def test_dp2_deals_whole_items_and_rejects_mismatched_calls(two_ranks):
    rows = [row["dp"] for row in two_ranks]
    for row in rows:
        assert "ranks passed different inputs" in row["mismatch_error"]
    assert {row["dp_rank"] for row in rows} == {0, 1}
    dealt = [set(row["seen"]) for row in rows]
    assert not dealt[0] & dealt[1] and dealt[0] | dealt[1] == {"0", "1", "2", "3", "4"}
    assert rows[0]["usable"][0] == 32 * 2**20 and rows[1]["usable"][0] == 30 * 2**20
    # Only rank 1 ran out of memory (and recovered); each replica measured its own items.
    # After the call both hold every observation and that miss: the same profile.
    assert rows[1]["fired"] == "layer forward" and rows[0]["fired"] is None
    assert rows[0]["profiles"] == rows[1]["profiles"]
    assert any(misses for _, misses in rows[0]["profiles"].values())
