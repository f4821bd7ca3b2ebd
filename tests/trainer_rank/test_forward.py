"""Packed forward on a real Megatron-Core GPTModel (CPU, fp32): packing changes nothing.

Every output (hidden states, target log-probs, top-k, logits) and every weight gradient of a
packed multi-sequence micro-batch equals running each sequence alone.
"""

from __future__ import annotations

import pytest
import torch

from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.megatron.model_builder import RecomputeConfig, build_gpt_model, build_transformer_config
from art.trainer_rank.compute.forward import decoder_hidden_states, unwrap_model
from art.trainer_rank.compute.heads import compute_heads
from art.trainer_rank.compute.packing import next_token_targets, pack_sequences, unpack

from _tiny import tiny_dense, tiny_moe

LOCAL = Implementation.cpu_local()
UNFUSED = Implementation.cpu_local("unfused")  # Megatron's DotProductAttention: a dense mask
TOP_K = 5


def _model(recompute: RecomputeConfig, num_layers: int = 2):
    geometry = tiny_dense(num_layers=num_layers)
    config = build_transformer_config(
        geometry, layout=ParallelLayout(), recompute=recompute, dtype="float32"
    )
    return geometry, build_gpt_model(geometry, config, seed=0)


def _run(model, sequences):
    """Outputs per sequence and the summed loss, as the trainer would use them."""
    batch = pack_sequences(sequences, implementation=LOCAL, layout=ParallelLayout())
    hidden = decoder_hidden_states(model, batch)
    heads = compute_heads(
        model, hidden, target_tokens=next_token_targets(batch), top_k=TOP_K, logits=True,
        chunk_tokens=7,
    )
    per_sequence = list(
        zip(
            unpack(hidden, batch),
            unpack(heads.target_logprobs, batch),
            unpack(heads.top_k_logprobs, batch),
            unpack(heads.top_k_tokens, batch),
            unpack(heads.logits, batch),
        )
    )
    loss = sum(
        lp.sum() + 0.1 * top.sum() + 0.01 * logits.pow(2).sum() + 0.1 * h.pow(2).sum()
        for h, lp, top, _, logits in per_sequence
    )
    return per_sequence, loss


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize(
    "recompute",
    [RecomputeConfig("selective"), RecomputeConfig("full", "uniform", 1)],
    ids=["selective", "full-uniform-1"],
)
def test_packed_outputs_and_gradients_equal_each_sequence_alone(megatron_process, recompute):
    geometry, model = _model(recompute)
    generator = torch.Generator().manual_seed(5)
    sequences = [
        torch.randint(0, geometry.vocab_size, (n,), generator=generator) for n in (11, 3, 17, 1)
    ]
    packed, packed_loss = _run(model, sequences)
    packed_loss.backward()
    packed_grads = _grads(model)
    assert packed_grads, "no trainable weight received a gradient"

    alone_grads: dict[str, torch.Tensor] = {}
    for sequence, packed_outputs in zip(sequences, packed):
        (alone_outputs,), loss = _run(model, [sequence])
        for name, got, want in zip(
            ("hidden", "logprobs", "top_k_logprobs", "top_k_tokens", "logits"),
            packed_outputs,
            alone_outputs,
        ):
            assert got.shape == want.shape, name
            if name == "top_k_tokens":
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
        loss.backward()
        for name, grad in _grads(model).items():
            alone_grads[name] = alone_grads.get(name, 0) + grad
    assert packed_grads.keys() == alone_grads.keys()
    for name, grad in packed_grads.items():
        torch.testing.assert_close(
            grad, alone_grads[name], rtol=1e-4, atol=1e-5, msg=f"gradient of {name}"
        )


def test_one_sequence_matches_megatrons_own_forward(megatron_process):
    geometry, model = _model(RecomputeConfig("selective"))
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, geometry.vocab_size, (1, 13), generator=generator)
    with torch.no_grad():
        reference = model(tokens, torch.arange(13)[None], attention_mask=None)[0]
        batch = pack_sequences([tokens[0]], implementation=LOCAL, layout=ParallelLayout())
        hidden = decoder_hidden_states(model, batch)
        heads = compute_heads(model, hidden, target_tokens=None, logits=True, chunk_tokens=4)
    assert not hidden.requires_grad
    assert hidden.dtype == torch.float32 and hidden.shape == (13, geometry.hidden_size)
    torch.testing.assert_close(heads.logits, reference.float(), rtol=1e-5, atol=1e-5)
    # The log-probs of the model's own logits at the next tokens.
    heads = compute_heads(model, hidden, target_tokens=next_token_targets(batch))
    expected = torch.log_softmax(reference.float(), dim=-1)[torch.arange(12), tokens[0, 1:]]
    torch.testing.assert_close(heads.target_logprobs[:12], expected, rtol=1e-5, atol=1e-5)
    assert heads.target_logprobs[12].item() == 0.0


def test_wrapped_models_are_unwrapped_and_other_objects_refused(megatron_process):
    _, model = _model(RecomputeConfig("selective"), num_layers=1)

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    assert unwrap_model(Wrapper(Wrapper(model))) is model
    with pytest.raises(TypeError, match="GPTModel"):
        unwrap_model(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("implementation", [LOCAL, UNFUSED], ids=["flash", "unfused"])
def test_a_batch_without_isolation_is_refused(megatron_process, implementation):
    """A row's sequences are kept apart by its dense mask (Megatron's unfused attention) or
    its AttentionLayout (the segmented flash attention); a row with neither is refused."""
    _, model = _model(RecomputeConfig("selective"), num_layers=1)
    batch = pack_sequences([torch.arange(4)], implementation=implementation,
                           layout=ParallelLayout())
    assert batch.attention_mask is not None or batch.packed_seq_params is not None
    unsafe = type(batch)(**{**batch.__dict__, "attention_mask": None,
                            "packed_seq_params": None})
    with pytest.raises(ValueError, match="pack_sequences"):
        decoder_hidden_states(model, unsafe)


def test_moe_layers_pack_like_dense_ones(megatron_process):
    """Token routing is per token and nothing is dropped, so packing (padding included)
    leaves every routed output unchanged."""
    geometry = tiny_moe(num_layers=2)
    config = build_transformer_config(
        geometry, layout=ParallelLayout(), recompute=RecomputeConfig("selective"), dtype="float32"
    )
    model = build_gpt_model(geometry, config, seed=0)
    generator = torch.Generator().manual_seed(9)
    sequences = [torch.randint(0, geometry.vocab_size, (n,), generator=generator) for n in (6, 9)]
    with torch.no_grad():
        packed, _ = _run(model, sequences)
        for sequence, packed_outputs in zip(sequences, packed):
            (alone_outputs,), _ = _run(model, [sequence])
            torch.testing.assert_close(packed_outputs[0], alone_outputs[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(packed_outputs[1], alone_outputs[1], rtol=1e-5, atol=1e-5)


def test_a_context_parallel_split_of_an_unfused_row_names_the_build_that_takes_it():
    """A row packed for Megatron's unfused attention (a dense mask, no AttentionLayout) cannot
    be split over CP ranks; the error names the implementations that can, and no setting
    that does not exist."""
    from art.megatron.context_parallel import ContextParallelSplit
    from art.trainer_rank.compute.forward import _split_layout

    batch = pack_sequences([torch.arange(8)], implementation=UNFUSED, layout=ParallelLayout())
    with pytest.raises(ValueError, match=r"cpu_local\('flash'\).*cuda_local\(\)") as raised:
        _split_layout(batch, ContextParallelSplit(total_tokens=8, size=2, rank=0))
    assert "ART_MEGATRON_ATTENTION_BACKEND" not in str(raised.value)
