"""The erosion study's pre-registered analysis (scripts/erosion_tables.py), checked on synthetic
endpoints with a known answer before any study data exist; and the statistics it uses."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from script_loader import load_script
from timlab.experiments.stats import bootstrap_ci, bootstrap_diff_ci, compare_family, holm, t_ci



E = load_script("erosion_tables")


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


def test_fit_power_recovers_a_known_law():
    k3 = np.array([4e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1])
    c, alpha = E.fit_power(k3, -2e-3 * k3**0.8)
    assert c == pytest.approx(2e-3) and alpha == pytest.approx(0.8)
    assert E.fit_power(k3, np.array([-1e-4, -1e-4, 1e-4, 1e-4, 1e-4, 1e-4])) is None  # < 3 negative arms


# ------------------------------------------------------------------------------- the analysis
NOISE = 1e-5
"""Seed-to-seed sd of the synthetic endpoints: small against the smallest planted excess (7.6e-4
per 100 steps at k3 4e-4), so the planted law is what the fit must find."""


def _endpoints(rng, *, k3, acc_slope, gold_slope, acc_level, gold_level, guard=True, start_acc=0.965):
    return {"acc_slope": acc_slope + rng.normal(0, NOISE), "gold_slope": gold_slope + rng.normal(0, NOISE),
            "acc_level": acc_level + rng.normal(0, NOISE), "gold_level": gold_level + rng.normal(0, NOISE),
            "k3": k3 * (1 + rng.normal(0, 0.05)) if k3 else 0.0, "k3_first": 2 * k3, "k3_last": k3,
            "start_acc": start_acc, "final_acc": acc_level, "final_gold": gold_level, "fell": False,
            "guard": guard, "steps": 500, "rows": 500}


def _synthetic(c=2e-3, alpha=0.8, seeds=8, guard=True):
    """11 arms; head_perturb arms erode at exactly -c * k3^alpha per step; realistic arms sit on the law
    (bf16, fp8) or far off it (stale_1); int8 does nothing."""
    rng = np.random.default_rng(0)
    k3s = {"head_0.11": 4e-4, "head_0.175": 1e-3, "head_0.3": 3e-3, "head_0.49": 1e-2, "head_0.78": 3e-2, "head_1.1": 0.1,
           "bf16": 3e-2, "fp8": 0.1, "int8": 0.0, "stale_1": 1e-3}
    per = {"control": [_endpoints(rng, k3=0, acc_slope=0, gold_slope=0, acc_level=0.95, gold_level=-0.3,
                                  guard=guard) for _ in range(seeds)]}
    for a, k in k3s.items():
        law = -c * k**alpha * 100 if k else 0.0  # per 100 steps
        if a == "stale_1":
            law = -0.2
        per[a] = [_endpoints(rng, k3=k, acc_slope=law, gold_slope=10 * law, acc_level=0.95 + law,
                             gold_level=-0.3 + law) for _ in range(seeds)]
    return per


def test_analysis_finds_a_planted_law_and_judges_each_arm():
    text = E.analyse(_synthetic())
    assert text.startswith("Validity: control guard (k3 exactly 0, every token bitwise equal, every step) held")
    assert "VALID" in text.splitlines()[0]
    fit = next(line for line in text.splitlines() if line.startswith("Fit (accuracy slope"))
    c = float(fit.split("c = ")[1].split(" ")[0])
    alpha = float(fit.split("alpha = ")[1].split(" ")[0])
    assert c == pytest.approx(2e-3, rel=0.3) and alpha == pytest.approx(0.8, abs=0.1)
    # T for k3 = 1e-3 to cost 0.1 accuracy: 0.1 / (2e-3 * 1e-3^0.8) = 1.26e4 steps
    t = float(fit.split("cost 0.1 accuracy: ")[1].split(" ")[0])
    assert t == pytest.approx(0.1 / (2e-3 * 1e-3**0.8), rel=0.5)
    rows = {line.split(" | ")[0][2:]: line for line in text.split("**accuracy slope per 100 steps**")[1]
            .split("**gold")[0].splitlines() if line.startswith("| ")}
    assert rows["head_1.1"].endswith("| **yes** |")  # -0.032 per 100 steps against noise 1e-5
    assert "| no (costs at most" in rows["int8"]
    assert "stale_1: " in text and "off the curve" in text.split("- stale_1:")[1].splitlines()[0]
    assert "agrees with the fit" in text.split("- fp8:")[1].splitlines()[0]


def test_analysis_refuses_partial_or_void_studies():
    per = _synthetic()
    per["fp8"] = per["fp8"][:5]
    assert E.analyse(per).startswith("INCOMPLETE: 85 of 88 runs")
    void = E.analyse(_synthetic(guard=False))
    assert "BROKEN" in void and "VOID" in void and "Fit" not in void


def test_run_endpoints_from_a_metrics_table():
    steps = np.arange(0, 501)
    ev = steps % 25 == 0
    m = pd.DataFrame({"step": steps, "rollout_corr/k3_kl": np.where(steps >= 1, 1e-3, np.nan),
                      "mismatch/frac_bitwise_equal": np.where(steps >= 1, 0.5, np.nan),
                      "val/accuracy": np.where(ev, 0.96 - 0.0002 * steps, np.nan),
                      "val/gold_logprob": np.where(ev, -0.3 - 0.001 * steps, np.nan)})
    r = E.run_endpoints(m)
    assert r["acc_slope"] == pytest.approx(-0.02) and r["gold_slope"] == pytest.approx(-0.1)
    assert r["acc_level"] == pytest.approx(0.96 - 0.0002 * 275) and r["k3"] == pytest.approx(1e-3)
    assert r["start_acc"] == 0.96 and not r["guard"] and not r["fell"] and r["rows"] == 500


def test_cost_bound_says_at_most_or_none():
    from timlab.experiments.stats import compare_family

    lower = compare_family({"a": [0.9, 0.8, 1.0, 0.95]}, {"a": [1.0, 0.9, 1.1, 1.05]})["a"]
    assert lower.cost_bound().startswith("at most -") and float(lower.cost_bound().split()[-1]) == pytest.approx(lower.diff_ci[0], abs=5e-5)
    higher = compare_family({"a": [2.0, 2.1, 2.2, 2.05]}, {"a": [1.0, 0.9, 1.1, 1.05]})["a"]
    lo, hi = higher.diff_ci
    assert lo > 0 and higher.cost_bound() == f"none: the interval [{lo:+.4f}, {hi:+.4f}] lies above 0"
