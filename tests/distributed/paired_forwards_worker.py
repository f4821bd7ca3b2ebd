"""torchrun worker (2 ranks, gloo): a MoE checkpoint at EP=2 with TP=1, where the expert-parallel
group is the two data-parallel ranks, against the same checkpoint at EP=1, on calls whose
ranks have unequal work: forward_micro_batches over five items under a limit that admits one
long item per micro-batch (its last wave leaves one rank's share empty) with one no-grad
item among them (one rank has a no-grad micro-batch while the other has a grad one), then
dp_rank_forward without grad with three items on rank 0 and one on rank 1, then with grad
and the same unequal items (which must raise on both ranks, not hang).

Writes out_dir/rank<R>-ep<EP>.json: whether the trainer pairs forwards, the fillers it ran,
each item's summed log-probs (every rank's, gathered), the optimizer step's grad norm, the
micro-batches' decisions, and the grad dp_rank_forward's error."""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from upstream_driver_worker import driver_module

ROOT = Path(__file__).resolve().parents[2]
LENGTHS = (40, 38, 39, 12, 30)
NO_GRAD_ITEM = 3


def _inputs(lengths, seed: int, no_grad_item: int | None = None) -> list:
    from art.trainer_rank import ForwardInput

    g = torch.Generator().manual_seed(seed)
    return [ForwardInput(input_tokens=torch.randint(0, 256, (n,), generator=g),
                         target_tokens=torch.randint(0, 256, (n,), generator=g),
                         no_grad=True if i == no_grad_item else None)
            for i, n in enumerate(lengths)]


def _partners(stats) -> list[list]:
    """Each micro-batch's (wave start, grad, packed tokens, the EP partners' rows it was
    priced beside: None when priced beside rows of its own size)."""
    records = []
    for s in stats:
        if not s.local_count:
            continue
        found = re.search(r"beside EP partners' rows of (\d+) packed tokens", s.term_table)
        records.append([s.global_start, s.grad_enabled, s.packed_tokens,
                        int(found[1]) if found else None])
    return records


def _gathered(mine: dict) -> dict:
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for part in every for k, v in part.items()}


def _phase(driver, folder: Path, ep: int) -> dict:
    from megatron.core import parallel_state

    from art.trainer_rank import AdamParams
    from art.trainer_rank.compute.items import make_items

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    os.environ.update({"ART_MEGATRON_EXPERT_MODEL_PARALLEL_SIZE": str(ep),
                       "ART_MEGATRON_CONTEXT_PARALLEL_SIZE": "1",
                       "ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "1"})
    args = driver.parse_args(["--dtype", "float32", "--steps", "0", "--model", str(folder)])
    _, trainer = driver.train(args)
    fillers: list[tuple[bool, int]] = []
    run_filler = trainer._filler

    def counted(grad: bool, forwards: int):
        fillers.append((grad, forwards))
        return run_filler(grad, forwards)

    trainer._filler = counted
    longest = make_items(_inputs([max(LENGTHS)], 0))[0]
    price = trainer.admission.price(longest.leaves, True)[0].dynamic_bytes
    trainer.options = replace(trainer.options, test_memory_limit_bytes=int(price * 1.6))

    inputs = _inputs(LENGTHS, 1, NO_GRAD_ITEM)
    history = len(trainer.stats_history)
    logprobs: dict[int, float] = {}
    decisions = []
    trainer.zero_grad()
    for micro in trainer.forward_micro_batches(inputs):
        decisions.append(micro.stats.decision)
        loss = None
        for index, out in zip(micro.indices, micro.outputs):
            logprobs[index] = float(out.target_logprobs.detach().sum())
            if out.target_logprobs.requires_grad:
                term = -out.target_logprobs.sum()
                loss = term if loss is None else loss + term
        if loss is not None:
            loss.backward()
    grad_norm = trainer.optim_step(params=AdamParams(learning_rate=1e-3))["grad_norm"]
    wave_partners = _partners(trainer.stats_history[history:])

    rank = dist.get_rank()
    mine = _inputs([30, 20, 25] if rank == 0 else [35], 2 + rank)
    history = len(trainer.stats_history)
    with torch.no_grad():
        scored = trainer.dp_rank_forward(mine)
    call_partners = _partners(trainer.stats_history[history:])
    nograd = {f"{rank}:{i}": float(out.target_logprobs.sum()) for i, out in enumerate(scored)}

    grad_error = None
    try:
        outs = trainer.dp_rank_forward(mine)
        sum(-o.target_logprobs.sum() for o in outs).backward()
    except Exception as exc:  # noqa: BLE001 - the record says what was raised
        grad_error = f"{type(exc).__name__}: {exc}"
    trainer.zero_grad()
    return {"paired_forwards": trainer.paired_forwards, "fillers": fillers,
            "logprobs": {str(k): v for k, v in _gathered(logprobs).items()},
            "grad_norm": float(grad_norm), "decisions": decisions,
            "nograd_dp_rank_forward": _gathered(nograd), "grad_error": grad_error,
            "wave_partners": wave_partners, "call_partners": call_partners,
            "recompute_choice": str(trainer.admission.policy.choice)}


def run(out_dir: str) -> None:
    out = Path(out_dir)
    sys.path.insert(0, str(ROOT / "scripts"))
    from _hf_checkpoint import save_random_checkpoint

    folder = out / "moe"
    if dist.get_rank() == 0:
        save_random_checkpoint(folder, family="qwen3_moe", layers=2)
    dist.barrier()
    driver = driver_module()
    saved = {k: os.environ.get(k) for k in (
        "ART_MEGATRON_EXPERT_MODEL_PARALLEL_SIZE", "ART_MEGATRON_CONTEXT_PARALLEL_SIZE",
        "ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE")}
    try:
        for ep in (2, 1):
            record = _phase(driver, folder, ep)
            with open(out / f"rank{dist.get_rank()}-ep{ep}.json", "w") as f:
                json.dump(record, f)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
