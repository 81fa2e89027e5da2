"""The demo's headline: effects with bootstrap intervals and exact permutation p (hand-checked on
synthetic seeds), and a tiny real demo-shaped sweep whose printed numbers are recomputed from its runs."""

from __future__ import annotations

from itertools import combinations

import numpy as np
import pandas as pd
import pytest
import yaml

from timlab.errors import UsageError
from timlab.experiments.reports import demo
from timlab.experiments.studies.collapse import run_summary
from timlab.experiments.studies.effects import effect, effects_view
from timlab.experiments.studies.stats import bootstrap_diff_ci
from timlab.rundir import read_metrics


def test_bootstrap_interval_known_cases():
    from timlab.experiments.studies.effects import N_BOOT

    assert bootstrap_diff_ci([1.0, 1.0, 1.0], [0.0, 0.0]) == (1.0, 1.0)  # no spread: the interval is the point
    a, b = [0.30, 0.35, 0.40, 0.45, 0.50], [0.68, 0.69, 0.70, 0.71, 0.72]
    lo, hi = bootstrap_diff_ci(a, b, n=N_BOOT)
    assert -0.40 <= lo < -0.30 < hi <= -0.20  # inside the extremes of every resample
    # the bootstrap distribution by hand: the same draws, the same quantiles
    rng = np.random.default_rng(0)
    d = (np.array(a)[rng.integers(0, 5, (N_BOOT, 5))].mean(1) - np.array(b)[rng.integers(0, 5, (N_BOOT, 5))].mean(1))
    assert (lo, hi) == tuple(np.quantile(d, [0.025, 0.975]))
    e = effect(_index({"a": a, "ref": b}), "a", "ref")
    assert (e.lo, e.hi) == (lo, hi)


def _index(groups: dict[str, list[float]], metric: str = "late_accuracy") -> pd.DataFrame:
    return pd.DataFrame([{"condition": c, "state": "finished", metric: v} for c, vs in groups.items() for v in vs]
                        + [{"condition": "a", "state": "failed", metric: 0.99}])  # incomplete: left out


def test_effect_separated_and_overlapping_groups():
    idx = _index({"a": [0.30, 0.35, 0.40, 0.45, 0.50], "ref": [0.68, 0.69, 0.70, 0.71, 0.72],
                  "b": [0.66, 0.71, 0.69, 0.73, 0.70]})
    e = effect(idx, "a", "ref")
    assert (e.n, e.n_ref) == (5, 5)
    assert e.diff == pytest.approx(-0.30) and e.mean == pytest.approx(0.40) and e.ref_mean == pytest.approx(0.70)
    assert e.p == pytest.approx(2 / 252) == e.p_floor  # completely separated: the exact floor
    assert e.hi < 0 and e.holds
    o = effect(idx, "b", "ref")
    # p by hand: the share of the 252 relabelings with |diff| >= the observed one
    pooled = [0.66, 0.71, 0.69, 0.73, 0.70, 0.68, 0.69, 0.70, 0.71, 0.72]
    obs = abs(np.mean(pooled[:5]) - np.mean(pooled[5:]))
    hits = sum(abs(np.mean([pooled[i] for i in c]) - np.mean([pooled[i] for i in range(10) if i not in c])) >= obs - 1e-12
               for c in combinations(range(10), 5))
    assert o.p == pytest.approx(hits / 252) and o.p > 0.05 and o.lo < 0 < o.hi and not o.holds
    with pytest.raises(UsageError, match="no runs of condition 'zz'; valid choices: a, ref, b"):
        effect(idx, "zz", "ref")
    with pytest.raises(UsageError, match="no column 'final_accuracy'"):
        effect(idx, "a", "ref", metric="final_accuracy")


def test_tiny_demo_shaped_sweep_prints_effects_from_its_runs(tmp_path):
    # the demo's quick conditions on the smoke model: 4 conditions x 2 seeds x 4 steps
    from timlab.experiments.sweeps.runner import run_sweep

    spec = {"base": {"preset": "smoke", "set": {"run.steps": 4}}, "conditions": demo.conditions(True),
            "grid": {"run.seed": [0, 1]}, "workers": 2}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    run_sweep(tmp_path / "spec.yaml", tmp_path / "runs")
    effects, table = demo.summarize(tmp_path / "runs", quick=True)
    assert list(zip(effects["condition"], effects["reference"])) == [
        ("head_2", "zero_mismatch"), ("head_2+token_tis", "head_2"), ("head_2+lr_div10", "head_2")]
    # every number recomputed from the runs' own metrics files
    runs = sorted((tmp_path / "runs").glob("*/metrics.parquet"))
    late, final = {}, {}
    for f in runs:
        cond = f.parent.name.split("__")[0]
        acc = read_metrics(f.parent)["val/accuracy"].dropna().to_numpy()
        late.setdefault(cond, []).append(float(acc[-3:].mean()))
        final.setdefault(cond, []).append(float(acc[-1]))
    for row in effects.itertuples():
        for metric, vals in (("late_accuracy", late), ("final_accuracy", final)):
            a, b = vals[row.condition], vals[row.reference]
            assert getattr(row, f"{metric}_diff") == pytest.approx(np.mean(a) - np.mean(b), abs=1e-12)
            lo, hi = bootstrap_diff_ci(a, b, n=10_000)
            assert (getattr(row, f"{metric}_lo"), getattr(row, f"{metric}_hi")) == pytest.approx((lo, hi), abs=1e-12)
        assert row.p_floor == pytest.approx(2 / 6)  # 2 vs 2 seeds: 6 relabelings
    plateau = {f.parent.name: run_summary(f.parent, rule="plateau")["collapsed"] for f in runs}
    for row in table.itertuples():
        assert row.n_collapsed == sum(v for k, v in plateau.items() if k.split("__")[0] == row.condition)
        assert row.late_accuracy_mean == pytest.approx(np.mean(late[row.condition]))
    text = demo.format_summary(effects, table)
    first = effects_view(effects).iloc[0, 2]  # late accuracy of head_2 - zero_mismatch, as printed
    assert text.startswith("Headline: effects with intervals") and first in text
    assert f"{effects['late_accuracy_diff'][0]:+.3f}" in first and "collapsed (plateau rule)" in text
