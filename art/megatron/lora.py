"""Tensor-parallel-correct LoRA for Megatron-Core linears, configured by a peft `LoraConfig` and
saved/loaded in peft's adapter format (adapter_config.json + adapter_model.safetensors).

Naming. Adapters follow the Hugging Face module names, one adapter per HF projection, because
that is what a peft adapter holds: Megatron's fused `linear_qkv` carries three adapters
(q_proj, k_proj, v_proj, each with its own A and B) and the gated `linear_fc1` two (gate_proj,
up_proj). Their outputs are laid out the way Megatron lays out the fused output on each rank:
QKV interleaved per query group ([q heads of group g, k_g, v_g] for each local group), fc1 as
[gate shard, up shard]. So an exported adapter loads into peft/HF unchanged, and an HF-trained
adapter loads here exactly. `target_modules` takes HF leaf names (q_proj, k_proj, v_proj,
o_proj, gate_proj, up_proj, down_proj), Megatron names (linear_qkv = q,k,v; linear_proj = o;
linear_fc1 = gate,up; linear_fc2 = down) or "all-linear". Routed experts get adapters under
`mlp.experts.<global expert>.<proj>`, shared experts under `mlp.shared_expert.<proj>`.

Tensor parallelism (y = W x + s * B A x, s = alpha / r, or alpha / sqrt(r) with rsLoRA):
- Column-parallel base (W sharded on its output): A is replicated [r, in], B is sharded
  [out/TP, r]. Without sequence parallel the rank-r product u = A x passes through
  `copy_to_tensor_model_parallel_region` (identity forward, all-reduce backward), so its
  gradient sums the B-shard contributions of all ranks: A's gradient and x's gradient are
  then complete and identical on every rank (x needs no further reduction for this path).
  With sequence parallel x is a sequence shard: u is computed on the shard and all-gathered
  (`gather_from_sequence_parallel_region`, reduce-scatter backward); A's gradient is then a
  per-shard partial sum and is all-reduced by passing A through copy_to_... (identity
  forward, all-reduce of the weight gradient backward). Only r columns ever travel.
- Row-parallel base (W sharded on its input): A is sharded [r, in/TP], B replicated [out, r].
  The partial products A_shard x_shard are summed over TP (`reduce_from_...`, all-reduce) or,
  with sequence parallel, reduce-scattered to the output's sequence shard, exactly like the
  base output; with sequence parallel B only sees its shard, so its gradient is all-reduced
  with the same weight trick.
- Expert linears (is_expert): Megatron's token dispatcher does the communication for the
  base (explicit_expert_comm), so the LoRA path does none on activations: a row-parallel
  expert's partial B A_shard x_shard is reduced together with the partial base output, and a
  column-parallel expert's partial input gradient together with the base's. The replicated
  factor's gradient (A for column, B for row) is all-reduced over the expert-TP group.
Initialisation follows peft (A kaiming-uniform with a = sqrt(5), B zero), drawn for the full
unsharded matrix from a generator seeded by (seed, module name) and then sharded, so every TP
size starts from the same adapter.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from peft import LoraConfig

    from art.megatron.geometry import ModelGeometry

HF_PROJECTIONS: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)
MEGATRON_TO_HF: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_KEY_PREFIX = "base_model.model.model.layers."


def requested_projections(target_modules: Any) -> frozenset[str]:
    """peft target_modules -> the HF projection names they select. Raises on unknown names."""
    if target_modules is None:
        raise ValueError(
            "LoraConfig.target_modules is None; name the projections, e.g. "
            "['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'] "
            "or 'all-linear'"
        )
    if isinstance(target_modules, str):
        if target_modules == "all-linear":
            return frozenset(HF_PROJECTIONS)
        raise ValueError(
            f"LoraConfig.target_modules={target_modules!r}: a regular expression is not "
            "supported; give a list of projection names or 'all-linear'"
        )
    selected: set[str] = set()
    for name in target_modules:
        if name in HF_PROJECTIONS:
            selected.add(name)
        elif name in MEGATRON_TO_HF:
            selected.update(MEGATRON_TO_HF[name])
        elif name == "all-linear":
            selected.update(HF_PROJECTIONS)
        else:
            raise ValueError(
                f"LoRA target module {name!r} is not known; use HF names "
                f"({', '.join(HF_PROJECTIONS)}) or Megatron names ({', '.join(MEGATRON_TO_HF)})"
            )
    if not selected:
        raise ValueError("LoraConfig.target_modules is empty; nothing would be trained")
    return frozenset(selected)


def lora_scaling(config: LoraConfig) -> float:
    r = int(config.r)
    alpha = float(config.lora_alpha)
    return alpha / math.sqrt(r) if getattr(config, "use_rslora", False) else alpha / r


def validate_lora_config(config: LoraConfig, geometry: ModelGeometry | None = None) -> None:
    """Reject what this LoRA cannot do faithfully, before any model is built."""
    if int(config.r) < 1:
        raise ValueError(f"LoraConfig.r must be >= 1, got {config.r}")
    requested_projections(config.target_modules)
    if float(getattr(config, "lora_dropout", 0.0) or 0.0) != 0.0:
        raise ValueError(
            f"LoraConfig.lora_dropout={config.lora_dropout}: dropout on the LoRA input is not "
            "supported (it would differ between TP ranks); set it to 0"
        )
    if getattr(config, "bias", "none") != "none":
        raise ValueError(f"LoraConfig.bias={config.bias!r} is not supported; use 'none'")
    if getattr(config, "use_dora", False):
        raise ValueError("LoraConfig.use_dora=True (DoRA) is not supported; use plain LoRA")
    if geometry is not None and geometry.gated_attention_output:
        raise ValueError(
            f"{geometry.name} has a gated attention output (q and gate fused in linear_qkv); "
            "the q_proj LoRA mapping for that layout is not implemented"
        )


@dataclass(frozen=True)
class _Part:
    """One HF projection inside a (possibly fused) Megatron linear. An absent part (e.g. k_proj
    when only q_proj and v_proj are targeted) has no parameters and contributes zeros."""

    name: str  # HF projection name
    full_out: int  # output features of the unsharded projection
    present: bool = True


class _GradAllReduce(torch.autograd.Function):
    """Identity forward; all-reduce the gradient over `group` backward (for a factor whose
    gradient each rank only partially sees)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class LoraLinear(nn.Module):
    """A Megatron Column/RowParallelLinear plus LoRA adapters for its HF projections.

    Parameters: `lora_A.<proj>` and `lora_B.<proj>` (per-rank shards). The base stays at
    `.base`, frozen. Forward returns what the base returns: (output, bias).
    """

    def __init__(
        self,
        base: nn.Module,
        *,
        kind: str,
        parts: tuple[_Part, ...],
        r: int,
        scaling: float,
        hf_path: str,
        layer_index: int,
        query_groups_local: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if kind not in ("column", "row"):
            raise ValueError(f"kind must be 'column' or 'row', got {kind!r}")
        self.base = base
        self.kind = kind
        self.parts = parts
        self.r = r
        self.scaling = scaling
        self.hf_path = hf_path  # e.g. "self_attn" or "mlp.experts.3"
        self.layer_index = layer_index  # 0-based global layer index (HF numbering)
        self.query_groups_local = query_groups_local
        self.is_expert = bool(getattr(base, "is_expert", False))
        self.tp_group = _tp_group_of(base)
        self.tp_size = dist.get_world_size(self.tp_group) if dist.is_initialized() else 1
        self.tp_rank = dist.get_rank(self.tp_group) if dist.is_initialized() else 0
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False)) and (
            not self.is_expert
        )
        weight = base.weight
        # Shapes, not attribute names, so Megatron's local linears and its Transformer Engine
        # wrappers read the same: column weight [out/TP, in], row weight [out, in/TP].
        full_in = int(weight.shape[1]) * (self.tp_size if kind == "row" else 1)
        # TE's LayerNormColumnParallelLinear normalises its input inside the base; the LoRA
        # path must see the same normalised input, so it applies that norm itself.
        self.fused_norm = getattr(base, "layer_norm_weight", None) is not None
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for part in parts:
            if not part.present:
                continue
            full_a, full_b = _init_full(
                r, full_in, part.full_out, seed=seed,
                key=f"{layer_index}.{hf_path}.{part.name}",
            )
            a, b = self._shard(full_a, full_b)
            self.lora_A[part.name] = nn.Parameter(a.to(weight.dtype).to(weight.device))
            self.lora_B[part.name] = nn.Parameter(b.to(weight.dtype).to(weight.device))
            self._mark(self.lora_A[part.name], self.lora_B[part.name])

    def _mark(self, a: nn.Parameter, b: nn.Parameter) -> None:
        """Megatron's parallel attributes. The sharded factor (B of a column linear, A of a
        row linear) is tensor-parallel along the base weight's split dimension, so the grad
        norm counts it on every TP rank; the replicated one counts once (TP rank 0). Their
        gradients are already reduced in the forward graph. Expert factors are reduced by DDP
        over the expert-data-parallel group, like Megatron's expert weights (allreduce=False)."""
        sharded, replicated = (b, a) if self.kind == "column" else (a, b)
        sharded.tensor_model_parallel = True
        sharded.partition_dim = 0 if self.kind == "column" else 1
        sharded.partition_stride = 1
        replicated.tensor_model_parallel = False
        for p in (a, b):
            p.is_lora = True
            if self.is_expert:
                p.allreduce = False

    # ------------------------------------------------------------------ sharding
    def _shard(self, full_a: torch.Tensor, full_b: torch.Tensor):
        if self.tp_size == 1:
            return full_a, full_b
        if self.kind == "column":
            return full_a, torch.chunk(full_b, self.tp_size, dim=0)[self.tp_rank].clone()
        return torch.chunk(full_a, self.tp_size, dim=1)[self.tp_rank].clone(), full_b

    def load_full(self, name: str, full_a: torch.Tensor, full_b: torch.Tensor) -> None:
        """Copy an unsharded adapter (peft shapes A [r, in], B [out, r]) into this rank."""
        a, b = self._shard(full_a, full_b)
        pa, pb = self.lora_A[name], self.lora_B[name]
        if a.shape != pa.shape or b.shape != pb.shape:
            raise ValueError(
                f"layer {self.layer_index} {self.hf_path}.{name}: adapter shards A{tuple(a.shape)}"
                f" B{tuple(b.shape)} do not fit this model's A{tuple(pa.shape)} "
                f"B{tuple(pb.shape)} (check r and the model config)"
            )
        with torch.no_grad():
            pa.copy_(a)
            pb.copy_(b)

    def gather_full(self, name: str, *, grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The unsharded (A, B) of one adapter, or of their gradients; a collective over the
        TP group."""
        pa, pb = self.lora_A[name], self.lora_B[name]
        if grad:
            if pa.grad is None or pb.grad is None:
                raise ValueError(f"layer {self.layer_index} {self.hf_path}.{name} has no grad")
            a, b = pa.grad.detach(), pb.grad.detach()
        else:
            a, b = pa.detach(), pb.detach()
        if self.tp_size == 1:
            return a.clone(), b.clone()
        if self.kind == "column":
            return a.clone(), _all_gather_cat(b, dim=0, group=self.tp_group, size=self.tp_size)
        return _all_gather_cat(a, dim=1, group=self.tp_group, size=self.tp_size), b.clone()

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any):
        output, bias = self.base(x, *args, **kwargs)
        return output + self.delta(x).to(output.dtype), bias

    def _lora_input(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused_norm:
            return x
        base = self.base
        weight = base.layer_norm_weight.detach()
        if getattr(base, "zero_centered_gamma", False):
            weight = weight + 1
        eps = float(getattr(base, "eps", None) or base.config.layernorm_epsilon)
        normalization = getattr(base, "normalization", "RMSNorm")
        if normalization != "RMSNorm":
            raise ValueError(
                f"LoRA on a fused {normalization}-linear is not supported (RMSNorm only)"
            )
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The LoRA term, in the layout and sharding of the base's output."""
        from megatron.core.tensor_parallel import mappings

        names = [p.name for p in self.parts if p.present]
        a = torch.cat([self.lora_A[n] for n in names], dim=0) if len(names) > 1 else (
            self.lora_A[names[0]]
        )
        distributed = self.tp_size > 1
        x = self._lora_input(x)
        if self.kind == "column":
            if distributed and (self.is_expert or self.sequence_parallel):
                a = _GradAllReduce.apply(a, self.tp_group)
            u = torch.matmul(x, a.t())
            if distributed and not self.is_expert:
                if self.sequence_parallel:
                    u = mappings.gather_from_sequence_parallel_region(
                        u, tensor_parallel_output_grad=True, group=self.tp_group
                    )
                else:
                    u = mappings.copy_to_tensor_model_parallel_region(u, group=self.tp_group)
            products = dict(zip(names, torch.split(u, self.r, dim=-1)))
            pieces = [
                torch.matmul(products[p.name], self.lora_B[p.name].t()) if p.present
                else u.new_zeros(*u.shape[:-1], p.full_out // self.tp_size)
                for p in self.parts
            ]
            return self._assemble(pieces) * self.scaling
        u = torch.matmul(x, a.t())
        b = self.lora_B[names[0]]
        if distributed and not self.is_expert:
            if self.sequence_parallel:
                u = mappings.reduce_scatter_to_sequence_parallel_region(u, group=self.tp_group)
                b = _GradAllReduce.apply(b, self.tp_group)
            else:
                u = mappings.reduce_from_tensor_model_parallel_region(u, group=self.tp_group)
        elif distributed:
            b = _GradAllReduce.apply(b, self.tp_group)
        return torch.matmul(u, b.t()) * self.scaling

    def _assemble(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        if len(pieces) == 1:
            return pieces[0]
        if self.query_groups_local:
            # Megatron's fused QKV: [..., groups, (q heads of the group, k, v) x head_dim].
            g = self.query_groups_local
            per_group = [p.reshape(*p.shape[:-1], g, p.shape[-1] // g) for p in pieces]
            out = torch.cat(per_group, dim=-1)
            return out.reshape(*out.shape[:-2], -1)
        return torch.cat(pieces, dim=-1)  # gated fc1: [gate shard, up shard]

    # Megatron reaches into a few attributes of its linears (e.g. weight for qk clipping).
    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def backward_dw(self) -> None:
        self.base.backward_dw()

    def extra_repr(self) -> str:
        names = ",".join(p.name for p in self.parts if p.present)
        return f"{self.kind}, {self.hf_path}[{names}], r={self.r}, scaling={self.scaling:g}"


def _tp_group_of(base: nn.Module) -> Any:
    """Megatron's local linears keep `tp_group`, its TE wrappers `_tp_group`."""
    group = getattr(base, "tp_group", None)
    return group if group is not None else getattr(base, "_tp_group", None)


def _full_columns(base: nn.Module) -> int:
    """Output features of an unsharded column-parallel linear (its weight is [out/TP, in])."""
    group = _tp_group_of(base)
    tp = dist.get_world_size(group) if (dist.is_initialized() and group is not None) else 1
    return int(base.weight.shape[0]) * tp


def _init_full(r: int, full_in: int, full_out: int, *, seed: int, key: str):
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode()))
                                              % (2**63))
    # kaiming_uniform_(a=sqrt(5)) as in peft/nn.Linear: bound = 1 / sqrt(fan_in).
    bound = 1.0 / math.sqrt(full_in)
    full_a = (torch.rand(r, full_in, generator=generator) * 2 - 1) * bound
    return full_a, torch.zeros(full_out, r)


def _all_gather_cat(t: torch.Tensor, *, dim: int, group: Any, size: int) -> torch.Tensor:
    t = t.contiguous()
    chunks = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(chunks, t, group=group)
    return torch.cat(chunks, dim=dim)


# ---------------------------------------------------------------------- applying
def _decoder_layers(model: nn.Module) -> Iterable[nn.Module]:
    inner = getattr(model, "module", model)
    decoder = getattr(inner, "decoder", None)
    if decoder is None or not hasattr(decoder, "layers"):
        raise ValueError(f"{type(model).__name__} has no decoder.layers; expected a GPTModel")
    return decoder.layers


def apply_lora(model: nn.Module, config: LoraConfig, *, seed: int = 0) -> list[str]:
    """Wrap the selected linears of a Megatron GPTModel with LoRA; freeze everything else.

    Returns the wrapped module names. Also makes the embedding output require grad, because
    Megatron's checkpoints are reentrant: with a frozen embedding the first checkpointed
    layer would otherwise see no input that needs grad and LoRA inside it would get none.
    """
    validate_lora_config(config)
    if lora_modules(model):
        raise ValueError("the model already has LoRA adapters; apply_lora once per model")
    wanted = requested_projections(config.target_modules)
    r, scaling = int(config.r), lora_scaling(config)
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped: list[str] = []
    module_names = {id(m): n for n, m in model.named_modules()}
    for layer in _decoder_layers(model):
        index = int(layer.layer_number) - 1
        attention = getattr(layer, "self_attention", None)
        if attention is not None and hasattr(attention, "linear_qkv"):
            cfg = attention.config
            heads, groups = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
            head_dim = cfg.kv_channels
            qkv_parts = tuple(
                _Part(n, size, present=n in wanted) for n, size in (
                    ("q_proj", heads * head_dim), ("k_proj", groups * head_dim),
                    ("v_proj", groups * head_dim),
                )
            )
            if any(p.present for p in qkv_parts):
                tp = (dist.get_world_size(_tp_group_of(attention.linear_qkv))
                      if dist.is_initialized() else 1)
                wrapped.append(_wrap(
                    attention, "linear_qkv", "column", qkv_parts, r, scaling, "self_attn",
                    index, seed, module_names, query_groups_local=groups // tp,
                ))
            if "o_proj" in wanted:
                wrapped.append(_wrap(
                    attention, "linear_proj", "row", (_Part("o_proj", cfg.hidden_size),), r,
                    scaling, "self_attn", index, seed, module_names,
                ))
        mlp = getattr(layer, "mlp", None)
        for owner, hf_path in _mlps(mlp):
            wrapped += _wrap_mlp(owner, hf_path, wanted, r, scaling, index, seed, module_names)
    if not wrapped:
        raise ValueError(
            f"LoRA target_modules {sorted(wanted)} matched no linear in this model"
        )
    _make_embedding_output_require_grad(model)
    model._art_lora_config = config
    return wrapped


def _mlps(mlp: nn.Module | None) -> Iterable[tuple[nn.Module, str]]:
    if mlp is None:
        return
    experts = getattr(mlp, "experts", None)
    if experts is not None:
        local = getattr(experts, "local_experts", None)
        if local is None:
            raise ValueError(
                f"{type(experts).__name__}: LoRA supports SequentialMLP experts "
                "(moe_grouped_gemm=False) only"
            )
        ep_group = getattr(experts, "ep_group", None)
        ep_rank = dist.get_rank(ep_group) if (dist.is_initialized() and ep_group) else 0
        for i, expert in enumerate(local):
            yield expert, f"mlp.experts.{ep_rank * len(local) + i}"
        shared = getattr(mlp, "shared_experts", None)
        if shared is not None:
            yield shared, "mlp.shared_expert"
        return
    if hasattr(mlp, "linear_fc1"):
        yield mlp, "mlp"


def _wrap_mlp(owner, hf_path, wanted, r, scaling, index, seed, module_names) -> list[str]:
    out: list[str] = []
    fc1 = owner.linear_fc1
    gated = bool(owner.config.gated_linear_unit)
    if gated:
        half = _full_columns(fc1) // 2
        parts = tuple(_Part(n, half, present=n in wanted) for n in ("gate_proj", "up_proj"))
        if not any(p.present for p in parts):
            parts = ()
    else:
        parts = (_Part("up_proj", _full_columns(fc1)),) if "up_proj" in wanted else ()
    if parts:
        out.append(_wrap(owner, "linear_fc1", "column", parts, r, scaling, hf_path, index, seed,
                         module_names))
    if "down_proj" in wanted:
        out.append(_wrap(owner, "linear_fc2", "row",
                         (_Part("down_proj", int(owner.linear_fc2.weight.shape[0])),), r, scaling,
                         hf_path, index, seed, module_names))
    return out


def _wrap(owner, attr, kind, parts, r, scaling, hf_path, index, seed, module_names,
          query_groups_local: int = 0) -> str:
    base = getattr(owner, attr)
    wrapper = LoraLinear(
        base, kind=kind, parts=parts, r=r, scaling=scaling, hf_path=hf_path,
        layer_index=index, query_groups_local=query_groups_local, seed=seed,
    )
    setattr(owner, attr, wrapper)
    return f"{module_names.get(id(owner), hf_path)}.{attr}"


def _make_embedding_output_require_grad(model: nn.Module) -> None:
    inner = getattr(model, "module", model)
    embedding = getattr(inner, "embedding", None)
    if embedding is None or getattr(embedding, "_art_requires_grad_hook", False):
        return

    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and not output.requires_grad:
            output = output.detach().requires_grad_(True)
        return output

    embedding.register_forward_hook(hook)
    embedding._art_requires_grad_hook = True


def lora_modules(model: nn.Module) -> list[LoraLinear]:
    return [m for m in model.modules() if isinstance(m, LoraLinear)]


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in lora_modules(model) for p in m.parameters() if p.requires_grad]


# ---------------------------------------------------------------------- peft files
def _peft_key(module: LoraLinear, name: str, factor: str) -> str:
    return f"{PEFT_KEY_PREFIX}{module.layer_index}.{module.hf_path}.{name}.lora_{factor}.weight"


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded adapter tensors under peft keys. Collective: every rank must call it; the
    result holds what this rank's pipeline stage / expert shard owns."""
    state: dict[str, torch.Tensor] = {}
    for module in lora_modules(model):
        for part in module.parts:
            if not part.present:
                continue
            full_a, full_b = module.gather_full(part.name)
            state[_peft_key(module, part.name, "A")] = full_a.contiguous()
            state[_peft_key(module, part.name, "B")] = full_b.contiguous()
    return state


def export_adapter(model: nn.Module, directory: str | Path, config: LoraConfig | None = None,
                   *, base_model_name_or_path: str | None = None) -> Path | None:
    """Write adapter_config.json + adapter_model.safetensors (peft format) on global rank 0.

    Collective over all ranks (TP gathers, then pipeline stages / expert shards merged).
    Returns the directory on rank 0, None elsewhere.
    """
    from peft import LoraConfig as PeftLoraConfig
    from safetensors.torch import save_file

    modules = lora_modules(model)
    if not modules:
        raise ValueError("the model has no LoRA adapters to export")
    state = adapter_state_dict(model)
    if dist.is_initialized() and dist.get_world_size() > 1:
        everything: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everything, {k: v.cpu() for k, v in state.items()})
        state = {k: v for part in everything for k, v in part.items()}
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    present = sorted({k.split(".")[-3] for k in state})
    base_config = config or getattr(model, "_art_lora_config", None)
    r, alpha = modules[0].r, None
    if base_config is not None:
        alpha = base_config.lora_alpha
        use_rslora = bool(getattr(base_config, "use_rslora", False))
    else:
        alpha, use_rslora = modules[0].scaling * r, False
    peft_config = PeftLoraConfig(
        r=r, lora_alpha=alpha, target_modules=present, lora_dropout=0.0, bias="none",
        use_rslora=use_rslora, task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name_or_path,
    )
    peft_config.save_pretrained(str(directory))
    save_file({k: v.cpu().contiguous() for k, v in sorted(state.items())},
              str(directory / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    return directory


_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(.+)\.(\w+)\.lora_([AB])\.weight$"
)


def load_adapter(model: nn.Module, directory: str | Path, *, seed: int = 0) -> LoraConfig:
    """Load a peft adapter directory into `model` (applying LoRA first if it has none).

    Each rank keeps its own shards. Every adapter of this rank's modules must be in the file;
    keys for layers this rank does not hold (other pipeline stages / experts) are skipped.
    """
    from peft import LoraConfig as PeftLoraConfig
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path = directory / ADAPTER_CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} is missing; expected a peft adapter directory")
    config = PeftLoraConfig.from_pretrained(str(directory))
    if not lora_modules(model):
        apply_lora(model, config, seed=seed)
        model._art_lora_config = config
    tensors = load_file(str(directory / ADAPTER_WEIGHTS_FILE))
    parsed: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        match = _KEY.match(key)
        if not match:
            raise ValueError(f"{directory}: tensor {key!r} is not a peft LoRA key")
        layer, path, proj, factor = match.groups()
        parsed.setdefault((int(layer), path, proj), {})[factor] = value
    modules = lora_modules(model)
    expected_scaling = lora_scaling(config)
    used: set[tuple[int, str, str]] = set()
    for module in modules:
        if abs(module.scaling - expected_scaling) > 1e-9 or module.r != int(config.r):
            raise ValueError(
                f"{directory}: adapter r={config.r}, alpha={config.lora_alpha} differs from the "
                f"model's LoRA (r={module.r}, scaling={module.scaling}); rebuild the model"
            )
        for part in module.parts:
            if not part.present:
                continue
            key = (module.layer_index, module.hf_path, part.name)
            if key not in parsed or set(parsed[key]) != {"A", "B"}:
                raise ValueError(
                    f"{directory}: no lora_A/lora_B for layer {key[0]} {key[1]}.{key[2]}"
                )
            module.load_full(part.name, parsed[key]["A"], parsed[key]["B"])
            used.add(key)
    local_layers = {m.layer_index for m in modules}
    stray = sorted(k for k in parsed if k not in used and k[0] in local_layers)
    if stray:
        raise ValueError(
            f"{directory}: adapters {stray[:4]} match no LoRA module of this model; were they "
            "trained for other target_modules?"
        )
    return config


def adapter_config_dict(directory: str | Path) -> dict[str, Any]:
    return json.loads((Path(directory) / ADAPTER_CONFIG_FILE).read_text())
