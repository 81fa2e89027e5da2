"""Advantage estimators over groups of samples of the same prompt (pure functions).

Input rewards are (N, G): N prompts x G samples. Output advantages have the same shape and are
broadcast over a sequence's tokens by the loss. Outcome rewards only (gamma = 1, no critic).
"""

from __future__ import annotations

import torch

from timlab.errors import UsageError
from timlab.registry import Registry

ADVANTAGES: Registry = Registry("advantage estimator")

STD_EPS = 1e-6


@ADVANTAGES.register("grpo")
def grpo(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO: (r - group mean) / (group std + eps); std is the unbiased sample std like DeepSeek's."""
    mean = rewards.mean(-1, keepdim=True)  # (N, 1)
    std = rewards.std(-1, keepdim=True) if rewards.shape[-1] > 1 else torch.zeros_like(mean)
    return (rewards - mean) / (std + STD_EPS)


@ADVANTAGES.register("rloo")
def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO: r_i minus the mean of the other G-1 rewards of its group."""
    G = rewards.shape[-1]
    if G < 2:
        raise UsageError("rloo needs rollout.samples_per_prompt >= 2")
    total = rewards.sum(-1, keepdim=True)  # (N, 1)
    return rewards - (total - rewards) / (G - 1)


@ADVANTAGES.register("reinforce")
def reinforce(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE with the group-mean baseline: r - group mean (no std normalization)."""
    return rewards - rewards.mean(-1, keepdim=True)


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """(N,) bool: groups whose rewards are not all equal (the others carry no signal)."""
    return (rewards.max(-1).values - rewards.min(-1).values) > 0
