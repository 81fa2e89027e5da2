"""Early warning of a fall: the lead time and false alarms of each registered alarm rule, measured
on the runs committed under sweeps/ (docs/FINDINGS.md, "Early warning of a fall", pre-registered
before this module was written; issue 40, item 3).

    python -m timlab.experiments.studies.early_warning sweeps [--figure docs/img/early_warning.png]
    python -m timlab.experiments.studies.early_warning sweeps --test-set h1

print the FINDINGS blocks ``<!-- findings:early-warning -->`` and ``<!-- findings:early-warning-h1 -->``
(tests/test_early_warning.py recomputes each from sweeps/ and compares it with the committed text;
a block is updated by pasting what the command prints).

The registered design, as code:

- **Runs**: every run two levels under the root (``sweeps/<sweep>/<run>``) that is finished or
  diverged, logged step ``MIN_STEPS`` or later and *learned* (an evaluation with accuracy >= the
  plateau rule's ``learned_at``). Runs whose ``REPEAT_COLUMNS`` over steps 1-``REPEAT_STEPS`` are
  equal bit for bit count once: the one with the most steps, then the first name (``distinct``).
- **A fall**: the plateau rule's step F (``timlab.experiments.studies.collapse.judge``); F_prev is the
  evaluation before it, the last one above the line. A run that did not fall *dipped* if any
  evaluation after learning was below the line it would have had to stay under.
- **Alarms**: the rules of ``timlab.metrics.alarm.ALARMS``, watching each indicator from the step
  after the run learned (L) on; ``alarm_trace`` is the statistic at each step. A run's *score* is
  its largest statistic up to F (a fall) or over the whole run; the rule alarms at threshold c when
  the score exceeds c. The first alarm a detects a fall when a <= F, early when a <= F_prev; the
  lead time is F - a.
- **Split**: within each (sweep, fell) stratum, runs ordered by the SHA-256 of their name
  alternate between the choosing half (even ranks) and the test half (odd ranks).
- **Threshold**: on the choosing half, the smallest non-falling score at which at most
  ``FALSE_ALARM_TARGET`` of its non-falling runs alarm (``choose_threshold``; falls unused).
- **Test**: on the test half, the one-sided Fisher exact test of detections among falls against
  alarms among non-falling runs, Holm over the rules with falls to detect. Verdicts: "early
  warning" (Holm p < 0.05 and early detection in more than half of the falls), "detects, not
  early" (Holm p < 0.05 only), "not supported", or "no falls" for a rule whose indicator no falling
  run logs.

The rule a trainer ships (``shipped``): the passing rule with the smallest Holm p (ties: more early
detections, then the longer median lead); if none passes, the rule with the smallest p, flagged as
failed. The one departure from the registration's wording: a change rule's log fold change is
thresholded as the fold change itself (the same decisions; no ``log`` whose last bit depends on the
C library).

**A later test set** (``second_test``; registered in FINDINGS, "Study H1 as a second test set of the
alarm rules"): every rule at its registered threshold (``ALARMS``, never re-chosen) on all the
included runs of one later sweep (``TEST_SETS``: Study H1's), the same per-rule numbers as the test
half, Holm over the 9 rules the benchmark tested. Nothing is computed, and no run's metrics read,
until every run of the sweep's study has finished at its last step or diverged (the study engine's
``incomplete``: its INCOMPLETE line). The read-out: with falls, the shipped rule is confirmed if its
Holm p < 0.05; without, its false-alarm rate over the long runs holds (upper end of the 95%
interval <= ``HOLDS_AT_MOST``), cries wolf (lower end > ``FALSE_ALARM_TARGET``) or is undecided.

``check_run`` / ``check_analysis`` run one rule over one series, as the trainer's alarm would: they
are ``timlab analyze --alarm`` (a run directory, or a log-prob file's per-step metrics).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from timlab.errors import TimlabError, UsageError, one_line
from timlab.experiments.studies.collapse import DEFAULT_FRAC, DEFAULT_LEARNED_AT, DEFAULT_LEVEL_WINDOW, judge, plateau_levels
from timlab.experiments.studies.stats import clopper_pearson, fisher_greater, holm
from timlab.metrics.alarm import ALARMS, BASELINE, EXPERIMENTAL, WINDOW, AlarmRule, first_alarm, statistic_series
from timlab.rundir import COMPLETE_STATES, DIVERGED, RunDir

MIN_STEPS = 100
"""A run is included when its last logged step is at least this."""
REPEAT_STEPS = 100
"""Runs equal bit for bit over steps 1 to this are one run."""
INDICATORS = ("rollout_corr/k3_kl", "rollout_corr/log_ppl_abs_diff", "train/response_length_mean", "train/entropy",
              "train/grad_norm", "train/reward_std")
"""The six indicators every included run logs (``mismatch/k3_seq`` is read where logged)."""
REPEAT_COLUMNS = ("step", "train/loss") + INDICATORS
"""The columns whose values over steps 1-``REPEAT_STEPS`` identify a repeated run."""
FALSE_ALARM_TARGET = 0.05
"""The threshold lets at most this share of the choosing half's non-falling runs alarm."""
LEVEL = 0.05
"""A rule passes at Holm-adjusted p below this."""
FINDINGS_BLOCK = "early-warning"
"""The FINDINGS block this module writes (``<!-- findings:early-warning -->``)."""


# ------------------------------------------------------------------------------- one run
@dataclass(frozen=True)
class RunSeries:
    """One run as the benchmark sees it: its fall and its indicators after it learned."""

    name: str
    """``sweep/run``: what the split hashes."""
    sweep: str
    last_step: int
    learned_step: int | None
    """L: the step of the first evaluation with accuracy >= learned_at (None: never learned)."""
    fall_step: int | None
    """F: the plateau rule's fall step (None: no fall)."""
    before_fall: int | None
    """F_prev: the evaluation before F, the last one above the line (None without a fall)."""
    dipped: bool
    """No fall, but some evaluation after learning was below the plateau line."""
    series: dict[str, np.ndarray] = field(repr=False)
    """``step`` and each indicator column the run logs, as arrays over its steps after L, sorted."""

    @property
    def fell(self) -> bool:
        return self.fall_step is not None


def run_series(name: str, metrics: pd.DataFrame, *, diverged: bool = False, diverged_step: int | None = None,
               learned_at: float = DEFAULT_LEARNED_AT, columns: tuple[str, ...] | None = None) -> RunSeries:
    """A run's ``RunSeries`` from its metrics table (``step``, ``val/accuracy``, the indicators):
    its series holds the ``columns`` the table has (None: ``INDICATORS`` and ``mismatch/k3_seq``)."""
    m = metrics.sort_values("step")
    ev = m.loc[m["val/accuracy"].notna(), ["step", "val/accuracy"]] if "val/accuracy" in m else m.iloc[:0]
    ev = ev[np.isfinite(ev["val/accuracy"].to_numpy(dtype=float))] if len(ev) else ev
    steps, acc = ev["step"].to_numpy(dtype=np.int64), ev["val/accuracy"].to_numpy(dtype=float)
    hit = np.flatnonzero(acc >= learned_at)
    learned = int(steps[hit[0]]) if hit.size else None
    fall = judge(m, rule="plateau", learned_at=learned_at, diverged=diverged, diverged_step=diverged_step)
    before = dipped = None
    if fall is not None:
        earlier = steps[steps < fall]
        before = int(earlier[-1]) if earlier.size else None
        dipped = False
    elif hit.size:
        level = plateau_levels(acc, int(hit[0]), DEFAULT_LEVEL_WINDOW)  # (E,)
        dipped = bool(any(acc[i] < DEFAULT_FRAC * level[i - 1] for i in range(int(hit[0]) + 1, len(acc))))
    cols = [c for c in (columns if columns is not None else (*INDICATORS, "mismatch/k3_seq")) if c in m.columns]
    after = m[m["step"] > learned] if learned is not None else m.iloc[:0]
    series = {"step": after["step"].to_numpy(dtype=np.int64), **{c: after[c].to_numpy(dtype=float) for c in cols}}
    return RunSeries(name=name, sweep=name.split("/")[0], last_step=int(m["step"].max()) if len(m) else 0,
                     learned_step=learned, fall_step=fall, before_fall=before, dipped=bool(dipped), series=series)


def alarm_trace(run: RunSeries, alarm: AlarmRule) -> tuple[np.ndarray, np.ndarray] | None:
    """(steps, statistics) of ``alarm`` over the run's steps after it learned (NaN while the rule
    is undefined; a fall's steps after F are left out), or None when the run does not log the
    indicator. Non-finite values are skipped, as the trainer's watcher skips them."""
    if alarm.indicator not in run.series:
        return None
    steps, values = run.series["step"], run.series[alarm.indicator]
    keep = np.isfinite(values) & (steps <= run.fall_step if run.fell else True)  # (steps,)
    stats = statistic_series(values[keep].tolist(), rule=alarm.rule, direction=alarm.direction)
    return steps[keep], np.array(stats, dtype=float)


def score(trace: tuple[np.ndarray, np.ndarray]) -> float:
    """The largest statistic of a trace (minus infinity when it is never defined)."""
    s = trace[1][np.isfinite(trace[1])]
    return float(s.max()) if s.size else -math.inf


def first_alarm_step(trace: tuple[np.ndarray, np.ndarray], threshold: float) -> int | None:
    """The step of the first statistic above ``threshold``, or None."""
    i = first_alarm(trace[1].tolist(), threshold)
    return None if i is None else int(trace[0][i])


# ------------------------------------------------------------------------------- the runs
def _repeat_key(m: pd.DataFrame) -> str:
    rows = m[(m["step"] >= 1) & (m["step"] <= REPEAT_STEPS)]
    cols = [c for c in REPEAT_COLUMNS if c in rows.columns]
    block = np.ascontiguousarray(rows[cols].to_numpy(dtype=np.float64))  # (steps, columns)
    return hashlib.sha256(",".join(cols).encode() + block.tobytes()).hexdigest()


REGISTERED_SWEEPS = ("e2", "e2_probe", "e3", "e3_starts", "e3_starts_rl", "e3b", "e3b_probe", "e3d", "erosion",
                     "erosion_pilot", "erosion_probe", "moe", "moe_calib", "moe_pilot", "moe_probe", "surge",
                     "surge_moe_learn", "surge_remedies", "threshold", "threshold_d16", "threshold_d16_300")
"""The 21 sweeps committed when the benchmark was registered (2026-11-26): the registered analysis
reads these only, so a sweep committed later (Study H1's) does not move its numbers."""


def load_runs(root: str | Path, sweeps: tuple[str, ...] | None = None, only: set[str] | None = None,
              columns: tuple[str, ...] | None = None) -> list[RunSeries]:
    """The included runs under ``root`` (``root/<sweep>/<run>``), repeats counted once (module
    docstring), in name order; only the sweeps named in ``sweeps`` when given, and only the runs
    named (``<sweep>/<run>``) in ``only`` when given; each run's series holds ``columns``
    (``run_series``)."""
    root = Path(root)
    if not root.is_dir():
        raise UsageError(f"sweeps root {str(root)!r} is not a directory")
    found: list[tuple[RunSeries, str]] = []
    for sweep in sorted(p for p in root.iterdir() if p.is_dir() and (sweeps is None or p.name in sweeps)):
        for d in sorted(p for p in sweep.iterdir() if p.is_dir()):
            if only is not None and f"{sweep.name}/{d.name}" not in only:
                continue
            rd = RunDir(d)
            status = rd.read_status()
            state = status.get("state")
            if state not in COMPLETE_STATES or not rd.metrics_file.exists():
                continue
            m = rd.read_metrics()
            if m is None or not len(m) or int(m["step"].max()) < MIN_STEPS:
                continue
            diverged = state == DIVERGED
            run = run_series(f"{sweep.name}/{d.name}", m, diverged=diverged,
                             diverged_step=status.get("step") if diverged else None, columns=columns)
            if run.learned_step is not None:
                found.append((run, _repeat_key(m)))
    return distinct(found)


def distinct(found: list[tuple[RunSeries, str]]) -> list[RunSeries]:
    """One run per repeat key: the one with the most steps, then the first name; in name order."""
    best: dict[str, RunSeries] = {}
    for run, key in sorted(found, key=lambda x: (-x[0].last_step, x[0].name)):
        best.setdefault(key, run)
    return sorted(best.values(), key=lambda r: r.name)


def split(runs: list[RunSeries]) -> tuple[list[RunSeries], list[RunSeries]]:
    """(choosing half, test half): within each (sweep, fell) stratum, runs in the order of the
    SHA-256 of their name alternate, even ranks choosing, odd ranks test."""
    strata: dict[tuple[str, bool], list[RunSeries]] = {}
    for r in runs:
        strata.setdefault((r.sweep, r.fell), []).append(r)
    choose, test = [], []
    for key in sorted(strata):
        ordered = sorted(strata[key], key=lambda r: hashlib.sha256(r.name.encode()).hexdigest())
        choose += ordered[0::2]
        test += ordered[1::2]
    return sorted(choose, key=lambda r: r.name), sorted(test, key=lambda r: r.name)


def choose_threshold(scores: list[float], target: float = FALSE_ALARM_TARGET) -> float:
    """The smallest of ``scores`` (the non-falling runs' scores) such that at most ``target`` of
    them exceed it."""
    if not scores:
        raise UsageError("choose_threshold: no non-falling run to set a threshold on")
    ordered = sorted(scores, reverse=True)
    return ordered[min(len(ordered) - 1, math.floor(target * len(ordered)))]


# ------------------------------------------------------------------------------- one rule
@dataclass(frozen=True)
class RuleResult:
    """One alarm rule on one half of the runs, at a fixed threshold."""

    name: str
    threshold: float
    falls: int
    detected: int
    """Falls with a first alarm at or before F."""
    early: int
    """Falls with a first alarm at or before F_prev."""
    healthy: int
    """Non-falling runs that log the indicator."""
    false_alarms: int
    clean: int
    """Non-falling runs that never dipped below their plateau line."""
    clean_alarms: int
    leads: tuple[int, ...]
    """F - a of each detected fall."""
    auc: float
    """P(a fall's score > a non-fall's) + half the ties (NaN without both)."""
    p: float
    """One-sided Fisher p, detections against false alarms (NaN without falls)."""
    alarms: dict = field(default_factory=dict, repr=False)
    """First alarm step (or None) per falling run's name."""


Trace = tuple[np.ndarray, np.ndarray]


def traces_of(runs: list[RunSeries], name: str) -> dict[str, Trace | None]:
    """``alarm_trace`` of rule ``name`` (of ``ALARMS``) for each run, by run name."""
    alarm = ALARMS.get(name)
    return {r.name: alarm_trace(r, alarm) for r in runs}


def evaluate(runs: list[RunSeries], name: str, threshold: float, traces: dict[str, Trace | None] | None = None
             ) -> RuleResult:
    """Rule ``name`` (of ``ALARMS``) on ``runs`` at ``threshold`` (``traces``: ``traces_of(runs,
    name)``, computed when not given)."""
    traces = traces_of(runs, name) if traces is None else traces
    falls, healthy, alarms = [], [], {}
    detected = early = false_alarms = clean = clean_alarms = 0
    leads = []
    for r in runs:
        trace = traces[r.name]
        if trace is None:
            continue
        a = first_alarm_step(trace, threshold)
        if r.fell:
            falls.append(score(trace))
            alarms[r.name] = a
            if a is not None:
                detected += 1
                leads.append(r.fall_step - a)
                early += int(r.before_fall is not None and a <= r.before_fall)
        else:
            healthy.append(score(trace))
            false_alarms += int(a is not None)
            if not r.dipped:
                clean += 1
                clean_alarms += int(a is not None)
    auc = (sum(1.0 if f > h else 0.5 if f == h else 0.0 for f in falls for h in healthy) / (len(falls) * len(healthy))
           if falls and healthy else math.nan)
    p = fisher_greater(detected, len(falls), false_alarms, len(healthy)) if falls and healthy else math.nan
    return RuleResult(name=name, threshold=threshold, falls=len(falls), detected=detected, early=early,
                      healthy=len(healthy), false_alarms=false_alarms, clean=clean, clean_alarms=clean_alarms,
                      leads=tuple(sorted(leads)), auc=auc, p=p, alarms=alarms)


def roc_points(runs: list[RunSeries], name: str, traces: dict[str, Trace | None] | None = None
               ) -> list[tuple[float, float, float]]:
    """(threshold, false-alarm rate, detection rate) at every score of ``runs`` as the threshold,
    from the highest (nothing alarms) down; the rule's ROC curve (``traces`` as in ``evaluate``)."""
    traces = traces_of(runs, name) if traces is None else traces
    falls, healthy = [], []
    for r in runs:
        trace = traces[r.name]
        if trace is not None:
            (falls if r.fell else healthy).append(score(trace))
    if not falls or not healthy:
        return []
    cuts = sorted({s for s in falls + healthy if math.isfinite(s)}, reverse=True)
    pts = [(math.inf, 0.0, 0.0)]
    for c in cuts[1:] + [-math.inf]:
        pts.append((c, sum(h > c for h in healthy) / len(healthy), sum(f > c for f in falls) / len(falls)))
    return pts


# ------------------------------------------------------------------------------- the study
@dataclass(frozen=True)
class Study:
    """The registered analysis: every rule on both halves, and the test's verdicts."""

    runs: int
    """Runs included (repeats counted once)."""
    falls: int
    choosing_runs: list[RunSeries] = field(repr=False)
    test_runs: list[RunSeries] = field(repr=False)
    choosing: dict[str, RuleResult] = field(default_factory=dict)
    """Per rule, on the choosing half at its own threshold (descriptive)."""
    test: dict[str, RuleResult] = field(default_factory=dict)
    """Per rule, on the test half at the choosing half's threshold."""
    holm: dict[str, float] = field(default_factory=dict)
    """Holm-adjusted p per tested rule (rules with falls to detect in the test half)."""

    def verdict(self, name: str) -> str:
        t = self.test[name]
        if name not in self.holm:
            return "no falls"
        if self.holm[name] >= LEVEL:
            return "not supported"
        return "early warning" if 2 * t.early > t.falls else "detects, not early"

    def shipped(self) -> tuple[str, bool]:
        """(the rule a trainer ships, whether it passed its test) (module docstring)."""
        passing = [n for n in self.holm if self.holm[n] < LEVEL]
        pool = passing or list(self.holm)
        key = lambda n: (self.holm[n], self.test[n].p, -self.test[n].early,  # noqa: E731
                         -(float(np.median(self.test[n].leads)) if self.test[n].leads else -math.inf), n)
        return min(pool, key=key), bool(passing)


def study(root: str | Path, sweeps: tuple[str, ...] | None = REGISTERED_SWEEPS) -> Study:
    """The registered analysis of the runs under ``root`` (by default the registered sweeps only)."""
    runs = load_runs(root, sweeps)
    choose, test = split(runs)
    choosing, tested = {}, {}
    for name in ALARMS:
        mine, theirs = traces_of(choose, name), traces_of(test, name)
        c = choose_threshold([score(t) for r in choose if not r.fell and (t := mine[r.name]) is not None])
        choosing[name] = evaluate(choose, name, c, mine)
        tested[name] = evaluate(test, name, c, theirs)
    names = [n for n in ALARMS if tested[n].falls and tested[n].healthy]
    return Study(runs=len(runs), falls=sum(r.fell for r in runs), choosing_runs=choose, test_runs=test,
                 choosing=choosing, test=tested, holm=dict(zip(names, holm([tested[n].p for n in names]))))


# ------------------------------------------------------------------------------- output
def _rate(k: int, n: int) -> str:
    if n == 0:
        return "-"
    lo, hi = clopper_pearson(k, n)
    return f"{k}/{n} [{lo:.2f}, {hi:.2f}]"


def _p(p: float) -> str:
    return "-" if not math.isfinite(p) else f"{p:.2g}"


def _lead(leads: tuple[int, ...]) -> str:
    if not leads:
        return "-"
    return f"{float(np.median(leads)):g} ({min(leads)}-{max(leads)})"


def _table_head(last: str) -> list[str]:
    """The header of the per-rule table (the test half's, or a test set's), ``last`` its last column."""
    return ["| alarm | indicator | rule | threshold | detected (alarm <= F) [95% CP] | early (alarm <= F_prev) | "
            "false alarms [95% CP] | false alarms, runs that never dipped | lead F - a, steps: median (range) | "
            f"ROC area | Fisher p | Holm p | {last} |",
            "|---|---|---|---:|---|---|---|---|---|---:|---:|---:|---|"]


def _table_row(t: RuleResult, holm_p: float, last: str) -> str:
    """One rule's row of ``_table_head``'s table."""
    a = ALARMS.get(t.name)
    thr = f"{t.threshold:.3g}" + ("x" if a.rule == "change" else "")
    early = f"{t.early}/{t.falls}" if t.falls else "-"
    auc = "-" if not math.isfinite(t.auc) else f"{t.auc:.2f}"
    return (f"| {t.name} | `{a.indicator}` | {a.rule}, {a.direction} | {thr} | {_rate(t.detected, t.falls)} | "
            f"{early} | {_rate(t.false_alarms, t.healthy)} | {_rate(t.clean_alarms, t.clean)} | {_lead(t.leads)} | "
            f"{auc} | {_p(t.p)} | {_p(holm_p)} | {last} |")


def _falls_table(runs: list[RunSeries], results: dict[str, RuleResult], names: list[str]) -> list[str]:
    """The falls among ``runs`` one by one: L, F_prev, F and the first alarm (by F) of each rule of ``names``."""
    out = ["| run | L | F_prev | F | " + " | ".join(names) + " |", "|---|---:|---:|---:|" + "---:|" * len(names)]
    for r in (r for r in runs if r.fell):
        cells = [str(a) if (a := results[n].alarms.get(r.name)) is not None else "-" for n in names]
        out.append(f"| {r.name} | {r.learned_step} | {r.before_fall if r.before_fall is not None else '-'} | "
                   f"{r.fall_step} | " + " | ".join(cells) + " |")
    return out


def _numbers(t: RuleResult) -> str:
    """A rule's detections, early detections, false alarms and lead, as the closing lines give them."""
    return (f"detected {t.detected}/{t.falls}, early {t.early}/{t.falls}, false alarms {t.false_alarms}/{t.healthy}, "
            f"lead {_lead(t.leads)} steps")


def format_study(s: Study) -> str:
    """The FINDINGS block: the test half's table, the choosing half's, and the falls one by one."""
    n_falls = lambda runs: sum(r.fell for r in runs)  # noqa: E731
    out = [f"{s.runs} runs included, {s.falls} of which fall; choosing half {len(s.choosing_runs)} runs "
           f"({n_falls(s.choosing_runs)} falls), test half {len(s.test_runs)} ({n_falls(s.test_runs)} falls). "
           f"Thresholds set on the choosing half at <= {FALSE_ALARM_TARGET:.0%} false alarms; everything below is the "
           f"test half unless marked.", "", *_table_head("verdict")]
    out += [_table_row(s.test[name], s.holm.get(name, math.nan), s.verdict(name)) for name in ALARMS]
    out += ["", "Choosing half, at the same thresholds (descriptive):", "",
            "| alarm | detected [95% CP] | early | false alarms [95% CP] | lead: median (range) |",
            "|---|---|---|---|---|"]
    for name in ALARMS:
        c = s.choosing[name]
        early = f"{c.early}/{c.falls}" if c.falls else "-"
        out.append(f"| {name} | {_rate(c.detected, c.falls)} | {early} | {_rate(c.false_alarms, c.healthy)} | "
                   f"{_lead(c.leads)} |")
    out += ["", "The test half's falls: F, F_prev and each rule's first alarm (- : none by F):", "",
            *_falls_table(s.test_runs, s.test, [n for n in ALARMS if n in s.holm])]
    name, ok = s.shipped()
    t = s.test[name]
    out += ["", (f"Shipped as the trainer's alarm: **{name}** (passed: Holm p = {_p(s.holm[name])}; {_numbers(t)})."
                 if ok else
                 f"No rule passed its test. The trainer's alarm defaults to the rule of the smallest p, **{name}** "
                 f"(Holm p = {_p(s.holm[name])}; {_numbers(t)}), which failed it.")]
    return "\n".join(out)


def plot_roc(s: Study, out_png: str | Path) -> Path:
    """Detection rate against false-alarm rate on the test half as the threshold moves, one curve per
    tested rule, its chosen threshold marked."""
    from matplotlib.figure import Figure

    groups = {"mismatch indicators": [n for n in s.holm if ALARMS.get(n).indicator.startswith("rollout_corr/")],
              "training indicators": [n for n in s.holm if not ALARMS.get(n).indicator.startswith("rollout_corr/")]}
    fig = Figure(figsize=(9.5, 4.2))
    for k, (title, names) in enumerate(groups.items()):
        ax = fig.add_subplot(1, 2, k + 1)
        for i, name in enumerate(names):
            pts = roc_points(s.test_runs, name)
            ax.plot([p[1] for p in pts], [p[2] for p in pts], color=f"C{i}", lw=1.2, label=name)
            t = s.test[name]
            ax.plot([t.false_alarms / t.healthy], [t.detected / t.falls], "o", color=f"C{i}")
        ax.plot([0, 1], [0, 1], ":", color="gray", lw=0.8)
        ax.set_xlim(-0.02, 1.02)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("false-alarm rate (runs that did not fall)")
        ax.set_ylabel("detection rate (alarm at or before the fall)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Early warning of a fall, test half ({sum(r.fell for r in s.test_runs)} falls): each curve moves the "
                 "threshold; the dot is the one chosen on the other half", fontsize=9)
    out = Path(out_png)
    fig.savefig(out, dpi=100, bbox_inches="tight")
    return out


# ------------------------------------------------------------------------------- a later test set
TEST_SETS = {"h1": "docs/examples/studies/h1.yaml"}
"""Sweeps committed after the benchmark and registered as further test sets of its rules (docs/FINDINGS.md,
"Study H1 as a second test set of the alarm rules"), each with its study file: a path from the folder
that holds the sweeps folder, as the study file's own ``out`` is."""
TESTED_RULES = tuple(n for n in ALARMS if ALARMS.get(n).indicator in INDICATORS)
"""The 9 rules the benchmark tested, its Holm family: those on the six indicators every included run
logs (the two on ``mismatch/k3_seq`` had no fall to detect)."""
SHIPPED = "grad_norm_change"
"""The rule the benchmark shipped as the trainer's alarm (``Study.shipped``; a test recomputes it)."""
HOLDS_AT_MOST = 0.20
"""A test set without a fall: a rule holds its false-alarm rate on long runs when the upper end of
its 95% interval is at most this; it cries wolf when the lower end is above ``FALSE_ALARM_TARGET``."""


@dataclass(frozen=True)
class SecondTest:
    """The rules at their registered thresholds (``ALARMS``) on the runs of one later sweep."""

    sweep: str
    steps: int
    """The study's last step: how long its runs are."""
    incomplete: str | None
    """The study engine's INCOMPLETE line while a run of the study has not finished (then nothing
    below is computed, no run's metrics read); None once every run has."""
    runs: list[RunSeries] = field(default_factory=list, repr=False)
    """The included runs (the benchmark's inclusion rule, repeats counted once), all of them tested."""
    results: dict[str, RuleResult] = field(default_factory=dict)
    """Per rule of ``ALARMS``, at its registered threshold."""
    holm: dict[str, float] = field(default_factory=dict)
    """Holm-adjusted p over ``TESTED_RULES`` (those with falls and non-falling runs to compare)."""

    @property
    def label(self) -> str:
        return self.sweep.upper()

    @property
    def falls(self) -> int:
        return sum(r.fell for r in self.runs)

    def readout(self, name: str) -> str:
        """The registered read-out of rule ``name``: with falls, confirmed or not (Holm p < ``LEVEL``);
        without, whether its false-alarm rate over these long runs holds, cries wolf or is undecided."""
        t = self.results[name]
        if self.falls:
            if name not in TESTED_RULES:
                return "descriptive (not one of the 9 tested rules)"
            return f"confirmed on {self.label}" if self.holm.get(name, 1.0) < LEVEL else "not confirmed"
        if not t.healthy:
            return "-"
        lo, hi = clopper_pearson(t.false_alarms, t.healthy)
        if hi <= HOLDS_AT_MOST:
            return "holds its false-alarm rate on long runs"
        return "cries wolf on long runs" if lo > FALSE_ALARM_TARGET else "undecided"


def _test_set_study(root: Path, sweep: str, study_file: str | Path | None):
    """The study whose sweep ``root/sweep`` is (``TEST_SETS``, unless ``study_file`` names it); a
    one-line error for a sweep the benchmark was set on, or one no study file registers."""
    from timlab.experiments.studies.registration import load_study

    choices = ", ".join(TEST_SETS)
    if sweep in REGISTERED_SWEEPS:
        raise UsageError(f"test set {sweep!r} is one of the {len(REGISTERED_SWEEPS)} sweeps the thresholds were set "
                         f"and tested on, not a new test set; valid choices: {choices}")
    if study_file is None:
        if sweep not in TEST_SETS:
            why = ("has no study file registered as a test set of the alarm rules" if (root / sweep).is_dir()
                   else f"is not a sweep under {root}")
            raise UsageError(f"test set {sweep!r} {why}; valid choices: {choices}")
        study_file = root.resolve().parent / TEST_SETS[sweep]
    s = load_study(study_file)
    if s.out and Path(s.out).name != sweep:
        raise UsageError(f"test set {sweep!r}: the study file {study_file} registers sweep {s.out}, not {sweep}")
    return s


def second_test(root: str | Path, sweep: str = "h1", study_file: str | Path | None = None) -> SecondTest:
    """Every rule at its registered threshold on the runs of ``root/sweep``, a later sweep registered
    as a further test set (``TEST_SETS``; ``study_file``: its study file, by default the registered
    one): all of its included runs are test runs, nothing is re-chosen. Until every run of the study
    has finished at its last step or diverged (the study engine's rule), only the INCOMPLETE line,
    and no run's metrics are read."""
    root = Path(root)
    from timlab.experiments.studies.engine import incomplete, planned_runs
    from timlab.experiments.studies.blocks import block_dirs

    s = _test_set_study(root, sweep, study_file)
    # the study's directories under root (a blocked study's runs live in one directory per block)
    dirs = {b: root / Path(d).name for b, d in block_dirs(s, None if s.blocks else root / sweep).items()}
    line = incomplete(s, dirs=dirs)
    if line is not None:
        return SecondTest(sweep=sweep, steps=s.steps, incomplete=line)
    only = {f"{dirs[p.block].name}/{p.run_id}" for p in planned_runs(s)}  # the study's runs, none left out of it
    runs = load_runs(root, tuple(d.name for d in dirs.values()), only)
    results = {name: evaluate(runs, name, ALARMS.get(name).threshold) for name in ALARMS}
    names = [n for n in TESTED_RULES if results[n].falls and results[n].healthy]
    return SecondTest(sweep=sweep, steps=s.steps, incomplete=None, runs=runs, results=results,
                      holm=dict(zip(names, holm([results[n].p for n in names]))))


def format_test_set(t: SecondTest) -> str:
    """The FINDINGS block ``early-warning-<sweep>``: the INCOMPLETE line alone, or the per-rule table,
    the falls one by one and the shipped rule's read-out."""
    if t.incomplete is not None:
        return t.incomplete
    out = [f"{t.label}: {len(t.runs)} runs included, {t.falls} of which fall; all of them test runs, at the thresholds "
           f"set on the benchmark's choosing half (<= {FALSE_ALARM_TARGET:.0%} false alarms there), none re-chosen; "
           f"Holm over the {len(TESTED_RULES)} rules the benchmark tested.", "", *_table_head("read-out")]
    out += [_table_row(t.results[name], t.holm.get(name, math.nan), t.readout(name)) for name in ALARMS]
    ship = t.results[SHIPPED]
    if t.falls:
        out += ["", f"{t.label}'s falls: F, F_prev and each rule's first alarm (- : none by F):", "",
                *_falls_table(t.runs, t.results, [n for n in TESTED_RULES if n in t.holm]), "",
                f"The shipped rule **{SHIPPED}** is **{t.readout(SHIPPED)}** (Holm p = "
                f"{_p(t.holm.get(SHIPPED, math.nan))}; {_numbers(ship)})."]
    else:
        out += ["", f"{t.label} has no fall: detection is untested, and only the false-alarm rates over its "
                    f"{t.steps}-step runs are read (holds: the upper end of the 95% interval <= {HOLDS_AT_MOST:.2f}; "
                    f"cries wolf: its lower end > {FALSE_ALARM_TARGET:.2f}). The shipped rule **{SHIPPED}**: "
                    f"**{t.readout(SHIPPED)}**, false alarms {_rate(ship.false_alarms, ship.healthy)} (runs that "
                    f"never dipped: {_rate(ship.clean_alarms, ship.clean)})."]
    return "\n".join(out)


# ------------------------------------------------------------------------------- one rule, one series
@dataclass(frozen=True)
class AlarmCheck:
    """A registered alarm rule run over one series: what ``timlab analyze --alarm`` prints."""

    name: str
    source: str
    threshold: float
    armed_after: int | None
    """The series is watched from the step after this one (None: from its first step)."""
    watched: int
    """Steps watched (finite values)."""
    first: int | None
    """The step it first fired (None: it did not)."""
    statistic: float
    """Its statistic at ``first`` (NaN without)."""
    above: int
    """Steps whose statistic exceeded the threshold."""


UPDATED = "train/updated"
GRAD_NORM = "train/grad_norm"


def update_mask(m: pd.DataFrame) -> np.ndarray:
    """True at each row of ``m`` that updated the policy: not ``train/updated`` = 0 (where logged),
    not ``train/grad_norm`` exactly 0 (a NaN in either does not remove the row)."""
    keep = np.ones(len(m), dtype=bool)  # (rows,)
    for col in (UPDATED, GRAD_NORM):
        if col in m.columns:
            keep &= ~(pd.to_numeric(m[col], errors="coerce").to_numpy(dtype=float) == 0)
    return keep


def check_series(steps, values, name: str, *, source: str, threshold: float | None = None,
                 armed_after: int | None = None) -> AlarmCheck:
    """Rule ``name`` of ``ALARMS`` over (steps, values), as the trainer's alarm would run it: from
    the step after ``armed_after`` (None: the first), at ``threshold`` (None: the rule's own)."""
    alarm = ALARMS.get(name)
    c = alarm.threshold if threshold is None else float(threshold)
    steps, values = np.asarray(steps, dtype=np.int64), np.asarray(values, dtype=float)
    keep = np.isfinite(values) & (steps > armed_after if armed_after is not None else True)  # (steps,)
    stats = np.array(statistic_series(values[keep].tolist(), rule=alarm.rule, direction=alarm.direction), dtype=float)
    i = first_alarm(stats.tolist(), c)
    return AlarmCheck(name=name, source=source, threshold=c, armed_after=armed_after, watched=int(keep.sum()),
                      first=None if i is None else int(steps[keep][i]), statistic=math.nan if i is None else float(stats[i]),
                      above=int((stats > c).sum()))


def check_run(run_dir: str | Path, name: str, *, threshold: float | None = None,
              armed_at: float = DEFAULT_LEARNED_AT) -> AlarmCheck:
    """Rule ``name`` over a run directory's logged series, watched after its first evaluation with
    val/accuracy >= ``armed_at`` (0: from the first step), as the benchmark and ``run.alarm`` do."""
    alarm = ALARMS.get(name)
    m = RunDir(run_dir).read_metrics()
    if m is None:
        raise UsageError(f"{run_dir}: no metrics.parquet (not a timlab run directory, or no step logged yet)")
    if alarm.indicator not in m.columns:
        raise UsageError(f"{run_dir}: the run did not log {alarm.indicator}, which alarm {name} reads")
    armed = None
    if armed_at > 0:
        ev = m.loc[m["val/accuracy"].notna() & (m["val/accuracy"] >= armed_at), "step"] if "val/accuracy" in m else []
        if not len(ev):
            return AlarmCheck(name=name, source=str(run_dir), threshold=alarm.threshold if threshold is None else threshold,
                              armed_after=None, watched=0, first=None, statistic=math.nan, above=0)
        armed = int(ev.iloc[0])
    m = m[update_mask(m)]  # a step that updated nothing is not watched (the re-registered benchmark's rule)
    return check_series(m["step"], m[alarm.indicator], name, source=str(run_dir), threshold=threshold,
                        armed_after=armed)


def check_file_rule(name: str) -> None:
    """A one-line error, before any reading, when rule ``name`` watches a series a file of log-probs
    cannot give (anything but ``timlab.metrics.all_metrics``' keys: the grad norm, entropy, ...)."""
    from timlab.metrics import MISMATCH_KEYS, VERL_KEYS

    known = {f"rollout_corr/{k}" for k in VERL_KEYS} | {f"mismatch/{k}" for k in MISMATCH_KEYS}
    if ALARMS.get(name).indicator not in known:
        fits = [n for n in ALARMS if ALARMS.get(n).indicator in known]
        raise UsageError(f"--alarm {name} reads {ALARMS.get(name).indicator}, which a file of log-probs does not give; "
                         f"give a run directory instead, or one of: {', '.join(fits)}")


def check_analysis(result: dict, name: str, *, threshold: float | None = None) -> AlarmCheck:
    """Rule ``name`` over the per-step metrics of ``timlab.experiments.diagnostics.analyze.analyze_file``'s
    result, from its first step (a log-prob file holds no accuracy to arm on)."""
    check_file_rule(name)
    alarm = ALARMS.get(name)
    per_step = result.get("per_step") or []
    if not per_step:
        raise UsageError(f"--alarm {name}: {result.get('source', 'the file')} has no step column, so no series to watch")
    return check_series([s["step"] for s in per_step], [s["metrics"][alarm.indicator] for s in per_step], name,
                        source=str(result.get("source", "")), threshold=threshold)


def format_check(c: AlarmCheck) -> str:
    """One line: where the alarm was watched and whether, when, it fired."""
    a = ALARMS.get(c.name)
    what = (f"mean of the last {WINDOW} steps' {a.indicator}" if a.rule == "level" else
            f"{a.indicator}'s last {WINDOW} steps against the {BASELINE} before ({a.direction})")
    unit = "x" if a.rule == "change" else ""
    watched = f"watched {c.watched} steps" + (f" after step {c.armed_after}" if c.armed_after is not None else "")
    if c.watched == 0:
        watched = "never armed (no evaluation reached the arming accuracy)" if c.armed_after is None else watched
    fired = (f"fired at step {c.first} ({c.statistic:.3g}{unit}), above the threshold on {c.above} steps"
             if c.first is not None else "did not fire")
    return f"alarm {c.name} ({what} > {c.threshold:.3g}{unit}) on {c.source}: {watched}; {fired}; {EXPERIMENTAL}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m timlab.experiments.studies.early_warning", description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", default="sweeps", help="the folder of sweeps (default: sweeps)")
    ap.add_argument("--figure", help="also write the ROC figure (PNG) here")
    ap.add_argument("--all-sweeps", action="store_true",
                    help="read every sweep under the root, not only the 21 the benchmark registered (REGISTERED_SWEEPS)")
    ap.add_argument("--test-set", metavar="SWEEP",
                    help=f"instead, every rule at its registered threshold on a later sweep registered as a further "
                         f"test set ({', '.join(TEST_SETS)}): the FINDINGS block early-warning-SWEEP, one INCOMPLETE "
                         f"line until every run of its study has finished")
    args = ap.parse_args(argv)
    try:
        if args.test_set is not None:
            if args.figure or args.all_sweeps:
                raise UsageError("--test-set prints its block only; --figure and --all-sweeps are options of the "
                                 "benchmark itself (without --test-set)")
            print(format_test_set(second_test(args.root, args.test_set)))
            return 0
        s = study(args.root, None if args.all_sweeps else REGISTERED_SWEEPS)
    except TimlabError as e:
        print(f"{ap.prog}: error: {one_line(e)}", file=sys.stderr)
        return 2
    print(format_study(s))
    if args.figure:
        plot_roc(s, args.figure)
    return 0


__all__ = ["REGISTERED_SWEEPS", "UPDATED", "GRAD_NORM", "update_mask", "RunSeries", "RuleResult", "Study", "run_series", "alarm_trace", "score", "first_alarm_step", "load_runs",
           "distinct", "split", "choose_threshold", "traces_of", "evaluate", "roc_points", "study", "format_study", "plot_roc",
           "AlarmCheck", "check_series", "check_run", "check_file_rule", "check_analysis", "format_check",
           "MIN_STEPS", "REPEAT_STEPS", "REPEAT_COLUMNS", "INDICATORS", "FALSE_ALARM_TARGET", "LEVEL", "FINDINGS_BLOCK",
           "TEST_SETS", "TESTED_RULES", "SHIPPED", "HOLDS_AT_MOST", "SecondTest", "second_test", "format_test_set"]

if __name__ == "__main__":
    sys.exit(main())
