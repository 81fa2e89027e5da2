"""Per-run endpoints over step windows: the numbers a study compares between arms.

A registered endpoint is one statistic of one logged metric over an inclusive window of steps
(``window_stat``); the values are the metric's non-missing rows in the window, in step order:

- ``level``: their mean (an evaluation metric's level, or a training metric's mean);
- ``slope``: the least-squares slope through (step, value), per 100 steps
  (``stats.line_fit``: the same bits on every machine); NaN with fewer than 2 points;
- ``first`` / ``last``: the mean of the first / last ``n`` values;
- ``start`` / ``final``: the first / last value;
- ``max`` / ``min``: the largest / smallest value (e.g. the peak accuracy); ``sum``: their sum
  (e.g. the seconds a run logged);
- ``log_slope``: the least-squares slope of the log of the window's positive values, per 100
  steps (a growth rate: +0.69 doubles every 100 steps); NaN with fewer than 2;
- ``fall``: 1 when the run falls under a collapse rule (``collapse.judge``, default the plateau
  rule: a sustained fall from the learned level; a diverged run always falls), else 0;
- ``fall_step``: the step of that fall, NaN when the run does not fall.

``reach`` opens the window where the run first reaches a value: at the first logged step whose
value is at least ``reach``, plus ``lag`` steps (e.g. the slope after a run has learned); NaN when
it never does. ``min_points``: a slope over fewer values is NaN.

``scale`` puts a level-like value (``SCALED_STATS``) on another scale before any arm is compared
(``SCALES``): ``logit``, the log-odds of a proportion clipped to [0.005, 0.995]
(``stats.logit``), so a family's "arm minus control" is a difference of log-odds.

``guard(m)`` and ``rows(m)`` are the validity checks' per-run facts: the zero-mismatch guard held
at every logged training step (k3 exactly 0 and every token bitwise equal), and how many training
steps were logged. ``run_endpoints`` is the erosion study's fixed set of endpoints, which the
analyses of E2, E3 and the MoE study build on.
"""

from __future__ import annotations

import math

import pandas as pd

from timlab.experiments.studies.collapse import judge
from timlab.experiments.studies.stats import line_fit, logit

STATS = ("level", "slope", "log_slope", "first", "last", "start", "final", "max", "min", "sum", "fall", "fall_step")
"""The statistics an endpoint may register."""
SCALES = {"logit": logit}
"""The scales an endpoint's value may be put on (``scale``), each a function of one run's value."""
SCALED_STATS = ("level", "first", "last", "start", "final", "max", "min")
"""The statistics whose value is a level of the metric (a proportion, for ``logit``): the only ones a
``scale`` applies to (the log-odds of a slope or a sum means nothing)."""
BOUNDED_METRICS = {"val/accuracy": (0.0, 1.0)}
"""Metrics whose every value lies within these bounds: the t-interval of a level of one (a
``SCALED_STATS`` endpoint on no ``scale``) is clipped to them (``endpoint_bounds``)."""
K3 = "rollout_corr/k3_kl"
BITWISE = "mismatch/frac_bitwise_equal"


def endpoint_bounds(metric: str, stat: str, scale: str = "") -> tuple[float, float] | None:
    """The bounds an endpoint's values and their means lie within (``BOUNDED_METRICS``), or None."""
    return BOUNDED_METRICS.get(metric) if stat in SCALED_STATS and not scale else None


def window_stat(m: pd.DataFrame, metric: str, stat: str, window: tuple[int | None, int | None] = (None, None), *,
                n: int = 20, rule: str = "plateau", diverged: bool = False, reach: float | None = None, lag: int = 0,
                min_points: int = 2) -> float:
    """One endpoint of one run (see the module docstring); ``m``: the run's metrics table."""
    if stat in ("fall", "fall_step"):
        step = judge(m, rule=rule, diverged=diverged)
        return float(step is not None) if stat == "fall" else math.nan if step is None else float(step)
    lo, hi = window
    m = m.sort_values("step")
    if metric not in m.columns:
        return math.nan
    v = m[["step", metric]].dropna()
    if reach is not None:  # the window opens lag steps after the first value that reaches ``reach``
        hit = v.loc[v[metric] >= reach, "step"]
        if hit.empty:
            return math.nan
        lo = max(lo if lo is not None else -math.inf, float(hit.iloc[0]) + lag)
    v = v[(v["step"] >= (lo if lo is not None else -math.inf)) & (v["step"] <= (hi if hi is not None else math.inf))]
    if v.empty:
        return math.nan
    if stat == "level":
        return float(v[metric].mean())
    if stat == "slope":
        return line_fit(v["step"], v[metric])[0] * 100 if len(v) >= max(2, min_points) else math.nan
    if stat == "log_slope":
        v = v[v[metric] > 0]  # log of a positive quantity (e.g. k3: exactly 0 where the weights have not moved)
        return line_fit(v["step"], [math.log(x) for x in v[metric]])[0] * 100 if len(v) >= max(2, min_points) \
            else math.nan
    if stat == "first":
        return float(v[metric].iloc[:n].mean())
    if stat == "last":
        return float(v[metric].iloc[-n:].mean())
    if stat == "start":
        return float(v[metric].iloc[0])
    if stat == "final":
        return float(v[metric].iloc[-1])
    if stat in ("max", "min", "sum"):
        return float(getattr(v[metric], stat)())
    raise ValueError(f"unknown endpoint statistic {stat!r}; valid choices: {', '.join(STATS)}")


def guard(m: pd.DataFrame) -> bool:
    """The zero-mismatch guard held at every training step: k3 exactly 0, every token bitwise equal."""
    t = m[m["step"] >= 1]  # step 0 is the evaluation of the start alone (no rollout)
    return bool((t[K3] == 0).all() and (t[BITWISE] == 1).all())


def rows(m: pd.DataFrame) -> int:
    """Training steps logged (steps >= 1)."""
    return int((m["step"] >= 1).sum())


def _slope(ev: pd.DataFrame, col: str) -> float:
    """OLS slope per 100 steps of ``col`` over the rows of ``ev`` (NaN with < 2 points)."""
    e = ev[["step", col]].dropna() if col in ev.columns else ev.iloc[:0]
    return line_fit(e["step"], e[col])[0] * 100 if len(e) >= 2 else math.nan


def run_endpoints(m: pd.DataFrame, start: int = 50, *, diverged: bool = False) -> dict:
    """The erosion study's endpoints of one run, over the evaluations at steps >= ``start``: the
    slopes (per 100 steps) and mean levels of ``val/accuracy`` and ``val/gold_logprob``, the
    realized k3 (mean over steps >= start), k3 over the first and last 20 steps, the step-0 and
    last evaluation, the plateau-rule fall, the guard and the steps logged."""
    m = m.sort_values("step")
    ev = m[m["val/accuracy"].notna()]
    win = ev[ev["step"] >= start]
    k3 = m[K3]
    gold = "val/gold_logprob" in m.columns
    return {
        "acc_slope": _slope(win, "val/accuracy"), "gold_slope": _slope(win, "val/gold_logprob") if gold else math.nan,
        "acc_level": float(win["val/accuracy"].mean()),
        "gold_level": float(win["val/gold_logprob"].mean()) if gold else math.nan,
        "k3": float(m.loc[m["step"] >= start, K3].mean()),
        "k3_first": float(k3[m["step"] >= 1].iloc[:20].mean()), "k3_last": float(k3.iloc[-20:].mean()),
        "start_acc": float(ev["val/accuracy"].iloc[0]), "final_acc": float(ev["val/accuracy"].iloc[-1]),
        "final_gold": float(ev["val/gold_logprob"].iloc[-1]) if gold else math.nan,
        "fell": judge(m, rule="plateau", diverged=diverged) is not None,
        "guard": guard(m), "steps": int(m["step"].max()), "rows": rows(m),
    }
