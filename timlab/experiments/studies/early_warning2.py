"""Early warning, re-registered: the 12 candidate alarm rules measured with no-update steps removed,
alarms counted as crossings per 10,000 watched steps and detection with a lead of at least 20 steps,
on the runs committed under sweeps/ and Study LF's late falls (docs/FINDINGS.md, "Early warning,
re-registered", pre-registered before this module was written; issue 58).

    python -m timlab.experiments.studies.early_warning2 sweeps

prints the FINDINGS block ``<!-- findings:early-warning-2 -->`` (scripts/findings_tables.py splices
it): one INCOMPLETE line until all 24 of Study LF's runs have finished, then the per-rule table.

What it takes from the first benchmark (``timlab.experiments.studies.early_warning``), unchanged: the
inclusion rule and repeats counted once (``load_runs``), the fall, its step F and the learned step L
(the plateau rule, ``run_series``), the stratified SHA-256 split (``split``); from
``timlab.metrics.alarm`` the statistic (``statistic_series``: level = m_t, change = the fold change
m_t / p_t in its direction). What the registration changes, as code:

- **Runs**: the 34 sweeps committed at registration and Study LF's (``EW2_SWEEPS``).
- **The series a rule reads** (``watched_series``): a run's steps after L (for a run that falls, up
  to F), without its no-update steps (``train/updated`` = 0 where logged, or ``train/grad_norm``
  exactly 0); a step whose indicator is not logged (absent or non-finite) is left out of that rule's
  series. Only then are the 5- and 10-step windows formed, so a no-update step neither fires nor
  enters a window. Its *watched steps* are the steps of that series.
- **Alarms** (``crossings``): at threshold c, each step whose statistic exceeds c where the previous
  defined step's did not (or the first defined step, if it exceeds c). A statistic that stays above
  c is one alarm. False alarms are counted per ``PER`` watched steps of non-falling runs.
- **Candidates** (``CANDIDATES``): the 12 registered rules. A rule is evaluated on the runs that log
  its indicator (a finite value at some step), and reports how many (its n).
- **Threshold** (``choose_threshold``): on the choosing half, c* is the smallest value such that at
  every c >= c* the non-falling runs' alarms are at most ``RATE_MAX`` per ``PER`` watched steps.
  Computed exactly by a sweep line: the alarm at step i of a series exists exactly for c in
  [s_{i-1}, s_i) (for the first defined step, (-inf, s_0)), so the alarm count A(c) is a sum of
  half-open intervals, constant between their end points. Walking the end points in order gives A
  on each piece; c* is the right end of the last piece where A(c) x PER > RATE_MAX x W (W the
  watched steps), i.e. the end point where the count drops for good (-inf if no piece is over).
  A(c) need not fall monotonically with c, which is why "at every c >= c*" is checked piece by
  piece rather than at one c.
- **Test** (``evaluate``), per rule at its c* on the test half: a fall is detected when its first
  alarm a comes ``LEAD`` or more steps before F; its rate with a Clopper-Pearson interval, the leads
  F - a, the same among the late falls (F > ``LATE``, descriptive); false alarms per ``PER`` watched
  steps of the non-falling runs with an exact Poisson interval; on the long controls (``control_*``
  runs of ``LONG_CONTROL_SWEEPS``, both halves, all their watched steps) the rate and the most alarms
  in one control; the one-sided Fisher exact test of falls detected with lead against non-falling
  runs with any alarm, Holm over the 12 rules (a rule without falls or non-falling runs to compare
  enters the family with p = 1).
- **Pass rule** (``Benchmark.passes``): at least ``DETECT_MIN`` of the test falls detected with lead,
  at most ``RATE_MAX`` false alarms per ``PER`` watched steps (point estimate), Holm p < ``LEVEL``.

As in the first benchmark, a change rule's statistic is the fold change itself (no ``log``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from timlab.errors import TimlabError, one_line
from timlab.experiments.studies.early_warning import (GRAD_NORM, LEVEL, UPDATED, RunSeries, _lead, _p, _rate, alarm_trace,
                                                      load_runs, split, update_mask)
from timlab.experiments.studies.stats import fisher_greater, holm, poisson_ci
from timlab.metrics.alarm import ALARMS, AlarmRule

EW2_SWEEPS = ("e2", "e2_probe", "e3", "e3_starts", "e3_starts_rl", "e3b", "e3b_probe", "e3c", "e3d", "erosion",
              "erosion_pilot", "erosion_probe", "h1", "h1_intel", "harm", "harm2", "harm2_pilot", "harm_oos",
              "harm_oos_probe", "l1", "moe", "moe_calib", "moe_pilot", "moe_probe", "p1", "p2", "p2_amd", "p2_rerun",
              "surge", "surge_moe_learn", "surge_remedies", "threshold", "threshold_d16", "threshold_d16_300",
              "late_falls")
"""The 34 sweeps committed under sweeps/ at the registration (2026-11-28), and Study LF's."""
LF_SWEEP = "late_falls"
"""Study LF's sweep: the analysis waits until every one of its runs has finished."""
LF_STUDY = "docs/examples/studies/late_falls.yaml"
"""Study LF's study file, from the folder that holds the sweeps folder (as its own ``out`` is)."""
LONG_CONTROL_SWEEPS = ("h1", "h1_intel", "late_falls")
"""The long controls: every run named ``control_*`` of these sweeps."""
LEAD = 20
"""A fall is detected when its first alarm comes at least this many steps before F."""
LATE = 500
"""A late fall: F above this step."""
PER = 10_000
"""False alarms are counted per this many watched steps."""
RATE_MAX = 1
"""The most false alarms per ``PER`` watched steps: c*'s bound on the choosing half, pass rule (ii)."""
DETECT_MIN = 0.5
"""Pass rule (i): at least this share of the test falls detected with lead."""
FINDINGS_BLOCK = "early-warning-2"
"""The FINDINGS block this module writes."""

_UNSET = math.nan  # a candidate's threshold is the benchmark's c*, not a registered value
CANDIDATES: dict[str, AlarmRule] = {
    "k3_level": AlarmRule("rollout_corr/k3_kl", "level", "up", _UNSET),
    "log_ppl_abs_diff_level": AlarmRule("rollout_corr/log_ppl_abs_diff", "level", "up", _UNSET),
    "grad_norm_level": AlarmRule("train/grad_norm", "level", "up", _UNSET),
    "clip_frac_level": AlarmRule("train/clip_frac", "level", "up", _UNSET),
    "persistence_level": AlarmRule("mismatch/persistence_ema", "level", "up", _UNSET),
    "k3_change": AlarmRule("rollout_corr/k3_kl", "change", "up", _UNSET),
    "log_ppl_abs_diff_change": AlarmRule("rollout_corr/log_ppl_abs_diff", "change", "up", _UNSET),
    "response_length_change": AlarmRule("train/response_length_mean", "change", "up", _UNSET),
    "clip_frac_change": AlarmRule("train/clip_frac", "change", "up", _UNSET),
    "grad_norm_change": AlarmRule("train/grad_norm", "change", "either", _UNSET),
    "entropy_change": AlarmRule("train/entropy", "change", "either", _UNSET),
    "reward_std_change": AlarmRule("train/reward_std", "change", "either", _UNSET),
}
"""The 12 registered candidates (indicator, rule, direction); their thresholds are chosen here."""
COLUMNS = tuple(dict.fromkeys(a.indicator for a in CANDIDATES.values()))
"""The indicators the candidates read."""

Trace = tuple[np.ndarray, np.ndarray]
"""(watched steps, the rule's statistic at each; NaN while undefined)."""


# ------------------------------------------------------------------------------- the series
SERIES_COLUMNS = (*COLUMNS, UPDATED)
"""What ``load`` keeps of each run: the candidates' indicators and what says a step updated nothing."""


def watched_series(run: RunSeries) -> RunSeries:
    """``run`` (its series read with ``SERIES_COLUMNS``) with its series replaced by the
    registration's: ``step`` and each candidate indicator the run logs (a finite value at some step
    after L), over its update steps after L and, for a fall, up to F. A non-finite value stays NaN
    here and is left out of the rule's series by ``trace``."""
    steps = run.series["step"]
    updates = pd.DataFrame({c: run.series[c] for c in (UPDATED, GRAD_NORM) if c in run.series}, index=range(len(steps)))
    keep = update_mask(updates)  # (steps,)
    if run.fell:
        keep &= steps <= run.fall_step
    logged = [c for c in COLUMNS if c in run.series and np.isfinite(run.series[c]).any()]
    return dataclasses.replace(run, series={"step": steps[keep], **{c: run.series[c][keep] for c in logged}})


trace = alarm_trace
"""(steps, statistics) of a rule over a run's watched series (its finite values only), or None when
the run does not log the indicator: the first benchmark's ``alarm_trace`` (the series already ends
at F)."""


def load(root: str | Path, sweeps: tuple[str, ...] = EW2_SWEEPS) -> list[RunSeries]:
    """The included runs under ``root`` (the first benchmark's inclusion rule, repeats counted once),
    each with its watched series (``watched_series``)."""
    return [watched_series(r) for r in load_runs(root, sweeps, columns=SERIES_COLUMNS)]


# ------------------------------------------------------------------------------- alarms
def crossings(stats: Sequence[float], threshold: float) -> list[int]:
    """The indices of the alarms at ``threshold``: each defined statistic above it whose previous
    defined one was not (the first defined one, if above)."""
    out, prev = [], None
    for i, s in enumerate(stats):
        if math.isnan(s):
            continue
        if s > threshold and (prev is None or not prev > threshold):
            out.append(i)
        prev = s
    return out


def crossing_intervals(stats: Sequence[float]) -> list[tuple[float, float]]:
    """For each step that alarms at some threshold, the thresholds c at which it does: [lo, hi),
    lo the previous defined statistic (-inf for the first defined one), hi its own."""
    out, prev = [], -math.inf
    for s in stats:
        if math.isnan(s):
            continue
        if s > prev:
            out.append((prev, float(s)))
        prev = float(s)
    return out


def choose_threshold(intervals: list[tuple[float, float]], watched: int, *, per: int = PER,
                     rate_max: float = RATE_MAX) -> float:
    """c*: the smallest value such that at every c >= c* the alarms (a sum of ``intervals``, as
    ``crossing_intervals`` gives them, pooled over runs) are at most ``rate_max`` per ``per`` of
    ``watched`` steps; by a sweep line over the intervals' end points (module docstring). -inf when
    no threshold is over; NaN without a watched step."""
    if watched <= 0:
        return math.nan
    delta: dict[float, int] = {}
    for lo, hi in intervals:
        delta[lo] = delta.get(lo, 0) + 1
        delta[hi] = delta.get(hi, 0) - 1
    points = sorted(delta)
    count, c_star = 0, -math.inf
    for k, x in enumerate(points):
        count += delta[x]  # alarms for c in [x, the next point)
        if count * per > rate_max * watched:
            c_star = points[k + 1]  # the count is 0 after the last point, so a piece over it has a next one
    return c_star


@dataclass(frozen=True)
class Counts:
    """Alarms of one rule at one threshold over a set of runs' watched steps."""

    runs: int
    steps: int
    alarms: int
    alarmed: int
    """Runs with at least one alarm."""
    most: int
    """The most alarms in one run."""

    @property
    def rate(self) -> float:
        """Alarms per ``PER`` watched steps (NaN without a step)."""
        return self.alarms * PER / self.steps if self.steps else math.nan

    def interval(self) -> tuple[float, float]:
        """The exact Poisson 95% interval of ``rate``."""
        lo, hi = poisson_ci(self.alarms)
        return lo * PER / self.steps, hi * PER / self.steps


def count_alarms(traces: list[Trace], threshold: float) -> Counts:
    """``Counts`` of the runs whose ``traces`` are given, at ``threshold``."""
    n = [len(crossings(t[1], threshold)) for t in traces]
    return Counts(runs=len(traces), steps=sum(len(t[0]) for t in traces), alarms=sum(n),
                  alarmed=sum(k > 0 for k in n), most=max(n, default=0))


# ------------------------------------------------------------------------------- one rule
@dataclass(frozen=True)
class RuleResult:
    """One candidate on one set of runs at a fixed threshold."""

    name: str
    threshold: float
    runs: int
    """Runs that log the indicator."""
    falls: int
    detected: int
    """Falls whose first alarm a is at least ``LEAD`` steps before F."""
    leads: tuple[int, ...]
    """F - a of each detected fall."""
    late_falls: int
    late_detected: int
    late_leads: tuple[int, ...]
    healthy: Counts
    """The non-falling runs' alarms over their watched steps."""
    p: float
    """One-sided Fisher p, falls detected with lead against non-falling runs with any alarm (NaN
    without falls or non-falling runs)."""
    first: dict = field(default_factory=dict, repr=False)
    """First alarm step (or None) per falling run's name."""


def traces_of(runs: list[RunSeries], name: str) -> dict[str, Trace | None]:
    """``trace`` of candidate ``name`` for each run, by run name."""
    return {r.name: trace(r, CANDIDATES[name]) for r in runs}


def evaluate(runs: list[RunSeries], name: str, threshold: float, traces: dict[str, Trace | None]) -> RuleResult:
    """Candidate ``name`` on ``runs`` at ``threshold`` (``traces``: ``traces_of`` at least these runs)."""
    first, leads, late_leads, healthy = {}, [], [], []
    falls = late = runs_logging = 0
    for r in runs:
        t = traces[r.name]
        if t is None:
            continue
        runs_logging += 1
        if not r.fell:
            healthy.append(t)
            continue
        i = crossings(t[1], threshold)
        a = int(t[0][i[0]]) if i else None
        first[r.name] = a
        falls += 1
        late += r.fall_step > LATE
        if a is not None and r.fall_step - a >= LEAD:
            leads.append(r.fall_step - a)
            if r.fall_step > LATE:
                late_leads.append(r.fall_step - a)
    h = count_alarms(healthy, threshold)
    p = fisher_greater(len(leads), falls, h.alarmed, h.runs) if falls and h.runs else math.nan
    return RuleResult(name=name, threshold=threshold, runs=runs_logging, falls=falls, detected=len(leads),
                      leads=tuple(sorted(leads)), late_falls=late, late_detected=len(late_leads),
                      late_leads=tuple(sorted(late_leads)), healthy=h, p=p, first=first)


def is_long_control(run: RunSeries) -> bool:
    """A ``control_*`` run of ``LONG_CONTROL_SWEEPS``."""
    return run.sweep in LONG_CONTROL_SWEEPS and run.name.split("/", 1)[1].startswith("control_")


# ------------------------------------------------------------------------------- the benchmark
@dataclass(frozen=True)
class Benchmark:
    """The registered analysis: c* per candidate on the choosing half, the test on the test half."""

    runs: list[RunSeries] = field(repr=False)
    choosing_runs: list[RunSeries] = field(repr=False)
    test_runs: list[RunSeries] = field(repr=False)
    thresholds: dict[str, float] = field(default_factory=dict)
    test: dict[str, RuleResult] = field(default_factory=dict)
    controls: dict[str, Counts] = field(default_factory=dict)
    """Per candidate, the long controls' alarms (both halves) at its c*."""
    logging: dict[str, int] = field(default_factory=dict)
    """Per candidate, the included runs (both halves) that log its indicator: its n."""
    holm: dict[str, float] = field(default_factory=dict)
    """Holm-adjusted p over the 12 candidates (p = 1 for one with nothing to compare)."""

    def passes(self, name: str) -> bool:
        """The pass rule: (i) >= ``DETECT_MIN`` of the test falls detected with lead, (ii) at most
        ``RATE_MAX`` false alarms per ``PER`` watched steps, (iii) Holm p < ``LEVEL``."""
        t = self.test[name]
        return bool(t.falls and t.detected >= DETECT_MIN * t.falls and t.healthy.steps
                    and t.healthy.rate <= RATE_MAX and self.holm[name] < LEVEL)


def benchmark(runs: list[RunSeries]) -> Benchmark:
    """The registered analysis of ``runs`` (``load``'s): split, c* on the choosing half's non-falling
    runs (no fall is looked at), every candidate tested on the test half at its c*."""
    choose, test = split(runs)
    controls = [r for r in runs if is_long_control(r)]
    thresholds, tested, ctl, logging = {}, {}, {}, {}
    for name in CANDIDATES:
        traces = traces_of(runs, name)
        logging[name] = sum(t is not None for t in traces.values())
        quiet = [t for r in choose if not r.fell and (t := traces[r.name]) is not None]
        c = choose_threshold([iv for t in quiet for iv in crossing_intervals(t[1])], sum(len(t[0]) for t in quiet))
        thresholds[name] = c
        tested[name] = evaluate(test, name, c, traces)
        ctl[name] = count_alarms([t for r in controls if (t := traces[r.name]) is not None], c)
    ps = [tested[n].p if math.isfinite(tested[n].p) else 1.0 for n in CANDIDATES]
    return Benchmark(runs=runs, choosing_runs=choose, test_runs=test, thresholds=thresholds, test=tested,
                     controls=ctl, logging=logging, holm=dict(zip(CANDIDATES, holm(ps))))


def incomplete_line(root: str | Path, study_file: str | Path | None = None) -> str | None:
    """The study engine's INCOMPLETE line while a run of Study LF (``study_file``, by default the
    registered one beside ``root``) has not finished at its last step or diverged; None once every
    one has. Reads the runs' states only."""
    from timlab.experiments.studies.engine import incomplete
    from timlab.experiments.studies.registration import load_study
    from timlab.experiments.studies.blocks import block_dirs

    root = Path(root)
    s = load_study(root.resolve().parent / LF_STUDY if study_file is None else study_file)
    dirs = {b: root / Path(d).name for b, d in block_dirs(s, None if s.blocks else root / LF_SWEEP).items()}
    return incomplete(s, dirs=dirs)


def report(root: str | Path, study_file: str | Path | None = None) -> str:
    """The FINDINGS block: the INCOMPLETE line (no run's metrics read) until Study LF is complete,
    then ``format_benchmark`` of the runs of ``EW2_SWEEPS`` under ``root``."""
    line = incomplete_line(root, study_file)
    if line is not None:
        return line
    return format_benchmark(benchmark(load(root)))


# ------------------------------------------------------------------------------- output
def _threshold(name: str, c: float) -> str:
    if not math.isfinite(c):
        return "-" if math.isnan(c) else f"{c:g}"
    return f"{c:.3g}" + ("x" if CANDIDATES[name].rule == "change" else "")


def _per(c: Counts) -> str:
    """Alarms per ``PER`` watched steps with the Poisson interval, and the counts behind it."""
    if not c.steps:
        return "-"
    lo, hi = c.interval()
    return f"{c.rate:.3g} [{lo:.3g}, {hi:.3g}] ({c.alarms} in {c.steps:,} steps)"


SHIPPED_BEFORE = "grad_norm_change"
"""The rule the first benchmark shipped (``run.alarm``), measured here at its registered threshold."""


def shipped_line(b: Benchmark, name: str = SHIPPED_BEFORE) -> str:
    """Descriptive, not part of the registered test: the rule shipped before, at the threshold the first
    benchmark set for it (``ALARMS``), counted as this benchmark counts (test half, long controls)."""
    c = ALARMS.get(name).threshold
    traces = traces_of(b.runs, name)
    t = evaluate(b.test_runs, name, c, traces)
    ctl = count_alarms([tr for r in b.runs if is_long_control(r) and (tr := traces[r.name]) is not None], c)
    return (f"Descriptive (not a registered test): the rule shipped before, {name} at its first benchmark's threshold "
            f"{_threshold(name, c)}, counted the same way: falls detected with lead {_rate(t.detected, t.falls)}, lead "
            f"{_lead(t.leads)}; false alarms per {PER:,} watched steps of the test half's non-falling runs "
            f"{_per(t.healthy)} ({t.healthy.alarmed} of {t.healthy.runs} runs alarmed); long controls {ctl.rate:.3g} per {PER:,} "
            f"steps, at most {ctl.most} in one control.")


def format_benchmark(b: Benchmark) -> str:
    """The per-rule table, the runs and falls per half, the test falls one by one and the verdict."""
    late = lambda runs: sum(r.fell and r.fall_step > LATE for r in runs)  # noqa: E731
    falls = lambda runs: sum(r.fell for r in runs)  # noqa: E731
    out = [f"{len(b.runs)} runs included, {falls(b.runs)} of which fall ({late(b.runs)} late, F > {LATE}); choosing half "
           f"{len(b.choosing_runs)} runs ({falls(b.choosing_runs)} falls), test half {len(b.test_runs)} "
           f"({falls(b.test_runs)} falls, {late(b.test_runs)} late); long controls "
           f"{sum(is_long_control(r) for r in b.runs)}. Thresholds c* set on the choosing half's non-falling runs "
           f"(<= {RATE_MAX} alarm per {PER:,} watched steps at every c >= c*); no-update steps removed before any "
           f"window; everything below is the test half unless marked.", "",
           f"| rule | indicator | n runs (test half) | c* | falls detected with lead >= {LEAD} [95% CP] | lead F - a: "
           f"median (range) | late falls (F > {LATE}) detected | false alarms per {PER:,} watched steps [95% Poisson] | "
           f"long controls: per {PER:,} steps (most in one) | Fisher p | Holm p | passes |",
           "|---|---|---|---:|---|---|---|---|---|---:|---:|---|"]
    for name, a in CANDIDATES.items():
        t, c = b.test[name], b.controls[name]
        ctl = f"{c.rate:.3g} ({c.most})" if c.steps else "-"
        late_cell = f"{_rate(t.late_detected, t.late_falls)}, lead {_lead(t.late_leads)}" if t.late_falls else "-"
        out.append(f"| {name} | `{a.indicator}` {a.rule}, {a.direction} | {b.logging[name]} ({t.runs}) | "
                   f"{_threshold(name, t.threshold)} | {_rate(t.detected, t.falls)} | {_lead(t.leads)} | {late_cell} | "
                   f"{_per(t.healthy)} | {ctl} | {_p(t.p)} | {_p(b.holm[name])} | "
                   f"{'**yes**' if b.passes(name) else 'no'} |")
    fell = [r for r in b.test_runs if r.fell]
    if fell:
        out += ["", "The test half's falls: L, F and each rule's first alarm (- : none by F; a lead F - a below "
                    f"{LEAD} is not a detection):", "",
                "| run | L | F | " + " | ".join(CANDIDATES) + " |", "|---|---:|---:|" + "---:|" * len(CANDIDATES)]
        for r in fell:
            cells = [("-" if (x := b.test[n].first.get(r.name)) is None else str(x)) if r.name in b.test[n].first
                     else "n/a" for n in CANDIDATES]
            out.append(f"| {r.name} | {r.learned_step} | {r.fall_step} | " + " | ".join(cells) + " |")
    out += ["", shipped_line(b)]
    passing = [n for n in CANDIDATES if b.passes(n)]
    rule = (f"(i) >= {DETECT_MIN:.0%} of the test falls detected with a lead >= {LEAD} steps, (ii) <= {RATE_MAX} false "
            f"alarm per {PER:,} watched steps, (iii) Holm p < {LEVEL}")
    out += ["", (f"Passing the registered rule {rule}: " + ", ".join(f"**{n}**" for n in passing) + "."
                 if passing else f"No rule passes the registered rule {rule}.")]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m timlab.experiments.studies.early_warning2", description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", default="sweeps", help="the folder of sweeps (default: sweeps)")
    args = ap.parse_args(argv)
    try:
        text = report(args.root)
    except TimlabError as e:
        print(f"{ap.prog}: error: {one_line(e)}", file=sys.stderr)
        return 2
    print(text)
    return 0


__all__ = ["EW2_SWEEPS", "LF_SWEEP", "LF_STUDY", "LONG_CONTROL_SWEEPS", "LEAD", "LATE", "PER", "RATE_MAX", "DETECT_MIN",
           "FINDINGS_BLOCK", "CANDIDATES", "COLUMNS", "update_mask", "watched_series", "trace", "load", "crossings",
           "crossing_intervals", "choose_threshold", "Counts", "count_alarms", "RuleResult", "traces_of", "evaluate",
           "is_long_control", "Benchmark", "benchmark", "incomplete_line", "report", "format_benchmark"]

if __name__ == "__main__":
    sys.exit(main())
