"""Is the mismatch noise or bias? How the sequence-level log-ratio grows with response length.

If the per-token log-ratios r_t = log pi - log mu are independent zero-mean noise, the
sequence-level sum S(T) = sum_{t<=T} r_t grows like sqrt(T); if they share a systematic offset b,
it grows like b T. (A proposal in tunix's issue tracker; the same reasoning is behind "sequence-level
IS breaks down once T * KL approaches the clamp".) IS can average noise out; a bias that grows
like T means the two engines compute different things.

``length_scaling`` measures it on prefixes: for prefix lengths t on a fixed, roughly
sqrt(2)-spaced grid (1, 2, 3, 4, 6, 8, 11, 16, ...), over the sequences with at least t valid
tokens, the root mean square of S(t), the mean of A(t) = sum_{s<=t} |r_s| and the root mean of
Q(t) = sum_{s<=t} r_s^2. The growth exponents are least-squares slopes against log t (each length
weighs by the number of sequences that reach it; the RMS at a length few sequences reach is
noisy), with 2.5-97.5% percentile intervals over bootstrap resamples of the sequences (prefixes of
one sequence move together, so sequences are the unit).

- ``sum_exponent``: of RMS S. With stationary noise sigma and bias b, E S(t)^2 = t sigma^2 + t^2 b^2:
  0.5 while t << (sigma / b)^2, 1 beyond.
- ``abs_sum_exponent``: of mean A. 1 for any stationary mismatch; below 1 when |r| shrinks along
  the response (as it does on real tasks: later tokens are more certain), above 1 when it grows.
- ``normalized_exponent`` = 0.5 + the slope of log(RMS S / RMS Q), a variance ratio: for
  independent zero-mean r_t, E S^2 = E Q at every t however the noise varies along the response,
  so it reads 0.5; for a bias, S^2 grows like t Q and it reads 1. Under stationarity it equals
  ``sum_exponent``; unlike it, it is not pulled down when |r| shrinks with position.

The reading uses the normalized exponent's interval against ``NOISE_BIAS_CUT`` = 0.75 (halfway):
entirely below, "noise-like (T^0.5)"; entirely above, "bias-like (T^1)"; across it, not resolved.

Note that tokens sampled from mu have E_mu[r_t] = -KL(mu || pi) < 0: every mismatch has a bias of
size KL per token. Noise-like means that bias is small against the noise over the lengths seen
(KL << sigma^2 / T), which holds for small mismatches: for zero-mean logit noise of std s, the KL
is about s^2 / 2 per token and sigma about s, so the noise dominates until T ~ 4 / s^2.

The statistics stream: ``length_scaling_sums`` per batch, ``merge_length_scaling_sums``, then
``length_scaling_from_sums`` (what ``timlab analyze`` does). Pure torch.
"""

from __future__ import annotations

import math

import torch

from timlab.errors import UsageError
from timlab.metrics._inputs import check_inputs

NOISE_BIAS_CUT = 0.75
"""Exponent halfway between iid noise (0.5) and a systematic bias (1.0)."""

DEFAULT_BOOTSTRAP = 200
"""Bootstrap resamples for the exponents' intervals."""

MIN_SEQS = 4
"""A prefix length enters the fit only if at least this many sequences reach it; each length
weighs in proportion to the sequences that reach it."""

GRID = tuple(sorted({int(round(2 ** (k / 2))) for k in range(0, 61)}))
"""Prefix lengths: 1, 2, 3, 4, 6, 8, 11, 16, 23, 32, 45, 64, ... (about sqrt(2) apart, up to 2^30)."""

READINGS = ("no mismatch (r = 0 on every token)", "noise-like (T^0.5)", "bias-like (T^1)",
            "between noise (T^0.5) and bias (T^1): not resolved", "too short to tell (needs 2+ prefix lengths)")


SUM_KEYS = ("sum", "abs_sum", "sq_sum")
"""Per-sequence prefix sums of r, |r| and r^2 that ``length_scaling_sums`` returns."""


def length_scaling_sums(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-sequence prefix sums at the grid lengths, inputs (B, T): ``SUM_KEYS``, each (B, G)
    float64, NaN where a sequence is shorter than the grid length; G covers the batch's longest."""
    with torch.no_grad():
        p = check_inputs(train_logp, rollout_logp, mask)
        r = p.train - p.rollout  # (B, T), 0 off-mask
        order = torch.sort((~p.valid).to(torch.int8), dim=-1, stable=True).indices  # valid positions first, in order
        rc = r.gather(-1, order)  # (B, T) compacted: valid tokens left-aligned
        n = p.valid.sum(-1)  # (B,)
        T = r.shape[-1]
        grid = torch.tensor([t for t in GRID if t <= max(T, 1)], device=r.device)  # (G,)
        cols = (grid - 1).clamp(max=max(T - 1, 0))  # (G,)
        if T == 0:
            empty = torch.full((r.shape[0], len(grid)), float("nan"), dtype=torch.float64, device=r.device)
            return {k: empty.clone() for k in SUM_KEYS}
        short = grid[None, :] > n[:, None]  # (B, G)
        nan = torch.tensor(float("nan"), dtype=torch.float64, device=r.device)
        prefix = {"sum": rc, "abs_sum": rc.abs(), "sq_sum": rc * rc}
        return {k: torch.where(short, nan, x.cumsum(-1)[:, cols]) for k, x in prefix.items()}  # (B, G) each


def merge_length_scaling_sums(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rows of two batches together (the narrower one padded with NaN)."""
    out = {}
    for k in SUM_KEYS:
        x, y = a[k], b[k]
        G = max(x.shape[1], y.shape[1])
        pad = lambda t: torch.nn.functional.pad(t, (0, G - t.shape[1]), value=float("nan"))  # noqa: E731
        out[k] = torch.cat([pad(x), pad(y.to(x.device))])
    return out


def _slopes(counts: torch.Tensor, s2: torch.Tensor, a: torch.Tensor, q: torch.Tensor, reach: torch.Tensor,
            log_t: torch.Tensor) -> dict[str, torch.Tensor]:
    """Least-squares exponents per resample. counts (K, B) sequence multiplicities; s2 = S^2, a = A,
    q = Q, reach (B, G) with 0 where a sequence is too short; log_t (G,). Returns (K,) tensors
    (NaN: fewer than 2 lengths)."""
    n = counts @ reach  # (K, G) sequences reaching each length
    mean = lambda x: (counts @ x) / n.clamp(min=1)  # noqa: E731  (K, G)
    rms_s, mean_a, rms_q = mean(s2).sqrt(), mean(a), mean(q).sqrt()
    series = {"sum_exponent": (rms_s, rms_s > 0), "abs_sum_exponent": (mean_a, mean_a > 0),
              "normalized_exponent": (rms_s / rms_q.clamp(min=1e-300), (rms_s > 0) & (rms_q > 0))}
    out = {}
    for key, (y, positive) in series.items():
        use = (n >= MIN_SEQS) & positive  # (K, G)
        w = use.to(torch.float64) * n  # weighted by the sequences behind each point
        ly = torch.where(use, y.clamp(min=1e-300).log(), torch.zeros_like(y))
        wsum = w.sum(-1).clamp(min=1e-300)
        xbar = (w * log_t).sum(-1) / wsum
        ybar = (w * ly).sum(-1) / wsum
        dx = log_t[None, :] - xbar[:, None]  # (K, G)
        var = (w * dx * dx).sum(-1)
        slope = (w * dx * (ly - ybar[:, None])).sum(-1) / var.clamp(min=1e-300)
        slope = torch.where((use.sum(-1) >= 2) & (var > 0), slope, torch.full_like(slope, float("nan")))
        out[key] = slope + 0.5 if key == "normalized_exponent" else slope
    return out


def reading(exponent_lo: float, exponent_hi: float) -> str:
    """The one-line reading of the normalized exponent's interval (see the module docstring)."""
    if math.isnan(exponent_lo) or math.isnan(exponent_hi):
        return READINGS[4]
    if exponent_hi < NOISE_BIAS_CUT:
        return READINGS[1]
    if exponent_lo > NOISE_BIAS_CUT:
        return READINGS[2]
    return READINGS[3]


def length_scaling_from_sums(sums: dict[str, torch.Tensor], *, n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0) -> dict:
    """The growth exponents, their bootstrap intervals, the reading and the per-length curve.

    Keys: ``sum_exponent``, ``abs_sum_exponent``, ``normalized_exponent`` (each + ``_lo``,
    ``_hi``; see the module docstring); ``reading``; ``num_seqs``; ``lengths``, ``rms_sum``,
    ``mean_abs_sum``, ``rms_sq_sum``, ``seqs_at_length``: the curve at the grid lengths that at
    least ``MIN_SEQS`` sequences reach. Exponents are NaN when fewer than two lengths qualify.
    """
    if not isinstance(n_boot, int) or n_boot < 1:
        raise UsageError(f"n_boot must be an int >= 1, got {n_boot!r}")
    with torch.no_grad():
        s, a, q = (sums[k].to(torch.float64).cpu() for k in SUM_KEYS)  # (B, G) each
        reach_b = ~torch.isnan(s)  # (B, G)
        keep = reach_b.any(-1)  # sequences with a valid token
        s, a, q, reach_b = s[keep], a[keep], q[keep], reach_b[keep]
        B, G = s.shape
        lengths = torch.tensor(GRID[:G], dtype=torch.float64)
        reach = reach_b.to(torch.float64)
        zero = torch.zeros_like(s)
        s2, a0, q0 = torch.where(reach_b, s * s, zero), torch.where(reach_b, a, zero), torch.where(reach_b, q, zero)
        log_t = lengths.log()
        point = _slopes(torch.ones(1, B, dtype=torch.float64), s2, a0, q0, reach, log_t)
        g = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, max(B, 1), (n_boot, B), generator=g)  # (K, B)
        ones = torch.ones(n_boot, B, dtype=torch.float64)
        counts = torch.zeros(n_boot, B, dtype=torch.float64).scatter_add_(1, idx, ones)  # (K, B) multiplicities
        boot = _slopes(counts, s2, a0, q0, reach, log_t)

        out: dict = {}
        for key, x in boot.items():
            x = x[~torch.isnan(x)]
            lo = hi = float("nan")
            if x.numel():
                qs = torch.quantile(x, torch.tensor([0.025, 0.975], dtype=torch.float64))
                lo, hi = float(qs[0]), float(qs[1])
            out.update({key: float(point[key][0]), f"{key}_lo": lo, f"{key}_hi": hi})
        n = reach.sum(0)  # (G,)
        shown = n >= MIN_SEQS
        nothing = B > 0 and bool((a0 == 0).all())
        out["reading"] = READINGS[0] if nothing else reading(out["normalized_exponent_lo"], out["normalized_exponent_hi"])
        out.update({
            "num_seqs": B,
            "lengths": [int(x) for x in lengths[shown].tolist()],
            "rms_sum": (s2.sum(0) / n.clamp(min=1)).sqrt()[shown].tolist(),
            "mean_abs_sum": (a0.sum(0) / n.clamp(min=1))[shown].tolist(),
            "rms_sq_sum": (q0.sum(0) / n.clamp(min=1)).sqrt()[shown].tolist(),
            "seqs_at_length": [int(x) for x in n[shown].tolist()],
        })
        return out


def length_scaling(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, *,
                   n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0) -> dict:
    """Noise vs bias: growth exponents of sum_t r and of sum_t |r| with the prefix length, with
    bootstrap intervals (``seed`` fixes them) and a one-line ``reading``. Inputs (B, T); see
    ``length_scaling_from_sums`` for the keys."""
    return length_scaling_from_sums(length_scaling_sums(train_logp, rollout_logp, mask), n_boot=n_boot, seed=seed)


def format_length_scaling(res: dict) -> str:
    """One line: the reading and the three exponents with their intervals (only the reading when
    no exponent could be fitted), then how many sequences and which prefix lengths it used."""
    def f(k: str, power: str = "") -> str:
        x, lo, hi = res[k], res[f"{k}_lo"], res[f"{k}_hi"]
        return "n/a" if math.isnan(x) else f"{power}{x:.2f} [{lo:.2f}, {hi:.2f}]"

    n, lengths = res["num_seqs"], res["lengths"]
    used = f"{n} sequence{'' if n == 1 else 's'}" + (f", lengths {lengths[0]}-{lengths[-1]}" if lengths else "")
    keys = ("normalized_exponent", "sum_exponent", "abs_sum_exponent")
    if all(math.isnan(res[k]) for k in keys):
        return f"{res['reading']} ({used})"
    return (f"{res['reading']}: normalized exponent {f(keys[0])}; |sum_t r| grows as {f(keys[1], 'T^')}, "
            f"sum_t |r| as {f(keys[2], 'T^')} ({used})")
