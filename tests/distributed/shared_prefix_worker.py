"""torchrun worker: shared-prefix packing at TP = WORLD_SIZE equals the unshared forward.

For each attention implementation (segmented flash, unfused with a dense tree mask) and with
and without sequence parallel, on a dense model and on a Gated DeltaNet hybrid, the cases of
tests/_shared_prefix.py run shared and unshared on this rank's shard of one model.
argv: out_dir; writes out_dir/rank<R>.json.
"""

from __future__ import annotations

import json
import os
import sys

from art.megatron.distributed import initialize_distributed, shutdown_distributed
from art.megatron.geometry import load_geometry
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.megatron.model_builder import RecomputeConfig, build_gpt_model, build_transformer_config

from _shared_prefix import CASES, HYBRID_CASES, compare, group
from _tiny import tiny_dense


def run(out_dir: str) -> None:
    """Every variant's cases at TP = WORLD_SIZE; this rank's results to out_dir."""
    tp = int(os.environ["WORLD_SIZE"])
    initialize_distributed(tensor_parallel=tp)
    rank = int(os.environ["RANK"])
    dense, hybrid = tiny_dense(num_layers=2), load_geometry("tiny-qwen3_5")
    results = []
    # The hybrid's Gated DeltaNet layers hand each child segment its parent's state (their
    # heads split over TP) and its conv window (its channels split over TP).
    variants = [(dense, "flash", True, CASES), (dense, "flash", False, CASES[2:3]),
                (dense, "unfused", True, CASES[3:4]), (hybrid, "flash", True, HYBRID_CASES),
                (hybrid, "unfused", False, HYBRID_CASES[2:3])]
    for geometry, attention, sequence_parallel, cases in variants:
        implementation = Implementation.cpu_local(attention)
        layout = ParallelLayout(tensor_parallel=tp, sequence_parallel=sequence_parallel)
        config = build_transformer_config(
            geometry, layout=layout, recompute=RecomputeConfig("selective"), dtype="float32",
            implementation=implementation,
        )
        model = build_gpt_model(geometry, config, implementation=implementation, seed=0)
        for case in cases:
            diffs = compare(model, group(case, geometry.vocab_size), implementation, layout)
            results.append({"geometry": geometry.name, "attention": attention,
                            "sequence_parallel": sequence_parallel,
                            "rollouts": case.rollouts, "prompt": case.prompt_tokens, **diffs})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def main() -> None:
    run(sys.argv[1])
    shutdown_distributed()


if __name__ == "__main__":
    main()
