"""Probe runs: a real layer (or full-recompute unit) and the head's tail run under the meter.

What the probe (`probe.py`) fits its curves to: for one token count, the inputs a layer is
called with (a packed row, its rotary embedding), the selective recompute flags switched on the
built layer, and the layer's kept / forward / backward / output bytes, or the tail's (final
norm, chunked head, requested outputs, the caller's loss and its backward) measured on the
meter (CPU: live storages; GPU: allocator stats).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from art.trainer_rank._request import OutputRequest, output_request_problem
from art.trainer_rank.measuring.meter import MemoryMeter, release_score_buffer
from art.trainer_rank.ranks import agree as _agree


def inner_model(model: Any) -> Any:
    from art.trainer_rank.compute.forward import unwrap_model

    return unwrap_model(model)


def set_modes(layer: Any, modules: frozenset[str]) -> dict[str, Any]:
    """Switch the selective recompute flags Megatron derived from the config; return the old."""
    attention = getattr(layer, "self_attention", None)
    old = {
        "recompute_input_layernorm": layer.recompute_input_layernorm,
        "recompute_pre_mlp_layernorm": layer.recompute_pre_mlp_layernorm,
        "recompute_mlp": layer.recompute_mlp,
    }
    from megatron.core.transformer.identity_op import IdentityOp

    # Megatron turns a norm's recompute on only where the norm is a module of the layer (a
    # Gated DeltaNet layer's input norm sits in its in_proj).
    layer.recompute_input_layernorm = "layernorm" in modules and not isinstance(
        layer.input_layernorm, IdentityOp)
    layer.recompute_pre_mlp_layernorm = "layernorm" in modules and not isinstance(
        layer.pre_mlp_layernorm, IdentityOp)
    layer.recompute_mlp = "mlp" in modules and not getattr(layer, "is_moe_layer", False)
    if attention is not None and hasattr(attention, "checkpoint_core_attention"):
        old["checkpoint_core_attention"] = attention.checkpoint_core_attention
        attention.checkpoint_core_attention = "core_attn" in modules
    return old


def restore_modes(layer: Any, old: dict[str, Any]) -> None:
    for name, value in old.items():
        if name == "checkpoint_core_attention":
            layer.self_attention.checkpoint_core_attention = value
        else:
            setattr(layer, name, value)


def _storage_nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.untyped_storage().nbytes()


@dataclass(frozen=True)
class ProbeInputs:
    batch: Any  # PackedBatch
    rotary: torch.Tensor | None
    rows: int


def probe_inputs(model: Any, tokens: int | list[int], layout: Any, implementation: Any,
                 device: torch.device, *, whole_row: bool = False) -> ProbeInputs:
    """A packed row of one sequence of `tokens`, or of sequences of the given lengths, per
    CP rank: under context parallel the row holds CP times as many tokens, so each rank's
    layer runs on `tokens` rows (what the memory model prices a layer at) and attends to
    the whole row. `whole_row`: `tokens` are the whole row's (a Gated DeltaNet layer runs the
    whole row under CP, so its curves are read at the whole row's tokens)."""
    from art.trainer_rank.compute.forward import _rotary, local_row
    from art.trainer_rank.compute.packing import pack_sequences

    inner = inner_model(model)
    cp = 1 if whole_row else layout.context_parallel
    lengths = [tokens * cp] if isinstance(tokens, int) else [n * cp for n in tokens]
    sequences = [torch.randint(0, inner.vocab_size, (n,), device=device) for n in lengths]
    batch = pack_sequences(sequences, implementation=implementation, layout=layout,
                           device=device)
    row = local_row(inner, batch)
    rows = row.tokens.shape[1]
    if layout.sequence_parallel:
        rows //= layout.tensor_parallel
    dummy = torch.zeros(rows, 1, inner.config.hidden_size, device=device,
                        dtype=inner.config.params_dtype)
    return ProbeInputs(replace(batch, packed_seq_params=row.packed_seq_params),
                       _rotary(inner, batch, dummy, row.positions[0]), rows)


def tail_inputs(model: Any, tokens: int, layout: Any, implementation: Any,
                device: torch.device) -> ProbeInputs:
    """A packed row of `tokens` as the tail sees it: the final norm runs inside the decoder on
    this rank's rows (its CP share, its sequence-parallel shard), and the heads on the whole
    row on every CP rank (`run_tail` gathers it), so the rows fed in are the local ones."""
    from art.trainer_rank.compute.packing import pack_sequences

    inner = inner_model(model)
    sequences = [torch.randint(0, inner.vocab_size, (tokens,), device=device)]
    batch = pack_sequences(sequences, implementation=implementation, layout=layout,
                           device=device, attention=False)
    rows = batch.padded_tokens // layout.context_parallel
    if layout.sequence_parallel:
        rows //= layout.tensor_parallel
    return ProbeInputs(batch, None, rows)


def _unit(layer: Any, inputs: ProbeInputs, full_layers: int) -> Callable[[torch.Tensor], Any]:
    """The layer, or a full-recompute checkpoint unit of `full_layers` runs of it, called the
    way TransformerBlock calls them (Megatron's reentrant tensor_parallel.checkpoint)."""
    batch = inputs.batch

    def run_layers(h: torch.Tensor) -> tuple[torch.Tensor, Any]:
        context = None
        for _ in range(max(1, full_layers)):
            h, context = layer(hidden_states=h, attention_mask=batch.attention_mask,
                               rotary_pos_emb=inputs.rotary,
                               packed_seq_params=batch.packed_seq_params)
        return h, context

    if not full_layers:
        return run_layers

    def checkpointed(h: torch.Tensor) -> tuple[torch.Tensor, Any]:
        from megatron.core import tensor_parallel

        # TransformerBlock checkpoints in training mode whether or not grad is enabled.
        return tensor_parallel.checkpoint(run_layers, False, h)

    return checkpointed


def measure_layer(layer: Any, inputs: ProbeInputs, hidden: int, dtype: torch.dtype,
                  device: torch.device, grad: bool, full_layers: int = 0,
                  hold_incoming: bool = False) -> dict[str, float]:
    """The layer's (or unit's) run as the trainer meets it: with what a first run at this
    size allocates to keep (the score buffer, the LoRA grads, rotary tables), which the
    memory model prices elsewhere (buffer term, resident grads), already in place.
    `hold_incoming`: the backward gets its incoming gradient as a tensor referenced until it
    returns, the way a full-recompute checkpoint calls torch.autograd.backward(outputs,
    incoming) on the layers it rebuilt.

    On CUDA a run is warmed up first: a kernel's first call at a shape may tune itself with
    scratch buffers it frees (Triton's autotuner), which no allocation left behind shows. On
    CPU the kernels do not, so a run is repeated only when it left allocations behind, on
    this rank or on any rank its collectives span (each runs the layer as often)."""
    run = _unit(layer, inputs, full_layers)
    x0 = torch.randn(inputs.rows, 1, hidden, dtype=dtype, device=device, requires_grad=grad)
    if device.type != "cpu":
        with torch.set_grad_enabled(grad):
            y, _ = run(x0 * 1.0)
            if grad:
                (y * 1.0).sum().backward()
        del y
        x0.grad = None
    row, left_behind = _metered_run(run, x0, device, grad, hold_incoming)
    if _agree.any_over_layer_ranks(left_behind):
        row, _ = _metered_run(run, x0, device, grad, hold_incoming)
    return row


def _metered_run(run: Callable[[torch.Tensor], Any], x0: torch.Tensor, device: torch.device,
                 grad: bool, hold_incoming: bool) -> tuple[dict[str, float], bool]:
    """One metered run: its row, and whether it left allocations behind (CPU meter)."""
    meter = MemoryMeter(device=device)
    with meter, torch.set_grad_enabled(grad):
        before_run = meter.live_bytes
        x = x0 * 1.0
        x_bytes = _storage_nbytes(x)
        x_ref = weakref.ref(x.untyped_storage())
        _sync(device, meter)
        start = meter.live_bytes
        meter.reset_peak()
        y, _ = run(x)
        del x
        _sync(device, meter)
        saves_input = x_ref() is not None
        forward = meter.peak_bytes - start
        y_bytes = _storage_nbytes(y)
        kept = meter.live_bytes - start + x_bytes - y_bytes
        backward = 0.0
        if grad and hold_incoming:
            _sync(device, meter)
            before = meter.live_bytes
            meter.reset_peak()
            incoming = torch.ones_like(y)
            torch.autograd.backward(y, incoming)
            _sync(device, meter)
            backward = meter.peak_bytes - before
            del incoming
        elif grad:
            z = (y * 1.0).sum()
            _sync(device, meter)
            before = meter.live_bytes
            meter.reset_peak()
            z.backward()
            _sync(device, meter)
            backward = meter.peak_bytes - before
            del z
        del y
        x0.grad = None
        left_behind = meter.live_bytes > before_run
    return ({"kept": kept, "forward": forward, "backward": backward,
             "output": y_bytes, "saves_input": saves_input}, left_behind)


def measure_mode(layer: Any, inputs: ProbeInputs, *, hidden: int, dtype: torch.dtype,
                 device: torch.device, grad: bool, full_layers: int, held: bool
                 ) -> dict[str, float]:
    """One probe row of a (layer, mode); `held`: with `backward_held` measured too."""
    release_score_buffer()
    row = measure_layer(layer, inputs, hidden, dtype, device, grad, full_layers)
    if held:
        release_score_buffer()
        row["backward_held"] = measure_layer(layer, inputs, hidden, dtype, device, grad,
                                             hold_incoming=True)["backward"]
    return row


def _sync(device: torch.device, meter: MemoryMeter) -> None:
    meter.synchronize()


def caller_loss(outputs: OutputRequest, heads: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The caller's loss used by the probe and the calibration harness: every requested,
    differentiable output contributes (a policy-gradient style sum over log-probs; a
    mean-square on hidden states in fp32)."""
    loss = hidden.new_zeros((), dtype=torch.float32)
    if heads.target_logprobs is not None:
        loss = loss - heads.target_logprobs.sum()
    if heads.top_k_logprobs is not None:
        loss = loss - heads.top_k_logprobs.sum()
    if heads.logits is not None:
        loss = loss + heads.logits.mean()
    if outputs.hidden_states:
        loss = loss + hidden.float().square().mean()
    return loss


def run_tail(model: Any, x: torch.Tensor, batch: Any, outputs: OutputRequest,
             targets: torch.Tensor | None, head_chunk_tokens: int | None = None
             ) -> tuple[Any, torch.Tensor]:
    """Final norm (+ SP gather, + CP gather) + chunked head: the same calls the trainer's path
    makes (`decoder_hidden_states`), with the trainer's head chunk (`head_chunk_tokens`; None:
    the head's default)."""
    from megatron.core import tensor_parallel

    from art.megatron.context_parallel import gather_row, split_for_this_rank
    from art.trainer_rank.compute.heads import HEAD_CHUNK_TOKENS, compute_heads

    inner = inner_model(model)
    hidden = inner.decoder.final_layernorm(x)
    if inner.config.sequence_parallel:
        hidden = tensor_parallel.gather_from_sequence_parallel_region(
            hidden, tensor_parallel_output_grad=False)
    if inner.config.context_parallel_size > 1:
        hidden = gather_row(hidden, split_for_this_rank(batch.padded_tokens),
                            replicated_grad=True)
    hidden = hidden.reshape(batch.padded_tokens, hidden.shape[-1])
    if outputs.uses_head:
        heads = compute_heads(model, hidden, target_tokens=targets if outputs.target_logprobs
                              else None, top_k=outputs.top_k, logits=outputs.logits,
                              chunk_tokens=head_chunk_tokens or HEAD_CHUNK_TOKENS)
    else:
        from art.trainer_rank.compute.heads import HeadOutputs

        heads = HeadOutputs(None, None, None, None)
    return heads, hidden


def _head_backward_node(outputs: OutputRequest, heads: Any, hidden: torch.Tensor) -> Any:
    """The autograd node whose start ends the caller's own backward (its mean-square on the
    hidden states): the head output's node, or the hidden row's where no head runs. None when
    the caller's loss has no mean-square: the whole backward is the head's."""
    if not outputs.hidden_states:
        return None
    for t in (heads.target_logprobs, heads.top_k_logprobs, heads.logits):
        if t is not None and t.grad_fn is not None:
            return t.grad_fn
    return hidden.grad_fn


class _CallerGradientsDone:
    """A pre-hook on the head's backward node: takes the peak of the caller's part of the
    backward when the head's part starts, and restarts the meter's peak for it."""

    def __init__(self, meter: MemoryMeter, device: torch.device) -> None:
        self.meter = meter
        self.device = device
        self.caller_peak: float | None = None

    def __call__(self, *_: Any) -> None:
        if self.caller_peak is None:
            _sync(self.device, self.meter)
            self.caller_peak = float(self.meter.peak_bytes)
            self.meter.reset_peak()


def measure_tail(model: Any, inputs: ProbeInputs, outputs: OutputRequest, dtype: torch.dtype,
                 device: torch.device, grad: bool, head_chunk_tokens: int | None = None
                 ) -> dict[str, float]:
    """kept / forward, and the backward's two moments as peaks above the tail's start:
    `caller_backward` (the caller's own loss ops, before the head's backward starts) and
    `head_backward` (the head's and the final norm's). A row that lays shared prefixes out
    once runs the caller's ops per sequence, on copies, so only the head's moment meets the
    row there; apart they price it exactly."""
    inner = inner_model(model)
    # The items' own rule, so that a request with nothing to differentiate is refused with
    # its reason rather than failing inside the caller-loss backward below.
    problem = output_request_problem(outputs, grad=grad, vocab_size=inner.vocab_size)
    if problem is not None:
        raise ValueError(f"probing the head for outputs {outputs.key!r}: the request {problem}")
    batch = inputs.batch
    x0 = torch.randn(inputs.rows, 1, inner.config.hidden_size, dtype=dtype, device=device,
                     requires_grad=grad)
    targets = torch.randint(0, inner.vocab_size, (batch.padded_tokens,), device=device)
    meter = MemoryMeter(device=device)
    caller_backward = head_backward = 0.0
    with meter, torch.set_grad_enabled(grad):
        x = x0 * 1.0
        _sync(device, meter)
        start = meter.live_bytes
        meter.reset_peak()
        heads, hidden = run_tail(model, x, batch, outputs, targets, head_chunk_tokens)
        del x
        held = sum(_storage_nbytes(t) for t in (heads.target_logprobs, heads.top_k_logprobs,
                                                 heads.top_k_tokens, heads.logits))
        # The caller's frame holds the hidden row until backward returns (the trainer's
        # path keeps it as a local, and returns it when hidden states were requested).
        held += _storage_nbytes(hidden)
        if grad:
            loss = caller_loss(outputs, heads, hidden)
            _sync(device, meter)
            forward = meter.peak_bytes - start
            done = _CallerGradientsDone(meter, device)
            node = _head_backward_node(outputs, heads, hidden)
            handle = node.register_prehook(done) if node is not None else None
            meter.reset_peak()
            loss.backward()
            _sync(device, meter)
            if handle is not None:
                handle.remove()
            head_backward = meter.peak_bytes - start
            caller_backward = (head_backward if done.caller_peak is None
                               else done.caller_peak - start)
            del loss
        else:
            _sync(device, meter)
            forward = meter.peak_bytes - start
        del heads, hidden
    return {"kept": held, "forward": forward, "caller_backward": caller_backward,
            "head_backward": head_backward}
