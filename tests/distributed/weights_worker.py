"""torchrun worker: HF checkpoints loaded at TP = WORLD_SIZE in several layouts, one process
per rank for all of them (Megatron's parallel state is rebuilt between layouts).

argv: cases.json out_dir. cases.json (`prepare_cases`): [{"name", "folder", "reference",
"env"}]; reference is a .pt with the token sequences and transformers' logprobs for them
(computed in the test's process before the launch, so no rank imports transformers). In the
shared 2-rank launch this is two_ranks_worker.py's weights/ job. For each case every rank
builds the runtime with build_training_runtime(model_identifier=<folder>,
model_initialization="pretrained") and compares TrainerRank's target logprobs with
transformers'; the export is gathered and compared bit for bit with the file (rank 0); the
loaded base weights' bytes are set beside the planner's resident weight term.
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


def prepare_cases(folder: Path) -> Path:
    """The test process's part, before the launch: tiny HF checkpoints saved by transformers
    (qwen3, tied llama, qwen3_moe, qwen3_5) with transformers' logprobs for a few sequences,
    and the layouts to load them in; returns cases.json."""
    from _hf_models import hf_logprobs, save_hf_model, save_qwen3_5, token_sequences

    qwen3 = save_hf_model("qwen3", folder / "qwen3")
    llama = save_hf_model("llama", folder / "llama", tied=True)
    moe = save_hf_model("qwen3_moe", folder / "moe")
    qwen3_5 = save_qwen3_5(folder / "qwen3_5")
    for checkpoint in (qwen3, llama, moe, qwen3_5):
        # One sequence past a 64-token Gated DeltaNet chunk (the others ignore the length).
        sequences = token_sequences(256, lengths=(70, 5, 9))
        torch.save({"sequences": sequences, "logprobs": hf_logprobs(checkpoint, sequences)},
                   checkpoint / "reference.pt")
    tp2 = {"ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "2"}

    def case(name: str, checkpoint: Path, env: dict) -> dict:
        return {"name": name, "folder": str(checkpoint),
                "reference": str(checkpoint / "reference.pt"), "env": env}

    cases = [
        case("qwen3 TP2 SP", qwen3, tp2),
        case("llama tied TP2", llama, {**tp2, "ART_MEGATRON_SEQUENCE_PARALLEL": "0"}),
        case("qwen3_moe TP2 ETP2", moe, tp2),
        case("qwen3_moe TP2 ETP1", moe, {**tp2, "ART_MEGATRON_EXPERT_TENSOR_PARALLEL_SIZE": "1"}),
        # Gated DeltaNet in_proj / conv per-rank sections, gated QKV groups, packed rows
        # split at sequence boundaries under sequence parallel.
        case("qwen3_5 TP2 SP", qwen3_5, tp2),
    ]
    path = folder / "cases.json"
    path.write_text(json.dumps(cases))
    return path


def run_cases(cases_path: Path, out_dir: Path) -> None:
    """Every case of cases.json; this rank's rows to out_dir/rank<R>.json. Sets the
    ART_MEGATRON_* environment per case (the caller restores its own)."""
    cases = json.loads(Path(cases_path).read_text())
    rows = {case["name"]: run(case) for case in cases}
    rank = torch.distributed.get_rank()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(rows, indent=1))


def main() -> None:
    run_cases(Path(sys.argv[1]), Path(sys.argv[2]))
    shutdown_distributed()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["ART_TRAINER_RANK_PROBE_LAYERS"] = "false"
    main()
