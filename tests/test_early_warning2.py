"""The re-registered early-warning benchmark (timlab.experiments.studies.early_warning2) and the trainer's
alarm that ignores no-update steps (timlab.metrics.alarm.AlarmWatch): planted run directories and
series whose alarms, thresholds, leads and rates are counted by hand; the exact Poisson interval;
the INCOMPLETE line while Study LF is not complete."""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from study_sweep import write_sweep
from timlab.config import resolve
from timlab.experiments.studies import early_warning as ew
from timlab.experiments.studies import early_warning2 as ew2
from timlab.experiments.studies.stats import clopper_pearson, fisher_greater, holm, poisson_ci
from timlab.experiments.studies.engine import planned_runs
from timlab.experiments.studies.registration import load_study
from timlab.metrics.alarm import ALARMS, AlarmWatch, alarm_statistic
from timlab.rundir import RunDir
from timlab.trainer.run import RLRun, train

REPO = Path(__file__).resolve().parents[1]
LF_STUDY = REPO / ew2.LF_STUDY

BASE = {"rollout_corr/k3_kl": 1e-3, "rollout_corr/log_ppl_abs_diff": 0.01, "train/response_length_mean": 20.0,
        "train/entropy": 0.3, "train/grad_norm": 1.0, "train/reward_std": 0.4, "train/clip_frac": 0.02,
        "train/updated": 1.0}


def course(steps: int, spec) -> np.ndarray:
    """Values over steps 0..steps: a constant, or {from step: value} change points (the first value
    from step 0 is the dict's earliest)."""
    if not isinstance(spec, dict):
        return np.full(steps + 1, float(spec))
    out = np.empty(steps + 1)
    for s, v in sorted(spec.items()):
        out[s:] = v
    return out


def plant(name: str, *, steps: int = 400, fall_at: int | None = None, **cols) -> pd.DataFrame:
    """A run's metrics table over steps 0..steps: accuracy 0.9 every 10 steps (learned at 0), 0.2
    from ``fall_at`` on (a plateau-rule fall at ``fall_at``); per training step the indicators of
    ``BASE`` with ``cols`` (keys with / for __) replacing them (``course`` specs); train/loss one value
    per run (no two runs repeat)."""
    s = np.arange(steps + 1)
    acc = np.where(s % 10 == 0, 0.9, np.nan)
    if fall_at is not None:
        acc[(s >= fall_at) & (s % 10 == 0)] = 0.2
    df = {"step": s, "val/accuracy": acc, "train/loss": np.full(steps + 1, zlib.crc32(name.encode()) / 2**32)}
    for k, v in {**BASE, **{k.replace("__", "/"): v for k, v in cols.items()}}.items():
        df[k] = course(steps, v)
    m = pd.DataFrame(df)
    m.loc[0, [c for c in m.columns if c not in ("step", "val/accuracy")]] = np.nan  # step 0: the evaluation only
    return m


def write(root: Path, name: str, m: pd.DataFrame) -> None:
    rd = RunDir(root / name)
    rd.path.mkdir(parents=True)
    m.to_parquet(rd.metrics_file, index=False)
    rd.write_status("finished", step=int(m["step"].max()), total_steps=int(m["step"].max()))


def series(name: str, m: pd.DataFrame) -> ew.RunSeries:
    return ew2.watched_series(ew.run_series(name, m, columns=ew2.SERIES_COLUMNS))


BUMP3 = {0: 1.0, 100: 3.0, 105: 1.0}   # the grad norm 3x for 5 steps
BUMP4 = {0: 1.0, 100: 4.0, 105: 1.0}   # 4x: one crossing of a c* set at 3x
S3 = alarm_statistic([1.0] * 10 + [3.0] * 5, rule="change", direction="either")  # the peak of BUMP3: 3x


# ------------------------------------------------------------------------------- no-update steps
@pytest.mark.parametrize("gap", [{"train__grad_norm": {0: 1.0, 200: 0.0, 205: 1.0}},
                                 {"train__updated": {0: 1.0, 200: 0.0, 205: 1.0}}])
def test_no_update_steps_never_alarm_and_never_enter_a_window(gap):
    # k3 spikes to 5 at steps 200-204, each a step that updated nothing (grad norm exactly 0, or
    # train/updated 0); k3 also varies before, so the windows around the gap have distinct values
    k3 = {0: 1e-3, 150: 2e-3, 190: 3e-3, 200: 5.0, 205: 4e-3}
    m = plant("s/gap", rollout_corr__k3_kl=k3, **gap)
    r = series("s/gap", m)
    assert not np.isin(np.arange(200, 205), r.series["step"]).any() and r.series["step"].size == 395
    # the first benchmark's trace, which read those steps, alarms on both rules; this one on neither
    old = ew.run_series("s/gap", m)
    for name, c in (("k3_level", 0.5), ("k3_change", 13.0)):
        assert ew.first_alarm_step(ew.alarm_trace(old, ALARMS.get(name)), c) == 200
        steps, stats = ew2.trace(r, ew2.CANDIDATES[name])
        assert ew2.crossings(stats, c) == [] and not np.isin(np.arange(200, 205), steps).any()
    # never in a window: the statistics equal those of the same run with those five rows deleted
    cut = series("s/cut", m[~m["step"].between(200, 204)].reset_index(drop=True))
    for name in ew2.CANDIDATES:
        a, b = ew2.trace(r, ew2.CANDIDATES[name]), ew2.trace(cut, ew2.CANDIDATES[name])
        if a is None:
            assert b is None
            continue
        assert a[0].tolist() == b[0].tolist()
        np.testing.assert_array_equal(a[1], b[1])
    # at step 206: k3's mean over steps 197, 198, 199, 205, 206, not over the spike
    steps, stats = ew2.trace(r, ew2.CANDIDATES["k3_level"])
    assert stats[steps.tolist().index(206)] == math.fsum([3e-3] * 3 + [4e-3] * 2) / 5


def test_watched_series_after_learning_and_up_to_the_fall():
    m = plant("s/f", steps=200, fall_at=150)
    m.loc[m["step"].isin([0, 10, 20]), "val/accuracy"] = 0.3  # learned at step 30
    r = series("s/f", m)
    assert (r.learned_step, r.fall_step) == (30, 150)
    assert r.series["step"].tolist() == list(range(31, 151))


# ------------------------------------------------------------------------------- alarms
def test_crossings_count_each_rise_above_once():
    nan = math.nan
    assert ew2.crossings([nan, 1, 3, 4, 2, 5, 5, 1], 2.5) == [2, 5]  # 3, 4 above: one alarm; 5, 5: one
    assert ew2.crossings([nan, 3, 1], 2) == [1]                      # the first defined step, if above
    assert ew2.crossings([1, nan, 3], 2) == [2]                      # previous *defined* step: 1
    assert ew2.crossings([3, nan, 3], 2) == [0]
    assert ew2.crossings([1, 2, 2, 1], 2) == []                      # equal is not above
    # a statistic that stays above c for 100 steps is one alarm
    assert ew2.crossings([1.0] * 5 + [9.0] * 100 + [1.0] * 5 + [9.0], 4) == [5, 110]


def test_threshold_is_exact_by_a_sweep_line():
    # run 1's statistics 1, 3, 2, 5 alarm for c in (-inf, 1), [1, 3), [2, 5); run 2's 4, 1, 4 for (-inf, 4), [1, 4)
    r1, r2 = [1.0, 3.0, 2.0, 5.0], [4.0, 1.0, 4.0]
    assert ew2.crossing_intervals([math.nan] + r1) == [(-math.inf, 1.0), (1.0, 3.0), (2.0, 5.0)]
    both = ew2.crossing_intervals(r1) + ew2.crossing_intervals(r2)
    # alarms: 1 on [4, 5), 3 on [3, 4), 4 on [2, 3), 0 from 5: 20,000 steps allow 2 -> c* = 4; 30,000 allow 3 -> c* = 3
    assert ew2.choose_threshold(both, 20_000) == 4.0
    assert ew2.choose_threshold(both, 30_000) == 3.0
    assert ew2.choose_threshold(both, 50_000) == -math.inf  # 5 alarms at most anywhere: no threshold is over
    # not monotone: run 1 alone has 1 alarm below c = 2 but 2 on [2, 3); 10,000 steps allow 1 -> c* = 3, not -inf
    assert ew2.choose_threshold(ew2.crossing_intervals(r1), 10_000) == 3.0
    assert [len(ew2.crossings(r1, c)) for c in (0.5, 1.5, 2.5, 3.0, 4.9, 5.0)] == [1, 1, 2, 1, 1, 0]
    # every c >= c* is within the budget, checked against counting itself
    for c in (4.0, 4.5, 5.0, 7.0):
        assert len(ew2.crossings(r1, c)) + len(ew2.crossings(r2, c)) <= 2
    assert len(ew2.crossings(r1, 3.9)) + len(ew2.crossings(r2, 3.9)) == 3
    assert math.isnan(ew2.choose_threshold(both, 0))


# ------------------------------------------------------------------------------- one rule
def test_detection_needs_a_lead_of_20_steps():
    # k3 jumps to 10 at step j: the 5-step mean is above 0.5 from j on, so the first alarm is j; F = 300
    runs = [series(f"s/j{j}", plant(f"s/j{j}", fall_at=300, rollout_corr__k3_kl={0: 1e-3, j: 10.0}))
            for j in (279, 280, 281, 299)]
    runs.append(series("s/ok", plant("s/ok")))
    res = ew2.evaluate(runs, "k3_level", 0.5, ew2.traces_of(runs, "k3_level"))
    assert res.first == {"s/j279": 279, "s/j280": 280, "s/j281": 281, "s/j299": 299}
    assert (res.falls, res.detected, res.leads) == (4, 2, (20, 21))
    assert (res.late_falls, res.healthy.runs, res.healthy.steps, res.healthy.alarms) == (0, 1, 400, 0)
    assert res.p == fisher_greater(2, 4, 0, 1)


def test_false_alarms_per_10000_steps_with_the_poisson_interval():
    assert poisson_ci(0) == (0.0, pytest.approx(3.688879, rel=1e-6))  # -log(0.025)
    assert poisson_ci(3) == (pytest.approx(0.618672, rel=1e-5), pytest.approx(8.767273, rel=1e-6))
    assert poisson_ci(10) == (pytest.approx(4.795389, rel=1e-6), pytest.approx(18.390356, rel=1e-6))
    with pytest.raises(ValueError):
        poisson_ci(-1)
    c = ew2.Counts(runs=4, steps=20_000, alarms=3, alarmed=2, most=2)
    assert c.rate == 1.5
    assert c.interval() == (pytest.approx(0.618672 / 2, rel=1e-5), pytest.approx(8.767273 / 2, rel=1e-6))
    # counted from traces: 3 runs of 4,000 steps, 1 + 2 + 0 crossings at c = 2
    up = np.array([1.0] * 1000 + [3.0] * 10 + [1.0] * 2990)
    twice = up.copy()
    twice[3000:3010] = 3.0
    traces = [(np.arange(4000), up), (np.arange(4000), twice), (np.arange(4000), np.ones(4000))]
    assert ew2.count_alarms(traces, 2.0) == ew2.Counts(runs=3, steps=12_000, alarms=3, alarmed=2, most=2)
    assert ew2.count_alarms(traces, 2.0).rate == 2.5


# ------------------------------------------------------------------------------- the planted benchmark
def test_planted_benchmark(tmp_path):
    root = tmp_path / "sweeps"
    # sweeps named as registered ones: "threshold" (fast falls and quiet runs), "harm2" (late falls), H1's and LF's
    a_falls, a_ok = [f"threshold/fall_{i}" for i in range(4)], [f"threshold/ok_{i}" for i in range(8)]
    b_falls, h1 = ["harm2/late_0", "harm2/late_1"], ["h1/control_s0__aaa", "h1/control_s1__bbb"]
    lf = ["late_falls/control_s3__c"]
    falls = set(a_falls + b_falls)
    stubs = [ew.RunSeries(n, n.split("/")[0], 0, 0, 300 if n in falls else None, None, False, {})
             for n in a_falls + a_ok + b_falls + h1 + lf]
    test = {r.name for r in ew.split(stubs)[1]}  # the registered split, by name and fell alone
    t_falls, t_ok = sorted(test & set(a_falls)), sorted(test & set(a_ok))
    assert (len(t_falls), len(t_ok), len(test & set(h1)), len(test & set(lf))) == (2, 4, 1, 0)
    persist = {"mismatch__persistence_ema": 0.5}
    for n in a_falls:  # choosing-half falls jump 100x early: c* must not look at them
        g = ({0: 1.0, 200: 10.0} if n == t_falls[0] else {0: 1.0, 285: 10.0} if n in t_falls
             else {0: 1.0, 50: 100.0, 55: 1.0})
        write(root, n, plant(n, fall_at=300, train__grad_norm=g))
    for n in a_ok:
        if n in t_ok[:2]:
            m = plant(n, train__grad_norm=BUMP4)
        elif n == t_ok[3]:  # a grad norm of 0 at 10 steps that updated nothing: would alarm if read
            m = plant(n, train__grad_norm={**BUMP3, 300: 0.0, 310: 1.0}, train__updated={0: 1.0, 300: 0.0, 310: 1.0})
        else:
            m = plant(n, train__grad_norm=BUMP3)
        write(root, n, m)
    for n in b_falls:  # late falls: F = 600, the grad norm up 10x at 500
        write(root, n, plant(n, steps=700, fall_at=600, train__grad_norm={0: 1.0, 500: 10.0}, **persist))
    for n in h1:
        g = {0: 1.0, 100: 4.0, 105: 1.0, 250: 4.0, 255: 1.0} if n in test else BUMP3
        write(root, n, plant(n, train__grad_norm=g, **persist))
    write(root, lf[0], plant(lf[0], train__grad_norm=BUMP3, mismatch__persistence_ema=math.nan))  # not logged
    write(root, "zz_later/ok_0", plant("zz_later/ok_0", train__grad_norm={0: 1.0, 100: 50.0}))  # not a registered sweep

    b = ew2.benchmark(ew2.load(root))
    assert sorted(r.name for r in b.runs) == sorted(n for n in [*a_falls, *a_ok, *b_falls, *h1, *lf])
    # c*: the choosing half's six quiet runs each peak once at S3 (3x) with 2,400 watched steps (< 1 alarm allowed)
    assert b.thresholds["grad_norm_change"] == S3 and b.thresholds["grad_norm_level"] == 3.0
    # a constant indicator: c* is its one statistic, at which nothing exceeds it
    assert b.thresholds["k3_level"] == alarm_statistic([1e-3] * 5, rule="level", direction="up")
    g = b.test["grad_norm_change"]
    # test falls: a/fall first alarm 201 (F 300, lead 99), 286 (lead 14: not a detection); b's late fall 501 (lead 99)
    assert g.first == {t_falls[0]: 201, t_falls[1]: 286, **{n: 501 for n in test & set(b_falls)}}
    assert (g.falls, g.detected, g.leads, g.late_falls, g.late_detected, g.late_leads) == (3, 2, (99, 99), 1, 1, (99,))
    # non-falling test runs: two 4x bumps (1 alarm each), the 3x bump (at c*: none), the no-update run (none,
    # 390 steps watched), the h1 control with two 4x bumps (2 alarms)
    assert g.healthy == ew2.Counts(runs=5, steps=1990, alarms=4, alarmed=3, most=2)
    assert g.p == fisher_greater(2, 3, 3, 5)
    # the long controls, both halves: 3 runs of 400 steps, the test-half h1 control's 2 alarms
    assert b.controls["grad_norm_change"] == ew2.Counts(runs=3, steps=1200, alarms=2, alarmed=1, most=2)
    # n: persistence is logged by b's runs and h1's controls (late_falls' column is all NaN), clip_frac by all
    assert (b.logging["persistence_level"], b.test["persistence_level"].runs) == (4, 2)
    assert (b.logging["clip_frac_level"], b.test["clip_frac_level"].runs) == (17, 8)
    ps = [b.test[n].p if math.isfinite(b.test[n].p) else 1.0 for n in ew2.CANDIDATES]
    assert list(b.holm.values()) == holm(ps) and len(b.holm) == 12
    assert all(b.test[n].p == 1.0 for n in ew2.CANDIDATES if "grad_norm" not in n)
    assert not any(b.passes(n) for n in ew2.CANDIDATES)  # 20 false alarms per 10,000 steps

    text = ew2.format_benchmark(b)
    assert text.splitlines()[0].startswith("17 runs included, 6 of which fall (2 late, F > 500); choosing half 9 runs "
                                           "(3 falls), test half 8 (3 falls, 1 late); long controls 3.")
    row = next(x for x in text.splitlines() if x.startswith("| grad_norm_change |"))
    lo, hi = clopper_pearson(2, 3)
    llo, lhi = clopper_pearson(1, 1)
    plo, phi = poisson_ci(4)
    assert row == (f"| grad_norm_change | `train/grad_norm` change, either | 17 (8) | {S3:.3g}x | 2/3 [{lo:.2f}, {hi:.2f}] "
                   f"| 99 (99-99) | 1/1 [{llo:.2f}, {lhi:.2f}], lead 99 (99-99) | {4e4 / 1990:.3g} [{plo * 1e4 / 1990:.3g}, "
                   f"{phi * 1e4 / 1990:.3g}] (4 in 1,990 steps) | {2e4 / 1200:.3g} (2) | {g.p:.2g} | "
                   f"{b.holm['grad_norm_change']:.2g} | no |")
    assert f"| {t_falls[0]} | 0 | 300 |" in text and text.splitlines()[-1].startswith("No rule passes")


def _result(name: str, *, falls: int, detected: int, steps: int, alarms: int, p: float) -> ew2.RuleResult:
    return ew2.RuleResult(name=name, threshold=2.0, runs=10, falls=falls, detected=detected, leads=(30,) * detected,
                          late_falls=0, late_detected=0, late_leads=(),
                          healthy=ew2.Counts(runs=5, steps=steps, alarms=alarms, alarmed=min(alarms, 5), most=1), p=p)


def test_pass_rule_at_its_bounds():
    rows = {"k3_level": dict(falls=4, detected=2, steps=20_000, alarms=2, p=0.001),      # 50%, 1 per 10,000: passes
            "k3_change": dict(falls=4, detected=1, steps=20_000, alarms=0, p=0.001),     # 25%
            "grad_norm_change": dict(falls=4, detected=4, steps=20_000, alarms=3, p=0.001),  # 1.5 per 10,000
            "entropy_change": dict(falls=4, detected=4, steps=20_000, alarms=0, p=0.01)}     # Holm 0.05: not below
    test = {n: _result(n, **rows.get(n, dict(falls=0, detected=0, steps=1000, alarms=0, p=math.nan)))
            for n in ew2.CANDIDATES}
    b = ew2.Benchmark(runs=[], choosing_runs=[], test_runs=[], thresholds={n: 2.0 for n in ew2.CANDIDATES}, test=test,
                      controls={n: ew2.Counts(0, 0, 0, 0, 0) for n in ew2.CANDIDATES},
                      logging={n: 10 for n in ew2.CANDIDATES},
                      holm={n: (0.05 if n == "entropy_change" else 0.01) for n in ew2.CANDIDATES})
    assert [n for n in ew2.CANDIDATES if b.passes(n)] == ["k3_level"]
    assert ew2.format_benchmark(b).splitlines()[-1].endswith(": **k3_level**.")


def test_the_registered_sweeps_and_candidates():
    assert len(ew2.EW2_SWEEPS) == 35 and ew2.EW2_SWEEPS[-1] == "late_falls" and len(set(ew2.EW2_SWEEPS)) == 35
    assert set(ew.REGISTERED_SWEEPS) < set(ew2.EW2_SWEEPS)
    assert all((REPO / "sweeps" / s).is_dir() for s in ew2.EW2_SWEEPS[:-1])
    assert len(ew2.CANDIDATES) == 12
    kinds = {(a.indicator.split("/")[1], a.rule, a.direction) for a in ew2.CANDIDATES.values()}
    assert kinds == {("k3_kl", "level", "up"), ("log_ppl_abs_diff", "level", "up"), ("grad_norm", "level", "up"),
                     ("clip_frac", "level", "up"), ("persistence_ema", "level", "up"), ("k3_kl", "change", "up"),
                     ("log_ppl_abs_diff", "change", "up"), ("response_length_mean", "change", "up"),
                     ("clip_frac", "change", "up"), ("grad_norm", "change", "either"), ("entropy", "change", "either"),
                     ("reward_std", "change", "either")}
    assert ew2.is_long_control(ew.RunSeries("h1_intel/control_s3__x", "h1_intel", 0, 0, None, None, False, {}))
    assert not ew2.is_long_control(ew.RunSeries("h1/grow_s0__x", "h1", 0, 0, None, None, False, {}))
    assert not ew2.is_long_control(ew.RunSeries("p2/control_s0__x", "p2", 0, 0, None, None, False, {}))


# ------------------------------------------------------------------------------- INCOMPLETE
def test_incomplete_until_all_of_lf_is_in_and_no_metrics_read(tmp_path, monkeypatch, capsys):
    ids = {p.name: p.run_id for p in planned_runs(load_study(LF_STUDY))}
    root = tmp_path / "sweeps"
    write_sweep(root / "late_falls", ["control_s0", "control_s1", "control_s2"], lambda n: plant(n, steps=120), 2000,
                run_ids=ids)
    write(root, "a/ok_0", plant("a/ok_0"))

    def peek(*a, **k):
        raise AssertionError("a run's metrics were read before Study LF is complete")
    monkeypatch.setattr(ew2, "load", peek)
    monkeypatch.setattr(RunDir, "read_metrics", peek)
    assert ew2.report(root, study_file=LF_STUDY) == (
        "INCOMPLETE: 3 of 24 runs finished at step 2000 (missing: head seeds 0-7, noise seeds 0-7, control seeds 3-7); "
        "no endpoint is computed before the study is complete (no interim analysis).")
    assert ew2.report(tmp_path / "empty", study_file=LF_STUDY).startswith("INCOMPLETE: 0 of 24 runs finished")


def test_complete_lf_runs_the_benchmark(tmp_path):
    ids = {p.name: p.run_id for p in planned_runs(load_study(LF_STUDY))}
    root = tmp_path / "sweeps"
    write_sweep(root / "late_falls", list(ids), lambda n: plant(n, steps=120), 2000, run_ids=ids)
    text = ew2.report(root, study_file=LF_STUDY)
    assert text.startswith("24 runs included, 0 of which fall") and "long controls 8." in text


# ------------------------------------------------------------------------------- the trainer's alarm
def test_watch_skips_no_update_steps_and_still_fires_on_updates():
    ones, zeros = [1.0] * 15, [0.0] * 5
    # without the update flags (as the watch read every step before): five zero grad norms fire it
    old = AlarmWatch(rule="change", direction="either", threshold=3.98)
    for i, v in enumerate(ones + zeros):
        old.update(v, step=i + 1)
    assert old.fired_step == 19  # the 5-step mean 0.8, 0.6, 0.4, 0.2 against 1: 1.25x ... 5x at the 4th zero
    w = AlarmWatch(rule="change", direction="either", threshold=3.98)
    for i, v in enumerate(ones):
        w.update(v, step=i + 1, grad_norm=v)
    before = w.state_dict()
    seen = [w.update(v, step=16 + i, grad_norm=v) for i, v in enumerate(zeros)]
    assert all(math.isnan(s) and not a for s, a in seen) and w.fired_step is None and w.state_dict() == before
    # a step that did not update (train/updated 0) is skipped whatever its value and grad norm
    assert math.isnan(w.update(50.0, step=21, grad_norm=2.0, updated=False)[0]) and w.state_dict() == before
    # ordinary steps still fire: the grad norm up 5x from step 22, the 5-step mean 1.8x, 2.6x, 3.4x, 4.2x
    out = [w.update(5.0, step=22 + i, grad_norm=5.0) for i in range(4)]
    assert [a for _, a in out] == [False, False, False, True] and w.fired_step == 25
    assert out[3][0] == pytest.approx(4.2, abs=1e-9)
    # a level rule on another indicator: k3 spikes at no-update steps, no alarm
    k = AlarmWatch(rule="level", direction="up", threshold=0.5)
    for i in range(10):
        k.update(9.0 if i % 2 else 1e-3, step=i + 1, grad_norm=0.0 if i % 2 else 1.0)
    assert k.fired_step is None and list(k.values) == [1e-3] * 5


def test_trainer_passes_the_update_to_its_alarm(tmp_path, monkeypatch):
    original = RLRun._update

    def update(self, batch):  # step 6 updates nothing: its grad norm is logged as exactly 0
        out, grad_norm, updated = original(self, batch)
        return (out, 0.0, updated) if self.step == 6 else (out, grad_norm, updated)
    monkeypatch.setattr(RLRun, "_update", update)
    cfg = resolve(preset="smoke", overrides=["rollout.samples_per_prompt=8", "run.alarm=grad_norm_level", "run.steps=8",
                                             "run.alarm_threshold=1e-9", "run.alarm_armed_at=0"])
    with pytest.warns(UserWarning, match="step 5: early-warning alarm"):
        train(cfg, tmp_path / "run")
    t = pd.read_parquet(tmp_path / "run" / "metrics.parquet")
    t = t[t["step"] >= 1].set_index("step")
    g = t["train/grad_norm"]
    assert g[6] == 0.0 and (g.drop(6) > 0).all()
    assert math.isnan(t.loc[6, "alarm/statistic"]) and t.loc[6, "alarm/above_threshold"] == 0.0
    # steps 7 and 8: the mean of the last five steps that updated, step 6 left out
    assert t.loc[7, "alarm/statistic"] == math.fsum(g[[2, 3, 4, 5, 7]].tolist()) / 5
    assert t.loc[8, "alarm/statistic"] == math.fsum(g[[3, 4, 5, 7, 8]].tolist()) / 5
