"""The workload fuzzer shared by tests/reliability/test_workload_fuzz.py and
scripts/soak_workload.py: random forward_micro_batches calls on a real (tiny) Megatron-Core
model under virtual memory limits, each checked against invariants.

Per call: a random top-level list (nesting depth 0-3, groups of 1-4, lengths 1-2,048 drawn
mostly short, per-sequence output mixes), grad or no-grad, a virtual limit drawn log-uniformly
from "nothing fits" to "everything fits". Trainers live for a few calls (profiles are learned
across them, as in a training run) with random admission options.

Invariants, checked on every call:
1. no torch.OutOfMemoryError (or anything but a decline) escapes the call;
2. every top-level item is yielded exactly once or declined, never both, nothing else;
3. every requested output is present, unrequested ones are None, and the values equal an
   unpacked one-sequence-at-a-time reference (GPTModel.forward, not the trainer's path);
4. declined items are exactly those whose smallest form cannot fit: an item the memory model
   prices above the limit in its smallest form (grad: whole, under full recompute when
   escalation is on; no-grad: its largest sequence alone) must be declined, and a declined
   item must be priced above the limit by model or learned profile; the error lists every
   declined item by index.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from art.megatron.geometry import ModelGeometry, geometry_from_hf_dict
from art.megatron.implementation import Implementation
from art.megatron.provider import Provider
from art.megatron.settings import load_settings
from art.megatron.train import TrainingRuntime
from art.trainer_rank import (
    ForwardInput,
    TrainerRank,
    TrainerRankMemoryError,
    TrainerRankOptions,
)
from art.trainer_rank.compute.items import make_items

VOCAB = 64
MAX_TOP_K = 4
ATOL = 1e-4
KIB = 2**10


def fuzz_geometry() -> ModelGeometry:
    """2 layers, hidden 32: small enough that 500 calls fit in minutes on two cores."""
    return geometry_from_hf_dict(
        dict(model_type="qwen3", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=VOCAB,
             max_position_embeddings=4096),
        name="fuzz-2x32",
    )


def fuzz_provider(granularity: str = "selective", lora_rank: int = 4) -> Provider:
    """The product's case: a frozen base with a LoRA on every linear (the adapters start at
    B = 0, so the reference is the base model's output)."""
    from peft import LoraConfig

    return Provider(
        fuzz_geometry(),
        settings=load_settings({"ART_MEGATRON_RECOMPUTE_GRANULARITY": granularity}),
        lora=LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules="all-linear"),
        dtype="float32",
        implementation=Implementation.cpu_local(),
    )


@dataclass
class FuzzCounts:
    calls: int = 0
    grad_calls: int = 0
    items: int = 0
    sequences: int = 0
    micro_batches: int = 0
    outputs_checked: int = 0  # individual output tensors compared with the reference
    declined_items: int = 0
    calls_with_declines: int = 0
    calls_fully_declined: int = 0
    runtime_oom_retries: int = 0  # micro-batches that ran after a forward OOM was re-planned
    caller_backward_ooms: int = 0  # OOMs in the caller's backward (caught, retried by the
    # trainer as documented); each one is a memory-model under-prediction
    escaped_ooms: int = 0  # OOMs out of forward_micro_batches itself: must stay 0
    decisions: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "decisions"}
        out["decisions"] = dict(self.decisions)
        return out


class ReferencePool:
    """Sequences drawn once, each with its unpacked reference outputs (computed lazily)."""

    def __init__(self, model: Any, rng: random.Random) -> None:
        self.model = model
        self.rng = rng
        self.tokens: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []
        self._refs: dict[int, dict[str, torch.Tensor]] = {}
        self._by_length: dict[int, int] = {}

    def draw_length(self) -> int:
        r = self.rng.random()
        if r < 0.70:
            return self.rng.randint(1, 48)
        if r < 0.93:
            return self.rng.randint(49, 384)
        return int(math.exp(self.rng.uniform(math.log(385), math.log(2048))))

    def sequence(self) -> int:
        """Index of a pooled sequence; reuses an existing one of the same length half the time
        (reference outputs are the expensive part)."""
        n = self.draw_length()
        if n in self._by_length and self.rng.random() < 0.5:
            return self._by_length[n]
        g = torch.Generator().manual_seed(self.rng.getrandbits(31))
        self.tokens.append(torch.randint(0, VOCAB, (n,), generator=g))
        targets = torch.randint(0, VOCAB, (n,), generator=g)
        targets[torch.rand(n, generator=g) < 0.2] = -100
        self.targets.append(targets)
        self._by_length[n] = len(self.tokens) - 1
        return len(self.tokens) - 1

    def reference(self, index: int) -> dict[str, torch.Tensor]:
        ref = self._refs.get(index)
        if ref is None:
            ref = _reference(self.model, self.tokens[index], self.targets[index])
            self._refs[index] = ref
        return ref


def _reference(model: Any, tokens: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    captured: dict[str, torch.Tensor] = {}
    hook = model.decoder.register_forward_hook(lambda m, a, out: captured.setdefault("h", out))
    n = int(tokens.numel())
    try:
        with torch.no_grad():
            logits = model(tokens.view(1, n), torch.arange(n).view(1, n),
                           attention_mask=None)[0].float()
    finally:
        hook.remove()
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(1, targets.clamp(min=0).view(-1, 1)).squeeze(1)
    picked = torch.where(targets == -100, torch.zeros_like(picked), picked)
    top = logp.topk(MAX_TOP_K + 1, dim=-1)
    return {"target_logprobs": picked, "top_values": top.values, "top_tokens": top.indices,
            "logits": logits, "hidden_states": captured["h"].reshape(n, -1)}


@dataclass(frozen=True)
class Leaf:
    pool_index: int
    outputs: tuple[bool, int, bool, bool]  # target_logprobs, top_k (0 = none), logits, hidden


def _random_outputs(rng: random.Random) -> tuple[bool, int, bool, bool]:
    while True:
        wanted = (rng.random() < 0.8, rng.choice((0, 0, 1, 2, MAX_TOP_K)),
                  rng.random() < 0.15, rng.random() < 0.25)
        if any(wanted):
            return wanted


def _random_item(rng: random.Random, pool: ReferencePool, depth: int) -> Any:
    """A Leaf, or a (nested) list of them: depth 0 is a single sequence."""
    if depth == 0 or rng.random() < 0.3:
        return Leaf(pool.sequence(), _random_outputs(rng))
    return [_random_item(rng, pool, depth - 1) for _ in range(rng.randint(1, 4))]


def _to_input(value: Any, pool: ReferencePool, no_grad: bool) -> Any:
    if isinstance(value, Leaf):
        target, top_k, logits, hidden = value.outputs
        return ForwardInput(
            input_tokens=pool.tokens[value.pool_index],
            target_tokens=pool.targets[value.pool_index] if target else None,
            top_k=top_k or None, logits=logits, hidden_states=hidden, no_grad=no_grad,
        )
    return [_to_input(child, pool, no_grad) for child in value]


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [leaf for child in value for leaf in _flatten(child)]
    return [value]


def _check_leaf(leaf: Leaf, out: Any, pool: ReferencePool, where: str) -> int:
    """Compare one sequence's outputs with the reference; returns how many were compared."""
    target, top_k, logits, hidden = leaf.outputs
    ref = pool.reference(leaf.pool_index)
    checked = 0
    present = {
        "target_logprobs": out.target_logprobs is not None, "top_k": out.top_k is not None,
        "logits": out.logits is not None, "hidden_states": out.hidden_states is not None,
    }
    wanted = {"target_logprobs": target, "top_k": bool(top_k), "logits": logits,
              "hidden_states": hidden}
    assert present == wanted, f"{where}: outputs present {present}, requested {wanted}"
    if target:
        torch.testing.assert_close(out.target_logprobs.detach(), ref["target_logprobs"],
                                   atol=ATOL, rtol=0, msg=f"{where}: target_logprobs")
        checked += 1
    if top_k:
        values = out.top_k.logprobs.detach()
        assert tuple(values.shape) == (ref["top_values"].shape[0], top_k), where
        torch.testing.assert_close(values, ref["top_values"][:, :top_k], atol=ATOL, rtol=0,
                                   msg=f"{where}: top_k logprobs")
        # Token ids must agree wherever the reference's neighbours are not (nearly) tied;
        # the reference keeps one value more than the largest k for the right neighbour.
        gaps = ref["top_values"][:, :-1] - ref["top_values"][:, 1:]  # [T, MAX_TOP_K]
        separated = gaps > 10 * ATOL
        clear = separated[:, :top_k].clone()
        clear[:, 1:] &= separated[:, : top_k - 1]
        mismatch = (out.top_k.tokens != ref["top_tokens"][:, :top_k]) & clear
        assert not mismatch.any(), f"{where}: top_k tokens differ"
        checked += 2
    if logits:
        torch.testing.assert_close(out.logits.detach(), ref["logits"], atol=ATOL, rtol=0,
                                   msg=f"{where}: logits")
        checked += 1
    if hidden:
        torch.testing.assert_close(out.hidden_states.detach(), ref["hidden_states"], atol=ATOL,
                                   rtol=0, msg=f"{where}: hidden_states")
        checked += 1
    return checked


def _loss(outputs: list[Any]) -> torch.Tensor | None:
    """A caller's loss touching every differentiable output it received."""
    total = None
    for out in outputs:
        for name in ("target_logprobs", "logits", "hidden_states"):
            value = getattr(out, name)
            if value is not None and value.requires_grad:
                term = value.float().sum() * 1e-3
                total = term if total is None else total + term
        if out.top_k is not None and out.top_k.logprobs.requires_grad:
            term = out.top_k.logprobs.sum() * 1e-3
            total = term if total is None else total + term
    return total


def _smallest_form_prices(trainer: TrainerRank, leaves: list[ForwardInput], grad: bool
                          ) -> tuple[int, int]:
    """(memory model only, max of model and learned profile) for the cheapest way the
    planner may run this item: dynamic bytes. Grad: the whole item, under the configured
    recompute or (escalation on) full recompute. No grad: one sequence per sub-forward, each
    priced with the outputs of the sub-forwards before it, which stay alive until the item is
    yielded."""
    from dataclasses import replace

    admission = trainer.admission
    if not grad:
        held = 0
        worst_model, worst_any = 0, 0
        for leaf in leaves:
            pricing, shape, _ = admission.price([leaf], grad)
            pricing = replace(pricing, held_bytes=held)
            worst_model = max(worst_model, pricing.model_dynamic_bytes)
            worst_any = max(worst_any, pricing.dynamic_bytes)
            if admission.held_output_bytes is not None:
                held += admission.held_output_bytes(shape)
        return worst_model, worst_any
    policies = [admission.recompute]
    full = admission.full_recompute
    if full is not None and admission.policy.escalate_to_full_recompute:
        policies.append(full)
    priced = [admission.price(leaves, grad, recompute)[0] for recompute in policies]
    return (min(p.model_dynamic_bytes for p in priced), min(p.dynamic_bytes for p in priced))


@dataclass
class WorkloadFuzzer:
    """Drives random calls against one model; raises AssertionError on a broken invariant."""

    model: Any
    provider: Provider
    seed: int = 0
    calls_per_trainer: int = 40
    counts: FuzzCounts = field(default_factory=FuzzCounts)
    log: Callable[[str], None] | None = None

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.pool = ReferencePool(self.model, self.rng)
        self.trainer: TrainerRank | None = None
        self._calls_on_trainer = 0

    def _new_trainer(self, limit_bytes: int) -> TrainerRank:
        rng = self.rng
        options = TrainerRankOptions(
            test_memory_limit_bytes=limit_bytes,
            escalate_to_full_recompute=rng.random() < 0.7,
            cold_start_fraction=rng.choice((0.1, 0.25, 0.5, 1.0)),
            trust_window=rng.choice((1.5, 2.0, 4.0)),
            head_chunk_tokens=rng.choice((16, 64, 2048)),
        )
        return TrainerRank(TrainingRuntime.for_model(self.model, self.provider,
                                                     trainer_options=options))

    def random_limit(self) -> int:
        # 8 KiB (nothing fits) .. 48 MiB (everything does), log-uniform.
        return int(math.exp(self.rng.uniform(math.log(8 * KIB), math.log(48 * 2**20))))

    def one_call(self) -> None:
        rng = self.rng
        limit = self.random_limit()
        if self.trainer is None or self._calls_on_trainer >= self.calls_per_trainer:
            self.trainer = self._new_trainer(limit)
            self._calls_on_trainer = 0
        trainer = self.trainer
        # The limit changes from call to call (as free memory does on a GPU).
        trainer.options = _with_limit(trainer.options, limit)
        self._calls_on_trainer += 1
        grad = rng.random() < 0.6
        depth = rng.choice((0, 0, 1, 1, 2, 3))
        n_items = rng.randint(1, 6)
        plan = [_random_item(rng, self.pool, depth) for _ in range(n_items)]
        inputs = [_to_input(item, self.pool, not grad) for item in plan]
        c = self.counts
        c.calls += 1
        c.grad_calls += int(grad)
        c.items += n_items
        c.sequences += sum(len(_flatten(item)) for item in plan)
        where = f"seed {self.seed} call {c.calls} (limit {limit} B, grad {grad})"
        stats_before = len(trainer.stats_history)

        seen: dict[int, Any] = {}
        voided: set[int] = set()  # yielded, but the caller's backward ran out of memory
        declined: tuple[int, ...] = ()
        error: TrainerRankMemoryError | None = None
        try:
            for mb in trainer.forward_micro_batches(inputs, no_grad=not grad):
                for index in mb.indices:
                    assert index not in seen or index in voided, (
                        f"{where}: item {index} yielded twice")
                    voided.discard(index)
                seen.update(zip(mb.indices, mb.outputs))
                c.micro_batches += 1
                c.decisions[mb.stats.decision] += 1
                if grad:
                    loss = _loss([o for out in mb.outputs for o in _flatten(out)])
                    try:
                        if loss is not None:
                            loss.backward()
                    except torch.OutOfMemoryError:
                        # The documented protocol: keep iterating; the trainer restores the
                        # gradients and yields these items again, smaller.
                        c.caller_backward_ooms += 1
                        voided.update(mb.indices)
                    del loss
        except TrainerRankMemoryError as exc:
            error = exc
            declined = exc.indices_not_run
        except torch.OutOfMemoryError as exc:
            c.escaped_ooms += 1
            raise AssertionError(f"{where}: an OOM escaped forward_micro_batches: {exc}") from exc
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.zero_()  # kept allocated, as a training loop's accumulator is
        c.runtime_oom_retries += sum(s.retries > 0 for s in trainer.stats_history[stats_before:])

        # 2. exactly once
        # An item whose backward ran out of memory is re-planned: yielded again or declined.
        assert voided <= set(declined), (
            f"{where}: items {sorted(voided - set(declined))} OOMed in backward and were "
            "neither yielded again nor declined")
        for index in voided:
            seen.pop(index, None)
        assert not set(seen) & set(declined), f"{where}: items both yielded and declined"
        assert set(seen) | set(declined) == set(range(n_items)), (
            f"{where}: items lost: yielded {sorted(seen)}, declined {sorted(declined)}")
        assert error is None or "run-time OOMs" not in str(error), f"{where}: {error}"
        # 3. outputs
        for index, out in seen.items():
            leaves = _flatten(plan[index])
            outs = _flatten(out)
            assert len(outs) == len(leaves), f"{where}: item {index} nesting changed"
            for k, (leaf, o) in enumerate(zip(leaves, outs)):
                c.outputs_checked += _check_leaf(leaf, o, self.pool, f"{where} item {index}.{k}")
        # 4. declines
        if declined:
            c.calls_with_declines += 1
            c.calls_fully_declined += int(len(declined) == n_items)
            c.declined_items += len(declined)
            assert error is not None
            message = str(error)
            for index in declined:
                assert f"item {index} " in message, f"{where}: item {index} not in {message}"
        # With grad the trainer lowers the fixed limit by its gradient snapshot (taken before
        # the limit is read); after a backward it holds every trainable gradient.
        snapshot = sum(q.grad.untyped_storage().nbytes() for q in self.model.parameters()
                       if grad and q.requires_grad and q.grad is not None)
        for item in make_items(inputs):
            model_price, any_price = _smallest_form_prices(trainer, list(item.leaves), grad)
            if item.index in declined:
                assert any_price > limit - snapshot, (
                    f"{where}: item {item.index} declined although its smallest form is priced "
                    f"{any_price} <= limit {limit} - gradient snapshot {snapshot}")
            else:
                assert model_price <= limit, (
                    f"{where}: item {item.index} ran although the memory model prices its "
                    f"smallest form at {model_price} > limit {limit}")
        if self.log is not None:
            self.log(f"{where}: {n_items} items, {len(seen)} yielded, {len(declined)} declined")

    def run(self, calls: int) -> FuzzCounts:
        for _ in range(calls):
            self.one_call()
        return self.counts


def _with_limit(options: TrainerRankOptions, limit: int) -> TrainerRankOptions:
    from dataclasses import replace

    return replace(options, test_memory_limit_bytes=limit)
