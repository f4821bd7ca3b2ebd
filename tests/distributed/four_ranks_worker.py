"""torchrun worker (4 ranks, gloo): the 4-rank workers of several test modules in one launch
(conftest.py's four_rank_launch), one after the other, each writing its records to a folder
of its own under out_dir:

    context_parallel/   context_parallel_worker.py at TP=2 x CP=2
    expert_parallel/    expert_parallel_worker.py at TP=2 x EP=2
    phase_faults/       phase_faults_worker.py's scenarios at TP=2 x DP=2, each in a world
                        of its own (after the launch's process group is shut down)

Megatron's parallel state is destroyed between the first two, so each builds its own as it
does in a launch of its own.

argv: out_dir.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import context_parallel_worker
import expert_parallel_worker
import phase_faults_worker
from _launches import CP_MODELS, DP_FAULT_SCENARIOS, EXPERT_LAYOUTS, FAULT_TIMEOUT_S
from megatron.core import parallel_state

from art.megatron.distributed import shutdown_distributed


def main() -> None:
    out_dir = Path(sys.argv[1])
    for name in ("context_parallel", "expert_parallel", "phase_faults"):
        (out_dir / name).mkdir(exist_ok=True)
    context_parallel_worker.run(str(out_dir / "context_parallel"), 2, list(CP_MODELS))
    print("four_ranks_worker: context_parallel done", flush=True)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    expert_parallel_worker.run(str(out_dir / "expert_parallel"), list(EXPERT_LAYOUTS[4]))
    print("four_ranks_worker: expert_parallel done", flush=True)
    shutdown_distributed()
    # TP=2 x DP=2: an OOM on rank 1 must end both replicas' calls.
    results = phase_faults_worker.run_scenarios(
        str(out_dir / "phase_faults"), FAULT_TIMEOUT_S, 2, 1, set(DP_FAULT_SCENARIOS), "")
    rank = int(os.environ["RANK"])
    with open(out_dir / "phase_faults" / f"rank{rank}.json", "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
