"""torchrun worker (2 ranks, one TP=2 replica, gloo): a fault another replica published
reaches this replica's ranks at different moments. Rank 1 has already passed its micro-batch
boundary and waits in a replica collective (the plan's agreed limit); rank 0 reads the fault
at its boundary a second later and raises it. Rank 1 must then end with the same error at
once, not when the process group times out (or rank 0 exits).

argv: out_dir, control port. Writes rank<r>.json: the error each rank ended with and how long
rank 1's collective took.
"""

from __future__ import annotations

import json
import os
import sys
import time

from _published_fault import RANK, publish_forward_oom, two_rank_agreement

from art.trainer_rank.ranks import agree as _agree
from art.trainer_rank.ranks.phases import PLAN

# Long enough that waiting it out fails the test's bound.
GROUP_TIMEOUT_S = 40
# How long rank 0 lives on after it raised (rank 1 must end well before).
HOLD_S = 10


def main() -> None:
    out_dir, port = sys.argv[1], int(sys.argv[2])
    phases = two_rank_agreement(port, tensor_parallel=2, group_timeout_s=GROUP_TIMEOUT_S)
    result: dict = {}
    if RANK == 1:
        # The fault of a rank of another replica (rank 3 of a TP=2 x DP=2 job), published
        # after this rank passed its boundary check.
        publish_forward_oom(phases, 3, (2, 4))
        started = time.monotonic()
        try:
            with phases.collectives(PLAN, None):
                _agree.min_over_replica(1)
        except Exception as exc:  # noqa: BLE001 - the test checks the type and text
            result["error"] = f"{type(exc).__name__}: {exc}"
        result["waited_s"] = time.monotonic() - started
    else:
        time.sleep(1.0)  # rank 1 is inside the all-reduce by now
        try:
            phases.check()
        except Exception as exc:  # noqa: BLE001
            result["error"] = f"{type(exc).__name__}: {exc}"
        # Carry on with the process groups alive, as a job's rank does after the error
        # (leaving the process would close its connections and wake rank 1 anyway).
        time.sleep(HOLD_S)
    with open(os.path.join(out_dir, f"rank{RANK}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
