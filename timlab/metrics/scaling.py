"""Is the mismatch noise or bias? How the sequence-level log-ratio grows with response length.

If the per-token log-ratios r_t = log pi - log mu are independent zero-mean noise, the
sequence-level sum S(T) = sum_{t<=T} r_t grows like sqrt(T); if they share a systematic offset b,
it grows like b T. (A proposal in tunix's issue tracker; the same reasoning is behind "sequence-level
IS breaks down once T * KL approaches the clamp".) IS can average noise out; a bias that grows
like T means the two engines compute different things.

``length_scaling`` measures it on prefixes: for prefix lengths t on a fixed, roughly
sqrt(2)-spaced grid (1, 2, 3, 4, 6, 8, 11, 16, ...), over the sequences with at least t valid
tokens, the root mean square of S(t) and the mean of A(t) = sum_{s<=t} |r_s|. The growth exponents
are the least-squares slopes of log RMS S and log mean A against log t; their intervals are the
2.5-97.5% percentiles over bootstrap resamples of the sequences (prefixes of one sequence move
together, so sequences are the unit). With noise sigma and bias b, E S(t)^2 = t sigma^2 + t^2 b^2:
the exponent is 0.5 while t << (sigma / b)^2 and 1 beyond. Each length weighs in the fit by the
number of sequences that reach it (the RMS at a length few sequences reach is noisy). A(t) grows like t for any stationary
mismatch; an exponent above 1 says |r| itself grows along the response.

Reading of the S exponent's interval against ``NOISE_BIAS_CUT`` = 0.75 (halfway): entirely below,
"noise-like (T^0.5)"; entirely above, "bias-like (T^1)"; across it, neither can be told apart.

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


def length_scaling_sums(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-sequence prefix sums at the grid lengths, inputs (B, T): ``sum`` and ``abs_sum`` (B, G)
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
            return {"sum": empty, "abs_sum": empty.clone()}
        s = rc.cumsum(-1)[:, cols]  # (B, G)
        a = rc.abs().cumsum(-1)[:, cols]  # (B, G)
        short = grid[None, :] > n[:, None]  # (B, G)
        nan = torch.tensor(float("nan"), dtype=torch.float64, device=r.device)
        return {"sum": torch.where(short, nan, s), "abs_sum": torch.where(short, nan, a)}


def merge_length_scaling_sums(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rows of two batches together (the narrower one padded with NaN)."""
    out = {}
    for k in ("sum", "abs_sum"):
        x, y = a[k], b[k]
        G = max(x.shape[1], y.shape[1])
        pad = lambda t: torch.nn.functional.pad(t, (0, G - t.shape[1]), value=float("nan"))  # noqa: E731
        out[k] = torch.cat([pad(x), pad(y.to(x.device))])
    return out


def _slopes(counts: torch.Tensor, s2: torch.Tensor, a: torch.Tensor, reach: torch.Tensor,
            log_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Least-squares slopes per resample. counts (K, B) sequence multiplicities; s2, a, reach (B, G)
    with 0 where a sequence is too short; log_t (G,). Returns two (K,) tensors (NaN: < 2 points)."""
    n = counts @ reach  # (K, G) sequences reaching each length
    rms = ((counts @ s2) / n.clamp(min=1)).sqrt()  # (K, G)
    mean_a = (counts @ a) / n.clamp(min=1)  # (K, G)
    out = []
    for y in (rms, mean_a):
        use = (n >= MIN_SEQS) & (y > 0)  # (K, G)
        w = use.to(torch.float64) * n  # weighted by the sequences behind each point
        ly = torch.where(use, y.clamp(min=1e-300).log(), torch.zeros_like(y))
        m = use.sum(-1)  # (K,) points in the fit
        wsum = w.sum(-1).clamp(min=1e-300)
        xbar = (w * log_t).sum(-1) / wsum
        ybar = (w * ly).sum(-1) / wsum
        dx = log_t[None, :] - xbar[:, None]  # (K, G)
        var = (w * dx * dx).sum(-1)
        slope = (w * dx * (ly - ybar[:, None])).sum(-1) / var.clamp(min=1e-300)
        out.append(torch.where((m >= 2) & (var > 0), slope, torch.full_like(slope, float("nan"))))
    return out[0], out[1]


def reading(exponent_lo: float, exponent_hi: float) -> str:
    """The one-line reading of the S exponent's interval (see the module docstring)."""
    if math.isnan(exponent_lo) or math.isnan(exponent_hi):
        return READINGS[4]
    if exponent_hi < NOISE_BIAS_CUT:
        return READINGS[1]
    if exponent_lo > NOISE_BIAS_CUT:
        return READINGS[2]
    return READINGS[3]


def length_scaling_from_sums(sums: dict[str, torch.Tensor], *, n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0) -> dict:
    """The growth exponents, their bootstrap intervals, the reading and the per-length curve.

    Keys: ``sum_exponent`` (+ ``_lo``, ``_hi``): of the RMS of sum_t r; ``abs_sum_exponent``
    (+ ``_lo``, ``_hi``): of the mean of sum_t |r|; ``reading``; ``num_seqs``; ``lengths``,
    ``rms_sum``, ``mean_abs_sum``, ``seqs_at_length``: the curve at the grid lengths that at least
    ``MIN_SEQS`` sequences reach. Exponents are NaN when fewer than two lengths qualify.
    """
    if not isinstance(n_boot, int) or n_boot < 1:
        raise UsageError(f"n_boot must be an int >= 1, got {n_boot!r}")
    with torch.no_grad():
        s, a = sums["sum"].to(torch.float64), sums["abs_sum"].to(torch.float64)  # (B, G)
        reach_b = ~torch.isnan(s)  # (B, G)
        keep = reach_b.any(-1)  # sequences with a valid token
        s, a, reach_b = s[keep], a[keep], reach_b[keep]
        B, G = s.shape
        lengths = torch.tensor(GRID[:G], dtype=torch.float64)
        reach = reach_b.to(torch.float64)
        s2 = torch.where(reach_b, s * s, torch.zeros_like(s))
        a0 = torch.where(reach_b, a, torch.zeros_like(a))
        log_t = lengths.log()
        full = torch.ones(1, B, dtype=torch.float64)
        k_s, k_a = _slopes(full, s2, a0, reach, log_t)
        g = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, max(B, 1), (n_boot, B), generator=g)  # (K, B)
        ones = torch.ones(n_boot, B, dtype=torch.float64)
        counts = torch.zeros(n_boot, B, dtype=torch.float64).scatter_add_(1, idx[:, :B], ones)  # (K, B) multiplicities
        b_s, b_a = _slopes(counts, s2, a0, reach, log_t)

        def interval(x: torch.Tensor) -> tuple[float, float]:
            x = x[~torch.isnan(x)]
            if x.numel() == 0:
                return float("nan"), float("nan")
            q = torch.quantile(x, torch.tensor([0.025, 0.975], dtype=torch.float64))
            return float(q[0]), float(q[1])

        n = reach.sum(0)  # (G,)
        rms = (s2.sum(0) / n.clamp(min=1)).sqrt()
        mean_a = a0.sum(0) / n.clamp(min=1)
        shown = n >= MIN_SEQS
        s_lo, s_hi = interval(b_s)
        a_lo, a_hi = interval(b_a)
        nothing = B > 0 and bool((a0 == 0).all())
        return {
            "sum_exponent": float(k_s[0]), "sum_exponent_lo": s_lo, "sum_exponent_hi": s_hi,
            "abs_sum_exponent": float(k_a[0]), "abs_sum_exponent_lo": a_lo, "abs_sum_exponent_hi": a_hi,
            "reading": READINGS[0] if nothing else reading(s_lo, s_hi),
            "num_seqs": B,
            "lengths": [int(x) for x in lengths[shown].tolist()],
            "rms_sum": rms[shown].tolist(),
            "mean_abs_sum": mean_a[shown].tolist(),
            "seqs_at_length": [int(x) for x in n[shown].tolist()],
        }


def length_scaling(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, *,
                   n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0) -> dict:
    """Noise vs bias: growth exponents of sum_t r and of sum_t |r| with the prefix length, with
    bootstrap intervals (``seed`` fixes them) and a one-line ``reading``. Inputs (B, T); see
    ``length_scaling_from_sums`` for the keys."""
    return length_scaling_from_sums(length_scaling_sums(train_logp, rollout_logp, mask), n_boot=n_boot, seed=seed)


def format_length_scaling(res: dict) -> str:
    """One line: the reading and both exponents with their intervals."""
    def f(k: str) -> str:
        x, lo, hi = res[k], res[f"{k}_lo"], res[f"{k}_hi"]
        return "n/a" if math.isnan(x) else f"{x:.2f} [{lo:.2f}, {hi:.2f}]"

    return (f"{res['reading']}: |sum_t r| grows as T^{f('sum_exponent')}, sum_t |r| as T^{f('abs_sum_exponent')} "
            f"({res['num_seqs']} sequences, lengths {res['lengths'][0] if res['lengths'] else 0}-"
            f"{res['lengths'][-1] if res['lengths'] else 0})")
