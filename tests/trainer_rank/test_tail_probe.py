"""The head tail's probe past the head chunk, on a real Megatron-Core model (CPU, fp32, TP=1).

Past one head chunk the tail grows by what each token adds (its outputs, its gradient rows),
not by the chunk's working set: a curve fitted at rows no longer than the chunk and carried
past it over-prices every long row. (The backward's two moments told apart, which a row of
shared prefixes needs, are guarded by the seed call's test, tests/distributed/
test_seed_call.py, where the head's moment sets the peak.)"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.megatron.provider import Provider
from art.megatron.settings import load_settings
from art.trainer_rank._request import OutputRequest
from art.trainer_rank.measuring.probe import CHUNK_MULTIPLES, probe, tail_points
from art.trainer_rank.measuring.probe_runs import measure_tail, tail_inputs

from _tiny import tiny_dense

CHUNK = 64
OUTPUTS = OutputRequest(target_logprobs=True, hidden_states=True)
LOGITS = OutputRequest(logits=True)
# Off the chunk's multiples and past the largest one measured (8 chunks), up to 23 chunks.
ROWS = (211, 397, 611, 1500)


def test_tail_points_add_the_chunk_multiples_that_fit():
    assert tail_points((16, 48), 64, None) == (16, 48)
    assert tail_points((16, 48), 64, 200) == (16, 48, 64, 96, 128, 192)
    assert tail_points((16, 64), 64, 10_000) == tuple(
        sorted({16} | {int(m * 64) for m in CHUNK_MULTIPLES}))


@pytest.fixture(scope="module")
def runtime(megatron_process):
    provider = Provider(tiny_dense(num_layers=2, vocab=256),
                        settings=load_settings({"ART_MEGATRON_RECOMPUTE_GRANULARITY":
                                                "selective"}),
                        lora=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"]),
                        dtype="float32", implementation=Implementation.cpu_local())
    return provider, provider.build_model(seed=0)


def _measured_peak(row: dict[str, float]) -> float:
    return max(row["forward"], row["caller_backward"], row["head_backward"])


def _probe_tail(runtime, outputs: OutputRequest, tail_max_tokens: int):
    """The probe's grad tail for `outputs` at rows of 16-48 tokens plus the head chunk's
    multiples up to `tail_max_tokens`."""
    provider, model = runtime
    return probe(model, geometry=provider.geometry, layout=ParallelLayout(),
                 implementation=provider.implementation, dtype="float32", lora_rank=4,
                 modes=(), outputs=[(outputs, True)], tokens=(16, 24, 32, 48),
                 head_chunk_tokens=CHUNK, tail_max_tokens=tail_max_tokens)


def _measured_tail_peak(runtime, outputs: OutputRequest, rows: int) -> float:
    """The tail's peak measured on a row of `rows` tokens with grad."""
    provider, model = runtime
    device = torch.device("cpu")
    inputs = tail_inputs(model, rows, ParallelLayout(), provider.implementation, device)
    return _measured_peak(measure_tail(model, inputs, outputs, torch.float32, device, True,
                                       CHUNK))


def test_tail_past_the_head_chunk_is_priced_from_rows_measured_past_it(runtime):
    coefficients = _probe_tail(runtime, OUTPUTS, 8 * CHUNK)
    for rows in ROWS:
        seen = _measured_tail_peak(runtime, OUTPUTS, rows)
        priced = coefficients.tail_cost(OUTPUTS, True, rows)
        assert priced is not None
        ratio = max(priced.forward_bytes, priced.backward_bytes) / seen
        assert 1.0 <= ratio <= 1.02, (rows, ratio, priced, seen)
        # The head's moment is one of the two the backward is the larger of.
        assert priced.head_backward_bytes <= priced.backward_bytes


def test_a_tail_measured_up_to_the_chunk_grows_past_it_as_the_formulas_do(runtime):
    """A probe whose tail rows stop at the chunk (a limit that fits no larger multiple, or a
    calibration's probe) prices a longer row from its largest row plus the formulas' growth:
    the curve's own extrapolation carries the chunk's working set on with every token. Full
    logits, whose chunk working set is the tail's largest part."""
    from dataclasses import replace

    from art.trainer_rank.pricing.model import MemoryModel

    coefficients = _probe_tail(runtime, LOGITS, CHUNK)
    memory = replace(MemoryModel.for_provider(runtime[0]), head_chunk_tokens=CHUNK
                     ).with_coefficients(coefficients)
    for rows in (150, 211):
        seen = _measured_tail_peak(runtime, LOGITS, rows)
        priced = memory.probed_tail(LOGITS, True, rows)
        curve = coefficients.tail_cost(LOGITS, True, rows)
        assert priced is not None and curve is not None
        ratio = max(priced.forward_bytes, priced.backward_bytes) / seen
        carried = max(curve.forward_bytes, curve.backward_bytes) / seen
        print(f"{rows} rows: priced {ratio:.4f}, the curve carried on {carried:.4f}")
        assert 1.0 <= ratio <= 1.02, (rows, ratio, priced, seen)
        assert carried > 1.1  # what the guard is for
