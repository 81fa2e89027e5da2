"""Tables of the erosion study (docs/FINDINGS.md, "Erosion study"), from its sweeps' run directories.

    python scripts/erosion_tables.py probe sweeps/erosion_probe    # dose -> realized k3 on the learned policy
    python scripts/erosion_tables.py slopes sweeps/erosion_pilot   # per-arm slopes, guard check, cost

``probe``: per condition, the realized k3 (mean of ``rollout_corr/k3_kl`` over a run's steps, then
over its runs) with the range over runs, and the median wall time of a training step.

``slopes``: per run, the OLS slope of ``val/accuracy`` over the evaluations at steps >= ``--from``
(50, as pre-registered), per 100 steps, and its realized k3 over the same steps; per condition, the
mean over seeds with a 95% t-interval, each run's mean k3 over its first and last 20 steps, the excess over the ``control`` condition with an exact
two-sided permutation p (``timlab.experiments.stats``), whether every control step kept k3 exactly
0 and every token bitwise equal, and the wall-clock cost per RL step (training step time plus its
share of evaluation time; one thread per run, so an upper bound on CPU-seconds per step on a
shared machine). The pre-registered gold log-prob endpoint is not logged yet, so it has no column.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timlab.experiments.collapse import read_metrics  # noqa: E402
from timlab.experiments.stats import permutation_test  # noqa: E402
from timlab.experiments.sweep import read_index  # noqa: E402

CONTROL = "control"
"""The zero-mismatch arm's condition name in the erosion specs."""
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
"""Two-sided 95% Student t quantiles by degrees of freedom (seeds - 1)."""


def fmt(x: float) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.1e}" if x != 0 and abs(x) < 0.01 else f"{x:.3f}"


def runs(sweep: str) -> list[tuple[pd.Series, pd.DataFrame]]:
    """(index row, metrics) of every run of a sweep that has metrics."""
    out = []
    for _, row in read_index(sweep).iterrows():
        d = Path(row["run_dir"])
        d = d if d.is_absolute() else Path(sweep) / row["run_id"]
        m = read_metrics(d)
        if m is not None:
            out.append((row, m))
    return out


def arm(condition: str) -> str:
    """The arm of a condition: its name without a trailing ``_s<seed>`` (one condition per seed)."""
    return re.sub(r"_s\d+$", "", condition)


def mean_ci(x: list[float]) -> tuple[float, float, float]:
    """Mean and 95% t-interval (NaN interval for one value)."""
    a = np.asarray(x, float)
    if a.size < 2:
        return float(a.mean()), math.nan, math.nan
    h = T975[a.size - 1] * a.std(ddof=1) / math.sqrt(a.size)
    return float(a.mean()), float(a.mean() - h), float(a.mean() + h)


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
    slope = float(np.polyfit(ev["step"], ev["val/accuracy"], 1)[0]) * 100 if len(ev) >= 2 else math.nan
    return slope, float(m.loc[m["step"] >= start, "rollout_corr/k3_kl"].mean())


def slopes(sweep: str, start: int) -> str:
    per: dict[str, dict[str, list]] = {}
    guard_ok, step_s = True, []
    for row, m in runs(sweep):
        s, k3 = run_slope(m, start)
        d = per.setdefault(arm(row["spec_condition"]), {"slope": [], "k3": [], "start": [], "final": [], "trend": []})
        k = m.sort_values("step")["rollout_corr/k3_kl"]
        d["trend"].append((float(k.iloc[:20].mean()), float(k.iloc[-20:].mean())))
        ev = m[["step", "val/accuracy"]].dropna()
        d["slope"].append(s), d["k3"].append(k3)
        d["start"].append(float(ev["val/accuracy"].iloc[0])), d["final"].append(float(ev["val/accuracy"].iloc[-1]))
        if arm(row["spec_condition"]) == CONTROL:
            t = m[m["step"] >= 1]  # step 0 is the evaluation of the start alone (no rollout)
            guard_ok &= bool(len(t) == int(m["step"].max()) and (t["rollout_corr/k3_kl"] == 0).all()
                             and (t["mismatch/frac_bitwise_equal"] == 1).all())
        steps = int(m["step"].max())
        step_s.append((float(m["train/step_time_s"].sum()) + float(m["time/eval_s"].sum())) / steps)
    ctrl = per.get(CONTROL, {}).get("slope", [])
    lines = [f"| arm | seeds | realized k3 (steps >= {start}) | start -> final accuracy (per seed) | "
             f"k3 first 20 -> last 20 steps | accuracy slope per 100 steps (95% t) | excess over control | permutation p |",
             "|---|---:|---:|---|---|---:|---:|---:|"]
    for c, d in per.items():
        mu, lo, hi = mean_ci(d["slope"])
        acc = ", ".join(f"{a:.2f}->{b:.2f}" for a, b in zip(d["start"], d["final"]))
        if c != CONTROL and ctrl:
            p = permutation_test(d["slope"], ctrl)
            ex, pv = f"{p.diff:+.3f}", f"{p.p:.2f} (floor {p.floor:.2f})"
        else:
            ex, pv = "-", "-"
        trend = ", ".join(f"{fmt(a)}->{fmt(b)}" for a, b in d["trend"])
        lines.append(f"| {c} | {len(d['slope'])} | {fmt(float(np.mean(d['k3'])))} | {acc} | {trend} | "
                     f"{mu:+.3f} [{lo:+.3f}, {hi:+.3f}] | {ex} | {pv} |")
    lines.append("")
    lines.append(f"control guard (k3 exactly 0 and every token bitwise equal at every step): "
                 f"{'held' if guard_ok else 'BROKEN'}; wall seconds per RL step (train + eval share), "
                 f"mean over {len(step_s)} runs: {np.mean(step_s):.2f} (range {min(step_s):.2f}-{max(step_s):.2f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", choices=("probe", "slopes"))
    ap.add_argument("sweep")
    ap.add_argument("--from", dest="start", type=int, default=50, help="first step of the slope window (default 50)")
    a = ap.parse_args(argv)
    print(probe(a.sweep) if a.table == "probe" else slopes(a.sweep, a.start))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
