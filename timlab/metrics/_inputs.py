"""Input checking shared by the metric functions: shapes, mask, non-finite log-probs.

Every metric takes ``(train_logp, rollout_logp, mask)``, all (B, T): ``train_logp`` = log pi (the
trainer's recomputed log-probs), ``rollout_logp`` = log mu (the rollout engine's), ``mask`` 1/True
on response tokens. Values at masked-out positions are ignored entirely (padding may hold -inf or
NaN); a non-finite log-prob at a *valid* position raises ValueError naming the input, because
every metric built on it would be inf/NaN and the usual cause is an engine bug worth seeing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from timlab.errors import UsageError

SAFETY_BOUND = 20.0
"""Clamp for log-ratios before ``exp`` (verl's ``SAFETY_BOUND``): exp(20) ~ 4.9e8."""

PPL_LOG_BOUND = 600.0
"""Clamp for the exponent of perplexities (exp(-mean log p)): keeps float64 finite, also the
mean over sequences, which sums them first: exp(600) ~ 3.8e260, so a sum over up to ~4e47
sequences at the bound is finite (at 700, 1.0e304 each, 18k sequences overflowed to inf).
verl does not clamp these; the two agree wherever the exponent is below 600."""


class Prepared(NamedTuple):
    """Validated float64 views of the inputs; masked-out positions hold 0."""

    train: torch.Tensor  # (B, T) log pi, 0 where mask is off
    rollout: torch.Tensor  # (B, T) log mu, 0 where mask is off
    valid: torch.Tensor  # (B, T) bool
    validf: torch.Tensor  # (B, T) float64 0/1


def check_inputs(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> Prepared:
    """Validate shapes and finiteness; return float64 copies with masked-out entries zeroed."""
    for name, t in (("train_logp", train_logp), ("rollout_logp", rollout_logp), ("mask", mask)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if train_logp.dim() != 2:
        raise UsageError(f"train_logp must be 2-D (B, T), got shape {tuple(train_logp.shape)}")
    if train_logp.shape != rollout_logp.shape or train_logp.shape != mask.shape:
        raise UsageError(
            "shape mismatch: train_logp "
            f"{tuple(train_logp.shape)}, rollout_logp {tuple(rollout_logp.shape)}, mask {tuple(mask.shape)}"
        )
    with torch.no_grad():
        valid = mask.detach() != 0  # (B, T) bool
        train = train_logp.detach().to(torch.float64)
        rollout = rollout_logp.detach().to(torch.float64)
        bad = torch.stack(
            [(~torch.isfinite(train) & valid).sum(), (~torch.isfinite(rollout) & valid).sum()]
        ).tolist()  # one host sync for both checks
        for name, count in zip(("train_logp", "rollout_logp"), bad):
            if count:
                raise UsageError(
                    f"{name} has {count} non-finite value(s) (-inf/+inf/NaN) at valid (mask=1) positions"
                )
        zero = torch.zeros((), dtype=torch.float64, device=train.device)
        train = torch.where(valid, train, zero)
        rollout = torch.where(valid, rollout, zero)
    return Prepared(train, rollout, valid, valid.to(torch.float64))
