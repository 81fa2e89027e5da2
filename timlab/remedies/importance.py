"""Importance-sampling corrections for training-inference mismatch: TIS, MIS, IcePop, veto.

``is_weights`` returns per-token weights (B, T) that multiply the policy-gradient loss of tokens
sampled from mu (rollout) but trained under pi (trainer), plus ``is/*`` metrics.

    level (IS_LEVELS)   rho per token
      token             exp(r_t)
      sequence          exp(sum_t r_t), broadcast to the sequence's tokens
      geometric         exp(mean_t r_t), broadcast
    mode (IS_MODES)     weight
      none              1 (stats only)
      truncate (TIS)    min(rho, C)
      mask (MIS)        rho * 1[rho <= C]
      two_sided (IcePop) rho * 1[C_low <= rho <= C_high], C_low defaults to 1 / C_high
    veto                whole sequence -> 0 if any token has exp(r_t) < veto_threshold
    batch_normalize     self-normalized IS: after all of the above, divide by the batch mean weight
                        (over tokens at token level; over sequences, one weight each, at the
                        sequence and geometric levels), as verl's ``rollout_is_batch_normalize``

with r_t = log pi - log mu. Defaults follow the seed paper (Table 1: C = 2 for TIS and MIS).
Veto is opt-in (``veto_threshold=None``, as in verl); ``DEFAULT_VETO_THRESHOLD`` = 1e-4 is the
value seen in the field.

Departures / choices:
- The log-rho is clamped to [-SAFETY_BOUND, SAFETY_BOUND] before exp at every level (verl does
  the same for sequence level). For ``mask``/``two_sided`` a clamped rho is compared with C, so a
  true rho of 1e12 is still rejected (exp(20) > any sane C).
- The veto tests the *token* ratio exp(r_t) whatever the level (verl's rollout_token_veto).
- Weights are computed in float64, detached, and returned in the promotion of train_logp's
  dtype with float32 (bf16 input -> float32 weights); masked-out positions are 0.
- Matches verl's ``compute_rollout_correction_weights`` (token / sequence x TIS / IcePop, with
  and without batch normalization; tests/test_rejection.py checks it against verl's own function).
  verl normalizes only when the mean weight exceeds 1e-8; so does this (factor 1 otherwise).
- Inputs are validated by ``timlab.metrics``' checker (the same pure layer), and SAFETY_BOUND is
  the metrics' constant.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from timlab.errors import UsageError
from timlab.metrics._inputs import SAFETY_BOUND, check_inputs
from timlab.registry import Registry

DEFAULT_THRESHOLD = 2.0
"""C for TIS/MIS (Beyond-Precision Table 1)."""

DEFAULT_VETO_THRESHOLD = 1e-4
"""Token-ratio veto commonly used in the field (verl docs); pass it as ``veto_threshold``."""

METRIC_KEYS = (
    "is/ratio_mean_before",
    "is/ratio_max_before",
    "is/ratio_min_before",
    "is/ratio_frac_high",
    "is/ratio_frac_low",
    "is/ratio_mean_after",
    "is/frac_truncated",
    "is/frac_masked",
    "is/frac_truncated_seqs",
    "is/frac_masked_seqs",
    "is/frac_vetoed_seqs",
    "is/batch_norm_factor",
    "is/ess",
)

RAW_RATIO_KEYS = ("is/ratio_mean_before", "is/ratio_max_before", "is/ratio_min_before", "is/ratio_frac_high",
                  "is/ratio_frac_low")
"""The ``METRIC_KEYS`` that describe the raw ratios, before any truncation or masking: the
same whatever the mode, so a plug-in can log them for a host that applies its own correction."""

BATCH_NORM_MIN = 1e-8
"""Self-normalization divides by the batch mean weight only above this (verl's guard)."""

# A level maps (r (B, T) with 0 off-mask, validf (B, T) float 0/1) -> log rho (B, T).
IS_LEVELS: Registry[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = Registry("IS level")
# A mode maps (rho (B, T), c_low, c_high) -> (weight (B, T), truncated (B, T) bool, masked (B, T) bool).
IS_MODES: Registry[Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = Registry("IS mode")


@IS_LEVELS.register("token")
def _token_level(r: torch.Tensor, validf: torch.Tensor) -> torch.Tensor:
    return r  # (B, T)


@IS_LEVELS.register("sequence")
def _sequence_level(r: torch.Tensor, validf: torch.Tensor) -> torch.Tensor:
    return r.sum(-1, keepdim=True).expand_as(r)  # (B, 1) -> (B, T)


@IS_LEVELS.register("geometric")
def _geometric_level(r: torch.Tensor, validf: torch.Tensor) -> torch.Tensor:
    n = validf.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
    return (r.sum(-1, keepdim=True) / n).expand_as(r)  # (B, T)


@IS_MODES.register("none")
def _mode_none(rho: torch.Tensor, c_low: float, c_high: float):
    no = torch.zeros_like(rho, dtype=torch.bool)
    return torch.ones_like(rho), no, no


@IS_MODES.register("truncate")
def _mode_truncate(rho: torch.Tensor, c_low: float, c_high: float):
    over = rho > c_high
    return rho.clamp(max=c_high), over, torch.zeros_like(over)


@IS_MODES.register("mask")
def _mode_mask(rho: torch.Tensor, c_low: float, c_high: float):
    over = rho > c_high
    return torch.where(over, torch.zeros_like(rho), rho), torch.zeros_like(over), over


@IS_MODES.register("two_sided")
def _mode_two_sided(rho: torch.Tensor, c_low: float, c_high: float):
    out = (rho < c_low) | (rho > c_high)
    return torch.where(out, torch.zeros_like(rho), rho), torch.zeros_like(out), out


def _check_positive(name: str, value: float | None) -> None:
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise UsageError(f"{name} must be a finite number > 0, got {value!r}")


def _check_inputs(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor):
    """r = log pi - log mu (float64, 0 off-mask) and the valid mask, via the metrics' checker."""
    p = check_inputs(train_logp, rollout_logp, mask)
    return p.train - p.rollout, p.valid


def is_weights(
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    threshold: float = DEFAULT_THRESHOLD,
    threshold_low: float | None = None,
    veto_threshold: float | None = None,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """IS weights (B, T), detached, 0 off-mask, and ``is/*`` metrics (keys in ``METRIC_KEYS``).

    ``threshold`` is C (C_high for two_sided); ``threshold_low`` only applies to ``two_sided``
    and defaults to 1 / threshold. ``batch_normalize``: divide the final weights by their batch
    mean (self-normalized IS, applied after truncation, masking and veto).

    Metrics, all over valid tokens unless said otherwise: ``ratio_mean_before`` /
    ``ratio_max_before`` / ``ratio_min_before``: the raw rho (at the chosen level, clamped at
    exp(+-20)) before the mode; ``ratio_frac_high`` / ``ratio_frac_low``: share of raw rho above
    C / below C_low (1 / C unless two_sided sets it), whatever the mode; ``ratio_mean_after``:
    mean final weight; ``frac_truncated``: share capped by ``truncate``; ``frac_masked``: share
    zeroed by ``mask``/``two_sided``; ``frac_truncated_seqs`` / ``frac_masked_seqs`` /
    ``frac_vetoed_seqs``: share of non-empty sequences with a token truncated / masked / vetoed;
    ``batch_norm_factor``: the mean weight divided out (1.0 without ``batch_normalize``); ``ess``:
    1 / mean((w / mean w)^2) of the final weights (0 if all are 0). With no valid token every
    metric is 0.0.
    """
    level_fn = IS_LEVELS.get(level)
    mode_fn = IS_MODES.get(mode)
    _check_positive("threshold", threshold)
    _check_positive("threshold_low", threshold_low)
    _check_positive("veto_threshold", veto_threshold)
    if threshold_low is not None and mode != "two_sided":
        raise UsageError(f"threshold_low only applies to mode='two_sided', got mode={mode!r}")
    c_high = float(threshold)
    c_low = float(threshold_low) if threshold_low is not None else 1.0 / c_high
    if mode == "two_sided" and not c_low < c_high:
        raise UsageError(f"threshold_low must be < threshold, got threshold_low={c_low} threshold={c_high}")

    with torch.no_grad():
        r, valid = _check_inputs(train_logp, rollout_logp, mask)
        validf = valid.to(torch.float64)  # (B, T)
        log_rho = level_fn(r, validf).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (B, T)
        rho = torch.exp(log_rho) * validf  # (B, T), 0 off-mask
        weights, truncated, masked = mode_fn(rho, c_low, c_high)
        weights = weights * validf
        truncated = truncated & valid
        masked = masked & valid

        has = valid.any(-1)  # (B,)
        if veto_threshold is not None:
            vetoed = ((r < math.log(veto_threshold)) & valid).any(-1)  # (B,)
            weights = weights * (~vetoed).to(torch.float64).unsqueeze(-1)  # (B, T)
        else:
            vetoed = torch.zeros_like(has)

        n_tok = validf.sum().clamp(min=1)
        n_seq = has.sum().clamp(min=1)
        one = torch.ones((), dtype=torch.float64, device=weights.device)
        norm = one
        if batch_normalize:
            if level == "token":
                batch_mean = weights.sum() / n_tok
            else:  # one weight per sequence: the mean over its tokens, then over sequences
                batch_mean = (weights.sum(-1) / validf.sum(-1).clamp(min=1)).sum() / n_seq
            norm = torch.where(batch_mean > BATCH_NORM_MIN, batch_mean, one)
            weights = weights / norm
        w_mean = weights.sum() / n_tok
        w2_mean = (weights * weights).sum() / n_tok
        zero = torch.zeros_like(w2_mean)
        ess = torch.where(w2_mean > 0, w_mean * w_mean / w2_mean.clamp(min=1e-300), zero)  # 0 if all w = 0
        inf = torch.tensor(float("inf"), dtype=torch.float64, device=rho.device)
        stats = torch.stack(
            [
                rho.sum() / n_tok,
                rho.max() if rho.numel() else zero,
                torch.cat([torch.where(valid, rho, inf).flatten(), inf[None]]).min(),
                ((rho > c_high) & valid).sum() / n_tok,
                ((rho < c_low) & valid).sum() / n_tok,
                w_mean,
                truncated.sum() / n_tok,
                masked.sum() / n_tok,
                truncated.any(-1).sum() / n_seq,
                masked.any(-1).sum() / n_seq,
                (vetoed & has).sum() / n_seq,
                norm,
                ess,
            ]
        ).tolist()  # one host sync
        if not valid.any():
            stats = [0.0] * len(stats)
        metrics = dict(zip(METRIC_KEYS, (float(x) for x in stats)))
        out_dtype = torch.promote_types(train_logp.dtype, torch.float32)
        return weights.to(out_dtype).detach(), metrics
