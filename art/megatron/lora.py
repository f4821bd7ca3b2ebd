"""Tensor-parallel-correct LoRA for Megatron-Core linears, configured by a peft `LoraConfig`;
several adapters resident per linear (see lora_selection for which one applies), each saved and
loaded in peft's adapter format by lora_peft.

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
- Expert linears (is_expert): the token dispatcher does the activation communication, so a
  row-parallel expert's partial LoRA term is reduced with the partial base output, a column
  one's input gradient with the base's; the replicated factor's gradient (A for column, B for
  row) is all-reduced over the expert-TP group.
Initialisation follows peft (A kaiming-uniform, a = sqrt(5); B zero), drawn unsharded from a
generator seeded by (seed, module name) and then sharded: every TP size starts the same.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from art.megatron.lora_config import (  # noqa: F401 - the names stay importable from here
    HF_PROJECTIONS,
    MEGATRON_TO_HF,
    lora_scaling,
    requested_projections,
    validate_lora_config,
)
from art.megatron.lora_selection import DEFAULT_ADAPTER, active_adapter

if TYPE_CHECKING:
    from peft import LoraConfig


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


class LoraAdapter(nn.Module):
    """One resident adapter of a LoRA linear: per HF projection `lora_A[proj]`, `lora_B[proj]`
    (this rank's shards), its rank and scaling. Projections it does not target are absent."""

    def __init__(self, r: int, scaling: float) -> None:
        super().__init__()
        self.r = r
        self.scaling = scaling
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()

    @property
    def names(self) -> list[str]:
        return list(self.lora_A.keys())


class LoraLinear(nn.Module):
    """A Megatron Column/RowParallelLinear plus resident LoRA adapters for its HF projections.

    Adapters live in `adapters[key]` ("default" is the one the model was built with); the
    forward applies the one `lora_selection.active_adapter()` names, or none for None.
    `lora_A`, `lora_B`, `r` and `scaling` read the default adapter. The base stays at `.base`,
    frozen. Forward returns what the base returns: (output, bias).
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
        gated_query_head_dim: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if kind not in ("column", "row"):
            raise ValueError(f"kind must be 'column' or 'row', got {kind!r}")
        self.base = base
        self.kind = kind
        self.parts = parts
        self.hf_path = hf_path  # e.g. "self_attn" or "mlp.experts.3"
        self.layer_index = layer_index  # 0-based global layer index (HF numbering)
        self.query_groups_local = query_groups_local
        # Gated attention output: q_proj holds [query head, gate head] per head (HF), which
        # linear_qkv keeps as each group's query heads, then their gate heads.
        self.gated_query_head_dim = gated_query_head_dim
        self.is_expert = bool(getattr(base, "is_expert", False))
        self.tp_group = _tp_group_of(base)
        self.tp_size = dist.get_world_size(self.tp_group) if dist.is_initialized() else 1
        self.tp_rank = dist.get_rank(self.tp_group) if dist.is_initialized() else 0
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False)) and (
            not self.is_expert
        )
        # Shapes, not attribute names, so Megatron's local linears and its Transformer Engine
        # wrappers read the same: column weight [out/TP, in], row weight [out, in/TP].
        self.full_in = int(base.weight.shape[1]) * (self.tp_size if kind == "row" else 1)
        # TE's LayerNormColumnParallelLinear normalises its input inside the base; the LoRA
        # path must see the same normalised input, so it applies that norm itself.
        self.fused_norm = getattr(base, "layer_norm_weight", None) is not None
        self.adapters = nn.ModuleDict()
        self.add_adapter(DEFAULT_ADAPTER, r=r, scaling=scaling,
                         projections=[p.name for p in parts if p.present], seed=seed)

    # ------------------------------------------------------------------ adapters
    def add_adapter(self, key: str, *, r: int, scaling: float, projections: Iterable[str],
                    seed: int = 0, trainable: bool = True) -> LoraAdapter:
        """A new resident adapter under `key`, initialised as peft does (A kaiming-uniform,
        B zero) for the projections named (those this linear does not carry are skipped)."""
        if key in self.adapters:
            raise ValueError(f"{self.hf_path} layer {self.layer_index}: adapter {key!r} exists")
        weight = self.base.weight
        adapter = LoraAdapter(r, scaling)
        wanted = set(projections)
        for part in self.parts:
            if part.name not in wanted:
                continue
            full_a, full_b = _init_full(
                r, self.full_in, part.full_out, seed=seed,
                key=f"{self.layer_index}.{self.hf_path}.{part.name}",
            )
            a, b = self._shard(full_a, full_b)
            adapter.lora_A[part.name] = nn.Parameter(a.to(weight.dtype).to(weight.device),
                                                     requires_grad=trainable)
            adapter.lora_B[part.name] = nn.Parameter(b.to(weight.dtype).to(weight.device),
                                                     requires_grad=trainable)
            self._mark(adapter.lora_A[part.name], adapter.lora_B[part.name])
        self.adapters[key] = adapter
        return adapter

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

    def remove_adapter(self, key: str) -> None:
        if key == DEFAULT_ADAPTER:
            raise ValueError("the default adapter is part of the model and cannot be removed")
        del self.adapters[key]

    def adapter(self, key: str) -> LoraAdapter:
        try:
            return self.adapters[key]  # type: ignore[return-value]
        except KeyError:
            raise KeyError(
                f"layer {self.layer_index} {self.hf_path}: no resident adapter {key!r} "
                f"(resident: {sorted(self.adapters.keys())})"
            ) from None

    @property
    def lora_A(self) -> nn.ParameterDict:
        return self.adapter(DEFAULT_ADAPTER).lora_A

    @property
    def lora_B(self) -> nn.ParameterDict:
        return self.adapter(DEFAULT_ADAPTER).lora_B

    r = property(lambda self: self.adapter(DEFAULT_ADAPTER).r)
    scaling = property(lambda self: self.adapter(DEFAULT_ADAPTER).scaling)

    # ------------------------------------------------------------------ sharding
    def _shard(self, full_a: torch.Tensor, full_b: torch.Tensor):
        if self.tp_size == 1:
            return full_a, full_b
        if self.kind == "column":
            return full_a, torch.chunk(full_b, self.tp_size, dim=0)[self.tp_rank].clone()
        return torch.chunk(full_a, self.tp_size, dim=1)[self.tp_rank].clone(), full_b

    def load_full(self, name: str, full_a: torch.Tensor, full_b: torch.Tensor,
                  *, adapter: str = DEFAULT_ADAPTER) -> None:
        """Copy an unsharded adapter (peft shapes A [r, in], B [out, r]) into this rank."""
        a, b = self._shard(full_a, full_b)
        holder = self.adapter(adapter)
        pa, pb = holder.lora_A[name], holder.lora_B[name]
        if a.shape != pa.shape or b.shape != pb.shape:
            raise ValueError(
                f"layer {self.layer_index} {self.hf_path}.{name}: adapter shards A{tuple(a.shape)}"
                f" B{tuple(b.shape)} do not fit this model's A{tuple(pa.shape)} "
                f"B{tuple(pb.shape)} (check r and the model config)"
            )
        with torch.no_grad():
            pa.copy_(a)
            pb.copy_(b)

    def gather_full(self, name: str, *, grad: bool = False,
                    adapter: str = DEFAULT_ADAPTER) -> tuple[torch.Tensor, torch.Tensor]:
        """The unsharded (A, B) of one projection's adapter, or of their gradients; a
        collective over the TP group."""
        holder = self.adapter(adapter)
        pa, pb = holder.lora_A[name], holder.lora_B[name]
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
        key = active_adapter()
        if key is None:
            return output, bias
        holder = self.adapter(key)
        if not holder.names:
            return output, bias
        return output + self.delta(x, adapter=key).to(output.dtype), bias

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

    def delta(self, x: torch.Tensor, *, adapter: str = DEFAULT_ADAPTER) -> torch.Tensor:
        """One adapter's LoRA term, in the layout and sharding of the base's output."""
        from megatron.core.tensor_parallel import mappings

        holder = self.adapter(adapter)
        names = [p.name for p in self.parts if p.name in holder.lora_A]
        r, scaling = holder.r, holder.scaling
        a = torch.cat([holder.lora_A[n] for n in names], dim=0) if len(names) > 1 else (
            holder.lora_A[names[0]]
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
            products = dict(zip(names, torch.split(u, r, dim=-1)))
            pieces = [
                torch.matmul(products[p.name], holder.lora_B[p.name].t()) if p.name in products
                else u.new_zeros(*u.shape[:-1], p.full_out // self.tp_size)
                for p in self.parts
            ]
            return self._assemble(pieces) * scaling
        u = torch.matmul(x, a.t())
        b = holder.lora_B[names[0]]
        if distributed and not self.is_expert:
            if self.sequence_parallel:
                u = mappings.reduce_scatter_to_sequence_parallel_region(u, group=self.tp_group)
                b = _GradAllReduce.apply(b, self.tp_group)
            else:
                u = mappings.reduce_from_tensor_model_parallel_region(u, group=self.tp_group)
        elif distributed:
            b = _GradAllReduce.apply(b, self.tp_group)
        return torch.matmul(u, b.t()) * scaling

    def _assemble(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        if len(pieces) == 1:
            return pieces[0]
        if self.query_groups_local:
            # Megatron's fused QKV: [..., groups, (q heads of the group, k, v) x head_dim].
            g = self.query_groups_local
            per_group = [p.reshape(*p.shape[:-1], g, p.shape[-1] // g) for p in pieces]
            if self.gated_query_head_dim:
                q = per_group[0]
                per_group[0] = q.reshape(*q.shape[:-1], -1, 2, self.gated_query_head_dim
                                         ).transpose(-3, -2).reshape(q.shape)
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
        adapters = "; ".join(
            f"{key}[{','.join(a.names)}] r={a.r} scaling={a.scaling:g}"
            for key, a in self.adapters.items()
        )
        return f"{self.kind}, {self.hf_path}: {adapters}"


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
            gated = bool(getattr(cfg, "attention_output_gate", False))
            qkv_parts = tuple(
                _Part(n, size, present=n in wanted) for n, size in (
                    ("q_proj", heads * head_dim * (2 if gated else 1)),
                    ("k_proj", groups * head_dim),
                    ("v_proj", groups * head_dim),
                )
            )
            if any(p.present for p in qkv_parts):
                tp = (dist.get_world_size(_tp_group_of(attention.linear_qkv))
                      if dist.is_initialized() else 1)
                wrapped.append(_wrap(
                    attention, "linear_qkv", "column", qkv_parts, r, scaling, "self_attn",
                    index, seed, module_names, query_groups_local=groups // tp,
                    gated_query_head_dim=head_dim if gated else 0,
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
          query_groups_local: int = 0, gated_query_head_dim: int = 0) -> str:
    base = getattr(owner, attr)
    wrapper = LoraLinear(
        base, kind=kind, parts=parts, r=r, scaling=scaling, hf_path=hf_path,
        layer_index=index, query_groups_local=query_groups_local,
        gated_query_head_dim=gated_query_head_dim, seed=seed,
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


def lora_parameters(model: nn.Module, adapter: str | None = DEFAULT_ADAPTER
                    ) -> list[nn.Parameter]:
    """Trainable LoRA parameters of one adapter (None: of every resident adapter)."""
    modules = lora_modules(model)
    if adapter is None:
        return [p for m in modules for p in m.parameters() if p.requires_grad]
    return [p for m in modules if adapter in m.adapters
            for p in m.adapters[adapter].parameters() if p.requires_grad]
