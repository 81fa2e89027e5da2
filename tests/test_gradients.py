"""timlab.metrics.gradients: Gram matrices, TV distance, bias / cosine / SNR and their intervals."""

from __future__ import annotations

import math

import pytest
import torch

from timlab.metrics.gradients import (
    MIN_MICRO_BATCHES,
    fit_power_law,
    gradient_stats,
    gram,
    pair_grams,
    tv_distance,
)


def test_grams_match_explicit_products_in_any_chunking():
    g = torch.Generator().manual_seed(0)
    X, Y = torch.randn(6, 50, generator=g), torch.randn(6, 50, generator=g)
    gxx, gyy, gdd, gxy = pair_grams(X, Y, chunk=7)
    Xd, Yd = X.double(), Y.double()
    assert torch.allclose(gxx, Xd @ Xd.T, atol=1e-10)
    assert torch.allclose(gyy, Yd @ Yd.T, atol=1e-10)
    assert torch.allclose(gdd, (Yd - Xd) @ (Yd - Xd).T, atol=1e-10)
    assert torch.allclose(gxy, Xd @ Yd.T, atol=1e-10)
    assert torch.allclose(gram(X, chunk=3), Xd @ Xd.T, atol=1e-10)
    with pytest.raises(ValueError, match="one shape"):
        pair_grams(X, Y[:, :3])


def test_tv_distance_hand_computed():
    # softmax([0, 0]) = (.5, .5); softmax([log 3, 0]) = (.75, .25): TV = 0.25
    p = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    q = torch.tensor([[math.log(3.0), 0.0], [1.0, 2.0]])
    assert torch.allclose(tv_distance(p, q), torch.tensor([0.25, 0.0], dtype=torch.float64), atol=1e-12)
    assert float(tv_distance(torch.tensor([0.0, -1e9]), torch.tensor([-1e9, 0.0]))) == pytest.approx(1.0)


def _stats(X, Y, m=4, **kw):
    return gradient_stats(*pair_grams(X, Y), micro_batch=m, n_boot=300, **kw)


def test_point_estimates_equal_the_textbook_formulas():
    g = torch.Generator().manual_seed(1)
    K, D, m = 10, 5, 4
    X = torch.randn(K, D, generator=g, dtype=torch.float64) + 1.0
    Y = X + 0.6 * torch.tensor([1.0, -1.0, 1.0, -1.0, 0.5], dtype=torch.float64) + 0.2 * torch.randn(K, D, generator=g, dtype=torch.float64)
    s = _stats(X, Y, m=m)
    xbar, ybar, dbar = X.mean(0), Y.mean(0), (Y - X).mean(0)
    tr = lambda A: float(((A - A.mean(0)) ** 2).sum() / (K - 1))  # noqa: E731  sample covariance trace
    g2x = float(xbar @ xbar) - tr(X) / K
    b2 = float(dbar @ dbar) - tr(Y - X) / K
    assert s["grad_norm_exact"] == pytest.approx(math.sqrt(g2x), rel=1e-9)
    assert s["bias_norm"] == pytest.approx(math.sqrt(b2), rel=1e-9)
    assert s["bias_norm_plugin"] == pytest.approx(float(dbar.norm()), rel=1e-9)
    assert s["noise_floor_norm"] == pytest.approx(math.sqrt(tr(Y - X) / K), rel=1e-9)
    assert s["rel_bias"] == pytest.approx(math.sqrt(b2 / g2x), rel=1e-9)
    assert s["cosine_plugin"] == pytest.approx(float(xbar @ ybar / (xbar.norm() * ybar.norm())), rel=1e-9)
    gxy = (float(X.sum(0) @ Y.sum(0)) - float((X * Y).sum())) / (K * (K - 1))  # U-statistic of <E x, E y>
    g2y = float(ybar @ ybar) - tr(Y) / K
    assert s["cosine"] == pytest.approx(gxy / math.sqrt(g2x * g2y), rel=1e-9)
    assert s["snr_exact"] == pytest.approx(g2x / (m * tr(X)), rel=1e-9)
    for k in ("bias_norm", "rel_bias", "snr_exact", "cosine"):
        assert s[f"{k}_lo"] <= s[k] <= s[f"{k}_hi"], k
    assert s["cosine"] < 0.99  # the hand case is not degenerate


def test_a_third_set_of_vectors_estimates_the_bias_directly():
    gen = torch.Generator().manual_seed(6)
    K, D = 12, 7
    X = torch.randn(K, D, generator=gen, dtype=torch.float64) + 1.0
    Z = 0.2 + 0.1 * torch.randn(K, D, generator=gen, dtype=torch.float64)
    s = gradient_stats(*pair_grams(X, X + Z), micro_batch=4, n_boot=300, gzz=gram(Z))
    zbar = Z.mean(0)
    u = float(zbar @ zbar) - float(((Z - zbar) ** 2).sum() / (K - 1)) / K
    assert s["bias_norm_is"] == pytest.approx(math.sqrt(u), rel=1e-9)
    assert s["bias_norm_is"] == pytest.approx(s["bias_norm"], rel=1e-9)  # here Y - X is Z itself
    assert s["bias_norm_is_lo"] <= s["bias_norm_is"] <= s["bias_norm_is_hi"]


def test_identical_sides_give_exactly_zero_bias():
    X = torch.randn(MIN_MICRO_BATCHES, 30, generator=torch.Generator().manual_seed(2)) + 0.5
    s = _stats(X, X.clone())
    assert s["bias_norm"] == s["bias_norm_lo"] == s["bias_norm_hi"] == 0.0
    assert s["rel_bias"] == s["bias_norm_plugin"] == s["noise_floor_norm"] == 0.0
    assert s["cosine_plugin"] == pytest.approx(1.0, abs=1e-12)
    assert math.isnan(s["cosine"]) or s["cosine"] == pytest.approx(1.0, abs=1e-12)
    assert s["snr_exact"] == s["snr_tim"]


def test_strata_weigh_equally_and_resample_within():
    # no noise inside a stratum: the pooled mean is exactly the average of the two stratum means
    a, b = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 3.0, 0.0])
    X = torch.stack([a] * 8 + [b] * 8)
    strata = torch.tensor([0] * 8 + [1] * 8)
    s = _stats(X, X + torch.tensor([0.0, 0.0, 0.5]), strata=strata)
    assert s["grad_norm_exact"] == pytest.approx(math.sqrt(1.0 + 9.0) / 2, rel=1e-12)
    assert s["bias_norm"] == pytest.approx(0.5, rel=1e-12)
    assert s["bias_norm_lo"] == pytest.approx(0.5, rel=1e-9) and s["bias_norm_hi"] == pytest.approx(0.5, rel=1e-9)


def test_no_cosine_when_a_gradient_is_not_resolved():
    gen = torch.Generator().manual_seed(5)
    noise = torch.randn(16, 100, generator=gen)
    X = 0.01 + noise  # mean far below the noise: ||E x|| is not resolved
    s = _stats(X, X + 0.3 * torch.randn(16, 100, generator=gen))
    assert s["grad_norm_exact_lo"] == 0.0
    assert math.isnan(s["cosine"]) and math.isnan(s["cosine_lo"]) and math.isfinite(s["cosine_plugin"])


def test_too_few_micro_batches_is_a_clear_error():
    X = torch.randn(MIN_MICRO_BATCHES - 1, 4)
    with pytest.raises(ValueError, match=f">= {MIN_MICRO_BATCHES} micro-batches per stratum, got {MIN_MICRO_BATCHES - 1}"):
        _stats(X, X)


def test_intervals_cover_the_truth_about_95_percent_of_the_time():
    """A simulation with known gradient g, bias b and noise: the estimates are unbiased and the
    bootstrap intervals cover the true values in >= 88% of 120 trials (nominal 95%)."""
    gen = torch.Generator().manual_seed(3)
    K, D, m, trials = 32, 200, 8, 120
    g = torch.randn(D, generator=gen)
    g = g / g.norm()
    b = torch.randn(D, generator=gen)
    b = 0.5 * b / b.norm()
    sig = 0.35
    truth = {"bias_norm": 0.5, "rel_bias": 0.5, "grad_norm_exact": 1.0, "snr_exact": 1.0 / (m * D * sig**2),
             "cosine": float(g @ (g + b) / (g + b).norm())}
    hits = {k: 0 for k in truth}
    est = {k: 0.0 for k in truth}
    for t in range(trials):
        X = g + sig * torch.randn(K, D, generator=gen)
        Y = X + b + 0.5 * sig * torch.randn(K, D, generator=gen)
        s = gradient_stats(*pair_grams(X, Y), micro_batch=m, n_boot=300, seed=t)
        for k, v in truth.items():
            hits[k] += s[f"{k}_lo"] <= v <= s[f"{k}_hi"]
            est[k] += s[k] / trials
    for k, v in truth.items():
        assert hits[k] / trials >= 0.88, (k, hits[k] / trials)
        assert est[k] == pytest.approx(v, rel=0.05), k


def test_power_law_fit():
    assert fit_power_law([2, 4, 8], [12, 48, 192]) == pytest.approx(2.0)
    assert math.isnan(fit_power_law([2], [3]))
    assert fit_power_law([1, 2, 4, 0], [1, 2, 4, 5]) == pytest.approx(1.0)  # x <= 0 is skipped
