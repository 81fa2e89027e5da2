"""The early-warning benchmark (timlab.experiments.early_warning) and the alarm rule it measures
(timlab.metrics.alarm): hand-computed statistics, planted runs whose falls, lead times and false
alarms are known, the registered split and threshold, and the FINDINGS block recomputed from
sweeps/."""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from timlab.cli import main
from timlab.config import ConfigError, RunSection, resolve, validate
from timlab.errors import TimlabError, UsageError
from timlab.experiments import early_warning as ew
from timlab.experiments.collapse import DEFAULT_LEARNED_AT
from timlab.experiments.stats import fisher_greater
from timlab.metrics.alarm import ALARMS, EPS, AlarmWatch, alarm_statistic, first_alarm, statistic_series
from timlab.trainer.run import train

REPO = Path(__file__).resolve().parents[1]
FINDINGS = REPO / "docs" / "FINDINGS.md"


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
    text = FINDINGS.read_text()
    m = re.search(rf"<!-- findings:{ew.FINDINGS_BLOCK} -->\n(.*?)\n<!-- /findings:{ew.FINDINGS_BLOCK} -->", text, re.S)
    assert m, f"no <!-- findings:{ew.FINDINGS_BLOCK} --> block in {FINDINGS}"
    assert m.group(1) == ew.format_study(committed), (
        "the early-warning block differs from sweeps/: run python -m timlab.experiments.early_warning sweeps")


def test_registered_thresholds_are_the_measured_ones(committed):
    for name in ALARMS:
        assert ALARMS.get(name).threshold == committed.choosing[name].threshold, name


# ------------------------------------------------------------------------------- the trainer's alarm
def _alarm_run(tmp_path, name: str, *sets: str) -> pd.DataFrame:
    cfg = resolve(preset="smoke", overrides=["rollout.samples_per_prompt=8", "run.alarm=grad_norm_level", *sets])
    train(cfg, tmp_path / name)
    m = pd.read_parquet(tmp_path / name / "metrics.parquet")
    return m[m["step"] >= 1].reset_index(drop=True)


def test_trainer_alarm_logs_each_step_and_warns_once(tmp_path):
    with pytest.warns(UserWarning, match=r"step 5: early-warning alarm grad_norm_level: train/grad_norm at") as rec:
        t = _alarm_run(tmp_path, "run", "run.steps=7", "run.alarm_threshold=-1", "run.alarm_armed_at=0")
    assert sum("early-warning alarm" in str(w.message) for w in rec) == 1
    assert t["alarm/above_threshold"].tolist() == [0.0] * 4 + [1.0] * 3  # a level rule needs 5 values
    g = t["train/grad_norm"].tolist()
    stat = t["alarm/statistic"]
    assert stat.iloc[:4].isna().all()
    assert [stat.iloc[4], stat.iloc[6]] == [math.fsum(g[0:5]) / 5, math.fsum(g[2:7]) / 5]  # the rule's own bits


def test_trainer_alarm_waits_until_armed_and_resumes(tmp_path):
    t = _alarm_run(tmp_path, "never", "run.steps=6", "run.alarm_threshold=-1", "run.alarm_armed_at=1")
    m = pd.read_parquet(tmp_path / "never" / "metrics.parquet")
    assert m["val/accuracy"].max() < 1  # so the alarm never armed
    assert (t["alarm/above_threshold"] == 0).all() and t["alarm/statistic"].isna().all()
    # stopped at step 4 and resumed to 7: the watch carries its last values across the checkpoint
    with pytest.warns(UserWarning, match="step 5: early-warning alarm"):
        ref = _alarm_run(tmp_path, "ref", "run.steps=7", "run.alarm_threshold=-1", "run.alarm_armed_at=0")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*early-warning alarm")  # steps 1-4: the rule is not defined yet
        _alarm_run(tmp_path, "resumed", "run.steps=4", "run.alarm_threshold=-1", "run.alarm_armed_at=0",
                   "run.checkpoint_every=4")
    cfg = resolve(preset="smoke", overrides=["rollout.samples_per_prompt=8", "run.alarm=grad_norm_level", "run.steps=7",
                                             "run.alarm_threshold=-1", "run.alarm_armed_at=0", "run.checkpoint_every=4"])
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
    # armed only after an accuracy it never reaches: never watched
    assert ew.check_run(tmp_path / "run", "k3_level", armed_at=0.95).watched == 0
    c0 = ew.check_run(tmp_path / "run", "k3_level", armed_at=0)
    assert (c0.armed_after, c0.watched, c0.first) == (None, 120, 52)  # step 0 logs no k3

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
    """The registered analysis reads REGISTERED_SWEEPS only (Studies H1 and H came later): the
    later sweeps hold runs it would include, and its count is the registered sweeps' alone."""
    assert len(ew.REGISTERED_SWEEPS) == 21 and "h1" not in ew.REGISTERED_SWEEPS
    later = tuple(p.name for p in (REPO / "sweeps").iterdir() if p.is_dir() and p.name not in ew.REGISTERED_SWEEPS)
    later_runs = ew.load_runs(REPO / "sweeps", later)  # the runs only: the registered ones are the fixture's
    assert later_runs and {r.name.split("/")[0] for r in later_runs} <= {"h1", "harm", "harm_oos", "harm_oos_probe"}
    assert (committed.runs, committed.falls) == (528, 11)  # the later sweeps are there, and left out
