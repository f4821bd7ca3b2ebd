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
from datetime import timedelta

import torch.distributed as dist
from megatron.core import parallel_state

from art.trainer_rank.ranks import agree as _agree
from art.trainer_rank.ranks.phases import (
    FAULT_COUNT_KEY,
    FAULT_KEY,
    PLAN,
    Fault,
    MicroBatchContext,
    PhaseAgreement,
)

RANK = int(os.environ["RANK"])
# Long enough that waiting it out fails the test's bound.
GROUP_TIMEOUT_S = 40
# How long rank 0 lives on after it raised (rank 1 must end well before).
HOLD_S = 10


def main() -> None:
    out_dir, port = sys.argv[1], int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, RANK == 0, timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=RANK, world_size=2,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    phases = PhaseAgreement(fault_timeout_s=20)
    dist.barrier()
    result: dict = {}
    if RANK == 1:
        # The fault of a rank of another replica (rank 3 of a TP=2 x DP=2 job), published
        # after this rank passed its boundary check.
        context = MicroBatchContext(call=1, micro_batch=0, items=(2, 4), signature="s",
                                    packed_tokens=64, usable_bytes=1000, predicted_bytes=900,
                                    recompute_summary="selective recompute (core_attn)")
        fault = Fault(3, "forward", "layer 1", "OutOfMemoryError: injected", context)
        phases._store.add(FAULT_COUNT_KEY, 1)
        phases._store.set(FAULT_KEY, fault.to_json())
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
