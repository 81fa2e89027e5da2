"""The early-warning benchmark (timlab.experiments.studies.early_warning) and the alarm rule it measures
(timlab.metrics.alarm): hand-computed statistics, planted runs whose falls, lead times and false
alarms are known, the registered split and threshold, the FINDINGS block recomputed from
sweeps/, and Study H1 as a second test set (planted H1 sweeps: with falls, without, incomplete)."""

from __future__ import annotations

import functools
import json
import math
import warnings
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from study_sweep import write_sweep
from timlab.cli import main
from timlab.config import ConfigError, RunSection, resolve, validate
from timlab.errors import TimlabError, UsageError
from timlab.experiments.studies import early_warning as ew
from timlab.experiments.studies.collapse import DEFAULT_LEARNED_AT
from timlab.experiments.studies.stats import clopper_pearson, fisher_greater
from timlab.experiments.studies.engine import planned_runs
from timlab.experiments.studies.registration import load_study
from timlab.findings import INDEX as FINDINGS, block_text
from timlab.metrics.alarm import ALARMS, EPS, AlarmWatch, alarm_statistic, first_alarm, statistic_series
from timlab.trainer.run import train

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------- the rule
def test_alarm_statistic_by_hand():
    assert alarm_statistic([1, 2, 3, 4, 5], rule="level", direction="up") == 3.0
    assert alarm_statistic([9, 1, 2, 3, 4, 5], rule="level", direction="down") == -3.0  # only the last 5
    assert math.isnan(alarm_statistic([1, 2, 3, 4], rule="level", direction="up"))
    v = [1.0, 1.0, 3.0, 3.0]
    assert alarm_statistic(v, rule="change", direction="up", window=2, baseline=2) == (3 + EPS) / (1 + EPS)
    assert alarm_statistic(v, rule="change", direction="down", window=2, baseline=2) == (1 + EPS) / (3 + EPS)
    assert alarm_statistic(v, rule="change", direction="either", window=2, baseline=2) == (3 + EPS) / (1 + EPS)
    assert alarm_statistic(v[::-1], rule="change", direction="either", window=2, baseline=2) == (3 + EPS) / (1 + EPS)
    assert alarm_statistic([0.0] * 15, rule="change", direction="up") == 1.0  # an exact rollout's k3: no change
    assert math.isnan(alarm_statistic([1.0] * 14, rule="change", direction="up"))
    s = statistic_series([1, 1, 1, 1, 5, 5], rule="level", direction="up")
    assert [x for x in s[:4] if not math.isnan(x)] == [] and s[4:] == [9 / 5, 13 / 5]
    assert first_alarm(s, 2.0) == 5 and first_alarm(s, 3.0) is None
    assert first_alarm([1.0, 2.0], 2.0) is None  # strictly above: the threshold is a healthy run's own score


@pytest.mark.parametrize("kwargs, words", [
    ({"rule": "trend", "direction": "up"}, ["trend", "level, change"]),
    ({"rule": "level", "direction": "sideways"}, ["sideways", "up, down, either"]),
    ({"rule": "level", "direction": "either"}, ["either", "change rule"]),
    ({"rule": "change", "direction": "up", "window": 0}, ["window", ">= 1"]),
])
def test_bad_rule_is_one_line(kwargs, words):
    with pytest.raises(UsageError) as e:
        alarm_statistic([1.0] * 20, **kwargs)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words)


def test_unknown_alarm_name_lists_the_registered_ones():
    with pytest.raises(TimlabError) as e:
        ALARMS.get("k3_trend")
    assert "k3_level" in str(e.value) and "grad_norm_change" in str(e.value)


def test_watch_fires_once_and_resumes_bitwise():
    values = [1.0] * 15 + [4.0] * 10
    w = AlarmWatch(rule="change", direction="up", threshold=2.0)
    seen = [w.update(v, step=i + 1) for i, v in enumerate(values)]
    # mean of the last 5 over the 10 before, steps 15-18: 1, 1.6, 2.2 (> 2: fires at step 17), 2.8
    assert [s for s, _ in seen[14:18]] == pytest.approx([1.0, 1.6, 2.2, 2.8], abs=1e-11)
    assert [a for _, a in seen].index(True) == 16 and w.fired_step == 17
    assert [s for s, _ in seen] == pytest.approx(statistic_series(values, rule="change", direction="up"), nan_ok=True)
    # a resumed watch continues with the same statistics
    a = AlarmWatch(rule="change", direction="up", threshold=2.0)
    for i, v in enumerate(values[:12]):
        a.update(v, step=i + 1)
    b = AlarmWatch(rule="change", direction="up", threshold=2.0)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert [b.update(v, step=i + 13)[0] for i, v in enumerate(values[12:])] == [s for s, _ in seen[12:]]
    assert b.fired_step == 17
    assert w.update(math.nan, step=26) == (pytest.approx(math.nan, nan_ok=True), False)


@pytest.mark.parametrize("sets, needle", [
    (["run.alarm_threshold=-1"], "run.alarm_threshold must be 0 (the rule's measured threshold) or a positive number, got -1"),
    (["run.alarm=grad_norm_change", "run.alarm_threshold=-1"], "run.alarm_threshold must be 0"),
    (["run.alarm=grad_norm_change", "run.alarm_threshold=1"],
     "run.alarm_threshold 1 of a change rule must be above 1: its statistic is a fold change (1 = no change), so the "
     "alarm would fire on every step it watches (run.alarm=grad_norm_change)"),
    (["run.alarm=k3_change", "run.alarm_threshold=0.5"], "of a change rule must be above 1"),
])
def test_59_23_an_alarm_threshold_at_or_below_the_statistics_floor_is_refused(sets, needle):
    """Issue 59, finding 23: run.alarm_threshold=-1 was accepted and the alarm fired at "1x" on every
    armed step (an either-way fold change is never below 1)."""
    from timlab.config import ConfigError, resolve, validate

    with pytest.raises(ConfigError) as e:
        validate(resolve(preset="smoke", overrides=sets))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_59_23_thresholds_above_the_floor_and_the_measured_default_pass():
    from timlab.config import resolve, validate

    for sets in (["run.alarm=grad_norm_change", "run.alarm_threshold=1.5"], ["run.alarm=k3_level", "run.alarm_threshold=0.1"],
                 ["run.alarm=grad_norm_change"], ["run.alarm_threshold=0.5"]):  # the last: alarm off, unused
        validate(resolve(preset="smoke", overrides=sets))
    with pytest.raises(UsageError, match="alarm threshold 0 of a level rule must be above 0"):
        AlarmWatch(rule="level", direction="up", threshold=0.0)
    # why: a flat indicator's either-way fold change is exactly 1, so any threshold below 1 fires every step
    assert alarm_statistic([3.0] * 15, rule="change", direction="either") == 1.0
    with pytest.raises(UsageError, match="alarm threshold -1 of a change rule must be above 1"):
        AlarmWatch(rule="change", direction="either", threshold=-1.0)


def test_fisher_greater_by_hand():
    assert fisher_greater(2, 2, 0, 2) == pytest.approx(1 / 6)  # both events in a: 1 of C(4,2) draws
    assert fisher_greater(1, 2, 1, 3) == pytest.approx(1 - 3 / 10)  # P(X >= 1), 2 events among 5, draw 2
    assert fisher_greater(0, 5, 7, 9) == 1.0
    assert fisher_greater(3, 5, 13, 257) == pytest.approx(0.0017502, rel=1e-4)  # the registration's power figure
    with pytest.raises(ValueError):
        fisher_greater(3, 2, 0, 1)


# ------------------------------------------------------------------------------- planted runs
def planted(acc: dict[int, float], k3: dict[int, float] | float = 1e-3, steps: int = 120,
            grad: float = 1.0) -> pd.DataFrame:
    """A metrics table: steps 0..steps, accuracy at the steps of ``acc``, k3 per step (a dict of
    change points or a constant), the other indicators constant."""
    rows = []
    level = k3 if isinstance(k3, float) else None
    for s in range(steps + 1):
        if level is None:
            level = k3[0]
        if isinstance(k3, dict) and s in k3:
            level = k3[s]
        row = {"step": s, "val/accuracy": acc.get(s, math.nan)}
        if s >= 1:
            row.update({"train/loss": 0.1, "rollout_corr/k3_kl": level, "rollout_corr/log_ppl_abs_diff": 0.01,
                        "train/response_length_mean": 20.0, "train/entropy": 0.3, "train/grad_norm": grad,
                        "train/reward_std": 0.4})
        rows.append(row)
    return pd.DataFrame(rows)


def evals(values: list[float], every: int = 10) -> dict[int, float]:
    return {i * every: v for i, v in enumerate(values)}


FALL_ACC = evals([0.9] * 7 + [0.2] * 6)             # learned at 0; below 0.45 from step 70 on
HEALTHY_ACC = evals([0.9] * 13)
DIP_ACC = evals([0.9] * 5 + [0.3] + [0.9] * 7)       # one evaluation below the line at 50, then back


def test_run_series_fall_and_dip():
    r = ew.run_series("s/fall", planted(FALL_ACC))
    assert (r.learned_step, r.fall_step, r.before_fall, r.fell, r.dipped) == (0, 70, 60, True, False)
    assert r.series["step"].min() == 1 and r.series["step"].max() == 120
    d = ew.run_series("s/dip", planted(DIP_ACC))
    assert (d.fall_step, d.dipped) == (None, True)
    h = ew.run_series("s/ok", planted(HEALTHY_ACC))
    assert (h.fall_step, h.dipped) == (None, False)
    late = ew.run_series("s/late", planted(evals([0.1, 0.2, 0.6] + [0.9] * 10)))
    assert late.learned_step == 20 and late.series["step"].min() == 21  # watched after it learned only


def test_lead_time_of_a_planted_rise():
    # k3 rises tenfold at step 50; the fall is at 70 (F_prev 60)
    r = ew.run_series("s/fall", planted(FALL_ACC, {0: 1e-3, 50: 1e-2}))
    lvl = ew.alarm_trace(r, ALARMS.get("k3_level"))
    # trailing mean of 5 > 0.005 once three of the five are 0.01: step 52
    assert ew.first_alarm_step(lvl, 0.005) == 52
    chg = ew.alarm_trace(r, ALARMS.get("k3_change"))
    # step 50: (4e-3 + 1e-2)/5 / 1e-3 = 2.8; step 51: 4.6 -> fires at 3x
    assert ew.first_alarm_step(chg, 3.0) == 51
    assert lvl[0].max() == 70  # nothing after the fall is read
    res = ew.evaluate([r], "k3_level", 0.005)
    assert (res.detected, res.early, res.leads) == (1, 1, (18,))


def planted_study_runs() -> list[ew.RunSeries]:
    return [
        ew.run_series("a/fall_warned", planted(FALL_ACC, {0: 1e-3, 50: 1e-2})),   # alarm at 52: lead 18, early
        ew.run_series("a/fall_late", planted(FALL_ACC, {0: 1e-3, 66: 1e-2})),     # alarm at 68: lead 2, not early
        ew.run_series("a/fall_missed", planted(FALL_ACC)),                         # no alarm
        ew.run_series("a/ok_quiet", planted(HEALTHY_ACC)),
        ew.run_series("a/ok_spike", planted(HEALTHY_ACC, {0: 1e-3, 90: 1e-2, 95: 1e-3})),  # a false alarm
        ew.run_series("a/dip_spike", planted(DIP_ACC, {0: 1e-3, 30: 1e-2, 40: 1e-3})),     # a false alarm, dipped
    ]


def test_planted_detection_false_alarms_and_p():
    res = ew.evaluate(planted_study_runs(), "k3_level", 0.005)
    assert (res.falls, res.detected, res.early, res.leads) == (3, 2, 1, (2, 18))
    assert (res.healthy, res.false_alarms, res.clean, res.clean_alarms) == (3, 2, 2, 1)
    assert res.alarms == {"a/fall_warned": 52, "a/fall_late": 68, "a/fall_missed": None}
    assert res.p == pytest.approx(fisher_greater(2, 3, 2, 3))
    # scores (largest trailing mean, up to F for a fall): falls 0.01, 0.01, 0.001; healthy 0.001, 0.01, 0.01.
    # Of the 9 pairs, a fall above: 2 (each 0.01 fall over the 0.001 run); ties count half: 4 x 0.01 = 0.01 and
    # 1 x 0.001 = 0.001 -> 2.5: AUC = 4.5 / 9
    assert res.auc == pytest.approx(4.5 / 9)
    pts = ew.roc_points(planted_study_runs(), "k3_level")
    assert pts[0] == (math.inf, 0.0, 0.0) and pts[-1][1:] == (1.0, 1.0)
    assert all(b[1] >= a[1] and b[2] >= a[2] for a, b in zip(pts, pts[1:]))


def test_choose_threshold_allows_the_target_share():
    scores = [float(x) for x in range(1, 21)]
    c = ew.choose_threshold(scores, 0.05)
    assert c == 19.0 and sum(s > c for s in scores) == 1  # 1 of 20 = 5%
    assert ew.choose_threshold(scores, 0.0) == 20.0
    assert ew.choose_threshold([-math.inf, -math.inf, 3.0], 0.05) == 3.0
    with pytest.raises(UsageError):
        ew.choose_threshold([])


def test_split_is_stratified_and_deterministic():
    runs = [ew.run_series(f"s{i % 2}/r{i}", planted(FALL_ACC if i < 6 else HEALTHY_ACC)) for i in range(20)]
    choose, test = ew.split(runs)
    assert ew.split(list(reversed(runs))) == (choose, test)
    for sweep in ("s0", "s1"):
        for fell in (True, False):
            n_c = sum(r.sweep == sweep and r.fell == fell for r in choose)
            n_t = sum(r.sweep == sweep and r.fell == fell for r in test)
            assert n_c - n_t in (0, 1)
    # 3 falls and 7 others per sweep: 2 + 4 of each go to the choosing half
    assert sum(r.fell for r in choose) == 4 and len(choose) == 12 and len(test) == 8
    assert len(choose) + len(test) == 20 and not {r.name for r in choose} & {r.name for r in test}


def _write_run(d: Path, m: pd.DataFrame, state: str = "finished") -> None:
    d.mkdir(parents=True)
    m.to_parquet(d / "metrics.parquet")
    (d / "status.json").write_text(json.dumps({"state": state, "step": int(m["step"].max()),
                                               "total_steps": int(m["step"].max()), "message": ""}))


def test_load_runs_inclusion_and_repeats(tmp_path):
    _write_run(tmp_path / "a" / "fall_s0", planted(FALL_ACC))
    _write_run(tmp_path / "a" / "ok_s0", planted(HEALTHY_ACC, 2e-3))
    _write_run(tmp_path / "b" / "ok_s0_longer", planted(evals([0.9] * 16), 2e-3, steps=150))  # repeats a/ok_s0
    _write_run(tmp_path / "b" / "short", planted(evals([0.9] * 6), steps=50))                  # < 100 steps
    _write_run(tmp_path / "b" / "never", planted(evals([0.1] * 13)))                          # never learned
    _write_run(tmp_path / "b" / "broken", planted(HEALTHY_ACC, 5e-3), state="failed")         # not complete
    _write_run(tmp_path / "c" / "grad", planted(HEALTHY_ACC, 2e-3, grad=2.0))                 # differs: kept
    runs = ew.load_runs(tmp_path)
    assert [r.name for r in runs] == ["a/fall_s0", "b/ok_s0_longer", "c/grad"]
    with pytest.raises(UsageError):
        ew.load_runs(tmp_path / "nowhere")


# ------------------------------------------------------------------------------- the committed result
@pytest.fixture(scope="module")
def committed():
    return ew.study(REPO / "sweeps")


def test_registered_counts(committed):
    # the registration's survey: 528 runs after repeats, 11 falls; 6 choosing and 5 test
    assert (committed.runs, committed.falls) == (528, 11)
    assert committed.choosing["k3_level"].falls == 6 and committed.test["k3_level"].falls == 5
    assert committed.choosing["k3_level"].healthy == 260 and committed.test["k3_level"].healthy == 257


def test_findings_block_matches_the_committed_sweeps(committed):
    block = block_text(FINDINGS, ew.FINDINGS_BLOCK)
    assert block, f"no <!-- findings:{ew.FINDINGS_BLOCK} --> block in {FINDINGS}"
    assert block == ew.format_study(committed) + "\n", (
        "the early-warning block differs from sweeps/: run python -m timlab.experiments.studies.early_warning sweeps")


def test_registered_thresholds_are_the_measured_ones(committed):
    for name in ALARMS:
        assert ALARMS.get(name).threshold == committed.choosing[name].threshold, name
    # what a later test set takes from the benchmark: its Holm family and the rule it shipped
    assert tuple(committed.holm) == ew.TESTED_RULES and committed.shipped() == (ew.SHIPPED, True)


# ------------------------------------------------------------------------------- the trainer's alarm
def _alarm_run(tmp_path, name: str, *sets: str) -> pd.DataFrame:
    cfg = resolve(preset="smoke", overrides=["rollout.samples_per_prompt=8", "run.alarm=grad_norm_level", *sets])
    train(cfg, tmp_path / name)
    m = pd.read_parquet(tmp_path / name / "metrics.parquet")
    return m[m["step"] >= 1].reset_index(drop=True)


def test_trainer_alarm_logs_each_step_and_warns_once(tmp_path):
    with pytest.warns(UserWarning, match=r"step 5: early-warning alarm grad_norm_level: train/grad_norm at") as rec:
        t = _alarm_run(tmp_path, "run", "run.steps=7", "run.alarm_threshold=1e-9", "run.alarm_armed_at=0")
    assert sum("early-warning alarm" in str(w.message) for w in rec) == 1
    assert t["alarm/above_threshold"].tolist() == [0.0] * 4 + [1.0] * 3  # a level rule needs 5 values
    g = t["train/grad_norm"].tolist()
    stat = t["alarm/statistic"]
    assert stat.iloc[:4].isna().all()
    assert [stat.iloc[4], stat.iloc[6]] == [math.fsum(g[0:5]) / 5, math.fsum(g[2:7]) / 5]  # the rule's own bits


def test_trainer_alarm_waits_until_armed_and_resumes(tmp_path):
    t = _alarm_run(tmp_path, "never", "run.steps=6", "run.alarm_threshold=1e-9", "run.alarm_armed_at=1")
    m = pd.read_parquet(tmp_path / "never" / "metrics.parquet")
    assert m["val/accuracy"].max() < 1  # so the alarm never armed
    assert (t["alarm/above_threshold"] == 0).all() and t["alarm/statistic"].isna().all()
    # stopped at step 4 and resumed to 7: the watch carries its last values across the checkpoint
    with pytest.warns(UserWarning, match="step 5: early-warning alarm"):
        ref = _alarm_run(tmp_path, "ref", "run.steps=7", "run.alarm_threshold=1e-9", "run.alarm_armed_at=0")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*early-warning alarm")  # steps 1-4: the rule is not defined yet
        _alarm_run(tmp_path, "resumed", "run.steps=4", "run.alarm_threshold=1e-9", "run.alarm_armed_at=0",
                   "run.checkpoint_every=4")
    cfg = resolve(preset="smoke", overrides=["rollout.samples_per_prompt=8", "run.alarm=grad_norm_level", "run.steps=7",
                                             "run.alarm_threshold=1e-9", "run.alarm_armed_at=0", "run.checkpoint_every=4"])
    with pytest.warns(UserWarning, match="step 5: early-warning alarm") as rec:
        train(cfg, tmp_path / "resumed", resume=True)
    assert sum("early-warning alarm" in str(w.message) for w in rec) == 1
    again = pd.read_parquet(tmp_path / "resumed" / "metrics.parquet")
    again = again[again["step"] >= 1].reset_index(drop=True)
    for col in ("alarm/above_threshold", "alarm/statistic", "train/grad_norm"):
        pd.testing.assert_series_equal(ref[col], again[col], check_exact=True)


@pytest.mark.parametrize("sets, words", [
    (["run.alarm=k3_trend"], ["unknown run.alarm 'k3_trend'", "off, entropy_change", "grad_norm_change"]),
    (["run.alarm_armed_at=2"], ["run.alarm_armed_at", "[0, 1]"]),
])
def test_trainer_alarm_bad_settings_one_line(sets, words):
    with pytest.raises(ConfigError) as e:
        validate(resolve(preset="smoke", overrides=sets))
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words)


def test_alarm_defaults_are_the_benchmarks():
    assert RunSection().alarm == "off" and RunSection().alarm_armed_at == DEFAULT_LEARNED_AT


# ------------------------------------------------------------------------------- timlab analyze --alarm
def test_analyze_alarm_on_a_run_directory(tmp_path, capsys):
    _write_run(tmp_path / "run", planted(FALL_ACC, {0: 1e-3, 50: 1.0}))
    c = ew.check_run(tmp_path / "run", "k3_level")
    # mean of steps 48-52: (2e-3 + 3) / 5 = 0.6004 > 0.411; at 51: 0.4006, not yet
    assert (c.armed_after, c.watched, c.first, c.above) == (0, 120, 52, 120 - 51)
    assert c.statistic == pytest.approx(0.6004)
    assert main(["analyze", str(tmp_path / "run"), "--alarm", "k3_level"]) == 0
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1 and "fired at step 52 (0.6)" in out and "watched 120 steps after step 0" in out
    assert out.endswith("experimental: no alarm rule passed the re-registered early-warning benchmark "
                        "(its measured catches and false alarms: docs/metrics.md)")
    # armed only after an accuracy it never reaches: never watched
    assert ew.check_run(tmp_path / "run", "k3_level", armed_at=0.95).watched == 0
    c0 = ew.check_run(tmp_path / "run", "k3_level", armed_at=0)
    assert (c0.armed_after, c0.watched, c0.first) == (None, 120, 52)  # step 0 logs no k3

def test_analyze_alarm_skips_steps_that_updated_nothing(tmp_path):
    """`timlab analyze --alarm` watches a run as the trainer's alarm does: a step with a grad norm of
    exactly 0 (or train/updated 0) is not in the series. Planted: grad_norm_change's statistic
    would read 1/1e-12 at the zero steps; without them no step moves."""
    m = planted(HEALTHY_ACC)
    m.loc[m["step"].between(60, 64), "train/grad_norm"] = 0.0
    _write_run(tmp_path / "run", m)
    c = ew.check_run(tmp_path / "run", "grad_norm_change")
    assert (c.watched, c.first, c.above) == (120 - 5, None, 0)
    m2 = planted(HEALTHY_ACC)
    m2["train/updated"] = 1.0
    m2.loc[m2["step"].between(60, 64), ["train/updated", "train/grad_norm"]] = [0.0, 50.0]
    _write_run(tmp_path / "run2", m2)
    assert ew.check_run(tmp_path / "run2", "grad_norm_change").first is None
    # the same spike on steps that did update fires
    m3 = planted(HEALTHY_ACC)
    m3.loc[m3["step"].between(60, 64), "train/grad_norm"] = 50.0
    _write_run(tmp_path / "run3", m3)
    assert ew.check_run(tmp_path / "run3", "grad_norm_change").first == 60


def test_analyze_alarm_on_a_log_file_and_bad_names(tmp_path, capsys):
    sample = REPO / "timlab" / "data" / "sample_logprobs.jsonl"
    assert main(["analyze", str(sample), "--alarm", "k3_level"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("alarm k3_level (mean of the last 5 steps' "
                                                                      "rollout_corr/k3_kl > 0.411) on ")
    for name, words in (("grad_norm_change", ["train/grad_norm", "run directory", "k3_level"]),
                        ("bogus", ["unknown alarm 'bogus'", "grad_norm_change"])):
        assert main(["analyze", str(sample), "--alarm", name]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
        assert all(w in captured.err for w in words)


def test_a_sweep_committed_after_registration_is_not_read(committed):
    """The registered analysis reads REGISTERED_SWEEPS only (Studies H1, H, L1, E3c and P1 came later):
    the later sweeps hold runs it would include, and its count is the registered sweeps' alone."""
    assert len(ew.REGISTERED_SWEEPS) == 21 and "h1" not in ew.REGISTERED_SWEEPS
    later = tuple(p.name for p in (REPO / "sweeps").iterdir() if p.is_dir() and p.name not in ew.REGISTERED_SWEEPS)
    later_runs = ew.load_runs(REPO / "sweeps", later)  # the runs only: the registered ones are the fixture's
    assert later_runs and {r.name.split("/")[0] for r in later_runs} <= {"h1", "harm", "harm_oos", "harm_oos_probe", "l1", "e3c", "p1", "p2", "p2_rerun", "h1_intel",
                                                                              "p2_amd", "harm2", "harm2_pilot", "late_falls", "s1_s", "s1_m", "s1_l"}
    assert (committed.runs, committed.falls) == (528, 11)  # the later sweeps are there, and left out


# ------------------------------------------------------------------------------- Study H1, a second test set
H1_STUDY = REPO / "docs" / "examples" / "studies" / "h1.yaml"
H1_BLOCK = f"{ew.FINDINGS_BLOCK}-h1"


@functools.cache
def h1_ids() -> dict[str, str]:
    """H1's 56 planned runs: condition -> run directory (the study engine's expansion of its sweep)."""
    return {p.name: p.run_id for p in planned_runs(load_study(H1_STUDY))}


def h1_run(name: str, *, fall_at: int | None = None, dip_at: int | None = None,
           grad: dict[int, float] | None = None) -> pd.DataFrame:
    """A 2,000-step H1 run: accuracy 0.95 every 25 steps (learned at step 0), from ``fall_at`` on
    0.2 (a fall at that evaluation), at ``dip_at`` alone 0.3 (a dip); train/grad_norm 1.0, then the
    values of ``grad`` from their steps on; the other indicators (and mismatch/k3_seq) constant,
    train/loss one value per run (so no two runs repeat)."""
    steps = np.arange(2001)
    acc = np.where(steps % 25 == 0, 0.95, np.nan)
    if fall_at is not None:
        acc[(steps >= fall_at) & (steps % 25 == 0)] = 0.2
    if dip_at is not None:
        acc[dip_at] = 0.3
    g = np.ones(steps.size)
    for s, v in sorted((grad or {}).items()):
        g[s:] = v
    t = steps >= 1
    nan = np.full(steps.size, np.nan)
    col = lambda v: np.where(t, v, nan)  # noqa: E731  (step 0 logs the evaluation only)
    return pd.DataFrame({"step": steps, "val/accuracy": acc, "train/loss": col(zlib.crc32(name.encode()) / 2**32),
                         "rollout_corr/k3_kl": col(1e-3), "rollout_corr/log_ppl_abs_diff": col(0.01),
                         "train/response_length_mean": col(30.0), "train/entropy": col(0.3), "train/grad_norm": col(g),
                         "train/reward_std": col(0.4), "mismatch/k3_seq": col(0.05)})


def h1_sweep(tmp_path: Path, plant: dict[str, dict], names: list[str] | None = None,
             states: dict | None = None) -> Path:
    """``tmp_path/sweeps`` holding a planted H1 sweep (``plant``: condition -> ``h1_run`` keywords)
    of the runs ``names`` (default all 56, finished at step 2000)."""
    ids, names = h1_ids(), names or list(h1_ids())
    for block, folder in (("amd", "h1"), ("intel", "h1_intel")):  # Amendment 1: seeds 0-2 and 3-7
        mine = [p.name for p in planned_runs(load_study(H1_STUDY)) if p.block == block and p.name in names]
        if mine:
            write_sweep(tmp_path / "sweeps" / folder, mine, lambda n: h1_run(n, **plant.get(n, {})), 2000,
                        run_ids=ids, states=states)
    return tmp_path / "sweeps"


def test_h1_with_falls_confirms_the_shipped_rule(tmp_path):
    # the 8 hold_1e-2 runs fall at step 1000 (F_prev 975); 6 of them see the grad norm drop tenfold at
    # step 940 (first alarm at 944: the 5 steps 940-944 against the 10 before, 10x > 3.98x), 2 do not;
    # of the 48 others, 3 see it jump fivefold at step 1500 (false alarms at 1503), one of them dipped
    fall = [f"hold_1e-2_s{s}" for s in range(8)]
    plant = {n: {"fall_at": 1000, "grad": {940: 0.1} if i < 6 else {}} for i, n in enumerate(fall)}
    plant |= {"control_s0": {"grad": {1500: 5.0}}, "control_s1": {"grad": {1500: 5.0}},
              "hold_3e-3_s2": {"grad": {1500: 5.0}, "dip_at": 500}}
    t = ew.second_test(h1_sweep(tmp_path, plant), "h1", study_file=H1_STUDY)
    assert t.incomplete is None and (len(t.runs), t.falls) == (56, 8)
    g = t.results["grad_norm_change"]
    assert g.threshold == ALARMS.get("grad_norm_change").threshold
    assert (g.falls, g.detected, g.early, g.leads) == (8, 6, 6, (56,) * 6)
    assert (g.healthy, g.false_alarms, g.clean, g.clean_alarms) == (48, 3, 47, 2)
    # scores: 6 falls at 10x, 2 at 1x; 45 non-falls at 1x (ties: half), 3 at 5x -> (6 * 48 + 2 * 45 / 2) / (8 * 48)
    assert g.auc == pytest.approx(333 / 384)
    p = fisher_greater(6, 8, 3, 48)
    assert g.p == pytest.approx(p) and t.holm["grad_norm_change"] == pytest.approx(9 * p)  # the smallest of 9
    assert set(t.holm) == set(ew.TESTED_RULES) and len(t.holm) == 9  # k3_seq's two rules: logged, not in the family
    assert t.results["k3_seq_level"].falls == 8 and t.results["k3_seq_level"].p == 1.0
    assert t.readout("k3_seq_level") == "descriptive (not one of the 9 tested rules)"
    assert all(t.holm[n] == 1.0 and t.results[n].detected == 0 for n in ew.TESTED_RULES if n != "grad_norm_change")
    assert t.readout("grad_norm_change") == "confirmed on H1" and t.readout("k3_level") == "not confirmed"
    text = ew.format_test_set(t)
    rows = {x.split(" | ")[0]: x for x in text.splitlines() if x.startswith("| ")}
    assert rows["| grad_norm_change"].endswith(
        f"| 6/8 [0.35, 0.97] | 6/8 | 3/48 [0.01, 0.17] | 2/47 [0.01, 0.15] | 56 (56-56) | 0.87 | {p:.2g} | "
        f"{9 * p:.2g} | confirmed on H1 |")
    ids = h1_ids()
    assert f"| h1/{ids['hold_1e-2_s0']} | 0 | 975 | 1000 | - | 944 | - |" in text
    assert f"| h1_intel/{ids['hold_1e-2_s7']} | 0 | 975 | 1000 | - | - | - |" in text
    assert text.splitlines()[-1] == (f"The shipped rule **grad_norm_change** is **confirmed on H1** (Holm p = "
                                     f"{9 * p:.2g}; detected 6/8, early 6/8, false alarms 3/48, lead 56 (56-56) steps).")


def test_h1_test_set_leaves_out_seed_3s_runs_made_on_amd(tmp_path):
    """Amendment 1: seed 3's five runs made on AMD stay in sweeps/h1 but are not H1's; falls there
    count nowhere."""
    ids, planned = h1_ids(), planned_runs(load_study(H1_STUDY))
    amd = [p.name for p in planned if p.block == "amd"]
    left_out = ["control_s3", "hold_3e-3_s3", "hold_3e-3_tis_s3", "hold_1e-2_s3", "hold_1e-2_tis_s3"]
    write_sweep(tmp_path / "sweeps" / "h1", amd + left_out,
                lambda n: h1_run(n, fall_at=500 if n in left_out else None), 2000, run_ids=ids)
    write_sweep(tmp_path / "sweeps" / "h1_intel", [p.name for p in planned if p.block == "intel"], h1_run, 2000,
                run_ids=ids)
    t = ew.second_test(tmp_path / "sweeps", "h1", study_file=H1_STUDY)
    assert (len(t.runs), t.falls) == (56, 0)
    assert sorted({r.sweep for r in t.runs}) == ["h1", "h1_intel"]
    assert sum(r.sweep == "h1" for r in t.runs) == 21


def test_h1_without_falls_and_many_jumps_cries_wolf(tmp_path):
    jumpy = [f"{a}_s{s}" for a in ("hold_1e-2", "hold_1e-2_tis") for s in range(8)] + [f"grow_s{s}" for s in range(4)]
    t = ew.second_test(h1_sweep(tmp_path, {n: {"grad": {1500: 5.0}} for n in jumpy}), "h1", study_file=H1_STUDY)
    g = t.results["grad_norm_change"]
    assert (t.falls, g.falls, g.healthy, g.false_alarms, t.holm) == (0, 0, 56, 20, {})
    lo, hi = clopper_pearson(20, 56)
    assert lo > 0.05 and t.readout("grad_norm_change") == "cries wolf on long runs"
    assert t.readout("k3_level") == "holds its false-alarm rate on long runs"  # 0/56: upper end 0.064
    text = ew.format_test_set(t)
    assert "| - | - | 20/56 [0.23, 0.50] | 20/56 [0.23, 0.50] | - | - | - | - | cries wolf on long runs |" in text
    assert "falls: F, F_prev" not in text  # no falls table
    assert text.splitlines()[-1].endswith("The shipped rule **grad_norm_change**: **cries wolf on long runs**, false "
                                          "alarms 20/56 [0.23, 0.50] (runs that never dipped: 20/56 [0.23, 0.50]).")


def test_h1_quiet_holds_and_the_registered_thresholds_are_used(tmp_path, monkeypatch):
    # 3 runs jump fivefold (alarm at 3.98x), 10 jump 3.5x (no alarm): H1's own 5% threshold would be
    # the third largest score, 5x, where nothing alarms; the registered one lets 3 alarm
    big = ["control_s0", "grow_s3", "hold_3e-3_tis_s7"]
    small = [f"grow_tis_s{s}" for s in range(8)] + ["control_s5", "control_s6"]
    plant = {n: {"grad": {1500: 5.0}} for n in big} | {n: {"grad": {1500: 3.5}} for n in small}

    def chosen_again(*a, **k):
        raise AssertionError("a threshold was re-chosen on the test set")
    monkeypatch.setattr(ew, "choose_threshold", chosen_again)
    t = ew.second_test(h1_sweep(tmp_path, plant), "h1", study_file=H1_STUDY)
    monkeypatch.undo()
    assert all(t.results[n].threshold == ALARMS.get(n).threshold for n in ALARMS)
    g = t.results["grad_norm_change"]
    assert (g.healthy, g.false_alarms) == (56, 3)
    scores = [ew.score(x) for x in ew.traces_of(t.runs, "grad_norm_change").values()]
    own = ew.choose_threshold(scores)
    assert own == pytest.approx(5.0) and ew.evaluate(t.runs, "grad_norm_change", own).false_alarms == 0
    lo, hi = clopper_pearson(3, 56)
    assert hi <= 0.20 and t.readout("grad_norm_change") == "holds its false-alarm rate on long runs"
    assert ew.format_test_set(t).splitlines()[-1].endswith(
        f"**holds its false-alarm rate on long runs**, false alarms 3/56 [{lo:.2f}, {hi:.2f}] (runs that never dipped: "
        f"3/56 [{lo:.2f}, {hi:.2f}]).")


def test_h1_undecided_between_the_two_bounds():
    t = ew.SecondTest(sweep="h1", steps=2000, incomplete=None, runs=[],
                      results={"grad_norm_change": ew.RuleResult("grad_norm_change", 3.98, 0, 0, 0, 56, 6, 56, 6, (),
                                                                 math.nan, math.nan)})
    lo, hi = clopper_pearson(6, 56)
    assert lo <= 0.05 < 0.20 < hi and t.readout("grad_norm_change") == "undecided"


def test_h1_incomplete_prints_one_line_and_reads_no_metrics(tmp_path, monkeypatch):
    names = list(h1_ids())
    root = h1_sweep(tmp_path, {}, names=names[:14],
                    states={"grow_tis_s1": ("running", 700), "grow_s1": ("diverged", 800)})

    def peek(*a, **k):
        raise AssertionError("an H1 run's metrics were read before H1 is complete")
    monkeypatch.setattr(ew, "load_runs", peek)
    monkeypatch.setattr(ew.RunDir, "read_metrics", peek)
    t = ew.second_test(root, "h1", study_file=H1_STUDY)
    assert (t.runs, t.results, t.holm) == ([], {}, {})
    assert ew.format_test_set(t) == (
        "INCOMPLETE: 13 of 56 runs finished at step 2000 (missing: grow_tis seeds 1-7, control seeds 2-7, "
        "hold_3e-3 seeds 2-7, hold_3e-3_tis seeds 2-7, hold_1e-2 seeds 2-7, hold_1e-2_tis seeds 2-7, grow seeds 2-7); "
        "no endpoint is computed before the study is complete (no interim analysis).")


@pytest.mark.parametrize("sweep, words", [
    ("e2", ["'e2' is one of the 21 sweeps", "valid choices: h1"]),
    ("harm", ["'harm' has no study file", "valid choices: h1"]),
    ("nope", ["'nope' is not a sweep under", "valid choices: h1"]),
])
def test_test_set_bad_sweep_is_one_line(tmp_path, capsys, sweep, words):
    (tmp_path / "sweeps" / "e2").mkdir(parents=True)
    (tmp_path / "sweeps" / "harm").mkdir()
    assert ew.main([str(tmp_path / "sweeps"), "--test-set", sweep]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert all(w in captured.err for w in words), captured.err
    with pytest.raises(UsageError):
        ew.second_test(tmp_path / "sweeps", sweep)


def test_findings_h1_block_matches_the_committed_sweeps(capsys):
    block = block_text(FINDINGS, H1_BLOCK)
    assert block, f"no <!-- findings:{H1_BLOCK} --> block in {FINDINGS}"
    assert block == ew.format_test_set(ew.second_test(REPO / "sweeps", "h1")) + "\n", (
        "the early-warning-h1 block differs from sweeps/: run python -m timlab.experiments.studies.early_warning sweeps "
        "--test-set h1")
    assert ew.main([str(REPO / "sweeps"), "--test-set", "h1"]) == 0
    assert capsys.readouterr().out == block
