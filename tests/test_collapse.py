"""The collapse rule, run summaries and condition tables on hand-computed synthetic data."""

import json
import math

import numpy as np
import pandas as pd
import pytest

from timlab.experiments.studies.collapse import (
                                                 SUMMARY_KEYS, accuracy_auc, collapse_step, condition_table, describe_rule, run_summary,
                                                 )

NAN = float("nan")


def evals(accs, every=2, train_rows=True):
    """A metrics frame: val/accuracy every `every` steps (NaN on the steps between)."""
    rows = []
    for i, a in enumerate(accs):
        rows.append({"step": i * every, "val/accuracy": a, "train/loss": 0.1})
        if train_rows and i < len(accs) - 1:
            rows += [{"step": i * every + k, "val/accuracy": NAN, "train/loss": 0.1} for k in range(1, every)]
    return pd.DataFrame(rows).sort_values("step").reset_index(drop=True)


def test_collapse_at_first_eval_of_a_full_window():
    # peak 0.6 at step 2, line 0.3: steps 4, 6, 8 below -> collapse at 4
    df = evals([0.2, 0.6, 0.25, 0.2, 0.1, 0.5])
    assert collapse_step(df) == 4
    # window 4 needs 4 consecutive evals below: 4, 6, 8 then 10 (0.5) is above -> none
    assert collapse_step(df, window=4) is None
    # frac 0.3: line 0.18 -> only step 8 (0.1) below, then 0.5 recovers -> none
    assert collapse_step(df, frac=0.3) is None


def test_recovery_resets_and_truncated_window_at_the_end():
    # below at 4, 6 then recovers at 8; below again at 10, 12 and the run ends (2 < window evals left)
    df = evals([0.2, 0.6, 0.25, 0.2, 0.5, 0.1, 0.1])
    assert collapse_step(df) == 10
    assert collapse_step(df, allow_truncated=False) is None
    assert collapse_step(df, window=2, allow_truncated=False) == 4


def test_threshold_is_strict_and_needs_min_peak():
    assert collapse_step(evals([0.6, 0.3, 0.3, 0.3])) is None  # exactly half of the peak is not below
    flat = evals([0.04, 0.01, 0.0, 0.0])  # peak 0.04 < min_peak 0.05: an untrained model cannot collapse
    assert collapse_step(flat) is None
    assert collapse_step(flat, min_peak=0.01) == 2


def test_divergence_counts_as_collapse():
    df = evals([0.2, 0.4, 0.5])  # steps 0..4, no accuracy drop
    assert collapse_step(df) is None
    assert collapse_step(df, diverged=True) == 5  # last logged step + 1
    assert collapse_step(df, diverged=True, diverged_step=3) == 3
    early = evals([0.2, 0.6, 0.1, 0.1, 0.1])  # accuracy collapse at 4 comes before a divergence at 9
    assert collapse_step(early, diverged=True, diverged_step=9) == 4
    inf_loss = df.copy()
    inf_loss.loc[inf_loss["step"] == 3, "train/loss"] = math.inf
    assert collapse_step(inf_loss) == 3


def test_bad_rule_parameters():
    with pytest.raises(ValueError, match="window"):
        collapse_step(evals([0.1]), window=0)
    with pytest.raises(ValueError, match="frac"):
        collapse_step(evals([0.1]), frac=1.5)


def test_accuracy_auc_trapezoid_normalized_by_steps():
    df = pd.DataFrame({"step": [0, 1, 2, 6], "val/accuracy": [0.0, NAN, 1.0, 1.0]})
    # (0 + 1) / 2 * 2 + (1 + 1) / 2 * 4 = 5, over 6 steps
    assert accuracy_auc(df) == pytest.approx(5 / 6)
    assert accuracy_auc(pd.DataFrame({"step": [0], "val/accuracy": [0.4]})) == pytest.approx(0.4)


def write_run(d, rows, status):
    d.mkdir(parents=True)
    pd.DataFrame(rows).to_parquet(d / "metrics.parquet", index=False)
    (d / "status.json").write_text(json.dumps(status))
    return d


def test_run_summary_hand_computed(tmp_path):
    rows = [{"step": 0, "val/accuracy": 0.2}]
    k3 = [0.1, 0.2, 0.3, 0.6]
    for s in range(1, 5):
        rows.append({
            "step": s, "val/accuracy": [NAN, 0.8, NAN, 0.3][s - 1], "train/loss": 0.1,
            "rollout_corr/k3_kl": k3[s - 1], "rollout_corr/log_ppl_abs_diff": 0.5 * s,
            "mismatch/abs_diff_mean": 0.01, "train/grad_norm": [1.0, 5.0, 2.0, 3.0][s - 1],
            "train/response_length_mean": [4.0, 9.0, 6.0, 5.0][s - 1],
            "scheduler/surge_step": [NAN, NAN, 3.0, 3.0][s - 1],
            "scheduler/decay_period": [NAN, NAN, 5.0, 5.0][s - 1],
        })
    d = write_run(tmp_path / "r", rows, {"state": "finished", "step": 4, "total_steps": 4, "message": ""})
    s = run_summary(d)
    assert set(s) == set(SUMMARY_KEYS)
    assert s["state"] == "finished" and s["last_step"] == 4 and s["total_steps"] == 4
    assert s["peak_accuracy"] == 0.8 and s["final_accuracy"] == 0.3
    # evals (0, .2), (2, .8), (4, .3): (1.0 * 2 + 1.1 * 2) / 2 / 4
    assert s["auc_accuracy"] == pytest.approx((0.2 + 0.8 + 0.8 + 0.3) / 4)
    assert s["collapsed"] and s["steps_to_collapse"] == 4  # 0.3 < 0.4, the run ends (truncated window)
    assert s["k3_kl_mean"] == pytest.approx(0.3)
    assert s["log_ppl_abs_diff_mean"] == pytest.approx(1.25)
    assert s["abs_diff_mean"] == pytest.approx(0.01)
    assert s["grad_norm_max"] == 5.0
    assert s["response_length_final"] == 5.0 and s["response_length_peak"] == 9.0
    assert s["surge_step"] == 3.0 and s["decay_period"] == 5.0


def test_run_summary_diverged_and_pending(tmp_path):
    rows = [{"step": 0, "val/accuracy": 0.3}, {"step": 1, "train/loss": 0.2, "rollout_corr/k3_kl": 0.0}]
    d = write_run(tmp_path / "div", rows, {"state": "diverged", "step": 2, "total_steps": 9, "message": "nan"})
    s = run_summary(d)
    assert s["collapsed"] and s["steps_to_collapse"] == 2 and s["message"] == "nan"
    assert math.isnan(s["surge_step"]) and math.isnan(s["grad_norm_max"])
    (tmp_path / "empty").mkdir()
    p = run_summary(tmp_path / "empty")
    assert p["state"] == "pending" and not p["collapsed"] and math.isnan(p["peak_accuracy"])


def test_condition_table_hand_computed():
    idx = pd.DataFrame([
        {"condition": "a", "state": "finished", "collapsed": True, "steps_to_collapse": 10.0,
         "peak_accuracy": 0.6, "final_accuracy": 0.1, "auc_accuracy": 0.3, "k3_kl_mean": 0.1, "log_ppl_abs_diff_mean": 1.0},
        {"condition": "a", "state": "diverged", "collapsed": True, "steps_to_collapse": 20.0,
         "peak_accuracy": 0.5, "final_accuracy": 0.2, "auc_accuracy": 0.3, "k3_kl_mean": 0.2, "log_ppl_abs_diff_mean": 1.0},
        {"condition": "a", "state": "finished", "collapsed": False, "steps_to_collapse": NAN,
         "peak_accuracy": 0.4, "final_accuracy": 0.4, "auc_accuracy": 0.3, "k3_kl_mean": 0.3, "log_ppl_abs_diff_mean": 1.0},
        {"condition": "a", "state": "failed", "collapsed": True, "steps_to_collapse": 1.0,  # not an outcome
         "peak_accuracy": 0.9, "final_accuracy": 0.9, "auc_accuracy": 0.9, "k3_kl_mean": 9.0, "log_ppl_abs_diff_mean": 9.0},
        {"condition": "b", "state": "finished", "collapsed": False, "steps_to_collapse": NAN,
         "peak_accuracy": 0.7, "final_accuracy": 0.7, "auc_accuracy": 0.6, "k3_kl_mean": 0.0, "log_ppl_abs_diff_mean": 0.0},
    ])
    t = condition_table(idx).set_index("condition")
    a, b = t.loc["a"], t.loc["b"]
    assert a["n"] == 3 and a["n_incomplete"] == 1 and a["n_collapsed"] == 2
    assert a["collapse_frac"] == pytest.approx(2 / 3)
    assert a["median_steps_to_collapse"] == 15.0
    assert a["peak_accuracy_mean"] == pytest.approx(0.5) and a["peak_accuracy_std"] == pytest.approx(0.1)
    assert a["final_accuracy_mean"] == pytest.approx(0.7 / 3)
    assert a["final_accuracy_std"] == pytest.approx(np.std([0.1, 0.2, 0.4], ddof=1))
    assert a["k3_kl_mean"] == pytest.approx(0.2)
    assert b["n"] == 1 and b["collapse_frac"] == 0.0
    assert math.isnan(b["median_steps_to_collapse"]) and math.isnan(b["peak_accuracy_std"])
    with pytest.raises(ValueError, match="no column 'nope'"):
        condition_table(idx, by="nope")


def test_describe_rule_states_the_parameters():
    text = describe_rule(frac=0.4, window=5, min_peak=0.1)
    assert "0.4 x its running peak" in text and "5 consecutive evaluations" in text and "0.1" in text


# ------------------------------------------------------------------------------- plateau rule
from timlab.experiments.studies.collapse import judge, plateau_collapse_step, plateau_levels  # noqa: E402
from timlab.errors import UsageError  # noqa: E402


def test_plateau_levels_hand_computed():
    acc = np.array([0.1, 0.6, 0.8, 0.7, 0.9, 0.2])
    lv = plateau_levels(acc, learned=1, level_window=3)
    assert np.isnan(lv[0])
    # partial means 0.6, 0.7; then best of full windows: (0.6+0.8+0.7)/3=0.7, (0.8+0.7+0.9)/3=0.8, max(0.8, 0.6)=0.8
    assert np.allclose(lv[1:], [0.6, 0.7, 0.7, 0.8, 0.8])


def test_plateau_rule_needs_a_sustained_fall_from_the_learned_level():
    # learned at step 2 (0.6 >= 0.5); plateau after step 8 = mean(0.8, 0.8, 0.8) = 0.8, line 0.4;
    # steps 10, 12 below -> collapse at 10
    df = evals([0.3, 0.6, 0.8, 0.8, 0.8, 0.3, 0.35, 0.8])
    assert plateau_collapse_step(df) == 10
    assert plateau_collapse_step(df, window=3) is None  # 0.8 at step 14 ends the fall after two
    assert plateau_collapse_step(df, frac=0.3) is None  # line 0.24: nothing below it
    # a single evaluation below the line never collapses, not even the last one
    assert plateau_collapse_step(evals([0.3, 0.6, 0.8, 0.8, 0.8, 0.1, 0.8, 0.1])) is None
    # a window cut short by the end of the run is not a collapse (the peak rule's allow_truncated counts it)
    late = evals([0.3, 0.6, 0.8, 0.8, 0.8, 0.1])
    assert plateau_collapse_step(late) is None
    assert collapse_step(late) == 10


def test_plateau_rule_ignores_falls_before_learning_and_one_lucky_evaluation():
    # an early-exploration fall (0.33 -> 0.1 for three evaluations) that the peak rule counts
    early = evals([0.33, 0.1, 0.1, 0.1, 0.7, 0.9, 0.95, 0.9])
    assert collapse_step(early) == 2
    assert plateau_collapse_step(early) is None
    # never learned: cannot collapse, whatever happens
    assert plateau_collapse_step(evals([0.4, 0.45, 0.0, 0.0, 0.0])) is None
    # the level is a mean over evaluations, not one lucky evaluation: a spike to 1.0 among 0.55s
    # gives plateau max(mean(0.55, 1, 0.55)) = 0.70, line 0.35; 0.4 twice is a dip, not a collapse
    spike = evals([0.55, 1.0, 0.55, 0.55, 0.4, 0.4, 0.55])
    assert plateau_collapse_step(spike) is None
    assert collapse_step(spike, window=2) == 8  # the peak rule measures from the spike (line 0.5)


def test_plateau_rule_learned_at_start_and_divergence():
    # learn-then-inject: learned at step 0 (0.97); level after step 0 is 0.97, line 0.485
    df = evals([0.97, 0.96, 0.4, 0.3, 0.9])
    assert plateau_collapse_step(df) == 4
    assert plateau_collapse_step(df, learned_at=0.98) is None
    ok = evals([0.2, 0.6, 0.7])
    assert plateau_collapse_step(ok, diverged=True, diverged_step=5) == 5  # after learning: a collapse
    assert plateau_collapse_step(ok, diverged=True, diverged_step=1) is None  # before learning (step 2): not
    assert judge(ok, rule="plateau", diverged=True, diverged_step=5) == 5
    assert judge(evals([0.33, 0.1, 0.1, 0.1]), rule="peak") == 2


def test_plateau_rule_bad_options_are_one_line_errors():
    df = evals([0.6, 0.6])
    with pytest.raises(UsageError, match="window must be >= 2"):
        plateau_collapse_step(df, window=1)
    with pytest.raises(UsageError, match="valid choices: peak, plateau"):
        judge(df, rule="late")
    assert "Plateau rule" in describe_rule(rule="plateau") and "2 consecutive" in describe_rule(rule="plateau")


def test_plateau_rule_rejudges_a_committed_sweep(capsys):
    """`timlab runs/threshold --rule plateau` on sweeps/threshold_d16: the sweeps' rule counts 10
    collapses, all early falls or a fall at the last evaluation; none is a sustained fall from
    a learned level."""
    from pathlib import Path

    from timlab.cli import main
    from timlab.experiments.sweeps.runner import query_index
    from timlab.experiments.studies.threshold import format_threshold, threshold_study

    sweep = Path(__file__).resolve().parents[1] / "sweeps" / "threshold_d16"
    stored = query_index(sweep, columns=["run_id", "collapsed"])
    plateau = query_index(sweep, columns=["run_id", "collapsed"], rule={"rule": "plateau"})
    assert int(stored["collapsed"].sum()) == 10 and int(plateau["collapsed"].sum()) == 0
    res = threshold_study(sweep, rule="plateau")
    assert res.rule == "plateau" and "collapsed[plateau]" in format_threshold(res)
    assert all(d == 0 for c in res.cells for d in c.doses["n_collapsed"])
    assert main(["runs", str(sweep), "--rule", "plateau", "--where", "collapsed"]) == 0
    assert "no runs match (of 20; collapsed: the plateau rule)" in capsys.readouterr().out
    assert main(["runs", str(sweep), "--rule", "late"]) == 2
    assert "valid choices: peak, plateau" in capsys.readouterr().err


def test_report_states_the_plateau_rule(tmp_path):
    from pathlib import Path

    from timlab.experiments.reports.report import build_report

    runs = sorted((Path(__file__).resolve().parents[1] / "sweeps" / "threshold_d16").glob("head_d16_m0.75__seed[12]*"))
    html = build_report(runs, tmp_path / "r.html", rule="plateau").path.read_text()
    assert "Plateau rule" in html
    with pytest.raises(UsageError, match="valid choices"):
        build_report(runs, tmp_path / "s.html", rule="late")


def test_rule_options_refuse_the_other_rules_knob():
    from timlab.experiments.studies.collapse import rule_options

    assert rule_options() == {} and rule_options(rule="plateau", learned_at=0.6) == {"rule": "plateau", "learned_at": 0.6}
    with pytest.raises(UsageError, match="belongs to the peak rule"):
        rule_options(rule="plateau", min_peak=0.5)
    with pytest.raises(UsageError, match="add --rule plateau"):
        rule_options(learned_at=0.6)


def test_before_falls_reads_the_steps_up_to_each_fall():
    """A run that falls under the plateau rule at step 60 (evaluations every 10 steps): the median and
    mean of a metric over steps 36-60; a run that holds is left out; a missing metric reads NaN."""
    from timlab.experiments.studies.collapse import before_falls

    steps = np.arange(0, 101)
    acc = np.where(steps % 10 == 0, np.where(steps < 60, 0.9, 0.2), np.nan)
    k3 = steps / 100.0  # k3 at step s is s / 100
    fall = pd.DataFrame({"step": steps, "val/accuracy": acc, "k": k3})
    hold = fall.assign(**{"val/accuracy": np.where(steps % 10 == 0, 0.9, np.nan)})
    rows = before_falls({"a": fall, "b": hold}, ("k", "missing"), 25, rule="plateau")
    assert [r["run"] for r in rows] == ["a"] and rows[0]["fall step"] == 60
    assert rows[0]["k"] == pytest.approx((0.48, 0.48))  # steps 36..60: median and mean 0.48
    assert all(math.isnan(x) for x in rows[0]["missing"])
