"""A reference-policy RL driver on checkpoint slots, as ART drivers write it: load the policy
adapter, keep a frozen snapshot as the reference, then per step score the rollouts under the
reference (and the base model), train the policy with a policy loss plus a KL-style term, and
optim_step the policy slot only. Run in-process (TP=1, `prepare`) or under torchrun
(TP=WORLD_SIZE: two_ranks_worker.py's slots/ job, or this file's main)."""

from __future__ import annotations

import json
import os
import sys

import torch

from _upstream_env import environment

STEPS = 3
ENV = {"ART_TRAINER_RANK_PROBE_LAYERS": "false", "ART_MEGATRON_RANDOM_STATE": "3",
       "ART_MEGATRON_RECOMPUTE_GRANULARITY": "full"}
REFERENCE = "reference.json"  # the TP=1 record, in prepare's tp1/ folder


def prepare(folder: str) -> str:
    """The test process's part, before the launch (TP=1, under ENV): a policy adapter with
    random B exported to folder/policy, and the driver run on it at TP=1, its record in
    folder/tp1/REFERENCE. Returns the policy's folder."""
    from art.megatron.lora import lora_modules

    policy = os.path.join(folder, "policy")
    tp1 = os.path.join(folder, "tp1")
    os.makedirs(tp1, exist_ok=True)
    with environment(ENV):
        rank = trainer()
        g = torch.Generator().manual_seed(8)
        with torch.no_grad():
            for m in lora_modules(rank.model):
                for b in m.lora_B.values():
                    b.copy_(torch.randn(b.shape, generator=g) * 0.3)
        rank.export_lora(policy)
        record = drive(rank, policy, tp1)
    with open(os.path.join(tp1, REFERENCE), "w") as f:
        json.dump(record, f)
    return policy


def run(out_dir: str, policy: str) -> None:
    """The driver at the layout the environment sets; this rank's record to out_dir."""
    rank = trainer()
    result = drive(rank, policy, out_dir)
    result["layout"] = rank.layout.summary
    with open(os.path.join(out_dir, f"rank{int(os.environ.get('RANK', 0))}.json"), "w") as f:
        json.dump(result, f)


def trainer():
    from art.megatron.train import build_training_runtime
    from art.trainer_rank import TrainerRank

    def configure(provider) -> None:
        provider.num_layers = 2

    return TrainerRank(build_training_runtime(
        model_identifier="tiny-qwen3", provider_configure=configure, print_env=False,
        model_initialization="random", provider_torch_dtype=torch.float32))


def _inputs():
    from art.trainer_rank import ForwardInput

    g = torch.Generator().manual_seed(21)
    return [ForwardInput(input_tokens=torch.randint(0, 256, (n,), generator=g),
                         target_tokens=torch.randint(0, 256, (n,), generator=g))
            for n in (13, 22, 9, 17)]


def _slot_state(rank, name):
    from art.trainer_rank.slots.optimizer import factor_sites

    slot = rank.slots.slots[name]
    params = [s.param.detach().clone() for s in factor_sites(rank.model, slot.key)]
    adam = slot.optimizer.adam
    moments = [(m.clone(), adam.state[m]["exp_avg"].clone(), adam.state[m]["exp_avg_sq"].clone(),
                float(adam.state[m]["step"])) for m in slot.optimizer.masters]
    return params, moments


def _same(x, y) -> bool:
    return (all(torch.equal(p, q) for p, q in zip(x[0], y[0])) and all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
        and a[3] == b[3] for a, b in zip(x[1], y[1])))


def drive(rank, policy: str, out_dir: str) -> dict:
    from art.trainer_rank import AdamParams

    rank.load_checkpoint(policy)
    assert rank.snapshot_checkpoint(policy, "reference") is True
    inputs = _inputs()
    record: dict = {"loss": [], "reference": [], "base": [], "policy": [], "grad_norm": []}
    for _ in range(STEPS):
        rank.zero_grad()
        reference = [o.target_logprobs for o in rank.dp_rank_forward(
            inputs, checkpoint="reference", no_grad=True)]
        base = [o.target_logprobs for o in rank.dp_rank_forward(
            inputs, checkpoint=None, no_grad=True)]
        total, tokens = torch.zeros(()), torch.zeros(())
        policy_lp = []
        for micro in rank.forward_micro_batches(inputs):  # the loaded policy slot
            ref = micro.select(reference)
            loss = sum(-o.target_logprobs.sum() + 0.1 * (o.target_logprobs - r).pow(2).sum()
                       for o, r in zip(micro.outputs, ref))
            loss.backward()
            total += loss.detach()
            tokens += sum(o.target_logprobs.numel() for o in micro.outputs)
            policy_lp += [o.target_logprobs.detach() for o in micro.outputs]
        rank.dp_reduce(total)
        rank.dp_reduce(tokens)
        metrics = rank.optim_step(params=AdamParams(learning_rate=2e-2),
                                  scale_grads=1 / float(tokens), checkpoints=[policy])
        record["loss"].append(float(total / tokens))
        record["grad_norm"].append(metrics["grad_norm"])
        record["reference"].append(torch.cat(reference).tolist())
        record["base"].append(torch.cat(base).tolist())
        record["policy"].append(torch.cat(policy_lp).tolist())
    saved = os.path.join(out_dir, "saved")
    rank.save_checkpoint(saved, policy)
    before = _slot_state(rank, policy)
    rank.load_checkpoint(saved)  # a second slot from the files, at this TP size
    record["round_trip_identical"] = _same(before, _slot_state(rank, saved))
    return record


def main() -> None:
    from art.megatron.distributed import shutdown_distributed

    run(sys.argv[1], sys.argv[2])
    shutdown_distributed()


if __name__ == "__main__":
    main()
