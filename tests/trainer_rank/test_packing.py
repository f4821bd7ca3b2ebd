"""Packing: positions restart per sequence, isolation (mask or cu_seqlens), layout padding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.trainer_rank._types import ForwardInput
from art.trainer_rank.compute.items import make_items
from art.trainer_rank.compute.packing import (
    IGNORE_INDEX,
    next_token_targets,
    pack_sequences,
    pack_targets,
    pack_values,
    packed_length_tokens,
    unpack,
)

LOCAL = Implementation.cpu_local()
# Megatron's unfused DotProductAttention: a dense mask, the caller's order, no context parallel.
UNFUSED = Implementation.cpu_local("unfused")
TE = Implementation.gpu_te()


def _seqs(*lengths: int) -> list[torch.Tensor]:
    return [torch.arange(1, n + 1) + 100 * i for i, n in enumerate(lengths)]


def test_positions_offsets_and_block_diagonal_causal_mask():
    batch = pack_sequences(_seqs(3, 1, 4), implementation=UNFUSED, layout=ParallelLayout())
    assert batch.padded_tokens == batch.logical_tokens == 8
    assert batch.offsets == (0, 3, 4)
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert batch.tokens.tolist() == [[1, 2, 3, 101, 201, 202, 203, 204]]
    assert batch.packed_seq_params is None
    mask = batch.attention_mask
    assert mask.dtype == torch.bool and mask.shape == (1, 1, 8, 8)
    owner = [0, 0, 0, 1, 2, 2, 2, 2]
    for q in range(8):
        for k in range(8):
            visible = owner[q] == owner[k] and k <= q
            assert bool(mask[0, 0, q, k]) is (not visible), (q, k)


def test_sequence_parallel_pads_the_row_to_a_multiple_of_tp_with_its_own_block():
    layout = ParallelLayout(tensor_parallel=4, sequence_parallel=True)
    batch = pack_sequences(_seqs(3, 2), implementation=UNFUSED, layout=layout)
    assert batch.logical_tokens == 5 and batch.padded_tokens == 8
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    mask = batch.attention_mask[0, 0]
    # The pad tokens see only pad tokens, and no real token sees them.
    causal_masked = torch.ones(3, 3, dtype=torch.bool).triu(diagonal=1)
    assert torch.equal(mask[5:, 5:], causal_masked)
    assert mask[:5, 5:].all() and mask[5:, :5].all()
    # Without sequence parallel TP needs no padding.
    plain = pack_sequences(_seqs(3, 2), implementation=UNFUSED, layout=ParallelLayout(2))
    assert plain.padded_tokens == 5


def test_te_spec_gets_cu_seqlens_instead_of_a_mask():
    layout = ParallelLayout(tensor_parallel=2, sequence_parallel=True)
    batch = pack_sequences(_seqs(3, 4), implementation=TE, layout=layout)
    assert batch.attention_mask is None
    params = batch.packed_seq_params
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.dtype == torch.int32
    # 7 real tokens padded to 8: the trailing pad is its own pseudo-sequence.
    assert params.cu_seqlens_q.tolist() == [0, 3, 7, 8]
    assert params.cu_seqlens_q_padded.tolist() == [0, 3, 7, 8]
    assert params.max_seqlen_q == params.max_seqlen_kv == 4


def test_context_parallel_pads_every_sequence_to_twice_cp():
    layout = ParallelLayout(tensor_parallel=1, context_parallel=2)
    batch = pack_sequences(_seqs(3, 5), implementation=TE, layout=layout)
    assert batch.offsets == (0, 4)
    assert batch.padded_tokens == 12
    params = batch.packed_seq_params
    assert params.cu_seqlens_q.tolist() == [0, 3, 8]
    assert params.cu_seqlens_q_padded.tolist() == [0, 4, 12]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]]


def test_context_parallel_with_the_unfused_attention_is_refused_with_the_remedy():
    with pytest.raises(ValueError, match="ART_MEGATRON_CONTEXT_PARALLEL_SIZE=1"):
        pack_sequences(_seqs(4), implementation=UNFUSED,
                       layout=ParallelLayout(context_parallel=2))


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    tp=st.sampled_from([1, 2, 4]),
    cp=st.sampled_from([1, 2]),
    sp=st.booleans(),
)
def test_padded_length_matches_pack_and_unpack_round_trips(lengths, tp, cp, sp):
    layout = ParallelLayout(
        tensor_parallel=tp, context_parallel=cp, sequence_parallel=sp and tp > 1
    )
    batch = pack_sequences(_seqs(*lengths), implementation=TE, layout=layout)
    assert batch.padded_tokens == packed_length_tokens(lengths, layout)
    assert batch.padded_tokens % (tp if layout.sequence_parallel else 1) == 0
    assert batch.padded_tokens % (2 * cp if cp > 1 else 1) == 0
    pieces = unpack(batch.tokens[0], batch)
    assert [p.tolist() for p in pieces] == [s.tolist() for s in _seqs(*lengths)]
    values = [torch.randn(n, 3) for n in lengths]
    packed = pack_values(values, batch, fill=0.0)
    for got, want in zip(unpack(packed, batch), values):
        assert torch.equal(got, want)


def test_next_token_targets_never_cross_sequences():
    layout = ParallelLayout(tensor_parallel=2, sequence_parallel=True)
    batch = pack_sequences(_seqs(3, 2), implementation=UNFUSED, layout=layout)
    assert next_token_targets(batch).tolist() == [
        2, 3, IGNORE_INDEX, 102, IGNORE_INDEX, IGNORE_INDEX
    ]
    # The segmented flash attention lays the roots out by length: the shorter one first.
    flash = pack_sequences(_seqs(3, 2), implementation=LOCAL, layout=layout)
    assert flash.tokens.tolist() == [[101, 102, 1, 2, 3, 0]]
    assert next_token_targets(flash).tolist() == [
        102, IGNORE_INDEX, 2, 3, IGNORE_INDEX, IGNORE_INDEX
    ]


@pytest.mark.parametrize(
    "sequences, match",
    [
        ([], "at least one sequence"),
        ([torch.zeros(0, dtype=torch.long)], "non-empty 1-D"),
        ([torch.zeros(2, 3, dtype=torch.long)], "non-empty 1-D"),
        ([torch.zeros(3)], "integer token ids"),
    ],
)
def test_bad_sequences_are_refused(sequences, match):
    with pytest.raises(ValueError, match=match):
        pack_sequences(sequences, implementation=LOCAL, layout=ParallelLayout())


def test_unpack_refuses_values_of_another_length():
    batch = pack_sequences(_seqs(2, 2), implementation=LOCAL, layout=ParallelLayout())
    with pytest.raises(ValueError, match="4 rows"):
        unpack(torch.zeros(5), batch)


FLASH = Implementation.cpu_local("flash")


def _group(prompt: list[int], *completions: list[int]) -> list[torch.Tensor]:
    return [torch.tensor(prompt + c) for c in completions]


def test_a_group_shares_its_prompt_positions_continue_and_siblings_never_meet():
    sequences = _group([5, 6, 7], [1, 2], [3], [8, 9, 4])
    batch = pack_sequences(sequences, implementation=UNFUSED, layout=ParallelLayout(),
                           groups=[3])
    assert batch.logical_tokens == 15 and batch.padded_tokens == 9 and batch.shared_tokens == 6
    assert batch.tokens.tolist() == [[5, 6, 7, 1, 2, 3, 8, 9, 4]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 3, 4, 5]]
    owner = [None, None, None, 0, 0, 1, 2, 2, 2]  # None = the shared prompt
    mask = batch.attention_mask[0, 0]
    for q in range(9):
        for k in range(9):
            visible = k <= q and (owner[k] is None or owner[k] == owner[q])
            assert bool(mask[q, k]) is (not visible), (q, k)
    for got, want in zip(unpack(batch.tokens[0], batch), sequences):
        assert torch.equal(got, want)
    # The flash implementation gets the same layout as segments instead of a mask.
    flash = pack_sequences(sequences, implementation=FLASH, layout=ParallelLayout(), groups=[3])
    assert flash.attention_mask is None and flash.packed_seq_params is flash.attention_layout
    assert torch.equal(flash.attention_layout.dense_mask(), batch.attention_mask)
    # Without groups (or on the TE spec) nothing is shared.
    assert pack_sequences(sequences, implementation=LOCAL,
                          layout=ParallelLayout()).padded_tokens == 15
    assert pack_sequences(sequences, implementation=TE, layout=ParallelLayout(),
                          groups=[3]).padded_tokens == 15


def test_deeper_shared_parts_nest_and_targets_on_shared_rows_are_kept_per_sequence():
    sequences = _group([5, 6], [1, 2, 3], [1, 2, 4], [7])
    batch = pack_sequences(sequences, implementation=FLASH, layout=ParallelLayout(),
                           groups=[3])
    # Depth by depth: the prompt, then the deeper part and the third sequence's own token,
    # then the two tokens after the deeper part.
    assert batch.tokens.tolist() == [[5, 6, 1, 2, 7, 3, 4]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 2, 4, 4]]
    segments = batch.attention_layout.segments
    assert [(s.start, s.length, [(c.start, c.length) for c in s.context]) for s in segments] == [
        (0, 2, []), (2, 2, [(0, 2)]), (4, 1, [(0, 2)]), (5, 1, [(0, 4)]), (6, 1, [(0, 4)])
    ]
    targets = pack_targets([torch.tensor(s[1:].tolist() + [IGNORE_INDEX]) for s in sequences],
                           batch)
    # Row 3 (token 2) is followed by 3 in sequence 0 but by 4 in sequence 1; row 1 by 1 or 7.
    assert targets.row_targets.tolist() == [6, 1, 2, 3, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]
    assert sorted(zip(targets.extra_rows.tolist(), targets.extra_targets.tolist())) == [
        (1, 7), (3, 4)]


def test_unpack_on_a_shared_row_copies_each_sequence_and_adds_gradients_into_one_row():
    """Each sequence's outputs on a shared row are copies whose backward fills one zeroed row:
    the gradient equals the sum of the sequences' gradients at their rows, and the backward
    holds the sequences' gradients beside that one row (views and concatenations of slices
    materialise a whole-row gradient per slice and sum them pairwise)."""
    from art.trainer_rank.measuring.meter import MemoryMeter

    sequences = _group([5, 6, 7, 8] * 10, [1, 2] * 20, [3] * 30, [9] * 5)
    batch = pack_sequences(sequences, implementation=FLASH, layout=ParallelLayout(),
                           groups=[3])
    rows, logical, vocab = batch.padded_tokens, batch.logical_tokens, 512
    weight = torch.randn(rows, vocab, requires_grad=True)
    meter = MemoryMeter(device="cpu")
    with meter:
        row = weight * 2.0
        per_sequence = unpack(row, batch)
        del row
        kept = meter.live_bytes
        loss = sum((out * (i + 1)).sum() for i, out in enumerate(per_sequence))
        loss.backward()
        del loss, per_sequence
    row_bytes = vocab * 4
    # The copies (all logical rows) and their int64 row indices stay once the row is dropped.
    assert kept == logical * (row_bytes + 8)
    # Backward: the copies, every sequence's gradient and the one zeroed row they are added
    # into; no whole-row gradient per sequence (or per slice).
    assert meter.peak_bytes <= (2 * logical + rows) * row_bytes + 2**12
    want = torch.zeros(rows, vocab)
    for i in range(batch.sequences):
        want[batch.sequence_rows(i)] += 2.0 * (i + 1)
    assert torch.equal(weight.grad, want)


def test_the_seed_group_packs_to_32710_tokens():
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 1000, (5733,), generator=generator)
    sequences = [
        torch.cat([prompt, torch.randint(1, 1000, (n - 5733,), generator=generator)])
        for n in (19222, 19221)
    ]
    sequences[1][5733] = sequences[0][5733] + 1  # they part right after the prompt
    batch = pack_sequences(sequences, implementation=FLASH, layout=ParallelLayout(), groups=[2])
    assert batch.logical_tokens == 38443 and batch.padded_tokens == 32710
    assert batch.shared_tokens == 5733
    item = make_items([[ForwardInput(input_tokens=s) for s in sequences]])[0]
    assert item.shared_tokens == 5733
    assert packed_length_tokens((19222, 19221), ParallelLayout(), item.shared_tokens) == 32710
    # Under sequence parallel at TP=2 the row is padded to an even length.
    sp = ParallelLayout(tensor_parallel=2, sequence_parallel=True)
    assert pack_sequences(sequences, implementation=FLASH, layout=sp,
                          groups=[2]).padded_tokens == 32710


def test_the_flash_build_lays_equal_lengths_side_by_side_and_unpacks_in_item_order():
    """On the segmented flash attention (CP = 1) the row's roots are ordered by length, ties
    in item order, so equal sequences form runs the attention batches; a group's prompt is a
    root like any other and its completions follow. Every sequence still unpacks to its own
    tokens, in the caller's order. Unfused attention and CP keep the caller's order."""
    flash = Implementation.cpu_local("flash")
    sequences = _seqs(5, 3, 5, 3, 2)
    batch = pack_sequences(sequences, implementation=flash, layout=ParallelLayout())
    assert [s.length for s in batch.attention_layout.segments] == [2, 3, 3, 5, 5]
    assert batch.offsets == (8, 2, 13, 5, 0)
    for sequence, got in zip(sequences, unpack(batch.tokens[0], batch)):
        assert got.tolist() == sequence.tolist()
    unfused = pack_sequences(sequences, implementation=Implementation.cpu_local("unfused"),
                             layout=ParallelLayout())
    assert unfused.offsets == (0, 5, 8, 13, 16)
    cp = pack_sequences(sequences, implementation=flash,
                        layout=ParallelLayout(context_parallel=2))
    assert cp.offsets == tuple(sorted(cp.offsets))
