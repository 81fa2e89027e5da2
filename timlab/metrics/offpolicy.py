"""Scalar training-inference mismatch metrics: verl's off-policy set plus timlab's extras.

``offpolicy_metrics`` reproduces verl's ``compute_offpolicy_metrics``
(verl/trainer/ppo/rollout_corr_helper.py) key for key; ``mismatch_metrics`` adds the numbers other
stacks and the Beyond-Precision paper report (TRL, TorchTitan, slime, verl's probs-diff);
``all_metrics`` namespaces both (``rollout_corr/*``, ``mismatch/*``) and is what trainers log.

Notation: r = log pi - log mu per valid token (trainer minus rollout), w = exp(clamp(r, +-20)).

Where this departs from verl (all departures only touch cases where verl returns inf/NaN or
counts padding rows):
- Sequences with no valid token are left out of every per-sequence mean (verl's masked_mean
  gives them a mean log-prob of 0 and averages them in). If the whole batch has no valid token,
  every metric is 0.0 (``mismatch/num_tokens`` == 0 says why); verl asserts instead.
- ``k3_kl`` is computed on r clamped to [-SAFETY_BOUND, SAFETY_BOUND] (exp(rc) - rc - 1, which
  stays >= 0 like the true K3); verl does not clamp. Identical for |r| <= 20.
- Perplexity exponents (training/rollout ppl, ppl_ratio) are clamped at PPL_LOG_BOUND = 700 so
  float64 stays finite; verl would return inf there.
- Everything is computed in float64 under no_grad and returned as Python floats with one host
  sync (verl computes in the input dtype and calls .item() per key).
- A non-finite log-prob at a valid position raises ValueError (see ``_inputs``).

The Beyond-Precision paper (Eq. 7-8) defines log-ppl as a *sum* over tokens; verl uses per-token
means. Both are reported: ``rollout_corr/log_ppl_abs_diff`` (means) and
``mismatch/log_ppl_abs_diff_sum`` (sums; grows with length by construction).
"""

from __future__ import annotations

import torch

from timlab.errors import UsageError
from timlab.metrics._inputs import PPL_LOG_BOUND, SAFETY_BOUND, Prepared, check_inputs

VERL_KEYS = (
    "training_ppl",
    "training_log_ppl",
    "rollout_ppl",
    "rollout_log_ppl",
    "kl",
    "k3_kl",
    "log_ppl_diff",
    "log_ppl_abs_diff",
    "log_ppl_diff_max",
    "log_ppl_diff_min",
    "ppl_ratio",
    "chi2_token",
    "chi2_seq",
)
"""Keys of ``offpolicy_metrics``: verl's names, unprefixed (``all_metrics`` adds ``rollout_corr/``)."""

MISMATCH_KEYS = (
    "abs_diff_mean",
    "abs_diff_p99",
    "diff_mean",
    "probs_diff_mean",
    "probs_diff_max",
    "probs_diff_std",
    "frac_bitwise_equal",
    "max_abs_diff",
    "log_ppl_abs_diff_sum",
    "num_tokens",
    "frac_tokens_different",
    "ess",
    "ratio_var_across_micro_batches",
)
"""Keys of ``mismatch_metrics`` (``all_metrics`` adds ``mismatch/``)."""

DIFFERENT_TOKEN_TOL = 1e-6
"""|r| above this counts a token as different (TorchTitan's ``ratio_tokens_different``)."""


def _seq_mean(x: torch.Tensor, has: torch.Tensor, n_seq: torch.Tensor) -> torch.Tensor:
    """Mean of per-sequence values x (B,) over sequences with >= 1 valid token."""
    return torch.where(has, x, torch.zeros_like(x)).sum() / n_seq


def _verl_values(p: Prepared) -> dict[str, torch.Tensor]:
    n_b = p.validf.sum(-1)  # (B,) valid tokens per sequence
    has = n_b > 0  # (B,)
    n_seq = has.sum().clamp(min=1).to(torch.float64)
    n_tok = p.validf.sum().clamp(min=1)

    mean_lp = p.train.sum(-1) / n_b.clamp(min=1)  # (B,) mean_t log pi
    mean_lq = p.rollout.sum(-1) / n_b.clamp(min=1)  # (B,) mean_t log mu
    r = p.train - p.rollout  # (B, T), 0 off-mask
    rc = r.clamp(-SAFETY_BOUND, SAFETY_BOUND)

    log_ppl_diff = mean_lq - mean_lp  # (B,) = log(training_ppl_b / rollout_ppl_b)
    neg_inf = torch.full_like(log_ppl_diff, float("-inf"))
    seq_r_sum = r.sum(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (B,)

    return {
        "training_ppl": _seq_mean(torch.exp((-mean_lp).clamp(max=PPL_LOG_BOUND)), has, n_seq),
        "training_log_ppl": _seq_mean(-mean_lp, has, n_seq),
        "rollout_ppl": _seq_mean(torch.exp((-mean_lq).clamp(max=PPL_LOG_BOUND)), has, n_seq),
        "rollout_log_ppl": _seq_mean(-mean_lq, has, n_seq),
        "kl": (-r).sum() / n_tok,
        "k3_kl": ((torch.exp(rc) - rc - 1.0) * p.validf).sum() / n_tok,
        "log_ppl_diff": _seq_mean(log_ppl_diff, has, n_seq),
        "log_ppl_abs_diff": _seq_mean(log_ppl_diff.abs(), has, n_seq),
        "log_ppl_diff_max": torch.where(has, log_ppl_diff, neg_inf).max(),
        "log_ppl_diff_min": torch.where(has, log_ppl_diff, -neg_inf).min(),
        "ppl_ratio": _seq_mean(torch.exp(log_ppl_diff.clamp(max=PPL_LOG_BOUND)), has, n_seq),
        "chi2_token": (torch.exp(2.0 * rc) * p.validf).sum() / n_tok - 1.0,
        "chi2_seq": _seq_mean(torch.exp(2.0 * seq_r_sum), has, n_seq) - 1.0,
    }


def _quantile_of_valid(x: torch.Tensor, valid: torch.Tensor, q: float) -> torch.Tensor:
    """Linear-interpolated q-quantile (numpy's default) of x over valid entries.

    Uses two kthvalue calls instead of torch.quantile, which refuses inputs over 2**24 elements.
    """
    vals = x[valid]  # (N,)
    n = vals.numel()
    pos = q * (n - 1)
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    v_lo = torch.kthvalue(vals, lo + 1).values
    v_hi = torch.kthvalue(vals, hi + 1).values
    return v_lo + (pos - lo) * (v_hi - v_lo)


def _micro_batch_ratio_var(w: torch.Tensor, validf: torch.Tensor, num_micro_batches: int) -> torch.Tensor:
    """Population variance, across contiguous row chunks, of each chunk's mean token ratio.

    Rows are split like ``torch.tensor_split(B, num_micro_batches)``; chunks with no valid token
    are left out; one (non-empty) chunk gives 0.
    """
    B = w.shape[0]
    k = num_micro_batches
    sizes = [B // k + 1] * (B % k) + [B // k] * (k - B % k)
    sizes_t = torch.tensor(sizes, device=w.device)  # (k,)
    ids = torch.repeat_interleave(torch.arange(k, device=w.device), sizes_t)  # (B,) chunk of each row
    zeros = torch.zeros(k, dtype=torch.float64, device=w.device)
    chunk_sum = zeros.index_add(0, ids, (w * validf).sum(-1))  # (k,)
    chunk_n = zeros.index_add(0, ids, validf.sum(-1))  # (k,)
    nonempty = (chunk_n > 0).to(torch.float64)  # (k,)
    n_chunks = nonempty.sum().clamp(min=1)
    chunk_mean = chunk_sum / chunk_n.clamp(min=1)  # (k,)
    grand = (chunk_mean * nonempty).sum() / n_chunks
    return (((chunk_mean - grand) ** 2) * nonempty).sum() / n_chunks


def _extra_values(p: Prepared, num_micro_batches: int) -> dict[str, torch.Tensor]:
    n_b = p.validf.sum(-1)  # (B,)
    has = n_b > 0
    n_seq = has.sum().clamp(min=1).to(torch.float64)
    n_tok_raw = p.validf.sum()
    n_tok = n_tok_raw.clamp(min=1)

    r = p.train - p.rollout  # (B, T), 0 off-mask
    a = r.abs()
    w = torch.exp(r.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * p.validf  # (B, T) token ratios, 0 off-mask
    probs_diff = (
        torch.exp(p.train.clamp(max=PPL_LOG_BOUND)) - torch.exp(p.rollout.clamp(max=PPL_LOG_BOUND))
    ).abs() * p.validf  # (B, T)
    probs_mean = probs_diff.sum() / n_tok
    probs_var = (((probs_diff - probs_mean) ** 2) * p.validf).sum() / (n_tok_raw - 1).clamp(min=1)
    w_mean = w.sum() / n_tok
    w2_mean = (w * w).sum() / n_tok

    return {
        "abs_diff_mean": a.sum() / n_tok,
        "abs_diff_p99": _quantile_of_valid(a, p.valid, 0.99),
        "diff_mean": r.sum() / n_tok,
        "probs_diff_mean": probs_mean,
        "probs_diff_max": probs_diff.max(),
        "probs_diff_std": probs_var.sqrt(),
        "frac_bitwise_equal": ((p.train == p.rollout) & p.valid).sum() / n_tok,
        "max_abs_diff": a.max(),  # a >= 0 and 0 off-mask, so no masking needed
        "log_ppl_abs_diff_sum": _seq_mean(r.sum(-1).abs(), has, n_seq),
        "num_tokens": n_tok_raw,
        "frac_tokens_different": ((a > DIFFERENT_TOKEN_TOL) & p.valid).sum() / n_tok,
        "ess": w_mean * w_mean / w2_mean,
        "ratio_var_across_micro_batches": _micro_batch_ratio_var(w, p.validf, num_micro_batches),
    }


def _to_floats(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """All scalars to Python floats with a single device->host transfer."""
    stacked = torch.stack([v.to(torch.float64).reshape(()) for v in values.values()])  # (K,)
    return dict(zip(values.keys(), (float(x) for x in stacked.tolist())))


def _check_micro_batches(num_micro_batches: int) -> None:
    if not isinstance(num_micro_batches, int) or isinstance(num_micro_batches, bool) or num_micro_batches < 1:
        raise UsageError(f"num_micro_batches must be an int >= 1, got {num_micro_batches!r}")


def offpolicy_metrics(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """verl's off-policy diagnostics (keys in ``VERL_KEYS``), inputs (B, T).

    - ``training_ppl`` = mean_b exp(-mean_t log pi); ``training_log_ppl`` = mean_b(-mean_t log pi);
      ``rollout_ppl`` / ``rollout_log_ppl`` likewise with log mu.
    - ``kl`` = masked_mean(log mu - log pi); ``k3_kl`` = masked_mean(exp(r) - r - 1).
    - ``log_ppl_diff`` = mean_b(mean_t log mu - mean_t log pi); ``log_ppl_abs_diff`` = mean_b |.|;
      ``log_ppl_diff_max`` / ``_min`` over b; ``ppl_ratio`` = mean_b exp(log_ppl_diff_b).
    - ``chi2_token`` = masked_mean(exp(2 r)) - 1; ``chi2_seq`` = mean_b exp(2 sum_t r) - 1.
    """
    with torch.no_grad():
        p = check_inputs(train_logp, rollout_logp, mask)
        if not p.valid.any():
            return {k: 0.0 for k in VERL_KEYS}
        return _to_floats(_verl_values(p))


def mismatch_metrics(
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_micro_batches: int = 1,
) -> dict[str, float]:
    """timlab's extra mismatch numbers (keys in ``MISMATCH_KEYS``), inputs (B, T).

    - ``abs_diff_mean`` / ``max_abs_diff`` / ``abs_diff_p99``: mean, max, 99th percentile (linear
      interpolation) of |r| over valid tokens.
    - ``diff_mean``: mean r (TorchTitan ``logprob_diff/mean``).
    - ``probs_diff_mean`` / ``_max`` / ``_std``: |exp(log pi) - exp(log mu)| (verl's
      ``training/rollout_probs_diff_*``; std is Bessel-corrected like torch.std, 0 for one token).
    - ``frac_bitwise_equal``: share of valid tokens whose two log-probs are the same value.
    - ``log_ppl_abs_diff_sum``: mean_b |sum_t log pi - sum_t log mu| (Beyond-Precision Eq. 8).
    - ``num_tokens``: number of valid tokens.
    - ``frac_tokens_different``: share with |r| > 1e-6 (TorchTitan ``ratio_tokens_different``).
    - ``ess``: 1 / mean((w / mean w)^2) over valid tokens, in (0, 1].
    - ``ratio_var_across_micro_batches``: rows split into ``num_micro_batches`` contiguous
      chunks; population variance of the chunk means of w (0.0 for one chunk).
    """
    _check_micro_batches(num_micro_batches)
    with torch.no_grad():
        p = check_inputs(train_logp, rollout_logp, mask)
        if not p.valid.any():
            return {k: 0.0 for k in MISMATCH_KEYS}
        return _to_floats(_extra_values(p, num_micro_batches))


def all_metrics(
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_micro_batches: int = 1,
) -> dict[str, float]:
    """Both sets, namespaced: ``rollout_corr/<VERL_KEYS>`` and ``mismatch/<MISMATCH_KEYS>``."""
    _check_micro_batches(num_micro_batches)
    with torch.no_grad():
        p = check_inputs(train_logp, rollout_logp, mask)
        if not p.valid.any():
            values = {f"rollout_corr/{k}": 0.0 for k in VERL_KEYS}
            values.update({f"mismatch/{k}": 0.0 for k in MISMATCH_KEYS})
            return values
        tensors = {f"rollout_corr/{k}": v for k, v in _verl_values(p).items()}
        tensors.update({f"mismatch/{k}": v for k, v in _extra_values(p, num_micro_batches).items()})
        return _to_floats(tensors)
