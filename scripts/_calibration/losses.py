"""Caller losses for calibration cells: the probe's synthetic loss and an RL policy loss.

The trainer never sees the caller's loss before it runs, so the memory model prices the
probe's synthetic loss; the RL loss here is what a GRPO/PPO-style caller computes from the
returned log-probs, and the calibration measures how far that moves the peak.
"""

from __future__ import annotations

from typing import Any

import torch

from art.trainer_rank._request import OutputRequest
from art.trainer_rank.measuring.probe_runs import caller_loss as synthetic_loss

CLIP_EPSILON = 0.2
KL_COEFFICIENT = 0.04
ENTROPY_COEFFICIENT = 0.01


def rl_loss(outputs: OutputRequest, heads: Any, hidden: torch.Tensor) -> torch.Tensor:
    """Clipped importance-ratio policy loss with a k3 KL penalty to a reference policy and an
    entropy bonus over the returned top-k (when requested), mean over tokens. The behaviour
    and reference log-probs and the advantages are per-token fp32 tensors the caller holds
    (seeded noise around the current log-probs here)."""
    logprobs = heads.target_logprobs
    if logprobs is None:
        return synthetic_loss(outputs, heads, hidden)
    generator = torch.Generator(device="cpu").manual_seed(logprobs.numel())
    noise = torch.randn(3, logprobs.numel(), generator=generator).to(logprobs.device)
    old_logprobs = logprobs.detach() + 0.1 * noise[0]
    ref_logprobs = logprobs.detach() + 0.1 * noise[1]
    advantages = noise[2]
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = ratio.clamp(1 - CLIP_EPSILON, 1 + CLIP_EPSILON)
    policy = -torch.minimum(ratio * advantages, clipped * advantages)
    log_ratio_ref = ref_logprobs - logprobs
    kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1
    loss = (policy + KL_COEFFICIENT * kl).mean()
    if heads.top_k_logprobs is not None:
        p = heads.top_k_logprobs.exp()
        entropy = -(p * heads.top_k_logprobs).sum(-1).mean()
        loss = loss - ENTROPY_COEFFICIENT * entropy
    if outputs.hidden_states:
        loss = loss + hidden.float().square().mean()
    return loss


LOSS_BY_NAME = {"synthetic": synthetic_loss, "rl": rl_loss}
