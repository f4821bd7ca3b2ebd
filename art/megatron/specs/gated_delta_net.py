"""The Gated DeltaNet layer's own local spec (no Transformer Engine).

Megatron-Core 0.16.1 builds `GatedDeltaNet` only through its TE spec provider: its in_proj is
TE's fused norm + column-parallel linear, which the local provider does not have. A spec is
data, so this module states the local one:
- `in_proj`: an RMSNorm followed by a column-parallel linear (`NormColumnParallelLinear`; the
  norm weight is named `layer_norm_weight` as in TE's fused module), so the layer's own
  `input_layernorm` is the identity, as in Megatron's TE spec;
- `out_norm`: a torch RMSNorm over one value head (the gated output norm);
- `out_proj`: a row-parallel linear.
`GatedDeltaNetTP` is Megatron's `GatedDeltaNet` with a CPU initialisation that gives every
tensor-parallel size the same function (see its docstring).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec

from art.megatron.cpu_gated_delta import SegmentedCausalConv1d, packed_sequences


class NormColumnParallelLinear(ColumnParallelLinear):
    """RMSNorm then ColumnParallelLinear: the local counterpart of TE's LayerNormLinear.

    Under sequence parallel the norm sees this rank's tokens before the linear gathers them;
    the weight is marked `sequence_parallel` so Megatron reduces its gradient over TP."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.layer_norm_weight = torch.nn.Parameter(
            torch.ones(input_size, dtype=config.params_dtype))
        self.layer_norm_weight.sequence_parallel = bool(config.sequence_parallel)
        self.layer_norm_eps = float(config.layernorm_epsilon)

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any):
        normed = torch.nn.functional.rms_norm(
            input_, (input_.shape[-1],), self.layer_norm_weight, self.layer_norm_eps)
        return super().forward(normed, *args, **kwargs)


class GatedOutputNorm(torch.nn.RMSNorm):
    """The gated output norm's RMSNorm over one value head (torch's, as the local spec's).

    One weight serves every value head, and TP splits the heads: each rank's gradient covers
    its heads only. Megatron's gradient finalisation sums no such weight, so the weight passes
    through an identity whose backward sums the gradient over TP (`tp_weight`)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.tensor_parallel = int(config.tensor_model_parallel_size)

    def tp_weight(self) -> torch.Tensor:
        if self.tensor_parallel == 1:
            return self.weight
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        return copy_to_tensor_model_parallel_region(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.tp_weight(), self.eps)


def _my_slices(full: torch.Tensor, sections: list[int], rank: int, size: int,
               dim: int = 0) -> torch.Tensor:
    """This rank's shard of each section of `full`, concatenated (Megatron's per-rank
    in_proj/conv layout: [q_r, k_r, v_r, z_r, beta_r, alpha_r])."""
    return torch.cat([part.chunk(size, dim=dim)[rank]
                      for part in torch.split(full, sections, dim=dim)], dim=dim)


class GatedDeltaNetTP(GatedDeltaNet):
    """Megatron's GatedDeltaNet; with CPU initialisation, weights drawn at full size and sliced.

    Megatron's CPU init splits a column-parallel master weight into contiguous row blocks, but
    GatedDeltaNet's in_proj and conv are laid out per rank as [q_r, k_r, v_r, ...]; its conv
    and A_log are drawn at the local size. So TP=2 would hold a different function than TP=1.
    Here the random weights are redrawn from the same generator state at full size and each
    section is sliced, which also leaves the generator where it is for every TP size."""

    def __init__(self, config: Any, submodules: GatedDeltaNetSubmodules, *args: Any,
                 **kwargs: Any) -> None:
        state = torch.get_rng_state()
        super().__init__(config, submodules, *args, **kwargs)
        # Same module and parameters; its forward keeps packed sequences apart.
        self.conv1d.__class__ = SegmentedCausalConv1d
        if config.use_cpu_initialization and config.perform_initialization:
            torch.set_rng_state(state)
            self._initialise_full_size()

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                *args: Any, packed_seq_params: Any = None, **kwargs: Any) -> Any:
        """Megatron's forward, one recurrence per sequence of a packed row.

        Megatron-Core 0.16.1 runs the row as one sequence (and refuses `packed_seq_params`):
        the conv and the recurrent state would carry one sequence into the next. The
        sequences are read from the row's attention layout or mask and handed to the kernels
        (`packed_sequences`)."""
        lengths = packed_sequence_lengths(attention_mask, packed_seq_params)
        if lengths is not None and len(lengths) > 1:
            _check_segment_kernels()
        with packed_sequences(lengths):
            return super().forward(hidden_states, attention_mask, *args,
                                   packed_seq_params=None, **kwargs)

    @torch.no_grad()
    def _initialise_full_size(self) -> None:
        tp, rank = self.pg_collection.tp.size(), self.pg_collection.tp.rank()
        qk, v, nv = self.qk_dim, self.v_dim, self.num_value_heads
        in_proj = torch.empty(self.in_proj_dim, self.hidden_size, dtype=torch.float32)
        self.config.init_method(in_proj)
        self.in_proj.weight.copy_(_my_slices(in_proj, [qk, qk, v, v, nv, nv], rank, tp))
        # nn.Conv1d's default init (kaiming uniform, a=sqrt(5)); fan_in = kernel size.
        conv = torch.empty(self.conv_dim, 1, self.conv_kernel_dim, dtype=torch.float32)
        torch.nn.init.kaiming_uniform_(conv, a=math.sqrt(5))
        self.conv1d.weight.copy_(_my_slices(conv, [qk, qk, v], rank, tp))
        a = torch.empty(nv, dtype=torch.float32).uniform_(*self.A_init_range)
        self.A_log.copy_(a.log().chunk(tp)[rank])
        self.dt_bias.fill_(1.0)
        out = torch.empty(self.hidden_size, v, dtype=torch.float32)
        self.config.output_layer_init_method(out)
        self.out_proj.weight.copy_(out.chunk(tp, dim=1)[rank])


def packed_sequence_lengths(attention_mask: torch.Tensor | None, packed_seq_params: Any
                            ) -> tuple[int, ...] | None:
    """The lengths of the sequences packed in the row (None: one sequence, no mask).

    From the attention layout when one is passed (segmented attention, THD cu_seqlens), else
    from the block-diagonal causal mask (True = masked): a sequence starts where a token may
    not see the one before it. A row whose tokens see more than their own sequence (a shared
    prefix) is refused: each continuation would need the prefix's recurrent state."""
    segments = getattr(packed_seq_params, "segments", None)
    if segments is not None:
        if any(segment.context for segment in segments):
            raise ValueError(
                "a Gated DeltaNet layer got a row with a shared prefix (a segment attends to "
                "another's tokens); it runs one recurrence per sequence, so pack hybrid models "
                "without shared prefixes")
        return tuple(segment.length for segment in segments)
    cu_seqlens = getattr(packed_seq_params, "cu_seqlens_q", None)
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        return tuple(b - a for a, b in zip(bounds, bounds[1:]))
    if attention_mask is None:
        return None
    mask = attention_mask.reshape(attention_mask.shape[-2], attention_mask.shape[-1])
    rows = mask.shape[0]
    starts = torch.zeros(rows, dtype=torch.bool, device=mask.device)
    starts[0] = True
    starts[1:] = mask.diagonal(-1)
    index = torch.arange(rows, device=mask.device)
    first = torch.cummax(torch.where(starts, index, 0), 0).values
    if not torch.equal((~mask).sum(-1), index - first + 1):
        raise ValueError(
            "a Gated DeltaNet layer got an attention mask that is not block-diagonal causal "
            "(some token sees beyond its own sequence, e.g. a shared prefix); it runs one "
            "recurrence per sequence, so pack hybrid models without shared prefixes")
    bounds = [*torch.nonzero(starts).flatten().tolist(), rows]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def _check_segment_kernels() -> None:
    from megatron.core.ssm import gated_delta_net

    from art.megatron import cpu_gated_delta

    if (gated_delta_net.chunk_gated_delta_rule is not cpu_gated_delta.chunk_gated_delta_rule
            or gated_delta_net.causal_conv1d_fn is not None):
        raise ValueError(
            "several sequences packed in one row reach a Gated DeltaNet layer whose kernels "
            "(fla / causal_conv1d) Megatron-Core 0.16.1 calls without cu_seqlens or seq_idx; "
            "only the CPU kernels (cpu_gated_delta) keep the sequences apart. Pack one sequence "
            "per row")


def gated_delta_net_spec() -> ModuleSpec:
    """The mixer spec of a Gated DeltaNet layer, local modules only."""
    return ModuleSpec(
        module=GatedDeltaNetTP,
        submodules=GatedDeltaNetSubmodules(
            in_proj=NormColumnParallelLinear,
            out_norm=GatedOutputNorm,
            out_proj=RowParallelLinear,
        ),
        metainfo={"fuse_input_layernorm": True},
    )
