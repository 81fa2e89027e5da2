"""Tables of the erosion study (docs/findings/erosion.md), from its sweeps' run directories; the
command is ``python scripts/erosion_tables.py``.

``probe``: per condition, the realized k3 (mean of ``rollout_corr/k3_kl`` over a run's steps, then
over its runs) with the range over runs, and the median wall time of a training step.

``slopes``: per run, the OLS slope of ``val/accuracy`` over the evaluations at steps >= ``--from``
(50, as pre-registered), per 100 steps, and its realized k3 over the same steps; per condition, the
mean over seeds with a 95% t-interval, each run's mean k3 over its first and last 20 steps, the excess over the ``control`` condition with an exact
two-sided permutation p (``timlab.experiments.studies.stats``), whether every control step kept k3 exactly
0 and every token bitwise equal, and the wall-clock cost per RL step (training step time plus its
share of evaluation time; one thread per run, so an upper bound on CPU-seconds per step on a
shared machine). It has no gold log-prob column (the pilot ran before ``val/gold_logprob`` existed).

The pre-registered analysis of the full study is a study file, analysed by the package:
``timlab study analyze docs/examples/studies/erosion.yaml`` (``timlab.experiments.studies``).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from timlab.experiments.studies.stats import line_fit, permutation_test, t_ci
from timlab.experiments.studies.sweep_runs import arm, runs
from timlab.experiments.studies.text import fmt

CONTROL = "control"
"""The zero-mismatch arm's condition name in the erosion specs."""
START = 50
"""First step of the pilot's slope window, as pre-registered."""


def probe(sweep: str) -> str:
    rows: dict[str, list[tuple[float, float]]] = {}
    for row, m in runs(sweep):
        rows.setdefault(arm(row["spec_condition"]), []).append(
            (float(m["rollout_corr/k3_kl"].mean()), float(m["train/step_time_s"].median())))
    lines = ["| condition | runs | realized k3 (mean) | range | median wall s per training step |",
             "|---|---:|---:|---:|---:|"]
    for c, r in rows.items():
        k = [x[0] for x in r]
        lines.append(f"| {c} | {len(k)} | {fmt(float(np.mean(k)))} | {fmt(min(k))}-{fmt(max(k))} | "
                     f"{np.mean([x[1] for x in r]):.2f} |")
    return "\n".join(lines)


def run_slope(m: pd.DataFrame, start: int) -> tuple[float, float]:
    """(accuracy slope per 100 steps over evaluations at steps >= start, mean k3 over those steps)."""
    ev = m[["step", "val/accuracy"]].dropna()
    ev = ev[ev["step"] >= start]
    slope = line_fit(ev["step"], ev["val/accuracy"])[0] * 100 if len(ev) >= 2 else math.nan
    return slope, float(m.loc[m["step"] >= start, "rollout_corr/k3_kl"].mean())


def slopes(sweep: str, start: int) -> str:
    per: dict[str, dict[str, list]] = {}
    guard_ok, step_s = True, []
    for row, m in runs(sweep):
        s, k3 = run_slope(m, start)
        d = per.setdefault(arm(row["spec_condition"]), {"slope": [], "k3": [], "path": [], "level": [], "trend": []})
        k = m.sort_values("step")["rollout_corr/k3_kl"]
        d["trend"].append((float(k.iloc[:20].mean()), float(k.iloc[-20:].mean())))
        ev = m[["step", "val/accuracy"]].dropna()
        d["slope"].append(s), d["k3"].append(k3)
        at = dict(zip(ev["step"], ev["val/accuracy"]))
        d["path"].append((at.get(0, math.nan), at.get(start, math.nan), float(ev["val/accuracy"].iloc[-1])))
        d["level"].append(float(ev.loc[ev["step"] >= start, "val/accuracy"].mean()))
        if arm(row["spec_condition"]) == CONTROL:
            t = m[m["step"] >= 1]  # step 0 is the evaluation of the start alone (no rollout)
            guard_ok &= bool(len(t) == int(m["step"].max()) and (t["rollout_corr/k3_kl"] == 0).all()
                             and (t["mismatch/frac_bitwise_equal"] == 1).all())
        steps = int(m["step"].max())
        step_s.append((float(m["train/step_time_s"].sum()) + float(m["time/eval_s"].sum())) / steps)
    ctrl = per.get(CONTROL, {})
    lines = [f"| arm | seeds | realized k3 (steps >= {start}) | k3 first 20 -> last 20 steps (per seed) | "
             f"accuracy at 0 -> {start} -> last (per seed) | accuracy slope per 100 steps from {start} (95% t) | "
             f"excess over control (permutation p) | mean accuracy from {start} minus control |",
             "|---|---:|---:|---|---|---:|---:|---:|"]
    for c, d in per.items():
        mu, lo, hi = t_ci(d["slope"])
        path = "; ".join(" -> ".join(f"{x:.3f}" for x in p) for p in d["path"])
        if c != CONTROL and ctrl:
            p = permutation_test(d["slope"], ctrl["slope"])
            ex = f"{p.diff:+.3f} (p {p.p:.2f}, floor {p.floor:.2f})"
            level = f"{float(np.mean(d['level']) - np.mean(ctrl['level'])):+.3f}"
        else:
            ex, level = "-", "-"
        trend = "; ".join(f"{fmt(a)} -> {fmt(b)}" for a, b in d["trend"])
        lines.append(f"| {c} | {len(d['slope'])} | {fmt(float(np.mean(d['k3'])))} | {trend} | {path} | "
                     f"{mu:+.3f} [{lo:+.3f}, {hi:+.3f}] | {ex} | {level} |")
    lines.append("")
    lines.append(f"Control guard (k3 exactly 0 and every token bitwise equal at every step): "
                 f"{'held' if guard_ok else 'BROKEN'}. Wall seconds per RL step (train + eval share), "
                 f"mean over {len(step_s)} runs: {np.mean(step_s):.2f} (range {min(step_s):.2f}-{max(step_s):.2f}).")
    return "\n".join(lines)
