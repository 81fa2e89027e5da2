"""The statistics behind the erosion study's analysis (now a study file,
docs/examples/studies/erosion.yaml, analysed by timlab.experiments.studies: tests/test_study.py
plants effects in whole sweeps) and its fixed per-run endpoints, which E2, E3 and the MoE study
build on."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from timlab.experiments.studies.stats import bootstrap_ci, bootstrap_diff_ci, compare_family, holm, t_ci
from timlab.experiments.studies.endpoints import run_endpoints
from timlab.experiments.studies.fits import fit_power


# ------------------------------------------------------------------------------- statistics
def test_holm_known_values():
    # sorted 0.01, 0.02, 0.03, 0.5 -> x4, x3, x2, x1 = 0.04, 0.06, 0.06 (monotone), 0.5
    assert holm([0.03, 0.5, 0.01, 0.02]) == pytest.approx([0.06, 0.5, 0.04, 0.06])
    assert holm([0.4, 0.9]) == pytest.approx([0.8, 0.9])
    assert holm([0.6, 0.7]) == [1.0, 1.0]


def test_t_interval_and_bootstrap():
    m, lo, hi = t_ci([1.0, 2.0, 3.0, 4.0])
    assert m == 2.5 and hi - m == pytest.approx(3.182 * math.sqrt(5 / 3) / 2)
    assert math.isnan(t_ci([1.0])[1])
    x = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    lo, hi = bootstrap_ci(x)
    assert lo < 0.45 < hi and bootstrap_ci(x) == (lo, hi)  # fixed seed: repeatable
    assert lo > 0.25 and hi < 0.65
    dlo, dhi = bootstrap_diff_ci(x, [v + 1 for v in x])
    assert dlo < -1 < dhi and dhi < -0.7


def test_compare_family_holm_adjusts_over_its_members():
    ref = np.array([0.0, 0.1, -0.1, 0.05, -0.05, 0.02, -0.02, 0.0])  # 8 seeds
    groups = {"low": ref - 1.0, "null": ref + 0.01, "high": ref + 1.0}
    cmp = compare_family(groups, {a: ref for a in groups})
    floor = 2 / math.comb(16, 8)  # every relabeling enumerated
    assert cmp["low"].p == pytest.approx(floor) and cmp["low"].p_holm == pytest.approx(3 * floor)
    assert cmp["low"].diff == pytest.approx(-1.0) and cmp["low"].diff_ci[1] < 0
    assert cmp["low"].below() and not cmp["low"].above() and cmp["high"].above() and not cmp["null"].below()
    assert cmp["null"].p_holm == cmp["null"].p > 0.5 and cmp["low"].t_ci[0] < cmp["low"].mean < cmp["low"].t_ci[1]
    with pytest.raises(ValueError, match="a reference per group"):
        compare_family(groups, {"low": ref})


def test_run_endpoints_from_a_metrics_table():
    steps = np.arange(0, 501)
    ev = steps % 25 == 0
    m = pd.DataFrame({"step": steps, "rollout_corr/k3_kl": np.where(steps >= 1, 1e-3, np.nan),
                      "mismatch/frac_bitwise_equal": np.where(steps >= 1, 0.5, np.nan),
                      "val/accuracy": np.where(ev, 0.96 - 0.0002 * steps, np.nan),
                      "val/gold_logprob": np.where(ev, -0.3 - 0.001 * steps, np.nan)})
    r = run_endpoints(m)
    assert r["acc_slope"] == pytest.approx(-0.02) and r["gold_slope"] == pytest.approx(-0.1)
    assert r["acc_level"] == pytest.approx(0.96 - 0.0002 * 275) and r["k3"] == pytest.approx(1e-3)
    assert r["start_acc"] == 0.96 and not r["guard"] and not r["fell"] and r["rows"] == 500


def test_fit_power_recovers_a_known_law():
    k3 = np.array([4e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1])
    c, alpha = fit_power(k3, -2e-3 * k3**0.8)
    assert c == pytest.approx(2e-3) and alpha == pytest.approx(0.8)
    assert fit_power(k3, np.array([-1e-4, -1e-4, 1e-4, 1e-4, 1e-4, 1e-4])) is None  # < 3 negative arms


def test_cost_bound_says_at_most_or_none():
    from timlab.experiments.studies.stats import compare_family

    lower = compare_family({"a": [0.9, 0.8, 1.0, 0.95]}, {"a": [1.0, 0.9, 1.1, 1.05]})["a"]
    assert lower.cost_bound().startswith("at most -") and float(lower.cost_bound().split()[-1]) == pytest.approx(lower.diff_ci[0], abs=5e-5)
    higher = compare_family({"a": [2.0, 2.1, 2.2, 2.05]}, {"a": [1.0, 0.9, 1.1, 1.05]})["a"]
    lo, hi = higher.diff_ci
    assert lo > 0 and higher.cost_bound() == f"none: the interval [{lo:+.4f}, {hi:+.4f}] lies above 0"
