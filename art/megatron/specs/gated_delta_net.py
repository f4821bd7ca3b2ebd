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

from art.megatron.attention_layout import AttentionLayout
from art.megatron.context_parallel import SplitRowLayout, gather_row
from art.megatron.gated_delta_rows import causal_conv, delta_rule_over_row
from art.megatron.recurrent_layout import RecurrentLayout


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


# Set on a TransformerConfig by the model builder when a CUDA build runs the torch delta rule
# (Implementation.delta_rule): the layers call it instead of fla's kernels.
TORCH_DELTA_RULE_CONFIG_FLAG = "art_torch_delta_rule"


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
        if config.use_cpu_initialization and config.perform_initialization:
            torch.set_rng_state(state)
            self._initialise_full_size()

    def _delta_rule(self) -> Any:
        """fla's `chunk_gated_delta_rule` as Megatron imports it (on CPU the runtime points it
        at the torch rule), or the torch rule itself where the build chose it on CUDA."""
        if getattr(self.config, TORCH_DELTA_RULE_CONFIG_FLAG, False):
            from art.megatron import cpu_gated_delta

            return cpu_gated_delta.chunk_gated_delta_rule
        from megatron.core.ssm import gated_delta_net as megatron_gdn

        return megatron_gdn.chunk_gated_delta_rule

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                key_value_states: Any = None, inference_context: Any = None,
                attention_bias: Any = None, packed_seq_params: Any = None,
                sequence_len_offset: Any = None, *, inference_params: Any = None,
                **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """Megatron-Core 0.16.1's GatedDeltaNet forward, one recurrence per path of the packed
        row (sequences, or a group's prefix tree), on whatever kernels are installed.

        Megatron's own forward refuses `packed_seq_params` and runs the row as one sequence,
        carrying the conv and the state from one sequence into the next; here the row's
        recurrent layout (from its attention layout, THD cu_seqlens or dense mask) drives the
        conv and fla's varlen delta rule (gated_delta_rows.py). Every other step is Megatron's,
        in the same order and dtypes, so the layer keeps what Megatron's keeps."""
        from megatron.core.ssm import gated_delta_net as megatron_gdn

        if inference_context is not None or inference_params is not None:
            raise ValueError("the packed Gated DeltaNet layer runs training and scoring "
                             "forwards, not Megatron's inference contexts")
        if isinstance(packed_seq_params, SplitRowLayout):
            return self._forward_over_context_parallel(hidden_states, packed_seq_params)
        seq_len, batch, _ = hidden_states.shape
        seq_len = seq_len * self.sp_size
        layout = recurrent_layout_of(attention_mask, packed_seq_params, seq_len)
        if batch != 1 and len(layout.segments) > 1:
            raise ValueError(f"a packed row has batch 1; got batch {batch}")

        qkvzba, _ = self.in_proj(hidden_states)
        qkvzba = qkvzba.transpose(0, 1)  # [s, b, x] -> [b, s, x]
        tp = self.tp_size
        qkv, gate, beta, alpha = torch.split(
            qkvzba, [(self.qk_dim * 2 + self.v_dim) // tp, self.v_dim // tp,
                     self.num_value_heads // tp, self.num_value_heads // tp], dim=-1)
        gate = gate.reshape(batch, seq_len, -1, self.value_head_dim)
        beta = beta.reshape(batch, seq_len, -1)
        alpha = alpha.reshape(batch, seq_len, -1)

        qkv = qkv.transpose(1, 2).contiguous()  # [b, s, d] -> [b, d, s]
        conv_fn = None if self.config.deterministic_mode else megatron_gdn.causal_conv1d_fn
        qkv = causal_conv(self.conv1d, qkv, layout, self.activation, self.act_fn, conv_fn)
        qkv = qkv.transpose(1, 2)  # [b, d, s] -> [b, s, d]
        query, key, value = torch.split(
            qkv, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], dim=-1)
        query = query.reshape(batch, seq_len, -1, self.key_head_dim)
        key = key.reshape(batch, seq_len, -1, self.key_head_dim)
        value = value.reshape(batch, seq_len, -1, self.value_head_dim)
        if self.use_qk_l2norm:
            query = megatron_gdn.l2norm(query.contiguous())
            key = megatron_gdn.l2norm(key.contiguous())
        if self.num_value_heads // self.num_key_heads > 1:
            repeats = self.num_value_heads // self.num_key_heads
            query = query.repeat_interleave(repeats, dim=2)
            key = key.repeat_interleave(repeats, dim=2)
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        gate, beta, alpha = gate.contiguous(), beta.contiguous(), alpha.contiguous()

        g = -self.A_log.exp() * torch.nn.functional.softplus(alpha.float() + self.dt_bias)
        beta = beta.sigmoid()
        core = delta_rule_over_row(self._delta_rule(), query, key, value, g, beta, layout)

        norm_out = self._apply_gated_norm(core, gate)
        norm_out = norm_out.reshape(batch, seq_len, -1).transpose(0, 1).contiguous()
        return self.out_proj(norm_out)

    def _forward_over_context_parallel(self, hidden_states: torch.Tensor,
                                       row: SplitRowLayout) -> tuple[torch.Tensor, Any]:
        """Under context parallel: the layer's input is gathered to the whole row over the CP
        ranks, every CP rank runs the recurrence over the whole row, and keeps its own rows
        of the output. Correct where the recurrence crosses the ranks' chunks, at the cost of
        the layer's compute and activations at the whole row on every CP rank. In backward
        each rank's gradient of the whole row's input comes from its own output rows, so the
        gather sums them over CP; the parameters' gradients are the parts the optimizer step
        sums over CP. Under sequence parallel the row is regathered over TP around it."""
        from megatron.core import tensor_parallel

        split = row.split
        sequence_parallel = self.sp_size > 1
        x = hidden_states
        if sequence_parallel:
            x = tensor_parallel.gather_from_sequence_parallel_region(
                x, tensor_parallel_output_grad=False)
        x = gather_row(x, split, replicated_grad=False)
        if sequence_parallel:
            x = tensor_parallel.scatter_to_sequence_parallel_region(x)
        out, bias = self.forward(x, packed_seq_params=row.layout)
        if sequence_parallel:
            out = tensor_parallel.gather_from_sequence_parallel_region(
                out, tensor_parallel_output_grad=False)
        out = split.local(out)
        if sequence_parallel:
            out = tensor_parallel.scatter_to_sequence_parallel_region(out)
        return out, bias

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


def recurrent_layout_of(attention_mask: torch.Tensor | None, packed_seq_params: Any,
                        tokens: int) -> RecurrentLayout:
    """The row's recurrent layout from what the layer is called with: the attention layout
    (segmented attention; sequences or a prefix tree), THD cu_seqlens (sequences), the dense
    causal mask of Megatron's unfused attention (read token by token), or one sequence."""
    if isinstance(packed_seq_params, AttentionLayout):
        layout = RecurrentLayout.from_attention(packed_seq_params)
    elif getattr(packed_seq_params, "cu_seqlens_q", None) is not None:
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        layout = RecurrentLayout.sequences([b - a for a, b in zip(bounds, bounds[1:])])
    elif attention_mask is not None:
        layout = RecurrentLayout.from_mask(attention_mask)
    else:
        layout = RecurrentLayout.sequences([tokens])
    if layout.total_tokens != tokens:
        raise ValueError(f"the row's layout covers {layout.total_tokens} tokens but the Gated "
                         f"DeltaNet layer got {tokens}; pack the row and its layout together")
    return layout


def with_packed_gated_delta_net(block_spec: Any) -> Any:
    """A block spec (e.g. Megatron's Transformer Engine hybrid spec) with every Gated DeltaNet
    mixer built as `GatedDeltaNetTP`, whose forward takes packed rows and prefix trees; the
    submodules (TE's fused in_proj, its norms) stay as the spec has them."""
    import copy

    block_spec = copy.deepcopy(block_spec)
    for layer in getattr(block_spec, "layer_specs", None) or []:
        mixer = getattr(layer.submodules, "self_attention", None)
        if isinstance(mixer, ModuleSpec) and mixer.module is GatedDeltaNet:
            mixer.module = GatedDeltaNetTP
    return block_spec


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
