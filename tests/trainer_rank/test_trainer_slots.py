"""Checkpoint slots through TrainerRank's public API on real runtimes (TP=1): checkpoint=None is
the model without LoRA, two adapters in one call equal two separately built trainers, per-slot
optim_step, save -> load bit-identical, and misuse raising before any state changes."""

from __future__ import annotations

import pytest
import torch

from art.megatron.lora import lora_modules
from art.trainer_rank import (
    AdamParams,
    ForwardInput,
    TrainerRank,
    TrainerRankSlotStateError,
)
from art.trainer_rank.slots.optimizer import factor_sites

LR = AdamParams(learning_rate=1e-2)


@pytest.fixture
def runtime_env(monkeypatch):
    monkeypatch.setenv("ART_TRAINER_RANK_PROBE_LAYERS", "false")
    monkeypatch.setenv("ART_MEGATRON_RANDOM_STATE", "3")


def _trainer(mode: str = "lora") -> TrainerRank:
    from art.megatron.train import build_training_runtime

    def configure(provider) -> None:
        provider.num_layers = 2

    return TrainerRank(build_training_runtime(
        model_identifier="tiny-qwen3", provider_configure=configure, print_env=False,
        model_initialization="random", provider_torch_dtype=torch.float32,
        trainable_parameter_mode=mode))


def _adapter(rank: TrainerRank, directory, seed: int) -> str:
    """A non-trivial adapter: the runtime's own with random B, exported as peft."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(rank.model):
            for b in m.lora_B.values():
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    rank.export_lora(str(directory))
    return str(directory)


def _inputs(seed: int, lengths=(11, 17)) -> list[ForwardInput]:
    g = torch.Generator().manual_seed(seed)
    return [ForwardInput(input_tokens=torch.randint(0, 256, (n,), generator=g),
                         target_tokens=torch.randint(0, 256, (n,), generator=g))
            for n in lengths]


def _logprobs(rank: TrainerRank, inputs, **kwargs) -> list[torch.Tensor]:
    return [out.target_logprobs for out in rank.dp_rank_forward(inputs, no_grad=True, **kwargs)]


def test_none_is_the_base_model_and_two_adapters_equal_separate_trainers(
        megatron_process, runtime_env, tmp_path):
    rank = _trainer()
    a = _adapter(rank, tmp_path / "a", seed=1)
    b = _adapter(rank, tmp_path / "b", seed=2)
    inputs = _inputs(0)
    base = _logprobs(_trainer("base_model"), inputs)
    assert all(torch.equal(x, y) for x, y in zip(_logprobs(rank, inputs, checkpoint=None), base))
    rank.load_checkpoint(a)
    rank.snapshot_checkpoint(a, "reference")
    # One call, three selections per input: a, b (loaded on first use by push), base.
    with rank.push_checkpoint(b):
        pass
    mixed = [ForwardInput(input_tokens=x.input_tokens, target_tokens=x.target_tokens,
                          checkpoint=c) for x in inputs for c in (a, b, None, "reference")]
    outs = rank.dp_rank_forward(mixed, no_grad=True)
    assert [o.checkpoint for o in outs] == [a, b, None, "reference"] * len(inputs)
    separate = {}
    for name in (a, b):
        alone = _trainer()
        alone.load_checkpoint(name)
        separate[name] = _logprobs(alone, inputs)
    for i in range(len(inputs)):
        got = {c: outs[4 * i + k].target_logprobs for k, c in enumerate((a, b, None, "ref"))}
        assert torch.equal(got[a], separate[a][i]) and torch.equal(got[b], separate[b][i])
        assert torch.equal(got[None], base[i]) and torch.equal(got["ref"], separate[a][i])
        assert not torch.equal(got[a], got[b]) and not torch.equal(got[a], base[i])


def _state(rank: TrainerRank, name: str):
    slot = rank.slots.slots[name]
    params = [s.param.detach().clone() for s in factor_sites(rank.model, slot.key)]
    adam = slot.optimizer.adam
    return params, [(m.clone(), {k: v.clone() for k, v in adam.state[m].items()})
                    for m in slot.optimizer.masters]


def _assert_same(x, y) -> None:
    assert len(x[0]) == len(y[0]) and all(torch.equal(p, q) for p, q in zip(x[0], y[0]))
    for (ma, sa), (mb, sb) in zip(x[1], y[1]):
        assert torch.equal(ma, mb) and all(torch.equal(sa[k], sb[k]) for k in ("step", "exp_avg",
                                                                               "exp_avg_sq"))


def _train(rank: TrainerRank, inputs, checkpoint, steps: int) -> None:
    for _ in range(steps):
        for micro in rank.forward_micro_batches(inputs, checkpoint=checkpoint):
            sum(-o.target_logprobs.sum() for o in micro.outputs).backward()
        rank.optim_step(params=LR, checkpoints=[checkpoint])


def test_optim_step_steps_only_named_slots_and_save_load_is_bit_identical(
        megatron_process, runtime_env, tmp_path):
    rank = _trainer()
    a = _adapter(rank, tmp_path / "a", seed=1)
    b = _adapter(rank, tmp_path / "b", seed=2)
    rank.load_checkpoint(a)
    with rank.push_checkpoint(b):
        pass
    builtin = {n: p.detach().clone() for n, p in rank.model.named_parameters()
               if ".adapters.default." in n}
    b_before = _state(rank, b)[0]
    inputs = _inputs(5)
    _train(rank, inputs, a, steps=2)
    assert all(torch.equal(p, q) for p, q in zip(_state(rank, b)[0], b_before))
    assert all(torch.equal(p, builtin[n]) for n, p in rank.model.named_parameters()
               if ".adapters.default." in n)
    rank.save_checkpoint(str(tmp_path / "saved"))  # the loaded (active) slot: a
    other = _trainer()
    other.load_checkpoint(str(tmp_path / "saved"))
    _assert_same(_state(rank, a), _state(other, str(tmp_path / "saved")))
    _train(rank, inputs, a, steps=1)
    _train(other, inputs, str(tmp_path / "saved"), steps=1)
    _assert_same(_state(rank, a), _state(other, str(tmp_path / "saved")))
    # prepare -> finish writes what prepare captured; abort leaves nothing behind.
    rank.prepare_checkpoint_save(str(tmp_path / "p"), a)
    rank.abort_checkpoint_save(str(tmp_path / "p"))
    assert not (tmp_path / "p").exists()


def test_slot_misuse_through_trainer_changes_nothing(megatron_process, runtime_env, tmp_path,
                                                     monkeypatch):
    monkeypatch.setenv("ART_TRAINER_RANK_TEST_MEMORY_LIMIT_BYTES", str(2**30))
    rank = _trainer()
    a = _adapter(rank, tmp_path / "a", seed=1)
    usable = rank.usable_limit_bytes()
    rank.load_checkpoint(a)
    after_load, held = rank.usable_limit_bytes(), rank.slots.resident_bytes()
    rank.snapshot_checkpoint(a, "ref")
    # Each resident slot lowers the limit the planner works with by what it holds.
    assert usable - after_load == held > 0
    assert usable - rank.usable_limit_bytes() == rank.slots.resident_bytes() > held
    inputs = _inputs(2)
    for micro in rank.forward_micro_batches(inputs):
        sum(-o.target_logprobs.sum() for o in micro.outputs).backward()
    params = {n: p.detach().clone() for n, p in rank.model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in rank.model.named_parameters() if p.grad is not None}
    stack, slots = list(rank.slots.stack), dict(rank.slots.slots)
    for call, match in [
        (rank.pop_checkpoint, "nothing pushed"),
        (lambda: rank.optim_step(params=LR, checkpoints=["ref"]), "forward-only"),
        (lambda: rank.optim_step(params=LR, checkpoints=["active"]), "no gradients"),
        (lambda: rank.optim_step(params=LR, checkpoints=["nope"]), "not resident"),
        (lambda: rank.save_checkpoint(str(tmp_path / "x"), "nope"), "not resident"),
        (lambda: rank.save_checkpoint(str(tmp_path / "x")), "accumulated gradients"),
        (lambda: rank.load_checkpoint(a), "accumulated gradients"),
        (lambda: rank.finish_checkpoint_save(str(tmp_path / "x")), "was prepared"),
        (lambda: rank.dp_rank_forward(inputs, checkpoint="unloaded"), "checkpoint='unloaded'"),
    ]:
        with pytest.raises(TrainerRankSlotStateError, match=match):
            call()
        assert rank.slots.stack == stack and rank.slots.slots == slots
        now = dict(rank.model.named_parameters())
        assert all(torch.equal(now[n], p) for n, p in params.items())
        assert all(torch.equal(now[n].grad, g) for n, g in grads.items())
    assert not (tmp_path / "x").exists()
    rank.optim_step(params=LR)  # steps a (the slot holding gradients), not the built-in
    assert not rank.slots.has_grads(a)


def test_runtime_adapter_saves_its_megatron_adam_state(megatron_process, runtime_env, tmp_path):
    """The runtime's own adapter ("active") is stepped by Megatron's optimizer; its save holds
    that optimizer's Adam state, which a load turns into the slot's own, value for value."""
    from art.trainer_rank.slots.optimizer import runtime_adam_state

    rank = _trainer()
    inputs = _inputs(4)
    for _ in range(2):
        for micro in rank.forward_micro_batches(inputs):
            sum(-o.target_logprobs.sum() for o in micro.outputs).backward()
        rank.optim_step(params=LR)
    rank.save_checkpoint(str(tmp_path / "runtime"))
    from art.trainer_rank import validate_checkpoint

    manifest = validate_checkpoint(tmp_path / "runtime", require_optimizer=True)
    assert set(manifest["steps"].values()) == {2.0}
    components, steps, _ = runtime_adam_state(
        rank.optimizer, factor_sites(rank.model, "default"))
    other = _trainer()
    other.load_checkpoint(str(tmp_path / "runtime"))
    params, state = _state(other, str(tmp_path / "runtime"))
    sites = factor_sites(other.model, other.slots.slots[str(tmp_path / "runtime")].key)
    for site, (master, adam) in zip(sites, state):
        assert torch.equal(master, components["master"][site.peft_key])
        assert torch.equal(adam["exp_avg"], components["exp_avg"][site.peft_key])
        assert torch.equal(adam["exp_avg_sq"], components["exp_avg_sq"][site.peft_key])
        assert float(adam["step"]) == steps[site.peft_key] == 2.0
