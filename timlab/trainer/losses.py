"""The policy losses (``POLICY_LOSSES``, picked by ``algorithm.loss_type``, verl's names):

- ``ppo_clip``: PPO's clipped surrogate with asymmetric clipping (DAPO's clip-higher).
  ratio = pi_theta / pi_old, where pi_old is by default the TRAINER's log-prob under the rollout
  weights (computed by the same forward, not taken from the engine). So with no IS correction the
  rollout's log mu never enters the loss: a training-inference mismatch acts only through which
  tokens were sampled, exactly as in verl's default "decoupled" mode (recomputed old_log_prob).
  In verl's bypass mode (``correction.bypass_mode``) the trainer passes log mu as pi_old, so the
  ratio is pi_theta / mu and its clipping is the correction.
- ``reinforce``: -A * w * log pi_theta, no clipping (verl's ``compute_policy_loss_reinforce``).

IS weights, when a remedy is on, multiply the per-token loss and are detached.
"""

from __future__ import annotations

from functools import partial

import torch

from timlab.errors import UsageError

LOSS_AGGREGATIONS = ("token_mean", "seq_mean")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: str, *, denom: float | None = None) -> torch.Tensor:
    """Reduce a (B, T) per-token loss over valid tokens.

    token_mean: sum / number of valid tokens (``denom`` overrides that count, e.g. the global
    count across data-parallel ranks or the whole batch when splitting into mini-batches).
    seq_mean: mean over each sequence's tokens, then mean over sequences with any token.
    """
    if how == "token_mean":
        n = mask.sum() if denom is None else denom
        return (per_token * mask).sum() / max(float(n), 1.0)
    if how == "seq_mean":
        tok = mask.sum(-1)  # (B,)
        has = tok > 0
        seq = (per_token * mask).sum(-1) / tok.clamp(min=1)
        n = has.sum() if denom is None else denom
        return seq[has].sum() / max(float(n), 1.0)
    raise UsageError(f"unknown algorithm.loss_agg {how!r}; valid choices: {', '.join(LOSS_AGGREGATIONS)}")


def _metrics(ratio: torch.Tensor, log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, clip_low: float,
             clip_high: float, clipped: bool) -> dict[str, float]:
    """train/* statistics of the ratio pi / pi_old (clip fractions 0 when the loss does not clip)."""
    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        low = ((ratio < 1.0 - clip_low) & (adv < 0)).to(mask.dtype) * float(clipped)
        high = ((ratio > 1.0 + clip_high) & (adv > 0)).to(mask.dtype) * float(clipped)
        return {
            "train/clip_frac_low": float((low * mask).sum() / n),
            "train/clip_frac_high": float((high * mask).sum() / n),
            "train/clip_frac": float(((low + high) * mask).sum() / n),
            "train/approx_kl": float((0.5 * log_ratio.pow(2) * mask).sum() / n),
            "train/ratio_max": float(torch.where(mask > 0, ratio, torch.zeros_like(ratio)).max()),
        }


def _kl_penalty(per_token: torch.Tensor, logp: torch.Tensor, kl_coef: float, ref_logp: torch.Tensor | None) -> torch.Tensor:
    if kl_coef > 0.0:
        if ref_logp is None:
            raise UsageError("kl_coef > 0 needs ref_logp")
        d = (ref_logp.detach() - logp).clamp(-20.0, 20.0)
        per_token = per_token + kl_coef * (torch.exp(d) - d - 1.0)
    return per_token


def ppo_clip_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, *, clip_low: float,
                       clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token, max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) with
    r = pi_theta / pi_old, and log r (clamped to +-20) for the ratio statistics: both (B, T)."""
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)  # (B, T)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), log_ratio


def reinforce_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, *, clip_low: float,
                        clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE per token, -A log pi_theta, no clipping; ``old_logp`` (and the clip bounds) only
    feed the ratio statistics, through the detached log r. Its gradient at pi_theta = pi_old
    equals PPO-clip's."""
    return -adv * logp, (logp.detach() - old_logp).clamp(-20.0, 20.0)


SURROGATES = {"ppo_clip": ppo_clip_surrogate, "reinforce": reinforce_surrogate}
"""``algorithm.loss_type`` -> its per-token surrogate (``policy_loss`` does the rest)."""


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "ppo_clip",
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    loss_agg: str = "token_mean",
    is_weights: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    denom: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss of ``loss_type`` (``SURROGATES``), IS-weighted, with the optional k3 KL penalty.

    logp: (B, T) differentiable log pi_theta; old_logp: (B, T) detached log pi_old;
    advantages: (B,) per sequence; mask: (B, T) float 0/1; is_weights: (B, T) detached or None;
    ref_logp: (B, T) for the optional k3 KL penalty. Returns (loss, metrics); the clip fractions
    are 0 for a loss that does not clip.
    """
    if loss_type not in SURROGATES:
        raise UsageError(f"unknown algorithm.loss_type {loss_type!r}; valid choices: {', '.join(SURROGATES)}")
    mask = mask.to(logp.dtype)
    adv = advantages[:, None].to(logp.dtype)  # (B, 1)
    per_token, log_ratio = SURROGATES[loss_type](logp, old_logp, adv, clip_low=clip_low, clip_high=clip_high)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    per_token = _kl_penalty(per_token, logp, kl_coef, ref_logp)
    loss = aggregate(per_token, mask, loss_agg, denom=denom)
    return loss, _metrics(torch.exp(log_ratio), log_ratio, adv, mask, clip_low, clip_high,
                          clipped=loss_type == "ppo_clip")


ppo_clip_loss = partial(policy_loss, loss_type="ppo_clip")
"""``policy_loss`` with PPO's clipped surrogate (``ppo_clip_surrogate``)."""
reinforce_loss = partial(policy_loss, loss_type="reinforce")
"""``policy_loss`` with REINFORCE's (``reinforce_surrogate``)."""


POLICY_LOSSES = {"ppo_clip": ppo_clip_loss, "reinforce": reinforce_loss}
"""``algorithm.loss_type`` -> loss function (one signature)."""
