"""What the launches conftest.py shares between modules run, read by their workers
(two_ranks_worker.py, four_ranks_worker.py) and by the tests that check the records."""

from __future__ import annotations

# test_foundation_tp2.py: the recompute granularities compared (one model each).
GRANULARITIES = ("selective", "full")
# test_context_parallel.py: the models run at CP=2 (2 ranks) and TP=2 x CP=2 (4 ranks); the
# tiny MoE at CP=2 x EP=2 (2 ranks), its experts spread over the CP ranks.
CP_MODELS = ("dense", "hybrid", "hybrid-moe")
CP_EP_MODELS = ("moe:2",)
# test_expert_parallel.py: the (TP, expert TP) layouts compared at EP=2, by number of ranks.
EXPERT_LAYOUTS = {2: ((1, 1), (2, 1)), 4: ((2, 2),)}
# test_phase_faults_tp2.py: how long a rank waits for a peer's fault report, and the scenario
# the 4-rank (TP=2 x DP=2) launch runs.
FAULT_TIMEOUT_S = 20.0
DP_FAULT_SCENARIOS = ("forward layer",)
