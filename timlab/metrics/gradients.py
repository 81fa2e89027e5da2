"""Gradient statistics for TIM: bias, cosine and signal-to-noise from paired micro-batch means.

The input is K pairs of gradient estimates (x_j, y_j), each the mean over one micro-batch of m
sequences: x_j from rollouts of the trainer's policy pi (the on-policy gradient), y_j from
rollouts of the mismatched sampler mu, both with pi's score function (Beyond Precision Eq. 2
and 3). Pairs share prompts and random numbers (common random numbers), so d_j = y_j - x_j has
a far smaller variance than two independent estimates would, and with no mismatch d_j is
exactly zero. Everything is computed from K x K Gram matrices, so a bootstrap over
micro-batches costs O(R K^2) and never touches the D-dimensional vectors again.

Noise-corrected ("debiased") estimates: a squared norm of a sample mean overestimates the
squared norm of its expectation by tr(Cov)/K, so ||g||^2 is estimated as ||mean||^2 - tr/K
(McCandlish et al. 2018 use the same correction for the gradient noise scale). The plug-in
values are reported next to them, and so is the noise floor: the relative bias that sampling
noise alone would show at this sample size.

Strata: micro-batches may come from different prompt strata (response-length buckets). The
pooled estimate is then the equal-weight mean over strata, its variance the sum of the
within-stratum variances, and the bootstrap resamples within each stratum.

Definitions (per stratum, or pooled):
- ``rel_bias`` = ||E y - E x|| / ||E x||, debiased, clamped at 0;
- ``cosine`` = <E y, E x> / (||E y|| ||E x||), each term noise-corrected (clamped to [-1, 1];
  NaN unless both norms' intervals exclude 0); ``cosine_plugin`` is the plain cosine of the
  two means, which noise pulls toward 0;
- ``snr_*`` = ||E g||^2 / tr Cov(one sequence's gradient) = ||E g||^2 / (m tr Cov(x_j)): the
  signal-to-noise ratio of a single sequence; a batch of N sequences has N times this.
Pure torch; imports nothing from timlab.
"""

from __future__ import annotations

import math

import torch

from timlab.errors import UsageError

GRAM_BUDGET_BYTES = 256 << 20
"""Float64 temporaries allowed while forming Gram matrices: columns are processed in chunks of
``GRAM_BUDGET_BYTES / (24 K)`` (three K x chunk float64 blocks), whatever the number of parameters."""


def _chunk(K: int, chunk: int | None) -> int:
    return chunk if chunk is not None else max(256, GRAM_BUDGET_BYTES // (24 * max(K, 1)))


def gram(X: torch.Tensor, Y: torch.Tensor | None = None, *, chunk: int | None = None) -> torch.Tensor:
    """X Y^T in float64, (K, D) x (K', D) -> (K, K'), accumulated over column chunks."""
    Y = X if Y is None else Y
    if X.dim() != 2 or Y.dim() != 2 or X.shape[1] != Y.shape[1]:
        raise UsageError(f"gram: expected (K, D) and (K', D) matrices, got {tuple(X.shape)} and {tuple(Y.shape)}")
    out = torch.zeros(X.shape[0], Y.shape[0], dtype=torch.float64, device=X.device)
    chunk = _chunk(X.shape[0] + Y.shape[0], chunk)
    for s in range(0, X.shape[1], chunk):
        out += X[:, s : s + chunk].double() @ Y[:, s : s + chunk].double().T
    return out


def pair_grams(X: torch.Tensor, Y: torch.Tensor, *, chunk: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(X X^T, Y Y^T, D D^T, X Y^T) in float64 with D = Y - X, in one pass over column chunks.

    D is formed in float64 from X and Y themselves, so identical rows give exact zeros and a
    small difference is not lost to cancellation in ||x||^2 + ||y||^2 - 2 <x, y>.
    """
    if X.shape != Y.shape or X.dim() != 2:
        raise UsageError(f"pair_grams: expected two (K, D) matrices of one shape, got {tuple(X.shape)} and {tuple(Y.shape)}")
    K = X.shape[0]
    gxx, gyy, gdd, gxy = (torch.zeros(K, K, dtype=torch.float64, device=X.device) for _ in range(4))
    chunk = _chunk(K, chunk)
    for s in range(0, X.shape[1], chunk):
        x, y = X[:, s : s + chunk].double(), Y[:, s : s + chunk].double()
        d = y - x
        gxx += x @ x.T
        gyy += y @ y.T
        gdd += d @ d.T
        gxy += x @ y.T
    return gxx, gyy, gdd, gxy


def tv_distance(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """Total-variation distance 0.5 * sum_a |p(a) - q(a)| between softmax(logits) rows.

    logits_p, logits_q: (..., V) -> (...,) in [0, 1], computed in float64.
    """
    if logits_p.shape != logits_q.shape:
        raise UsageError(f"tv_distance: shapes differ, {tuple(logits_p.shape)} vs {tuple(logits_q.shape)}")
    p = torch.softmax(logits_p.double(), dim=-1)
    q = torch.softmax(logits_q.double(), dim=-1)
    return 0.5 * (p - q).abs().sum(-1)


def _quad(W: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Row-wise w^T G w for W (R, K), G (K, K) -> (R,)."""
    return ((W @ G) * W).sum(-1)


def _moments(W: torch.Tensor, G: torch.Tensor, strata: list[torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For count vectors W (R, K) over micro-batches and the Gram G of a pair of vector sets:

    - plug: <mean, mean'> of the stratified mean (strata weighed equally);
    - unbiased: the same with each within-stratum block's diagonal (i == j) left out, i.e. a
      U-statistic; for W = 1 it equals plug - var exactly, and in the bootstrap it never pairs
      a micro-batch with itself, so its spread is not inflated by repeated draws;
    - var: the trace of the covariance of the stratified mean;
    - within: the mean over strata of the within-stratum covariance trace of one micro-batch.
    All (R,).
    """
    n = len(strata)
    a = torch.zeros_like(W)
    for idx in strata:
        a[:, idx] = W[:, idx] / (n * len(idx))
    plug = _quad(a, G)
    unbiased = plug.clone()
    var = torch.zeros_like(plug)
    within = torch.zeros_like(plug)
    for idx in strata:
        Kb = len(idx)
        Wb, Gb = W[:, idx], G[idx][:, idx]
        diag = torch.diagonal(Gb)
        quad_b = _quad(Wb, Gb)
        U_b = (quad_b - (Wb * Wb * diag).sum(-1)) / (Kb**2 - (Wb * Wb).sum(-1))  # mean over pairs i != j
        unbiased = unbiased + (U_b - quad_b / Kb**2) / n**2
        tr_b = (Wb * diag).sum(-1) / Kb - U_b  # E||x||^2 - ||E x||^2
        var = var + tr_b / (n**2 * Kb)
        within = within + tr_b / n
    return plug, unbiased, var, within


def _stats(W: torch.Tensor, gxx, gyy, gdd, gxy, strata, micro_batch: int, gzz=None) -> dict[str, torch.Tensor]:
    """Every statistic for each row of count weights W (R, K), with the norm-type ones SQUARED.

    Noise-corrected squares (U-statistics) may come out negative; they stay signed here.
    """
    # m*: plug-in squared norms / inner product of the means; g2x, g2y, b2, gxy_: noise-corrected
    mx, g2x, _, tx = _moments(W, gxx, strata)
    my, g2y, _, ty = _moments(W, gyy, strata)
    md, b2, vd, _ = _moments(W, gdd, strata)
    mxy, gxy_, _, _ = _moments(W, 0.5 * (gxy + gxy.T), strata)  # <mean x, mean y>
    tx, ty = micro_batch * tx, micro_batch * ty  # per-sequence covariance traces
    nan = torch.full_like(mx, float("nan"))

    def ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
        return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), nan)

    out = {}
    if gzz is not None:  # importance-weighted paired differences z = (1 - rho) w s on mu's samples
        _, uz, vz, _ = _moments(W, gzz, strata)
        out = {"bias_norm_is": uz, "rel_bias_is": ratio(uz, g2x), "noise_floor_rel_is": ratio(vz.clamp(min=0), g2x)}
    return out | {
        "grad_norm_exact": g2x,
        "grad_norm_tim": g2y,
        "bias_norm": b2,
        "bias_norm_plugin": md,
        "noise_floor_norm": vd,
        "rel_bias": ratio(b2, g2x),
        "rel_bias_plugin": ratio(md, mx),
        "noise_floor_rel": ratio(vd, g2x),
        "cosine": torch.where((g2x > 0) & (g2y > 0), ratio(gxy_, (g2x.clamp(min=0) * g2y.clamp(min=0)).sqrt()), nan),
        "cosine_plugin": ratio(mxy, (mx * my).clamp(min=0).sqrt()),
        "snr_exact": ratio(g2x, tx),
        "snr_tim": ratio(g2y, ty),
    }


SQUARED = ("grad_norm_exact", "grad_norm_tim", "bias_norm", "bias_norm_plugin", "noise_floor_norm", "rel_bias",
           "rel_bias_plugin", "noise_floor_rel", "bias_norm_is", "rel_bias_is", "noise_floor_rel_is")
"""Statistics computed as squares (intervals are formed there) and reported as square roots."""

NONNEGATIVE = ("grad_norm_exact", "grad_norm_tim", "bias_norm", "rel_bias", "snr_exact", "snr_tim", "bias_norm_is",
               "rel_bias_is")
"""Noise-corrected statistics whose true value is >= 0: reported (and their bounds) clamped at 0."""

STAT_KEYS: tuple[str, ...] = (
    "grad_norm_exact", "grad_norm_tim", "bias_norm", "rel_bias", "cosine", "snr_exact", "snr_tim",
)  # fmt: skip
"""The noise-corrected statistics ``gradient_stats`` returns, each with ``_lo`` / ``_hi`` bounds."""

IS_KEYS: tuple[str, ...] = ("bias_norm_is", "rel_bias_is")
"""With ``gzz``: the bias estimated from mu's samples alone by importance weighting, with bounds."""

PLUGIN_KEYS: tuple[str, ...] = ("bias_norm_plugin", "rel_bias_plugin", "cosine_plugin", "noise_floor_norm", "noise_floor_rel")
"""Plug-in values and noise floors (plus ``noise_floor_rel_is`` with ``gzz``), returned as points
only: a plug-in statistic is biased by the very noise the bootstrap adds again, so no bootstrap
interval of it covers anything useful."""

MIN_MICRO_BATCHES = 8
"""Fewest micro-batches per stratum for which a bootstrap confidence interval is given."""


def gradient_stats(
    gxx: torch.Tensor,
    gyy: torch.Tensor,
    gdd: torch.Tensor,
    gxy: torch.Tensor,
    *,
    micro_batch: int,
    strata: torch.Tensor | None = None,
    n_boot: int = 1000,
    ci: float = 0.95,
    seed: int = 0,
    gzz: torch.Tensor | None = None,
) -> dict[str, float]:
    """Bias / cosine / SNR with basic-bootstrap confidence intervals (over micro-batches).

    gxx = X X^T (exact), gyy = Y Y^T (mismatched), gdd = D D^T with D = Y - X (formed from D
    itself, so a zero mismatch gives exact zeros), gxy = X Y^T; all (K, K). ``micro_batch``: m,
    sequences per micro-batch. ``strata`` (K,) long: the stratum of each micro-batch (None: one).
    Returns each key of ``STAT_KEYS`` with ``<key>_lo`` / ``<key>_hi``, and each of ``PLUGIN_KEYS``,
    as floats. ``gzz`` (optional, (K, K)): the Gram of a third set of micro-batch means whose
    expectation IS the bias (importance-weighted differences); adds ``IS_KEYS`` (with bounds)
    and ``noise_floor_rel_is``.
    """
    K = gxx.shape[0]
    for name, g in (("gxx", gxx), ("gyy", gyy), ("gdd", gdd), ("gxy", gxy)):
        if g.shape != (K, K):
            raise UsageError(f"gradient_stats: {name} must be ({K}, {K}), got {tuple(g.shape)}")
    if micro_batch < 1:
        raise UsageError(f"micro_batch must be >= 1, got {micro_batch}")
    if not 0 < ci < 1:
        raise UsageError(f"ci must be in (0, 1), got {ci}")
    labels = torch.zeros(K, dtype=torch.long) if strata is None else strata.long().cpu()
    groups = [torch.nonzero(labels == s).flatten() for s in torch.unique(labels)]
    small = min(len(i) for i in groups)
    if small < MIN_MICRO_BATCHES:
        raise UsageError(f"a confidence interval needs >= {MIN_MICRO_BATCHES} micro-batches per stratum, got {small}; "
                         f"draw more samples or use a smaller micro-batch")
    gs = [g.double().cpu() for g in (gxx, gyy, gdd, gxy)]
    gz = None if gzz is None else gzz.double().cpu()
    if gz is not None and gz.shape != (K, K):
        raise UsageError(f"gradient_stats: gzz must be ({K}, {K}), got {tuple(gz.shape)}")
    ones = torch.ones(1, K, dtype=torch.float64)
    point = _stats(ones, *gs, groups, micro_batch, gz)
    gen = torch.Generator().manual_seed(seed)
    W = torch.zeros(n_boot, K, dtype=torch.float64)
    for idx in groups:  # resample micro-batches within each stratum
        draws = torch.randint(0, len(idx), (n_boot, len(idx)), generator=gen)
        counts = torch.zeros(n_boot, len(idx), dtype=torch.float64)
        W[:, idx] = counts.scatter_add_(1, draws, torch.ones(draws.shape, dtype=torch.float64))  # (R, K_b) draw counts
    boot = _stats(W, *gs, groups, micro_batch, gz)
    qs = torch.tensor([(1 - ci) / 2, 1 - (1 - ci) / 2], dtype=torch.float64)
    out: dict[str, float] = {}
    plugin_keys = PLUGIN_KEYS + (("noise_floor_rel_is",) if gz is not None else ())
    for key in plugin_keys:
        v = float(point[key][0])
        out[key] = math.sqrt(max(v, 0.0)) if key in SQUARED else v
    for key in STAT_KEYS + (IS_KEYS if gz is not None else ()):
        est = float(point[key][0])
        vals = boot[key][torch.isfinite(boot[key])]
        lo = hi = float("nan")
        if vals.numel() >= n_boot // 2 and math.isfinite(est):
            q_lo, q_hi = (float(v) for v in torch.quantile(vals, qs))
            lo, hi = 2 * est - q_hi, 2 * est - q_lo  # basic bootstrap: est - theta ~ theta* - est
        if key in SQUARED:
            est, lo, hi = (math.copysign(math.sqrt(abs(v)), v) if math.isfinite(v) else v for v in (est, lo, hi))
        if key == "cosine":
            est, lo, hi = (min(max(v, -1.0), 1.0) if math.isfinite(v) else v for v in (est, lo, hi))
        if key in NONNEGATIVE:
            est, lo, hi = (max(v, 0.0) if math.isfinite(v) else v for v in (est, lo, hi))
        out[key], out[f"{key}_lo"], out[f"{key}_hi"] = est, lo, hi
    if not (out["grad_norm_exact_lo"] > 0 and out["grad_norm_tim_lo"] > 0):
        # a ratio over a norm whose interval reaches 0 is unstable (it swings past +-1 and covers
        # badly in simulation): no cosine unless both gradients are resolved
        out["cosine"] = out["cosine_lo"] = out["cosine_hi"] = float("nan")
    return out


def fit_power_law(x: list[float], y: list[float]) -> float:
    """Least-squares slope of log y on log x over points with x, y > 0 (NaN if fewer than 2)."""
    pts = [(math.log(a), math.log(b)) for a, b in zip(x, y) if a > 0 and b > 0 and math.isfinite(b)]
    if len(pts) < 2:
        return float("nan")
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx == 0:
        return float("nan")
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
