"""The figure of a grouped study whose fits include ``kind: predict``: another study's length fit
tested at answer lengths it did not see (Study E3c tests E3b's fit at T ~ 300).

Used by ``engine.figure`` (``timlab study figure``), which hands it the test study's valid columns
and, per ``predict`` fit, the fitted study's cells. One row of panels per ``predict`` fit:

- one panel per dose T^rho * k3 of the fit's ``rho``: each cell's loss (its group control's mean
  minus its mean of the fit's endpoint, with ``fits.cost_ci``'s 95% seed-bootstrap interval)
  against its dose, log-log; the fitted study's cells as circles coloured by group, the test's as
  black stars; the one-power fit of that dose (``fits.fit_shape`` over the fitted cells) drawn solid
  over the doses it saw and dashed where it extrapolates. Under the dose the cost follows, the stars
  sit on that dose's line. A loss at or below 0 is drawn at the axis floor with an open marker.
- the test itself (``fits.prediction_test``, the numbers the analysis prints): per test cell, the
  measured loss and each hypothesis' prediction at the cell's realized k3 and T, each with its 95%
  interval, on a linear axis with 0 marked, and each hypothesis' verdict in its label.

``prediction_panels`` returns what is plotted, so the numbers can be checked without the picture;
``draw`` makes the figure of them and ``prediction_figure`` writes it.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from timlab.experiments.studies.figures import log_floor
from timlab.experiments.studies.fits import (LossCell, TestCell, dose_name, fit_shape, length_cells, loss_cells,
                                             prediction_test)
from timlab.experiments.studies.registration import Study


@dataclass(frozen=True)
class PredictionPanels:
    """One ``predict`` fit's row of the figure."""

    fit: str
    """The fit's name (its fitted study's name where it has none)."""
    fitted_study: str
    """The name of the study whose cells were fitted."""
    endpoint: str
    """The endpoint whose loss is plotted."""
    fitted: tuple[LossCell, ...]
    """The fitted study's treated cells, in its order."""
    tested: tuple[TestCell, ...]
    """The test study's treated cells with each hypothesis' prediction (``prediction_test``)."""
    doses: tuple[tuple[float, tuple[float, float] | None], ...]
    """Per rho of the fit: (rho, (a, g) of log loss = a + g log(T^rho k3) over the fitted cells, or None)."""


def prediction_panels(study: Study, col: dict, treated: list, fitted: list) -> list[PredictionPanels]:
    """What the figure plots. ``col``, ``treated``: the test study's columns by (group, arm) and its
    treated cells (``engine._cells`` of its valid groups); ``fitted``: per ``predict`` fit, (the fit,
    the fitted study's name, its columns by (group, arm), its treated cells)."""
    out = []
    for f, name, colf, fit_treated in fitted:
        keys = dict(control=study.control, k3=f.k3, length=f.length)
        ks, T, ex, group = length_cells(colf, fit_treated, f.endpoint, **keys)
        cells = tuple(loss_cells(colf, fit_treated, f.endpoint, **keys))
        doses = tuple((r, fit_shape(ks, T, ex, group, r, min_cells=f.min_cells, min_groups=f.min_groups))
                      for r in f.rho)
        tested = prediction_test(colf, fit_treated, col, treated, f.endpoint, rho=f.rho, min_cells=f.min_cells,
                                 min_groups=f.min_groups, **keys)
        out.append(PredictionPanels(f.name or name, name, f.endpoint, cells, tuple(tested), doses))
    return out


def _loss_label(study: Study, endpoint: str) -> str:
    return f"loss: the {study.groups}'s {study.control} minus the arm\n" + textwrap.fill(study.label(endpoint), 48)


def _dose_panel(ax, study: Study, p: PredictionPanels, rho: float, shape) -> None:
    """Every cell's loss against T^rho * k3, log-log, with the one-power fit of that dose."""
    from matplotlib.ticker import NullFormatter

    floor = log_floor(x for c in (*p.fitted, *p.tested) for x in (c.loss, c.lo, c.hi))
    groups = list(dict.fromkeys(c.group for c in p.fitted))
    labelled = set()

    def point(c, x, **style):
        positive = c.loss > 0
        y = c.loss if positive else floor
        lo, hi = min(max(c.lo, floor), y), max(c.hi, y)  # a lower end at or below 0 is cut at the floor
        label = style.pop("label")
        ax.errorbar([x], [y], yerr=[[y - lo], [hi - y]], capsize=2, mfc=style["color"] if positive else "white",
                    label=None if label in labelled else label, **style)
        labelled.add(label)

    for c in p.fitted:
        i = groups.index(c.group)
        point(c, c.T ** rho * c.k3, fmt="o", ms=5, color=f"C{i % 10}",
              label=f"{p.fitted_study}: {study.groups} {c.group} (T {c.T:.0f})")
    for c in p.tested:
        point(c, c.T ** rho * c.k3, fmt="*", ms=12, color="k",
              label=f"test: {study.groups} {c.group}, {c.arm} (T {c.T:.0f})")
    if any(c.loss <= 0 for c in (*p.fitted, *p.tested)):
        ax.plot([], [], "o", mfc="white", color="0.4", label="loss <= 0: open marker at the axis floor")
    seen = [c.T ** rho * c.k3 for c in p.fitted]
    every = seen + [c.T ** rho * c.k3 for c in p.tested]
    if shape is not None:
        a, g = shape
        x = np.geomspace(min(seen), max(seen), 50)  # (50,)
        ax.plot(x, [math.exp(a + g * math.log(v)) for v in x], color="C3", lw=1.2,
                label=f"fit: loss = {math.exp(a):.3g} x^{g:.2f}")
        for lo, hi in ((min(every), min(seen)), (max(seen), max(every))):
            if hi > lo:
                x = np.geomspace(lo, hi, 20)  # (20,)
                ax.plot(x, [math.exp(a + g * math.log(v)) for v in x], color="C3", lw=1.2, ls="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels overlap within a decade
    ax.set_ylim(bottom=floor / 1.5)
    ax.set_xlabel(f"{dose_name(rho)} (T: the {study.groups}'s {study.control} mean length)", fontsize=8)
    ax.set_ylabel(_loss_label(study, p.endpoint), fontsize=8)
    ax.set_title(f"against {dose_name(rho)}" + ("" if shape else " (no fit)") + "; dashed: extrapolated", fontsize=8)
    ax.legend(fontsize=6, loc="upper left")


def _test_panel(ax, study: Study, p: PredictionPanels) -> None:
    """Per test cell, the measured loss and each hypothesis' prediction, with their intervals."""
    rows = []  # (label, value, lo, hi, colour)
    for c in p.tested:
        rows.append((f"{study.groups} {c.group}, {c.arm}: measured", c.loss, c.lo, c.hi, "k"))
        for j, q in enumerate(c.predicted):
            rows.append((textwrap.fill(f"{q.hypothesis}: {q.verdict.split(' (')[0]}", 30), q.point, q.lo, q.hi,
                         f"C{(3, 0, 2, 4)[j % 4]}"))
    for i, (label, v, lo, hi, color) in enumerate(rows):
        y = len(rows) - 1 - i
        if v is None:
            ax.annotate("no fit", (0, y), fontsize=7, va="center")
            continue
        ax.errorbar([v], [y], xerr=[[v - lo], [hi - v]], fmt="*" if color == "k" else "o", ms=9 if color == "k" else 5,
                    capsize=3, color=color)
        ax.annotate(f"{v:.3g} [{lo:.3g}, {hi:.3g}]", (hi, y), textcoords="offset points", xytext=(5, 3), fontsize=6.5)
    ax.axvline(0, color="0.5", lw=0.8)
    ends = [r[3] for r in rows if r[1] is not None] + [0.0]
    ax.set_xlim(right=max(ends) * 1.45 + 1e-9)  # room for the values written right of each interval
    ax.set_yticks(range(len(rows)), [r[0] for r in reversed(rows)], fontsize=7)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.set_xlabel(_loss_label(study, p.endpoint), fontsize=7)
    ax.set_title("the test: measured and predicted loss, 95% intervals", fontsize=8)


def draw(study: Study, rows: list[PredictionPanels]):
    """The matplotlib ``Figure`` of ``rows`` (``prediction_panels``): per fit, one panel per dose and the test."""
    from matplotlib.figure import Figure

    width = max(len(p.doses) for p in rows) + 1
    fig = Figure(figsize=(4.6 * width, 4.2 * len(rows)))
    for i, p in enumerate(rows):
        for j, (rho, shape) in enumerate(p.doses):
            _dose_panel(fig.add_subplot(len(rows), width, i * width + j + 1), study, p, rho, shape)
        _test_panel(fig.add_subplot(len(rows), width, (i + 1) * width), study, p)
    fig.suptitle(f"{study.name}: {rows[0].fitted_study}'s fit tested out of sample; mean over seeds with its 95% "
                 f"bootstrap interval", fontsize=9)
    fig.tight_layout()
    return fig


def prediction_figure(study: Study, col: dict, treated: list, fitted: list, path: str | Path) -> Path:
    """Draw ``prediction_panels`` to the PNG ``path``."""
    path = Path(path)
    draw(study, prediction_panels(study, col, treated, fitted)).savefig(path, dpi=100)
    return path
