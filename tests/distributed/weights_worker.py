"""torchrun worker: HF checkpoints loaded at TP = WORLD_SIZE in several layouts, one process
per rank for all of them (Megatron's parallel state is rebuilt between layouts).

argv: cases.json out_dir. cases.json: [{"name", "folder", "reference", "env"}]; reference is
a .pt with the token sequences and transformers' logprobs for them (computed by the test, so
no rank imports transformers). For each case every rank builds the runtime with
build_training_runtime(model_identifier=<folder>, model_initialization="pretrained") and
compares TrainerRank's target logprobs with transformers'; the export is gathered and
compared bit for bit with the file (rank 0); the loaded base weights' bytes are set beside
the planner's resident weight term.
Writes out_dir/rank<R>.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from _hf_models import pretrained_runtime, runtime_logprobs
from megatron.core import parallel_state
from safetensors.torch import load_file

from art.megatron.distributed import shutdown_distributed
from art.megatron.lora import lora_parameters
from art.megatron.weights import prepare_checkpoint
from art.megatron.weights.export import hf_state_dict
from art.trainer_rank.pricing.model import MemoryModel


def run(case: dict) -> dict:
    folder = Path(case["folder"])
    for name in [n for n in os.environ if n.startswith("ART_MEGATRON_")]:
        del os.environ[name]
    os.environ.update({"ART_MEGATRON_RECOMPUTE_GRANULARITY": "none", **case["env"]})
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    runtime = pretrained_runtime(folder)
    model = runtime.model[0]
    reference = torch.load(case["reference"])
    ours = runtime_logprobs(runtime, reference["sequences"])
    theirs = reference["logprobs"]
    lora = {id(p) for p in lora_parameters(model)}
    base = [p for p in model.parameters() if id(p) not in lora]
    result = {
        "layout": runtime.provider.layout.summary,
        "expert_tp": parallel_state.get_expert_tensor_parallel_world_size(),
        "logprob_max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(ours, theirs)),
        "live_param_bytes": sum(p.numel() * p.element_size() for p in base),
        "priced_weight_bytes": next(t.bytes for t in MemoryModel.for_provider(runtime.provider)
                                    .resident_terms() if t.name == "weights"),
    }
    exported = hf_state_dict(model, prepare_checkpoint(folder, runtime.provider.geometry))
    if exported is not None:
        original = load_file(str(folder / "model.safetensors"))
        result["export_same_names"] = set(exported) == set(original)
        result["export_differs"] = sorted(n for n, t in original.items()
                                          if n not in exported or not torch.equal(exported[n], t))
    return result


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    rows = {case["name"]: run(case) for case in cases}
    rank = torch.distributed.get_rank()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(rows, indent=1))
    shutdown_distributed()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["ART_TRAINER_RANK_PROBE_LAYERS"] = "false"
    main()
