"""Each arm's course over training: the figure ``timlab study figure --trajectories`` draws.

One panel per metric the study's endpoints read, in the order they first appear: each arm's mean
over its seeds against the step, with the 95% Student-t band of that mean. A metric logged at
every training step is first smoothed per run over ``smoothing(steps)`` steps (a trailing
mean). A divergence (a metric named for k3 or a KL) and any non-negative metric whose positive
values span more than two decades is drawn on a log axis: smoothed and averaged as its
logarithm, so the curve is a geometric mean, with zeros left out (an exact control has none to
draw). For a grouped study the curves are (group, arm) cells: an arm keeps its colour in every
group, a group its line style (the control grey). Like every study figure it is drawn only for a
complete study (no interim look).

``trajectories`` returns what is plotted, so the numbers can be checked without the picture;
``draw`` makes the figure of them and ``trajectory_figure`` writes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from timlab.experiments.studies.stats import T975
from timlab.experiments.studies.registration import Study

LOG_SPAN = 100.0
"""A non-negative metric whose positive values' max / min exceeds this is drawn on a log axis."""


def smoothing(steps: int) -> int:
    """The trailing window, in steps, of a per-step metric: 1% of the run, at least 1."""
    return max(1, steps // 100)


@dataclass(frozen=True)
class Curve:
    """One arm's course in one panel."""

    group: str
    """Its group in a grouped study; empty otherwise."""
    arm: str
    steps: np.ndarray
    """(n,) the steps every run of the arm logged the metric at."""
    mean: np.ndarray
    """(n,) the mean over runs (of the logarithm on a log panel, returned exponentiated)."""
    low: np.ndarray
    """(n,) the 95% t interval of that mean (NaN with one run)."""
    high: np.ndarray
    runs: int

    @property
    def label(self) -> str:
        return f"{self.group} {self.arm}" if self.group else self.arm


@dataclass(frozen=True)
class Panel:
    metric: str
    log: bool
    curves: tuple[Curve, ...]


def study_metrics(study: Study) -> list[str]:
    """The metrics the study's endpoints read, in the order they first appear."""
    out: list[str] = []
    for e in study.endpoints:
        if e.metric and e.metric not in out:
            out.append(e.metric)
    return out


def _series(metrics: pd.DataFrame, metric: str, steps: int, log: bool) -> pd.Series:
    """One run's metric by step: smoothed when logged at (most) training steps; log10 on a log panel."""
    s = metrics.set_index("step")[metric].dropna().astype(float) if metric in metrics else pd.Series(dtype=float)
    if log:
        s = np.log10(s[s > 0])
    if len(s) > steps // 2:  # logged every step, not only at evaluations
        s = s.rolling(smoothing(steps), min_periods=1).mean()
    return s


def _is_log(runs: list[pd.DataFrame], metric: str) -> bool:
    name = metric.rsplit("/", 1)[-1]
    if "k3" in name or name == "kl" or name.endswith("_kl"):
        return True
    values = np.concatenate([m[metric].dropna().to_numpy(float) for m in runs if metric in m] or [np.zeros(0)])
    positive = values[values > 0]
    return bool(positive.size) and (values >= 0).all() and positive.max() / positive.min() > LOG_SPAN


def _curve(cell: tuple[str, str], series: list[pd.Series], log: bool) -> Curve | None:
    table = pd.concat(series, axis=1, join="inner").dropna()  # steps every run logged
    if table.empty:
        return None
    n = table.shape[1]
    mean = table.mean(axis=1).to_numpy()
    if n >= 2:
        t = T975[min(n - 1, len(T975) - 1)]  # past 20 degrees of freedom the df-20 quantile: a band a little wide
        half = t * table.std(axis=1, ddof=1).to_numpy() / math.sqrt(n)
    else:
        half = np.full(mean.shape, np.nan)
    low, high = mean - half, mean + half
    if log:
        mean, low, high = 10.0**mean, 10.0**low, 10.0**high
    return Curve(*cell, table.index.to_numpy(), mean, low, high, n)


def trajectories(study: Study, runs: dict[tuple[str, str], list[pd.DataFrame]]) -> list[Panel]:
    """The panels of ``runs`` ({(group, arm): each run's metrics}; group "" in an ungrouped study)
    over ``study_metrics(study)``."""
    everything = [m for ms in runs.values() for m in ms]
    panels = []
    for metric in study_metrics(study):
        log = _is_log(everything, metric)
        curves = [_curve(cell, [_series(m, metric, study.steps, log) for m in ms], log) for cell, ms in runs.items()]
        panels.append(Panel(metric, log, tuple(c for c in curves if c is not None)))
    return [p for p in panels if p.curves]


def draw(study: Study, panels: list[Panel]):
    from matplotlib.figure import Figure

    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(5.0 * cols, 3.6 * rows))
    arms = list(dict.fromkeys(c.arm for p in panels for c in p.curves))
    groups = list(dict.fromkeys(c.group for p in panels for c in p.curves))
    colour = {a: "0.3" if a == study.control else f"C{i}" for i, a in enumerate(a for a in arms if a != study.control)}
    colour[study.control] = "0.3"  # the control in grey; an arm keeps its colour in every group
    style = dict(zip(groups, ("-", "--", ":", "-.") * len(groups)))  # a group its line style
    legend_at = max(range(len(panels)), key=lambda i: len(panels[i].curves)) if panels else 0  # the fullest panel
    for i, p in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        for c in p.curves:
            ax.plot(c.steps, c.mean, color=colour[c.arm], ls=style[c.group], lw=1.2, label=f"{c.label} ({c.runs})")
            if c.runs >= 2:
                ax.fill_between(c.steps, c.low, c.high, color=colour[c.arm], alpha=0.12, lw=0)
        if p.log:
            ax.set_yscale("log")
        smooth = smoothing(study.steps)
        per_step = any(c.steps.size > study.steps // 2 for c in p.curves)
        ax.set_title(p.metric + (f" (trailing mean of {smooth} steps)" if per_step and smooth > 1 else "")
                     + (", geometric" if p.log else ""), fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if i == legend_at:
            ax.legend(fontsize=7, title=f"{study.groups + ' ' if study.groups else ''}arm (runs)", title_fontsize=7)
    fig.suptitle(f"{study.name}: each arm's mean over its seeds, 95% t band", fontsize=10)
    fig.tight_layout()
    return fig


def trajectory_figure(study: Study, runs: dict[tuple[str, str], list[pd.DataFrame]], path: str | Path) -> Path:
    path = Path(path)
    draw(study, trajectories(study, runs)).savefig(path, dpi=100)
    return path


__all__ = ["Curve", "Panel", "LOG_SPAN", "smoothing", "study_metrics", "trajectories", "draw", "trajectory_figure"]
