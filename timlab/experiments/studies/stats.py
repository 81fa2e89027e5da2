"""Small-sample statistics for seed comparisons: exact permutation tests and Clopper-Pearson
intervals. numpy and the standard library only (no scipy).

- ``permutation_test(a, b)``: the two-sided p-value of the difference in means of two groups,
  by exact enumeration of every relabeling (C(n_a + n_b, n_a) of them) when there are at most
  ``max_exact`` (5 vs 5: 252), else by Monte Carlo over ``n_mc`` random relabelings with a
  fixed seed (the result says which). The observed labeling is one of the relabelings, so p is
  never below 1 / (number of relabelings): the floor ``permutation_floor`` reports (5 vs 5
  two-sided: 2/252 = 0.0079). By Monte Carlo it is (hits + 1) / (n_mc + 1), never 0.
- ``cochran_q(costs, variances)``: Cochran's heterogeneity Q of estimates with their variances, and
  its chi-square p (``chi2_sf``: the regularized upper incomplete gamma, in plain floats).
- ``clopper_pearson(k, n)``: the exact (conservative) binomial interval for k successes in n,
  by bisection on the binomial CDF (the Beta-quantile form needs scipy).
- ``poisson_ci(k)``: the exact (Garwood, conservative) interval for the mean of a Poisson count k,
  by bisection on the Poisson CDF written as a chi-square tail (``chi2_sf``).
- ``bootstrap_ci(a)`` / ``bootstrap_diff_ci(a, b)`` / ``bootstrap_ratio_ci(a, b)``: percentile
  intervals of a mean, of a difference in means and of a ratio of means, resampling seeds with
  replacement (within each group) with a fixed seed.
- ``fisher_greater(k_a, n_a, k_b, n_b)``: the one-sided Fisher exact p that group a's rate of
  events is above group b's (the hypergeometric tail, in exact integers).
- ``t_ci(a)``: the Student-t interval of a mean.
- ``holm(ps)``: Holm's step-down adjustment of p-values for a family of tests.
- ``least_squares(X, y)`` / ``line_fit(x, y)``: small least-squares fits (a few columns, tens of
  rows) in plain Python floats, so a published fit has the same bits on every machine: numpy's
  ``lstsq``/``polyfit`` go through whichever BLAS kernel the CPU picks (OpenBLAS chooses other
  kernels on AVX-512 than on AVX2), and a slope that is 0 in exact arithmetic came out as
  +-1e-17 by kernel, which decided whether a cell entered a later fit.
- ``compare_family(groups, references)``: each group against its reference (one endpoint of a
  pre-registered study): mean with t- and bootstrap intervals, difference with its bootstrap
  interval, exact permutation p and the Holm-adjusted p over the family (``Comparison``).
- ``logit(a)``: the log-odds of a proportion clipped to ``LOGIT_CLIP`` (a run's accuracy level on
  the log-odds scale), in the standard library's ``math`` (the same bits on every machine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

import numpy as np

MAX_EXACT = 200_000
"""Enumerate every relabeling up to this many; Monte Carlo above it."""
N_MC = 100_000
"""Random relabelings of the Monte Carlo test."""


@dataclass(frozen=True)
class PermutationResult:
    """A two-sided permutation test of mean(a) - mean(b)."""

    diff: float
    """mean(a) - mean(b)."""
    p: float
    """Two-sided p-value: the share of relabelings with |difference| >= the observed one."""
    n_relabelings: int
    """Relabelings enumerated (exact) or drawn (Monte Carlo)."""
    exact: bool
    """True: every relabeling enumerated; False: Monte Carlo."""
    floor: float
    """The smallest p this design can give (exact: 2 / C(n_a + n_b, n_a) when the two tails are
    distinct labelings; 1 / C when they coincide)."""


def permutation_floor(n_a: int, n_b: int) -> float:
    """The smallest two-sided p an exact permutation test of n_a vs n_b can reach (group sizes
    differ or not: the two extreme relabelings are distinct, so 2 / C(n_a + n_b, n_a))."""
    return min(1.0, 2 / math.comb(n_a + n_b, n_a))


def _strata_sizes(strata) -> list[tuple[int, int]]:
    """[(units of a, units of b)] per stratum of ``strata`` = (labels of a's units, labels of b's)."""
    sa, sb = (np.asarray(x) for x in strata)
    return [(int((sa == s).sum()), int((sb == s).sum())) for s in np.unique(np.concatenate([sa, sb]))]


def stratified_floor(strata) -> float:
    """``permutation_floor`` of a test that relabels within strata only: 2 / prod C(n_s, k_s)."""
    return min(1.0, 2 / math.prod(math.comb(ka + kb, ka) for ka, kb in _strata_sizes(strata)))


def _relabel_sums(pooled: np.ndarray, labels: np.ndarray | None, k: int, max_exact: int, n_mc: int,
                  seed: int) -> tuple[np.ndarray, bool]:
    """The sum of group a's values under every relabeling (exact) or ``n_mc`` random ones; with
    ``labels`` (a stratum per unit, a's ``k`` units first), only relabelings that keep each
    stratum's count of a-units."""
    n = pooled.size
    if labels is None:
        if math.comb(n, k) <= max_exact:
            return pooled[np.array(list(combinations(range(n), k)))].sum(axis=1), True
        rng = np.random.default_rng(seed)
        return pooled[np.stack([rng.permutation(n)[:k] for _ in range(n_mc)])].sum(axis=1), False
    members = [np.flatnonzero(labels == s) for s in np.unique(labels)]
    counts = [int((m < k).sum()) for m in members]
    if math.prod(math.comb(m.size, c) for m, c in zip(members, counts)) <= max_exact:
        sums = np.zeros(1)
        for m, c in zip(members, counts):  # every choice in one stratum, added to every choice in the others
            sums = np.add.outer(sums, pooled[m][np.array(list(combinations(range(m.size), c)))].sum(axis=1)).ravel()
        return sums, True
    rng = np.random.default_rng(seed)
    return np.array([sum(pooled[m][rng.permutation(m.size)[:c]].sum() for m, c in zip(members, counts))
                     for _ in range(n_mc)]), False


def permutation_test(a, b, *, strata=None, max_exact: int = MAX_EXACT, n_mc: int = N_MC,
                     seed: int = 0) -> PermutationResult:
    """Two-sided permutation test of the difference in means of ``a`` and ``b`` (see module).
    ``strata``: (the stratum of each of ``a``'s values, of each of ``b``'s), e.g. the machine block
    each seed ran on: then only the relabelings that keep every stratum's number of a-values count,
    so a shift between strata, common to both groups, cannot make a difference."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.size < 1 or b.size < 1 or not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError(f"permutation_test needs finite values in both groups, got {a.size} and {b.size}")
    labels = None
    if strata is not None:
        sa, sb = (np.asarray(x) for x in strata)
        if sa.shape != a.shape or sb.shape != b.shape:
            raise ValueError(f"permutation_test: strata need one label per value: {sa.size} and {sb.size} labels for "
                             f"{a.size} and {b.size} values")
        labels = np.concatenate([sa, sb])
    pooled = np.concatenate([a, b])
    n, k = pooled.size, a.size
    total = pooled.sum()
    observed = a.mean() - b.mean()
    tol = 1e-12 * max(1.0, float(np.abs(pooled).max()))
    sums, exact = _relabel_sums(pooled, labels, k, max_exact, n_mc, seed)
    diffs = sums / k - (total - sums) / (n - k)
    hits = int((np.abs(diffs) >= abs(observed) - tol).sum())
    # Monte Carlo: (hits + 1) / (draws + 1), the observed labelling counted as one of the draws, so a p
    # value is never 0 and the test keeps its level (Phipson and Smyth 2010); exact: the plain fraction
    p = hits / len(sums) if exact else (hits + 1) / (len(sums) + 1)
    floor = permutation_floor(k, n - k) if strata is None else stratified_floor(strata)
    return PermutationResult(float(observed), p, len(sums), exact, floor)


def chi2_sf(x: float, df: int) -> float:
    """P(chi-square with ``df`` degrees of freedom > x), the regularized upper incomplete gamma
    Q(df / 2, x / 2): its series below s + 1, its continued fraction (modified Lentz) above."""
    if x <= 0:
        return 1.0
    s, z = df / 2.0, x / 2.0
    log_front = s * math.log(z) - z - math.lgamma(s)
    if z < s + 1:
        term = total = 1.0 / s
        a = s
        for _ in range(10_000):
            a += 1
            term *= z / a
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return max(0.0, 1.0 - math.exp(log_front) * total)
    tiny = 1e-300
    b, c, dd = z + 1 - s, 1 / tiny, 1 / (z + 1 - s)
    h = dd
    for i in range(1, 10_000):
        an = -i * (i - s)
        b += 2
        dd = an * dd + b
        dd = tiny if abs(dd) < tiny else dd
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        dd = 1 / dd
        delta = dd * c
        h *= delta
        if abs(delta - 1) < 1e-16:
            break
    return math.exp(log_front) * h


def cochran_q(costs, variances) -> tuple[float, int, float]:
    """Cochran's Q of ``costs`` with weights 1 / ``variances``: (Q, degrees of freedom, chi-square p)."""
    w = [1.0 / float(v) for v in variances]
    c = [float(x) for x in costs]
    mean = math.fsum(wi * ci for wi, ci in zip(w, c)) / math.fsum(w)
    q = math.fsum(wi * (ci - mean) ** 2 for wi, ci in zip(w, c))
    return q, len(c) - 1, chi2_sf(q, len(c) - 1)


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    return float(sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1)))


def _bisect(f, lo: float = 0.0, hi: float = 1.0, iters: int = 100) -> float:
    """The root of a function decreasing in [lo, hi] (f(lo) > 0 > f(hi))."""
    for _ in range(iters):
        mid = (lo + hi) / 2
        if f(mid) > 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The Clopper-Pearson interval for a binomial proportion with k successes in n trials:
    lower = the p with P(X >= k | p) = alpha/2 (0 when k = 0), upper = the p with
    P(X <= k | p) = alpha/2 (1 when k = n)."""
    if not (0 <= k <= n and n >= 1):
        raise ValueError(f"clopper_pearson needs 0 <= k <= n, n >= 1; got k={k}, n={n}")
    alpha = 1 - level
    lower = 0.0 if k == 0 else _bisect(lambda p: alpha / 2 - (1 - binom_cdf(k - 1, n, p)))
    upper = 1.0 if k == n else _bisect(lambda p: binom_cdf(k, n, p) - alpha / 2)
    return lower, upper


def poisson_ci(k: int, level: float = 0.95) -> tuple[float, float]:
    """The exact (Garwood) interval for the mean mu of a Poisson count k: lower = the mu with
    P(X >= k | mu) = alpha/2 (0 when k = 0), upper = the mu with P(X <= k | mu) = alpha/2. The
    Poisson CDF is a chi-square tail, P(X <= k | mu) = ``chi2_sf(2 mu, 2 (k + 1))``. A rate of k
    events in an exposure E has the interval divided by E."""
    if not (isinstance(k, int) and k >= 0):
        raise ValueError(f"poisson_ci needs a count k >= 0; got k={k!r}")
    alpha = 1 - level
    hi = 2.0 * k + 20.0  # above both bounds: the upper one is k + ~2 sqrt(k) + 4 at most
    lower = 0.0 if k == 0 else _bisect(lambda mu: alpha / 2 - (1 - chi2_sf(2 * mu, 2 * k)), 0.0, hi, iters=200)
    upper = _bisect(lambda mu: chi2_sf(2 * mu, 2 * (k + 1)) - alpha / 2, 0.0, hi, iters=200)
    return lower, upper


def fisher_greater(k_a: int, n_a: int, k_b: int, n_b: int) -> float:
    """One-sided Fisher exact test that k_a events in n_a is a higher rate than k_b in n_b: the
    chance that n_a of the n_a + n_b units, drawn at random, hold k_a or more of the k_a + k_b
    events (the upper hypergeometric tail). Counted in exact integers, one division at the end."""
    if not (0 <= k_a <= n_a and 0 <= k_b <= n_b and n_a >= 1 and n_b >= 1):
        raise ValueError(f"fisher_greater needs 0 <= k <= n, n >= 1; got {k_a}/{n_a} and {k_b}/{n_b}")
    n, k = n_a + n_b, k_a + k_b
    tail = sum(math.comb(k, i) * math.comb(n - k, n_a - i) for i in range(k_a, min(n_a, k) + 1))
    return tail / math.comb(n, n_a)


N_BOOT = 2_000
"""Bootstrap resamples."""

LOGIT_CLIP = (0.005, 0.995)
"""A proportion is clipped to this range before its log-odds, so a run at accuracy 0 or 1 counts
as +-5.29 (log(0.995 / 0.005)) instead of an infinity that no mean survives."""


def logit(a: float) -> float:
    """log(a / (1 - a)) of ``a`` clipped to ``LOGIT_CLIP``; NaN stays NaN (a run with no value)."""
    if math.isnan(a):
        return math.nan
    a = min(max(float(a), LOGIT_CLIP[0]), LOGIT_CLIP[1])
    return math.log(a / (1 - a))

T975 = (math.nan, 12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086)
"""Two-sided 95% Student t quantiles, indexed by degrees of freedom (0-20; no scipy)."""


def t_ci(a) -> tuple[float, float, float]:
    """(mean, low, high): the 95% Student-t interval of the mean of ``a`` (2-21 values; NaN
    interval for one value)."""
    a = np.asarray(a, dtype=float)
    if a.size > len(T975):
        raise ValueError(f"t_ci has t quantiles for at most {len(T975)} values, got {a.size}")
    m = float(a.mean())
    if a.size < 2:
        return m, math.nan, math.nan
    h = T975[a.size - 1] * float(a.std(ddof=1)) / math.sqrt(a.size)
    return m, m - h, m + h


def bootstrap_means(a, *, n: int = N_BOOT, rng: np.random.Generator | None = None) -> np.ndarray:
    """(n,) means of ``a`` resampled with replacement (``rng`` default: seed 0)."""
    a = np.asarray(a, dtype=float)
    rng = np.random.default_rng(0) if rng is None else rng
    return a[rng.integers(0, a.size, size=(n, a.size))].mean(axis=1)


def bootstrap_ci(a, *, n: int = N_BOOT, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``a``."""
    m = bootstrap_means(a, n=n, rng=np.random.default_rng(seed))
    q = (1 - level) / 2
    return float(np.quantile(m, q)), float(np.quantile(m, 1 - q))


def bootstrap_diff_ci(a, b, *, n: int = N_BOOT, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(a) - mean(b), each group resampled on its own."""
    rng = np.random.default_rng(seed)
    d = bootstrap_means(a, n=n, rng=rng) - bootstrap_means(b, n=n, rng=rng)
    q = (1 - level) / 2
    return float(np.quantile(d, q)), float(np.quantile(d, 1 - q))


def bootstrap_ratio_ci(a, b, *, n: int = N_BOOT, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(a) / mean(b), each group resampled on its own (the
    same draws as ``bootstrap_diff_ci`` with the same seed). A resample of ``b`` whose mean is 0
    gives an infinite or NaN ratio; the function refuses rather than report a broken interval."""
    rng = np.random.default_rng(seed)
    num, den = bootstrap_means(a, n=n, rng=rng), bootstrap_means(b, n=n, rng=rng)
    if not (den != 0).all():
        raise ValueError(f"bootstrap_ratio_ci: {int((den == 0).sum())} of {n} resamples of the denominator "
                         f"have mean 0; a ratio of means needs a denominator whose resamples are never 0")
    q = (1 - level) / 2
    r = num / den
    return float(np.quantile(r, q)), float(np.quantile(r, 1 - q))


def holm(ps) -> list[float]:
    """Holm-adjusted p-values, in the input's order: the i-th smallest p times (m - i + 1),
    made non-decreasing along the sorted order and capped at 1."""
    ps = [float(p) for p in ps]
    order = sorted(range(len(ps)), key=ps.__getitem__)
    out, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        out[i] = running
    return out


RANK_TOL = 1e-10
"""``least_squares`` calls a design rank-deficient when a diagonal entry of R falls below this
fraction of the largest column norm (numpy's ``matrix_rank`` uses ~1e-15 x rows; the designs
fitted here have condition numbers below 1e3, so the margin is wide both ways)."""


def least_squares(X, y) -> tuple[float, ...] | None:
    """The coefficients minimizing ||X b - y|| (X: rows of equal length, y: one value per row),
    by Householder QR in plain Python floats with correctly rounded sums (``math.fsum``): every
    operation is an IEEE double operation in a fixed order, so the result is the same on every
    CPU and BLAS. None when X has fewer rows than columns or is rank-deficient (``RANK_TOL``).
    For the few-column fits of the study analyses; O(rows x columns^2) Python operations."""
    A = [[float(v) for v in row] for row in X]  # (rows, cols), copied: reduced in place
    b = [float(v) for v in y]
    m, n = len(A), len(A[0]) if A else 0
    if m != len(b):
        raise ValueError(f"least_squares: X has {m} rows, y has {len(b)} values")
    if n == 0 or m < n:
        return None
    scale = max(math.sqrt(math.fsum(A[i][j] ** 2 for i in range(m))) for j in range(n))
    if not scale > 0 or not math.isfinite(scale):
        return None
    for k in range(n):
        norm = math.sqrt(math.fsum(A[i][k] ** 2 for i in range(k, m)))
        if norm <= RANK_TOL * scale:
            return None
        alpha = -norm if A[k][k] >= 0 else norm
        v = [A[i][k] for i in range(k, m)]
        v[0] -= alpha
        vv = math.fsum(x * x for x in v)
        for j in range(k, n):  # A[k:, j] -= 2 v (v . A[k:, j]) / (v . v)
            f = 2 * math.fsum(v[i - k] * A[i][j] for i in range(k, m)) / vv
            for i in range(k, m):
                A[i][j] -= f * v[i - k]
        f = 2 * math.fsum(v[i - k] * b[i] for i in range(k, m)) / vv
        for i in range(k, m):
            b[i] -= f * v[i - k]
    coef = [0.0] * n
    for k in reversed(range(n)):  # back-substitution in R (the upper n x n of A)
        coef[k] = (b[k] - math.fsum(A[k][j] * coef[j] for j in range(k + 1, n))) / A[k][k]
    return tuple(coef)


def line_fit(x, y) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through (x, y), as ``np.polyfit(x, y, 1)``
    but in plain Python floats with correctly rounded sums (the same bits on every machine; a
    constant y gives a slope of exactly 0). NaN, NaN with fewer than 2 points or one distinct x."""
    xs, ys = [float(v) for v in x], [float(v) for v in y]
    if len(xs) != len(ys):
        raise ValueError(f"line_fit: {len(xs)} x values, {len(ys)} y values")
    if len(xs) < 2:
        return math.nan, math.nan
    xm, ym = math.fsum(xs) / len(xs), math.fsum(ys) / len(ys)
    sxx = math.fsum((a - xm) ** 2 for a in xs)
    if sxx == 0:
        return math.nan, math.nan
    slope = math.fsum((a - xm) * (b - ym) for a, b in zip(xs, ys)) / sxx
    return slope, ym - slope * xm


@dataclass(frozen=True)
class Comparison:
    """One group against its reference, one member of a Holm family (``compare_family``)."""

    mean: float
    """Mean of the group (over seeds)."""
    t_ci: tuple[float, float]
    """95% Student-t interval of that mean."""
    boot_ci: tuple[float, float]
    """95% seed-bootstrap interval of that mean."""
    diff: float
    """mean(group) - mean(reference)."""
    diff_ci: tuple[float, float]
    """95% bootstrap interval of the difference (each side's seeds resampled on their own)."""
    p: float
    """Exact (or Monte Carlo) two-sided permutation p of the difference."""
    p_holm: float
    """``p`` adjusted by Holm over the family."""
    floor: float | None = None
    """The smallest p the test could give (``PermutationResult.floor``; None: not recorded)."""

    def below(self, alpha: float = 0.05) -> bool:
        """The group is lower than its reference: negative difference, Holm p < ``alpha`` and a
        bootstrap interval that lies below 0."""
        return self.diff < 0 and self.p_holm < alpha and self.diff_ci[1] < 0

    def above(self, alpha: float = 0.05) -> bool:
        """The group is higher than its reference (``below`` mirrored)."""
        return self.diff > 0 and self.p_holm < alpha and self.diff_ci[0] > 0

    def cost_bound(self) -> str:
        """What a group that is not ``below`` its reference may still cost, from the lower end of
        the difference's interval: "at most -0.0061" (the most the data allow), or, when the
        whole interval lies above 0, "none: the interval [+0.0016, +0.0055] lies above 0"."""
        lo, hi = self.diff_ci
        return f"at most {lo:+.4f}" if lo < 0 else f"none: the interval [{lo:+.4f}, {hi:+.4f}] lies above 0"


def compare_family(groups: dict, references: dict, strata: dict | None = None) -> dict:
    """``{name: Comparison}`` of each ``groups[name]`` (values over seeds) against
    ``references[name]``, Holm-adjusted over all the names (one family). Intervals and tests are
    this module's (``t_ci``, ``bootstrap_ci``, ``bootstrap_diff_ci``, ``permutation_test``);
    ``strata[name]``: the permutation test's strata of that comparison (e.g. machine blocks)."""
    if set(groups) != set(references):
        raise ValueError(f"compare_family needs a reference per group: groups {sorted(groups)}, "
                         f"references {sorted(references)}")
    tests = {a: permutation_test(groups[a], references[a], strata=(strata or {}).get(a)) for a in groups}
    adj = dict(zip(tests, holm([t.p for t in tests.values()])))
    out = {}
    for a, x in groups.items():
        mu, lo, hi = t_ci(x)
        out[a] = Comparison(mean=mu, t_ci=(lo, hi), boot_ci=bootstrap_ci(x), diff=tests[a].diff,
                            diff_ci=bootstrap_diff_ci(x, references[a]), p=tests[a].p, p_holm=adj[a],
                            floor=tests[a].floor)
    return out


__all__ = ["LOGIT_CLIP", "logit", "least_squares", "line_fit", "RANK_TOL", "Comparison", "compare_family", "permutation_test", "t_ci", "bootstrap_means", "bootstrap_ci", "bootstrap_diff_ci", "bootstrap_ratio_ci", "holm", "N_BOOT", "T975", "permutation_floor", "stratified_floor", "PermutationResult", "clopper_pearson", "fisher_greater", "binom_cdf",
           "MAX_EXACT", "N_MC"]
