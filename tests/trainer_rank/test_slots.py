"""The checkpoint-slot store on a real Megatron-Core model (TP=1): selection, per-slot Adam,
save -> load bit-identical (optimizer state included), and every misuse raising before any
state changes."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from peft import LoraConfig

from art.megatron.lora import lora_modules
from art.megatron.lora_peft import export_adapter
from art.megatron.lora_selection import use_adapter
from art.megatron.provider import Provider
from art.megatron.settings import load_settings
from art.trainer_rank.slots import (
    BUILTIN,
    MaterializedCheckpoint,
    SaveQueue,
    SlotStore,
    TrainerRankSlotStateError,
    Unset,
    export_lora,
    materialize_lora,
    validate_checkpoint,
)
from art.trainer_rank.slots.optimizer import factor_sites

TOKENS = 12


@dataclass(frozen=True)
class _Adam:  # the fields of AdamParams the slot optimizer reads
    learning_rate: float = 1e-2
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.1
    grad_clip_norm: float = 0.1


def _provider() -> Provider:
    return Provider("tiny-qwen3", settings=load_settings({}), dtype="float32",
                    lora=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))


def _store(model) -> SlotStore:
    return SlotStore(model, has_builtin=True, base_model_name_or_path="tiny-qwen3",
                     builtin_r=4, builtin_alpha=8.0)


def _adapter(tmp_path, name, seed):
    model = _provider().build_model(seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model):
            for b in m.lora_B.values():
                b.copy_(torch.randn(b.shape, generator=g) * 0.2)
    export_adapter(model, tmp_path / name, base_model_name_or_path="tiny-qwen3")
    return str(tmp_path / name)


def _loss(model, key):
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, 256, (1, TOKENS), generator=g)
    with use_adapter(key):
        return model(tokens, torch.arange(TOKENS)[None], attention_mask=None).float().pow(
            2).mean()


def _slot_state(store, name):
    slot = store.slots[name]
    params = [s.param.detach().clone() for s in factor_sites(store.model, slot.key)]
    opt = slot.optimizer
    state = [(m.clone(), {k: v.clone() for k, v in opt.adam.state.get(m, {}).items()})
             for m in opt.masters]
    return params, state


def _same(a, b):
    (pa, sa), (pb, sb) = a, b
    assert len(pa) == len(pb) and all(torch.equal(x, y) for x, y in zip(pa, pb))
    for (ma, da), (mb, db) in zip(sa, sb):
        assert torch.equal(ma, mb) and da.keys() == db.keys()
        assert all(torch.equal(da[k], db[k]) for k in da)


def _snapshot_of_everything(store):
    return (dict(store.slots), list(store.stack), store.loaded,
            {n: {k: v.detach().clone() for k, v in m.adapters.items()
                 for k, v in v.named_parameters()} for n, m in
             enumerate(lora_modules(store.model))})


def _unchanged(store, before):
    slots, stack, loaded, params = before
    assert store.slots == slots and store.stack == stack and store.loaded == loaded
    now = _snapshot_of_everything(store)[3]
    assert now.keys() == params.keys()
    for n in params:
        assert now[n].keys() == params[n].keys()
        assert all(torch.equal(now[n][k], params[n][k]) for k in params[n])


def test_slots_select_step_save_and_load_bit_identically(megatron_process, tmp_path):
    a, b = _adapter(tmp_path, "a", 1), _adapter(tmp_path, "b", 2)
    model = _provider().build_model(seed=0)
    store = _store(model)
    assert store.active() == BUILTIN
    store.load(a)
    assert store.active() == a and store.resolve(Unset) == a and store.resolve(None) is None
    task = store.prefetch(b)  # read in a background thread; push then uses what was read
    task.get_loop().run_until_complete(task)
    assert b in store._prefetched and b not in store.slots
    with store.push(b):
        assert b not in store._prefetched
        assert store.active() == b and store.resolve(Unset, a) == a
        with store.push(None):
            assert store.active() is None
        assert store.active() == b
    assert store.active() == a and b in store.slots
    # Two steps on a; b has no gradient and keeps its state untouched.
    b_before = [s.param.detach().clone() for s in factor_sites(model, store.slots[b].key)]
    for _ in range(2):
        _loss(model, store.slots[a].key).backward()
        assert store.has_grads(a) and not store.has_grads(b)
        store.step_slot(a, _Adam(), 1.0)
    assert all(torch.equal(x, s.param) for x, s in
               zip(b_before, factor_sites(model, store.slots[b].key)))
    # Snapshot: a forward-only copy of a, returned True once, False after.
    assert store.snapshot(a, "ref") is True and store.snapshot(a, "ref") is False
    assert store.slots["ref"].forward_only
    with torch.no_grad():
        assert torch.equal(_loss(model, store.slots["ref"].key), _loss(model, store.slots[a].key))
    # Save (prepare + finish) and load into a fresh model: bit-identical, Adam state included.
    saves = SaveQueue(store)
    saves.prepare(str(tmp_path / "saved"))
    saves.finish(str(tmp_path / "saved"))
    manifest = validate_checkpoint(tmp_path / "saved", require_optimizer=True)
    assert manifest["optimizer"]["learning_rate"] == 1e-2
    assert set(manifest["steps"].values()) == {2.0}
    fresh = _store(_provider().build_model(seed=0))
    fresh.load(str(tmp_path / "saved"))
    _same(_slot_state(store, a), _slot_state(fresh, str(tmp_path / "saved")))
    # ...and the next step is the same on both.
    for s, name in ((store, a), (fresh, str(tmp_path / "saved"))):
        _loss(s.model, s.slots[name].key).backward()
        s.step_slot(name, _Adam(), 1.0)
    _same(_slot_state(store, a), _slot_state(fresh, str(tmp_path / "saved")))
    # export_lora: a plain peft directory that loads as a fresh-optimizer slot.
    assert export_lora(store, str(tmp_path / "exported"), a) == len(
        factor_sites(model, store.slots[a].key))
    assert validate_checkpoint(tmp_path / "exported") is None
    materialize_lora(tmp_path / "saved", tmp_path / "served")
    assert json.loads((tmp_path / "served" / "adapter_config.json").read_text())["r"] == 4
    fresh.load(MaterializedCheckpoint(path="logical/name", directory=str(tmp_path / "served")))
    assert fresh.active() == "logical/name"


def test_every_slot_misuse_raises_before_any_state_changes(megatron_process, tmp_path):
    a = _adapter(tmp_path, "a", 1)
    model = _provider().build_model(seed=0)
    store = _store(model)
    store.load(a)
    store.snapshot(a, "ref")
    saves = SaveQueue(store)
    _loss(model, store.slots[a].key).backward()  # a holds gradients now
    grads = {id(s.param): s.param.grad.clone() for s in factor_sites(model, store.slots[a].key)}
    before = _snapshot_of_everything(store)
    misuses = [
        (store.pop, "nothing pushed"),
        (lambda: store.check_steppable(["ref"]), "forward-only"),
        (lambda: store.check_steppable(["nope"]), "not resident"),
        (lambda: saves.prepare(str(tmp_path / "x"), "nope"), "not resident"),
        (lambda: saves.prepare(str(tmp_path / "x")), "accumulated gradients"),
        (lambda: saves.finish(str(tmp_path / "x")), "was prepared"),
        (lambda: store.load(a), "accumulated gradients"),
        (lambda: store.load("ref"), "forward-only snapshot"),
        (lambda: store.snapshot("nope", "other"), "not resident"),
        (lambda: store.snapshot(a, a), "trainable checkpoint"),
        (lambda: store.resolve("unloaded/path"), "not a resident slot"),
    ]
    for call, match in misuses:
        with pytest.raises(TrainerRankSlotStateError, match=match):
            call()
        _unchanged(store, before)
    with store.push(None):
        with pytest.raises(TrainerRankSlotStateError, match="pushed"):
            store.load(None)
        _unchanged(store, (before[0], [None], before[2], before[3]))
    pushed = store.push(a)
    store.push(None)
    with pytest.raises(TrainerRankSlotStateError, match="stack changed"):
        with pushed:
            pass
    assert store.stack == [a, None]
    store.pop()
    store.pop()
    # A failed read (a directory that is not a checkpoint) leaves the store as it was.
    store.zero_grad()
    before = _snapshot_of_everything(store)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        store.load(str(tmp_path / "missing"))
    _unchanged(store, before)
    assert all(s.param.grad is None for s in factor_sites(model, store.slots[a].key))
    assert grads  # the gradients were there while the misuses ran


def test_resident_slots_are_priced_as_the_store_holds_them(megatron_process, tmp_path):
    """The estimate's resident-adapter terms equal what the store really keeps resident (a
    trainable slot: factors + grads + fp32 master + 2 moments; a snapshot: factors), and
    `plan` prices them per cell."""
    from art.trainer_rank._request import LoraShape, MicroBatchShape
    from art.trainer_rank.cli.planner import plan
    from art.trainer_rank.pricing.model import MemoryModel

    a = _adapter(tmp_path, "a", 1)
    model = _provider().build_model(seed=0)
    store = _store(model)
    assert store.resident_bytes() == 0
    store.load(a)
    one_adapter = store.resident_bytes()
    store.snapshot(a, "ref")
    one_snapshot = store.resident_bytes() - one_adapter
    provider = _provider()
    base = MemoryModel.for_provider(provider)

    def resident(**slots) -> int:
        from dataclasses import replace

        lora = replace(base.lora, **slots)
        return replace(base, lora=lora).estimate(MicroBatchShape((64,))).resident_bytes

    assert resident(resident_adapters=1) - resident() == one_adapter
    assert resident(resident_snapshots=1) - resident() == one_snapshot
    assert resident(resident_adapters=3, resident_snapshots=2) - resident() == (
        3 * one_adapter + 2 * one_snapshot)
    batch = MicroBatchShape((512,))
    cells = [plan("Qwen3-8B", batch=batch, gpus=1, gpu_memory_bytes=80 * 2**30,
                  lora=LoraShape(rank=8, resident_adapters=n)).cells[0] for n in (0, 4)]
    assert cells[1].estimate.resident_bytes > cells[0].estimate.resident_bytes
    assert cells[1].max_tokens < cells[0].max_tokens
