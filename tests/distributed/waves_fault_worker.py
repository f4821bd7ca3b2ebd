"""torchrun worker (2 ranks, two DP replicas of one rank each, gloo): rank 0 waits in the
data-parallel waves' all-reduce (ranks/lockstep.py) while rank 1, of the other replica,
publishes a fault and stays away from that collective with its process groups open (the
state of a replica whose fault ended the call and whose ranks left for the next job, seen
from a peer its closed pairs did not reach). Rank 0 must end with the published fault's
error at once, not when rank 1 leaves its process or the process group times out.

argv: out_dir, control port. Writes rank<r>.json: the error rank 0 ended with and how long
its wave step took.
"""

from __future__ import annotations

import json
import os
import sys
import time

from _published_fault import RANK, publish_forward_oom, two_rank_agreement

from art.trainer_rank.ranks.lockstep import in_waves

# Long enough that waiting it out fails the test's bound.
GROUP_TIMEOUT_S = 40
# How long rank 1 keeps its process groups open (rank 0 must end well before).
HOLD_S = 12


def main() -> None:
    out_dir, port = sys.argv[1], int(sys.argv[2])
    phases = two_rank_agreement(port, tensor_parallel=1, group_timeout_s=GROUP_TIMEOUT_S)
    result: dict = {}
    if RANK == 0:
        started = time.monotonic()
        try:
            for _ in in_waves(2, lambda start: 1, lambda wave: iter(()),
                              lambda wave: None,  # type: ignore[arg-type,return-value]
                              guard=lambda: phases.between_micro_batches(2)):
                pass
        except Exception as exc:  # noqa: BLE001 - the test checks the type and text
            result["error"] = f"{type(exc).__name__}: {exc}"
        result["waited_s"] = time.monotonic() - started
    else:
        time.sleep(1.0)  # rank 0 is inside the all-reduce by now
        publish_forward_oom(phases, 1, (1,))
        time.sleep(HOLD_S)
    with open(os.path.join(out_dir, f"rank{RANK}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
