"""Each trainable checkpoint slot's own Adam state: fp32 master copies of its LoRA factors and
their moments, stepped only when that slot is named (or holds gradients), saved and restored
with the slot.

The gradients of a slot's factors reach them through autograd (they are not in the runtime's
DDP buckets), so the step first sums them over the data-parallel ranks that hold copies of the
same factor, then scales, clips by the global norm and applies AdamW (decoupled weight decay,
eps 1e-8, as Megatron-Core's optimizer does on CPU) to the masters, and copies the masters back
into the model dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from art.megatron.lora import LoraLinear, _all_gather_cat

ADAM_EPS = 1e-8


@dataclass(frozen=True)
class FactorSite:
    """One LoRA factor of one slot: where it lives and how it is sharded over TP."""

    peft_key: str  # base_model.model.model.layers.<i>.<path>.<proj>.lora_<A|B>.weight
    module: LoraLinear
    projection: str
    factor: str  # "A" or "B"
    param: torch.nn.Parameter

    @property
    def sharded_dim(self) -> int | None:
        """The dim this rank holds a TP shard of (None: replicated over TP)."""
        if self.module.tp_size == 1:
            return None
        if self.module.kind == "column":
            return 0 if self.factor == "B" else None
        return 1 if self.factor == "A" else None

    def full(self, local: torch.Tensor) -> torch.Tensor:
        """The unsharded tensor of a per-rank one shaped like this factor (TP collective)."""
        dim = self.sharded_dim
        if dim is None:
            return local.detach().clone()
        return _all_gather_cat(local.detach(), dim=dim, group=self.module.tp_group,
                               size=self.module.tp_size)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        dim = self.sharded_dim
        if dim is None:
            return full.clone()
        return torch.chunk(full, self.module.tp_size, dim=dim)[self.module.tp_rank].clone()


def factor_sites(model: Any, adapter: str) -> list[FactorSite]:
    from art.megatron.lora import lora_modules
    from art.megatron.lora_peft import PEFT_KEY_PREFIX

    sites = []
    for module in lora_modules(model):
        if adapter not in module.adapters:
            continue
        holder = module.adapter(adapter)
        for name in holder.names:
            for factor, store in (("A", holder.lora_A), ("B", holder.lora_B)):
                key = (f"{PEFT_KEY_PREFIX}{module.layer_index}.{module.hf_path}.{name}"
                       f".lora_{factor}.weight")
                sites.append(FactorSite(key, module, name, factor, store[name]))
    return sites


def _copies_group(site: FactorSite) -> Any:
    """The data-parallel group whose ranks hold the same shard of this factor."""
    from megatron.core import parallel_state as ps

    if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
        return None
    if site.module.is_expert:
        return ps.get_expert_data_parallel_group()
    return ps.get_data_parallel_group(with_context_parallel=True)


class SlotOptimizer:
    """AdamW over fp32 masters of one slot's factors (see the module docstring)."""

    def __init__(self, sites: list[FactorSite]) -> None:
        self.sites = sites
        self.masters = [site.param.detach().float().clone() for site in sites]
        self.adam = torch.optim.AdamW(self.masters, lr=0.0, eps=ADAM_EPS, foreach=False)
        self.config: dict[str, float] | None = None

    def state_bytes(self) -> int:
        return sum(4 * m.numel() * 3 for m in self.masters)

    def has_grads(self) -> bool:
        return any(site.param.grad is not None for site in self.sites)

    def zero_grad(self) -> None:
        for site in self.sites:
            site.param.grad = None

    def step(self, params: Any, scale_grads: float) -> float:
        """One AdamW step with `params` (AdamParams); returns the global grad norm (after
        the DP sum and scaling, before clipping)."""
        grads = []
        for site in self.sites:
            grad = site.param.grad
            grad = torch.zeros_like(site.param, dtype=torch.float32) if grad is None else (
                grad.detach().float().clone())
            group = _copies_group(site)
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(grad, group=group)
            grads.append(grad.mul_(scale_grads))
        norm = self._global_norm(grads)
        clip = float(getattr(params, "grad_clip_norm", 0.0) or 0.0)
        factor = clip / (norm + 1e-6) if clip > 0 and norm > clip else 1.0
        for master, grad in zip(self.masters, grads):
            master.grad = grad.mul_(factor) if factor != 1.0 else grad
        eps = float(getattr(params, "eps", ADAM_EPS))
        for group in self.adam.param_groups:
            group["lr"] = float(params.learning_rate)
            group["betas"] = (float(params.beta1), float(params.beta2))
            group["weight_decay"] = float(params.weight_decay)
            group["eps"] = eps
        self.config = {
            "learning_rate": float(params.learning_rate), "beta1": float(params.beta1),
            "beta2": float(params.beta2), "eps": eps, "weight_decay": float(params.weight_decay),
        }
        self.adam.step()
        with torch.no_grad():
            for site, master in zip(self.sites, self.masters):
                master.grad = None
                site.param.copy_(master.to(site.param.dtype))
                site.param.grad = None
        return norm

    def _global_norm(self, grads: list[torch.Tensor]) -> float:
        """sqrt of the sum of squares over every distinct element of the slot: a factor held
        by several ranks (TP-replicated, DP copies) counts once."""
        from megatron.core import parallel_state as ps

        distributed = dist.is_initialized() and dist.get_world_size() > 1
        total = torch.zeros((), dtype=torch.float64)
        for site, grad in zip(self.sites, grads):
            copies = 1
            if distributed:
                group = _copies_group(site)
                copies = dist.get_world_size(group) if group is not None else 1
                if site.sharded_dim is None:
                    copies *= site.module.tp_size
            total += grad.double().pow(2).sum() / copies
        if distributed and ps.model_parallel_is_initialized():
            dist.all_reduce(total)
        return math.sqrt(float(total))

    # -- persistence: unsharded tensors under peft keys ------------------------------------

    def state_tensors(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, float]]:
        """{"master"|"exp_avg"|"exp_avg_sq": {peft key: unsharded fp32}}, {peft key: step}.
        Collective over TP (gathers the shards)."""
        components: dict[str, dict[str, torch.Tensor]] = {
            "master": {}, "exp_avg": {}, "exp_avg_sq": {}}
        steps: dict[str, float] = {}
        for site, master in zip(self.sites, self.masters):
            state = self.adam.state.get(master, {})
            zeros = torch.zeros_like(master)
            components["master"][site.peft_key] = site.full(master)
            components["exp_avg"][site.peft_key] = site.full(state.get("exp_avg", zeros))
            components["exp_avg_sq"][site.peft_key] = site.full(state.get("exp_avg_sq", zeros))
            steps[site.peft_key] = float(state.get("step", torch.tensor(0.0)))
        return components, steps

    def restore(self, components: dict[str, dict[str, torch.Tensor]],
                steps: dict[str, float], config: dict[str, float] | None) -> None:
        """Masters and moments from unsharded tensors (this rank's shards are cut here)."""
        for site, master in zip(self.sites, self.masters):
            key = site.peft_key
            master.copy_(site.local(components["master"][key].float()))
            if steps[key] > 0:
                self.adam.state[master] = {
                    "step": torch.tensor(float(steps[key])),
                    "exp_avg": site.local(components["exp_avg"][key].float()),
                    "exp_avg_sq": site.local(components["exp_avg_sq"][key].float()),
                }
        self.config = dict(config) if config is not None else None


def runtime_adam_state(optimizer: Any, sites: list[FactorSite]
                       ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, float],
                                  dict[str, float]] | None:
    """The Adam state the runtime's Megatron optimizer holds for `sites` (the runtime's own
    adapter), unsharded like `SlotOptimizer.state_tensors`, plus its hyper-parameters; None
    when it has taken no step for them (or keeps them in a form this does not read, e.g. the
    distributed optimizer's shards)."""
    if optimizer is None:
        return None
    pairs: list[tuple[torch.Tensor, torch.Tensor, Any]] = []
    for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        adam = getattr(inner, "optimizer", None)
        if adam is None:
            continue
        model_groups = getattr(inner, "float16_groups", None)
        master_groups = getattr(inner, "fp32_from_float16_groups", None)
        if model_groups is not None and master_groups is not None:
            for models, masters in zip(model_groups, master_groups):
                pairs += [(p, m, adam) for p, m in zip(models, masters)]
            for group in getattr(inner, "fp32_from_fp32_groups", []):
                pairs += [(p, p, adam) for p in group]
        else:
            pairs += [(p, p, adam) for group in adam.param_groups for p in group["params"]]
    by_param = {id(p): (m, adam) for p, m, adam in pairs}
    components: dict[str, dict[str, torch.Tensor]] = {
        "master": {}, "exp_avg": {}, "exp_avg_sq": {}}
    steps: dict[str, float] = {}
    config: dict[str, float] = {}
    for site in sites:
        found = by_param.get(id(site.param))
        if found is None or not found[1].state.get(found[0]):
            return None
        master, adam = found
        state = adam.state[master]
        components["master"][site.peft_key] = site.full(master.float())
        components["exp_avg"][site.peft_key] = site.full(state["exp_avg"].float())
        components["exp_avg_sq"][site.peft_key] = site.full(state["exp_avg_sq"].float())
        steps[site.peft_key] = float(state["step"])
        group = next(g for g in adam.param_groups if any(q is master for q in g["params"]))
        beta1, beta2 = group["betas"]
        config = {"learning_rate": float(group["lr"]), "beta1": float(beta1),
                  "beta2": float(beta2), "eps": float(group["eps"]),
                  "weight_decay": float(group["weight_decay"])}
    return components, steps, config
