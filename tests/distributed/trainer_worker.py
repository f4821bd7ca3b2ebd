"""torchrun worker for TrainerRank: first forward_micro_batches at TP = WORLD_SIZE (outputs
and gradients), without and with sequence parallel, then, in the same processes, TP=1 /
DP = WORLD_SIZE (dealing, the mismatched-call error, and an OOM on rank 1 only whose miss
every rank holds after the call). `run("tp")` is also called in-process by the test for the
TP=1 reference. argv: out_dir, then optionally a folder for rank_mismatch_worker.py's records:
its phases then run at TP = WORLD_SIZE in the same launch, before the DP part (the suite runs
`run_all` so in two_ranks_worker.py's launch)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from megatron.core import parallel_state

from art.megatron.distributed import shutdown_distributed
from art.megatron.implementation import Implementation
from art.megatron.provider import Provider
from art.megatron.settings import load_settings
from art.megatron.train import build_runtime_for_provider
from art.trainer_rank import ForwardInput, TrainerRank, TrainerRankOptions

from _tiny import tiny_dense

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reliability"))
from _faults import Injector  # noqa: E402


def inputs(extra: bool = False) -> list:
    g = torch.Generator().manual_seed(11)

    def x(n: int) -> ForwardInput:
        return ForwardInput(input_tokens=torch.randint(0, 256, (n,), generator=g),
                            target_tokens=torch.randint(0, 256, (n,), generator=g), top_k=4,
                            logits=True, hidden_states=True)

    items = [x(9), [x(7), x(12)], x(5), [[x(10)]], x(8)]
    return items + [x(3)] if extra else items


def leaves(value) -> list:
    return [value] if not isinstance(value, list) else [y for v in value for y in leaves(v)]


def run(mode: str) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    tp = 1 if mode == "dp" else world
    provider = Provider(
        tiny_dense(num_layers=2),
        settings=load_settings({
            "ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": str(tp),
            "ART_MEGATRON_SEQUENCE_PARALLEL": "true" if mode == "tp_sp" else "false",
            # tp_adaptive: built with full recompute, each micro-batch runs the least-work
            # rung that fits (every rank the same).
            **({"ART_MEGATRON_RECOMPUTE_GRANULARITY": "full",
                "ART_MEGATRON_RECOMPUTE_METHOD": "uniform",
                "ART_MEGATRON_RECOMPUTE_NUM_LAYERS": "1"} if mode == "tp_adaptive" else
               {"ART_MEGATRON_RECOMPUTE_GRANULARITY": "selective"}),
        }),
        dtype="float32",
        implementation=Implementation.cpu_local(),
    )
    # Ranks see different limits; the replica must agree on the smallest.
    # Small enough that the start-up probe stops at a few hundred tokens (seconds, not tens).
    limit = (32 - 2 * rank) * 2**20
    trainer = TrainerRank(build_runtime_for_provider(
        provider, build_optimizer=False, wrap_ddp=False, trainable_parameter_mode="base_model",
        trainer_options=TrainerRankOptions(
            test_memory_limit_bytes=limit,
            recompute="adaptive" if mode == "tp_adaptive" else "escalate")))
    result: dict = {"rank": rank, "tp": tp, "world": world}
    if mode == "dp":
        try:
            list(trainer.forward_micro_batches(inputs(extra=rank == 1)))
        except ValueError as exc:
            result["mismatch_error"] = str(exc)
    else:
        from art.trainer_rank.ranks import agree as _agree

        try:  # two TP ranks holding different plans must both refuse to run them
            _agree.check_same_plan(f"admitted items=[{rank}]")
        except RuntimeError as exc:
            result["plan_mismatch_error"] = str(exc)
    seen: dict[int, list[dict]] = {}
    # DP: rank 1 alone runs out of memory in a layer's forward (recovered on that replica).
    injector = Injector("layer forward", 2) if mode == "dp" and rank == 1 else Injector()
    with injector:
        for mb in trainer.forward_micro_batches(inputs()):
            loss = 0.0
            for index, out in zip(mb.indices, mb.outputs):
                rows = []
                for o in leaves(out):
                    loss = loss - o.target_logprobs.sum()
                    rows.append({
                        "logprobs": o.target_logprobs.tolist(),
                        "top_tokens": o.top_k.tokens.tolist(),
                        "top_logprobs": o.top_k.logprobs.tolist(),
                        "logits_shape": list(o.logits.shape),
                        "logits_sum": float(o.logits.double().sum()),
                        "hidden_sum": float(o.hidden_states.double().sum()),
                    })
                seen[index] = rows
            if isinstance(loss, torch.Tensor):  # not an empty micro-batch (DP lockstep)
                loss.backward()
    # The final norm's weight is replicated over TP: its gradient compares directly with TP=1.
    final_norm = trainer.model.decoder.final_layernorm.weight
    result.update(
        seen={str(k): v for k, v in seen.items()},
        usable=[s.usable_limit_bytes for s in trainer.stats_history],
        decisions=[s.decision for s in trainer.stats_history],
        recompute=[s.recompute_summary for s in trainer.stats_history],
        measured=[s.measured_peak_bytes for s in trainer.stats_history],
        final_norm_grad=final_norm.grad.tolist(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        # Probe coefficients (layers, and the tails probed on first use): one digest per rank.
        probe_digest=hashlib.sha256(trainer.probe.snapshot().to_json().encode()).hexdigest(),
        probe_tails=trainer.probe.probed_tails,
        probed=[("coefficients: probe:" in s.term_table) for s in trainer.stats_history],
        fired=injector.fired,
        profiles={sig: [p.observations, p.misses]
                  for sig, p in sorted(trainer.profiles.profiles.items())},
        step_times=[[t.forward_flops, t.recomputed_flops, t.seconds]
                    for t in trainer.step_times.times],
    )
    return result


def run_all(out_dir: str, mismatch_dir: str | None = None) -> None:
    """Every mode at TP = WORLD_SIZE, then (with `mismatch_dir`) rank_mismatch_worker.py's
    phases there, then DP; this rank's record to out_dir."""
    rank = int(os.environ.get("RANK", "0"))
    result = {"tp": run("tp"), "tp_sp": run("tp_sp"), "tp_adaptive": run("tp_adaptive")}
    if mismatch_dir is not None:
        import rank_mismatch_worker

        rank_mismatch_worker.run(int(os.environ["WORLD_SIZE"]), Path(mismatch_dir))
    # Same process group, new Megatron layout: TP=1, DP = WORLD_SIZE.
    parallel_state.destroy_model_parallel()
    result["dp"] = run("dp")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def main() -> None:
    run_all(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
    shutdown_distributed()


if __name__ == "__main__":
    main()
