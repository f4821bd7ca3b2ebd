"""A caller's per-token RL loss is priced: on the flash build the head's backward is the peak
of a block-rung micro-batch, and a policy loss over the returned log-probs (importance ratios,
a KL penalty, an entropy over the top-k; the calibration harness's `rl_loss`) keeps more live
there than the probe's synthetic sum does. The formula price must still be at or above what
really ran, and the term must be exactly what a per-token loss adds."""

from __future__ import annotations

import torch

from art.trainer_rank._request import OutputRequest
from art.trainer_rank.pricing.tail import caller_per_token_loss_bytes

TOKENS = 1795


def test_the_caller_term_is_a_gradient_per_log_prob_and_the_top_k_exp():
    outputs = OutputRequest.parse("logprobs,top_k=8")
    assert caller_per_token_loss_bytes(outputs, TOKENS) == TOKENS * 4 * (1 + 8)
    assert caller_per_token_loss_bytes(OutputRequest.parse("hidden_states"), TOKENS) == 0


def test_an_rl_loss_on_a_block_rung_stays_within_its_price(megatron_process):
    from _calibration.cells import POLICY_BY_NAME, Cell, calibration_geometries
    from _calibration.harness import (
        calibration_provider,
        default_memory_model,
        micro_batch_shape,
        run_micro_batch,
    )

    from art.megatron.implementation import Implementation

    flash = Implementation.cpu_local("flash")
    geometry = calibration_geometries()["gqa-256"]
    provider = calibration_provider(geometry, POLICY_BY_NAME["full block 2"], lora_rank=8,
                                    tensor_parallel=1, dtype="float32", implementation=flash)
    model = provider.build_model(seed=0)
    outputs = OutputRequest.parse("logprobs,top_k=8")
    device = torch.device("cpu")
    run_micro_batch(model, [16], OutputRequest(target_logprobs=True), True, provider.layout,
                    flash, device)  # LoRA grads exist before the measured micro-batch
    torch.manual_seed(0)
    measured, _ = run_micro_batch(model, [TOKENS], outputs, True, provider.layout, flash,
                                  device, loss_name="rl")
    cell = Cell("gqa-256", "full block 2", 8, 1, (TOKENS,), "logprobs,top_k=8", True,
                loss="rl")
    memory = default_memory_model(cell, flash)
    estimate = memory.estimate(micro_batch_shape((TOKENS,), outputs, True, provider.layout,
                                                 flash))
    assert estimate.peak_at == "backward: head backward"
    predicted = max(estimate.forward_peak_bytes, estimate.backward_peak_bytes)
    assert 1.0 <= predicted / measured <= 1.05, (predicted, measured)
