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
from datetime import timedelta

import torch.distributed as dist
from megatron.core import parallel_state

from art.trainer_rank.ranks.lockstep import in_waves
from art.trainer_rank.ranks.phases import (
    FAULT_COUNT_KEY,
    FAULT_KEY,
    Fault,
    MicroBatchContext,
    PhaseAgreement,
)

RANK = int(os.environ["RANK"])
# Long enough that waiting it out fails the test's bound.
GROUP_TIMEOUT_S = 40
# How long rank 1 keeps its process groups open (rank 0 must end well before).
HOLD_S = 12


def main() -> None:
    out_dir, port = sys.argv[1], int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, RANK == 0, timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=RANK, world_size=2,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    phases = PhaseAgreement(fault_timeout_s=20)
    dist.barrier()
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
        context = MicroBatchContext(call=1, micro_batch=0, items=(1,), signature="s",
                                    packed_tokens=64, usable_bytes=1000, predicted_bytes=900,
                                    recompute_summary="selective recompute (core_attn)")
        fault = Fault(1, "forward", "layer 1", "OutOfMemoryError: injected", context)
        phases._store.add(FAULT_COUNT_KEY, 1)
        phases._store.set(FAULT_KEY, fault.to_json())
        time.sleep(HOLD_S)
    with open(os.path.join(out_dir, f"rank{RANK}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
