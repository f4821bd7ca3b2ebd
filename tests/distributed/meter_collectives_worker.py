"""torchrun worker: gloo collectives under a CPU MemoryMeter.

Writes rank<R>.json with what the collectives produced (the meter must not change it) and how
often a storage given to an all-reduce was still counted live after the caller dropped it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from art.trainer_rank.measuring.meter import MemoryMeter

DROPS = 2000


def collective_values(rank: int) -> dict[str, object]:
    """Every collective Megatron's TP and MoE dispatch use, run under the meter."""
    with MemoryMeter(device="cpu") as meter:
        x = torch.full((4,), float(rank + 1))
        dist.all_reduce(x)
        summed = x.tolist()
        handle = dist.all_reduce(x, async_op=True)
        handle.wait()
        summed_async = x.tolist()
        src = torch.full((2,), float(rank))
        src_version = src._version
        gathered = torch.empty(4)
        dist.all_gather_into_tensor(gathered, src)
        buffer = torch.zeros(4)
        dist.all_gather(list(buffer.chunk(2)), src)  # views of one buffer
        scattered = torch.empty(2)
        dist.reduce_scatter_tensor(scattered, torch.arange(4.0))
        exchanged = torch.empty(4)
        dist.all_to_all_single(exchanged, torch.arange(4.0) + 10 * rank)
        broadcast = torch.full((3,), float(rank))
        dist.broadcast(broadcast, 1)
        # Point-to-point, both ranks sending first: runs as it is (no early wait).
        sent, received = torch.full((2,), float(rank)), torch.empty(2)
        requests = [dist.isend(sent, 1 - rank), dist.irecv(received, 1 - rank)]
        for request in requests:
            request.wait()
        dist.barrier()
        live = meter.live_bytes
        expected_live = sum(t.untyped_storage().nbytes() for t in
                            (x, src, gathered, buffer, scattered, exchanged, broadcast, sent,
                             received))
    return {"summed": summed, "summed_async": summed_async, "gathered": gathered.tolist(),
            "gathered_views": buffer.tolist(), "scattered": scattered.tolist(),
            "exchanged": exchanged.tolist(), "broadcast": broadcast.tolist(),
            "received": received.tolist(),
            "input_version_kept": src._version == src_version,
            "live_bytes": live, "expected_live_bytes": expected_live}


def late_deaths() -> int:
    """Drops of an all-reduced tensor after which the meter still counted its storage."""
    late = 0
    for _ in range(DROPS):
        with MemoryMeter(device="cpu") as meter:
            x = torch.randn(64, 64) * 1.0
            dist.all_reduce(x)
            kept = x @ x
            del x
            if meter.live_bytes != kept.untyped_storage().nbytes():
                late += 1
            del kept
    return late


def run(out_dir: str) -> None:
    """This rank's record in out_dir, in a process group already initialised."""
    rank = dist.get_rank()
    row = collective_values(rank) | {"late_deaths": late_deaths(), "drops": DROPS}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(row))


def main() -> None:
    dist.init_process_group("gloo")
    run(sys.argv[1])
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
