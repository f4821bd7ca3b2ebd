"""torchrun worker (2 ranks, gloo): the workers of several test modules in one launch
(conftest.py's two_rank_launch), one after the other in one process group, each writing its
records to a folder of its own under out_dir. Megatron's parallel state is destroyed between
them, so each builds its own as it does in a launch of its own:

    trainer/, rank_mismatch/   trainer_worker.py with rank_mismatch_worker.py's phases
    foundation/                tp_loss_worker.py at TP=2
    shared_prefix/             shared_prefix_worker.py at TP=2
    hybrid/                    hybrid_tp_worker.py at TP=2
    heads/                     heads_tp_worker.py at TP=2, against the test's reference.pt
    context_parallel/          context_parallel_worker.py at CP=2
    expert_parallel/           expert_parallel_worker.py's 2-rank layouts
    paired_forwards/           paired_forwards_worker.py: EP=2 across the DP ranks, unequal work
    expert_partners/           expert_partners_worker.py: EP partners' rows of other sizes, priced
    meter/                     meter_collectives_worker.py: the CPU meter under gloo collectives
    lora/                      lora_tp_worker.py at TP=2 on the adapters in lora-adapters/
    weights/                   weights_worker.py's cases in weights-cases/ (HF checkpoints)
    slots/                     slots_driver_worker.py at TP=2 on the policy in slots-tp1/

Each of the last three runs in the ART_MEGATRON_* environment it reads (set for the job,
restored after it), as in a launch of its own.

argv: out_dir, the heads' reference.pt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import context_parallel_worker
import expert_parallel_worker
import expert_partners_worker
import heads_tp_worker
import hybrid_tp_worker
import lora_tp_worker
import meter_collectives_worker
import paired_forwards_worker
import shared_prefix_worker
import slots_driver_worker
import tp_loss_worker
import trainer_worker
import weights_worker
from _launches import CP_EP_MODELS, CP_MODELS, EXPERT_LAYOUTS, GRANULARITIES
from megatron.core import parallel_state

from art.megatron.distributed import shutdown_distributed

from _upstream_env import environment


def _in(values: dict[str, str], job) -> None:
    with environment(values):
        job()


def main() -> None:
    out_dir, reference = Path(sys.argv[1]), sys.argv[2]
    tp2 = {"ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "2"}
    lora_env = {**tp2, **lora_tp_worker.ENV}
    weights_env = {"ART_TRAINER_RANK_PROBE_LAYERS": "false"}
    slots_env = {**tp2, **slots_driver_worker.ENV}
    jobs = {
        "trainer": lambda out: trainer_worker.run_all(out, str(out_dir / "rank_mismatch")),
        "foundation": lambda out: tp_loss_worker.run(list(GRANULARITIES), out),
        "shared_prefix": shared_prefix_worker.run,
        "hybrid": hybrid_tp_worker.run,
        "heads": lambda out: heads_tp_worker.run_variants(reference, out),
        "context_parallel": lambda out: context_parallel_worker.run(
            out, 1, [*CP_MODELS, *CP_EP_MODELS]),
        "expert_parallel": lambda out: expert_parallel_worker.run(out, list(EXPERT_LAYOUTS[2])),
        "paired_forwards": paired_forwards_worker.run,
        "expert_partners": expert_partners_worker.run,
        "meter": meter_collectives_worker.run,
        "lora": lambda out: _in(lora_env, lambda: lora_tp_worker.run_specs(out, json.loads(
            (out_dir / "lora-adapters" / lora_tp_worker.SPECS).read_text()))),
        "weights": lambda out: _in(weights_env, lambda: weights_worker.run_cases(
            out_dir / "weights-cases" / "cases.json", Path(out))),
        "slots": lambda out: _in(slots_env, lambda: slots_driver_worker.run(
            out, str(out_dir / "slots-tp1" / "policy"))),
    }
    (out_dir / "rank_mismatch").mkdir(exist_ok=True)
    for name, job in jobs.items():
        folder = out_dir / name
        folder.mkdir(exist_ok=True)
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        job(str(folder))
        print(f"two_ranks_worker: {name} done", flush=True)
    shutdown_distributed()


if __name__ == "__main__":
    main()
