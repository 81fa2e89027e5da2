"""Tests for timlab.experiments.studies.threshold: k3* brackets by hand, and a synthetic threshold sweep
whose k3* falls as T^-2 by construction, read back through the index and the CLI."""

import json
import math

import numpy as np
import pandas as pd
import pytest

from timlab.cli import main
from timlab.experiments.studies.threshold import bracket, threshold_study
from timlab.rundir import RunDir


def _doses(rows):
    return pd.DataFrame(rows, columns=["k3", "collapse_frac"])


def test_bracket_by_hand():
    assert bracket(_doses([(0.01, 0.0), (0.1, 0.2), (1.0, 0.6), (3.0, 1.0)])) == (0.1, 1.0)
    lo, hi = bracket(_doses([(0.01, 0.0), (0.1, 0.4)]))  # no dose reaches the bar: k3* > 0.1
    assert lo == 0.1 and math.isnan(hi)
    lo, hi = bracket(_doses([(0.01, 0.5), (0.1, 1.0)]))  # the lowest dose already does
    assert math.isnan(lo) and hi == 0.01
    # a non-monotone dose (0.3 collapses less than 0.2) is bracketed from the lowest dose at the bar
    assert bracket(_doses([(0.1, 0.0), (0.2, 0.6), (0.3, 0.4), (1.0, 1.0)])) == (0.1, 0.2)


def _fake_sweep(root, *, exponent=-2.0):
    """Three length scales; at each, doses whose realized k3 brackets k3* = 10 * T**exponent."""
    rows = []
    for digits, T in ((2, 10.0), (4, 20.0), (8, 40.0)):
        k3_star = 10 * T**exponent
        for dose, k3 in enumerate((k3_star / 3, k3_star * 3)):
            for seed in range(4):
                collapsed = k3 > k3_star and seed < 3  # 3/4 collapse above the threshold, 0/4 below
                run_dir = f"d{digits}_m{dose}_s{seed}"
                rd = RunDir(root / run_dir)
                rd.path.mkdir(parents=True)
                pd.DataFrame({"step": [1, 2], "train/response_length_mean": [T - 1, T + 1]}).to_parquet(rd.metrics_file)
                rd.write_status("finished", step=2, total_steps=2)
                rows.append({"run_id": run_dir, "run_dir": run_dir, "state": "finished", "collapsed": collapsed,
                             "k3_kl_mean": k3, "final_accuracy": 0.2 if collapsed else 0.9,
                             "mismatch.injector": "logit_noise", "mismatch.magnitude": float(dose),
                             "optim.lr": 2e-4, "task.kwargs.max_digits": digits})
    pd.DataFrame(rows).to_parquet(root / "index.parquet", index=False)


def test_threshold_study_recovers_a_known_law(tmp_path):
    _fake_sweep(tmp_path)
    res = threshold_study(tmp_path)
    summary = res.summary()
    assert list(summary["T"]) == [10.0, 20.0, 40.0]
    np.testing.assert_allclose(summary["k3*"], [10 * T**-2.0 for T in (10.0, 20.0, 40.0)], rtol=1e-12)
    (fit,) = res.fits
    assert fit.slope == pytest.approx(-2.0) and fit.n_cells == 3
    # k3* = 10 T^-2 = 1e-3 at T = 100
    assert fit.T_at_realistic == pytest.approx(100.0)
    assert set(res.table()["collapsed"]) == {"0/4", "3/4"}


def test_threshold_cli_prints_writes_and_plots(tmp_path, capsys):
    _fake_sweep(tmp_path / "sw")
    out_json, out_png = tmp_path / "t.json", tmp_path / "t.png"
    assert main(["threshold", str(tmp_path / "sw"), "--json", str(out_json), "--plot", str(out_png)]) == 0
    text = capsys.readouterr().out
    assert "k3* ~ T^-2.00 over 3 cells" in text and "at T ~ 100" in text
    assert " collapsed[peak] " in text.splitlines()[1]  # the header names the rule its counts use (issue 60)
    assert json.loads(out_json.read_text())["fits"][0]["slope"] == pytest.approx(-2.0)
    assert out_png.stat().st_size > 10_000


def test_runs_with_a_remedy_are_cells_of_their_own(tmp_path):
    _fake_sweep(tmp_path)
    index = pd.read_parquet(tmp_path / "index.parquet")
    index["correction.mode"] = "none"
    index["scheduler.name"] = "constant"
    tis = index.copy()
    tis["run_id"] = tis["run_id"] + "_tis"
    tis["correction.mode"] = "truncate"
    tis["correction.level"] = "token"
    tis["collapsed"] = False  # the remedy prevents every collapse
    pd.concat([index, tis]).to_parquet(tmp_path / "index.parquet", index=False)
    res = threshold_study(tmp_path)
    plain = [c for c in res.cells if c.family == "logit_noise"]
    assert len(plain) == 3 and all(math.isfinite(c.k3_star) for c in plain)  # not diluted by the TIS runs
    with_tis = [c for c in res.cells if c.family == "logit_noise+token_truncate"]
    assert len(with_tis) == 3 and all(math.isnan(c.hi) for c in with_tis)


def test_threshold_reads_several_sweeps_together(tmp_path):
    """A cell's doses may sit in different sweep directories (e.g. a dose-response sweep and a
    threshold sweep): split the synthetic sweep in two and get the same result."""
    _fake_sweep(tmp_path / "all")
    index = pd.read_parquet(tmp_path / "all" / "index.parquet")
    for part, rows in (("a", index.iloc[::2]), ("b", index.iloc[1::2])):
        (tmp_path / part).mkdir()
        for d in rows["run_dir"]:
            (tmp_path / "all" / d).rename(tmp_path / part / d)
        rows.to_parquet(tmp_path / part / "index.parquet", index=False)
    res = threshold_study([tmp_path / "a", tmp_path / "b"])
    assert res.fits[0].slope == pytest.approx(-2.0) and len(res.table()) == 6


def test_threshold_unknown_scale_is_one_line(tmp_path, capsys):
    _fake_sweep(tmp_path)
    assert main(["threshold", str(tmp_path), "--scale", "task.kwargs.max_len"]) == 2
    err = capsys.readouterr().err
    assert "no column 'task.kwargs.max_len'; valid choices:" in err and len(err.strip().splitlines()) == 1


def test_min_peak_counts_only_falls_after_learning(tmp_path):
    """A dip below half of a low warm-start accuracy before learning is a collapse under the
    default rule but not with min_peak=0.5; a fall after learning is one under both."""
    curves = {"dip_then_learn": [0.3, 0.1, 0.1, 0.1, 0.9, 0.9], "learn_then_fall": [0.3, 0.9, 0.9, 0.2, 0.2, 0.2]}
    rows = []
    for dose, (name, acc) in enumerate(curves.items()):
        rd = RunDir(tmp_path / name)
        rd.path.mkdir()
        steps = list(range(0, 60, 10))
        pd.DataFrame({"step": steps, "val/accuracy": acc, "train/response_length_mean": [10.0] * 6}).to_parquet(rd.metrics_file)
        rd.write_status("finished", step=50, total_steps=50)
        rows.append({"run_id": name, "run_dir": name, "state": "finished", "collapsed": True, "k3_kl_mean": 0.1 * (dose + 1),
                     "final_accuracy": acc[-1], "mismatch.injector": "head_perturb", "mismatch.magnitude": float(dose),
                     "optim.lr": 2e-4, "task.kwargs.max_digits": 4})
    pd.DataFrame(rows).to_parquet(tmp_path / "index.parquet", index=False)
    default = threshold_study(tmp_path, min_peak=0.05).table().set_index("dose")["collapsed"]
    learned = threshold_study(tmp_path, min_peak=0.5).table().set_index("dose")["collapsed"]
    assert list(default) == ["1/1", "1/1"] and list(learned) == ["0/1", "1/1"]
