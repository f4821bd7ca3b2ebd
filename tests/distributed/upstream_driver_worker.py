"""Worker for test_upstream_driver.py (torchrun, 2 ranks): scripts/upstream_driver.py's
`train` at TP=2, then again at TP=1 x DP=2 in the same processes (Megatron's parallel state
rebuilt in between), then upstream's data-parallel waves with uneven items and a collective
inside the caller's loop, then `train` at CP=2 with the layer probe on, a hybrid model at
CP=2 and at TP=1 x DP=2, and a MoE checkpoint at EP=2 and EP=1 and at CP=2 x EP=2. Each
phase's report and the gathered adapter go to OUT_DIR/rank<r>.json."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]


def driver_module():
    """scripts/upstream_driver.py loaded as a module (a script, not a package member)."""
    spec = importlib.util.spec_from_file_location("upstream_driver",
                                                  ROOT / "scripts" / "upstream_driver.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _adapter(trainer) -> dict[str, list]:
    from art.megatron.lora_peft import adapter_state_dict

    state = adapter_state_dict(trainer.model)  # collective over TP: every rank calls it
    return {k: v.flatten().tolist() for k, v in sorted(state.items())}


def _waves(trainer) -> dict:
    """Upstream's DP waves: one long item first, then short ones, an output mix no profile
    has seen (its first wave is cold-capped) and a limit that admits the long item alone, so
    the waves have different widths and some shares run out before others (empty
    micro-batches); the caller runs a collective of its own every iteration."""
    from megatron.core import parallel_state

    from art.trainer_rank import ForwardInput

    g = torch.Generator().manual_seed(5)
    lengths = [60, 6, 6, 6, 6, 6, 6]
    inputs = [ForwardInput(input_tokens=torch.randint(0, 256, (n,), generator=g),
                           target_tokens=torch.randint(0, 256, (n,), generator=g),
                           top_k=2)
              for n in lengths]
    from art.trainer_rank.compute.items import make_items

    long_item = make_items(inputs[:1])[0]
    price = trainer.admission.price(long_item.leaves, True)[0].dynamic_bytes
    trainer.options = replace(trainer.options, test_memory_limit_bytes=int(price * 1.5))
    group = parallel_state.get_data_parallel_group()
    rows, totals = [], []
    for micro in trainer.forward_micro_batches(inputs):
        count = torch.ones(1)
        dist.all_reduce(count, group=group)  # the caller's own collective, every iteration
        totals.append(int(count))
        s = micro.stats
        rows.append({"decision": s.decision, "indices": list(micro.indices),
                     "global_start": s.global_start, "global_stop": s.global_stop,
                     "global_count": s.global_count, "local_count": s.local_count})
        if micro.outputs:
            sum(-o.target_logprobs.sum() for o in micro.outputs).backward()
    trainer.zero_grad()
    return {"rows": rows, "totals": totals, "items": len(inputs),
            "dp_rank": parallel_state.get_data_parallel_rank(),
            "dp_size": parallel_state.get_data_parallel_world_size()}


def _train(driver, args, **megatron_env: str) -> tuple[dict, object]:
    """The driver's `train` in a fresh Megatron parallel state under these ART_MEGATRON_*
    settings (they stay set for the next phase); its report carries the gathered adapter."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    os.environ.update({f"ART_MEGATRON_{k}": v for k, v in megatron_env.items()})
    report, trainer = driver.train(args)
    report["adapter"] = _adapter(trainer)
    return report, trainer


def main() -> None:
    out_dir = Path(sys.argv[1])
    driver = driver_module()
    args = driver.parse_args(["--dtype", "float32", "--steps", "3", "--items", "6",
                              "--max-tokens", "24"])
    from megatron.core import parallel_state

    tp2, _ = _train(driver, args, TENSOR_MODEL_PARALLEL_SIZE="2")
    dp2, trainer = _train(driver, args, TENSOR_MODEL_PARALLEL_SIZE="1")
    waves = _waves(trainer)
    # Context parallel: both ranks hold halves of every row; the probe runs its layers on
    # them (keys and values gathered over CP).
    os.environ["ART_TRAINER_RANK_PROBE_LAYERS"] = "true"
    cp2, trainer = _train(driver, args, CONTEXT_PARALLEL_SIZE="2")
    cp2["context_parallel"] = parallel_state.get_context_parallel_world_size()
    cp2["probed_layers"] = len(trainer.probe.layers.layers) if trainer.probe else 0
    # The hybrid (three Gated DeltaNet layers, one attention layer): CP=2, whose recurrence
    # runs over the gathered whole row, against TP=1 x DP=2.
    hybrid_args = driver.parse_args(["--dtype", "float32", "--steps", "3", "--items", "6",
                                     "--max-tokens", "24", "--model", "tiny-qwen3_5",
                                     "--num-layers", "4"])
    # The hybrid's layer probe under CP is measured in test_calibration_cp2.py; here the
    # steps are what is compared.
    os.environ["ART_TRAINER_RANK_PROBE_LAYERS"] = "false"
    hybrid = {name: _train(driver, hybrid_args, CONTEXT_PARALLEL_SIZE=size)[0]
              for name, size in (("cp2", "2"), ("dp2", "1"))}
    # A MoE checkpoint (saved by transformers, the same on every rank) at EP=2 against EP=1.
    sys.path.insert(0, str(ROOT / "scripts"))
    from _hf_checkpoint import save_random_checkpoint

    folder = out_dir / "moe"
    if dist.get_rank() == 0:
        save_random_checkpoint(folder, family="qwen3_moe", layers=2)
    dist.barrier()
    moe_args = driver.parse_args(["--dtype", "float32", "--steps", "3", "--items", "6",
                                  "--max-tokens", "24", "--model", str(folder)])
    moe = {name: _train(driver, moe_args, CONTEXT_PARALLEL_SIZE="1",
                        EXPERT_MODEL_PARALLEL_SIZE=size)[0]
           for name, size in (("ep2", "2"), ("ep1", "1"))}
    # The same checkpoint under CP=2 with its experts spread over the CP ranks (EP=2,
    # upstream's default layout for a MoE model on 2 GPUs).
    for name, size in (("cp2ep2", "2"),):
        moe[name], _ = _train(driver, moe_args, CONTEXT_PARALLEL_SIZE="2",
                              EXPERT_MODEL_PARALLEL_SIZE=size)
        moe[name]["context_parallel"] = parallel_state.get_context_parallel_world_size()
        moe[name]["expert_parallel"] = parallel_state.get_expert_model_parallel_world_size()
    del os.environ["ART_MEGATRON_EXPERT_MODEL_PARALLEL_SIZE"]
    rank = dist.get_rank()
    with open(out_dir / f"rank{rank}.json", "w") as f:
        json.dump({"tp2": tp2, "dp2": dp2, "waves": waves, "cp2": cp2, "hybrid": hybrid,
                   "moe": moe}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
