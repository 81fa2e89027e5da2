"""The figure of a grouped study whose fits include ``kind: length_exponent``: how one arm's cost
grows with the answer length T, and, at the longest answers, how the treated arms compare.

Used by ``engine.figure`` (``timlab study figure``), which hands it the valid groups' columns of a
complete study (``engine.valid_columns``); any other grouped study keeps the length-fit figure.
One row of two panels per ``length_exponent`` fit with tests (the registered decision inputs; where no
such fit has tests, per ``length_exponent`` fit), in the study's order:

- left: per group, the cost of the fit's arm (its group's control mean minus its mean of the fit's
  endpoint: ``fits.arm_cost`` via ``fits.exponent_points``, with ``fits.cost_ci``, the family
  table's 95% seed-bootstrap interval negated) against T (the group control's mean of the fit's
  ``length``), on log-log axes; the fitted line cost = a * T^b (``fits.fit_exponent``) over the T
  of the groups the fit uses; a reference line of slope 1 (cost proportional to T: T * k3 at a fixed k3) through the
  fit's mean point (the means of log T and log cost over those groups, which the least-squares line
  also passes through), so the two slopes compare at a glance. A log axis has no place for a cost
  at or below 0: such a point is drawn at the axis floor with an open marker (the legend says so),
  and an interval's lower end at or below 0 is cut at the floor.
- right: at the longest answers (the group of the largest T), each treated arm's cost with its
  interval on a linear axis, 0 marked: e.g. a mismatch spread over the answer against the same
  mean k3 concentrated on the decision tokens or on the filler.

``exponent_panels`` returns what is plotted, so the numbers can be checked without the picture;
``draw`` makes the figure of them and ``exponent_figure`` writes it.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from timlab.experiments.studies.fits import arm_cost, cost_ci, exponent_points, fit_exponent
from timlab.experiments.studies.registration import Study, StudyError

FLOOR_SHARE = 0.5
"""The log panel's floor: this share of the smallest positive cost or interval end plotted."""


@dataclass(frozen=True)
class CostPoint:
    """One group's cost of the fit's arm, as the left panel plots it."""

    group: str
    """The group (e.g. a restate level)."""
    T: float
    """The group control's mean of the fit's ``length`` endpoint."""
    cost: float
    """The group control's mean minus the arm's mean of the fit's endpoint."""
    lo: float
    """The lower end of the cost's 95% seed-bootstrap interval."""
    hi: float
    """The upper end of the cost's 95% seed-bootstrap interval."""
    fitted: bool
    """Whether the fit's line goes through this group (one of the groups the fit uses)."""


@dataclass(frozen=True)
class ArmCost:
    """One treated arm's cost at the longest answers, as the right panel plots it."""

    arm: str
    """The arm."""
    cost: float
    """The group control's mean minus the arm's mean of the fit's endpoint."""
    lo: float
    """The lower end of the cost's 95% seed-bootstrap interval."""
    hi: float
    """The upper end of the cost's 95% seed-bootstrap interval."""


@dataclass(frozen=True)
class ExponentPanels:
    """One ``length_exponent`` fit's row of the figure: what each of its two panels plots."""

    fit: str
    """The fit's name."""
    endpoint: str
    """The endpoint whose cost is plotted."""
    arm: str
    """The arm whose cost is fitted against T."""
    length: str
    """The endpoint whose group-control mean is the group's T."""
    points: tuple[CostPoint, ...]
    """Left: each valid group holding the arm, in the study's group order."""
    line: tuple[float, float] | None
    """Left: (a, b) of cost = a * T^b through the fitted points; None where a cost there is not above
    0 (no log) or fewer than 2 distinct T."""
    through: tuple[float, float] | None
    """Left: the fit's mean point (exp of the mean log T, exp of the mean log cost over the fitted
    points), where both the fitted line and the slope-1 reference pass; None without a line."""
    longest: str
    """Right: the group of the largest T."""
    longest_T: float
    """Right: that group's T."""
    arms: tuple[ArmCost, ...]
    """Right: each treated arm of that group, in the study's arm order."""


def _fit_groups(fit, groups: list[str]) -> list[str]:
    """The groups of ``groups`` the fit's line goes through: those its ``groups`` option names, where
    the registration has one (read with getattr: an older registration has no such option), else
    all of them."""
    chosen = getattr(fit, "groups", None)
    if not chosen:
        return groups
    names = {str(g) for g in chosen}
    return [g for g in groups if g in names]


def exponent_panels(study: Study, cols: dict[str, dict[str, dict[str, np.ndarray]]]) -> list[ExponentPanels]:
    """What the figure plots, one entry per ``length_exponent`` fit of ``study`` that has tests (every
    one where none has). ``cols``: {group:
    {arm: {endpoint: per-run values}}} of the valid groups (``engine.valid_columns``)."""
    ctrl = study.control
    if not cols:
        raise StudyError(f"{study.source}: no figure: every {study.groups} is void (its validity line), so no cost is "
                         f"plotted")
    col = {(g, a): v for g, c in cols.items() for a, v in c.items()}  # (group, arm) -> endpoints
    out = []
    exponent = [f for f in study.fits if f.kind == "length_exponent"]
    for f in [f for f in exponent if f.tests] or exponent:  # descriptive fits only where none is tested
        groups = [g for g in cols if (g, f.arm) in col and (g, ctrl) in col]
        T, cost = exponent_points(col, groups, f.endpoint, control=ctrl, arm=f.arm, length=f.length)
        used = _fit_groups(f, groups)
        points = tuple(CostPoint(g, t, c, *cost_ci(col[g, ctrl][f.endpoint], col[g, f.arm][f.endpoint]),
                                 fitted=g in used) for g, t, c in zip(groups, T, cost))
        fitted = [p for p in points if p.fitted]
        line = fit_exponent([p.T for p in fitted], [p.cost for p in fitted])
        through = None if line is None else (math.exp(float(np.mean([math.log(p.T) for p in fitted]))),
                                              math.exp(float(np.mean([math.log(p.cost) for p in fitted]))))
        longest = max(cols, key=lambda g: float(np.mean(cols[g][ctrl][f.length])))
        c = cols[longest]
        arms = tuple(ArmCost(a, arm_cost(c[ctrl][f.endpoint], c[a][f.endpoint]),
                             *cost_ci(c[ctrl][f.endpoint], c[a][f.endpoint])) for a in c if a != ctrl)
        out.append(ExponentPanels(f.name, f.endpoint, f.arm, f.length, points, line, through, longest,
                                  float(np.mean(c[ctrl][f.length])), arms))
    return out


def log_floor(values) -> float:
    """Where a log cost axis draws what is not above 0: ``FLOOR_SHARE`` of the smallest positive of
    ``values`` (costs and their interval ends); 1e-3 when none is."""
    pos = [x for x in values if x > 0]
    return FLOOR_SHARE * min(pos) if pos else 1e-3


def _floor(points: tuple[CostPoint, ...]) -> float:
    """``log_floor`` of the points' costs and interval ends."""
    return log_floor(x for p in points for x in (p.cost, p.lo, p.hi))


def _cost_label(study: Study, endpoint: str, arm: str) -> str:
    """A cost axis' label: what is subtracted, then the endpoint's label wrapped to the panel."""
    return f"cost: {study.control} minus {arm}\n" + textwrap.fill(study.label(endpoint), 48)


def _left(ax, study: Study, p: ExponentPanels) -> None:
    """The cost of ``p.arm`` against T, log-log, with the fitted line and the slope-1 reference."""
    if not p.points:
        ax.text(0.5, 0.5, f"{p.arm} is in no valid {study.groups}", ha="center", transform=ax.transAxes)
        return
    floor = _floor(p.points)
    labelled = set()
    for q in p.points:
        positive = q.cost > 0
        y = q.cost if positive else floor
        lo, hi = min(max(q.lo, floor), y), max(q.hi, y)  # a lower end at or below 0 is cut at the floor
        color = "C0" if q.fitted else "0.55"
        label = (f"{p.arm}, {'in' if q.fitted else 'not in'} the fit" if positive
                 else "cost <= 0: open marker at the axis floor")
        ax.errorbar([q.T], [y], yerr=[[y - lo], [hi - y]], fmt="o", ms=6, capsize=3, color=color,
                    mfc=color if positive else "white", label=None if label in labelled else label)
        labelled.add(label)
        ax.annotate(f"{study.groups} {q.group}" + ("" if positive else f" ({q.cost:+.3g})"), (q.T, y),
                    textcoords="offset points", xytext=(6, -10), fontsize=7)
    Ts = [q.T for q in p.points]
    if p.line is not None:
        a, b = p.line
        fitted = [q.T for q in p.points if q.fitted]
        x = np.geomspace(min(fitted), max(fitted), 50)  # (50,)
        ax.plot(x, a * x ** b, color="C3", lw=1.2, label=f"fit: cost = {a:.3g} T^{b:.2f}")
        t0, c0 = p.through
        x = np.geomspace(min(Ts), max(Ts), 50)  # (50,)
        ax.plot(x, c0 * x / t0, color="0.3", lw=1, ls="--", label="slope 1 (cost ~ T: T * k3 at fixed k3)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(bottom=floor / 1.5)
    ax.set_xlim(min(Ts) / 1.6, max(Ts) * 1.6)
    ax.set_xlabel(f"T: the {study.groups}'s {study.control} mean {p.length}", fontsize=8)
    ax.set_ylabel(_cost_label(study, p.endpoint, p.arm), fontsize=8)
    ax.set_title(f"{p.fit}: {p.arm}'s cost against T" + ("" if p.line else " (no exponent: a cost is not above 0)"),
                 fontsize=8)
    ax.legend(fontsize=6.5, loc="upper left")


def _right(ax, study: Study, p: ExponentPanels) -> None:
    """Each treated arm's cost at the longest answers, linear, 0 marked."""
    others = iter(f"C{k}" for k in (1, 2, 4, 5, 6, 7, 8, 9) * len(p.arms))  # C0: the fit's arm; C3: the fit's line
    for j, c in enumerate(p.arms):
        ax.errorbar([j], [c.cost], yerr=[[c.cost - c.lo], [c.hi - c.cost]], fmt="o", ms=6, capsize=3,
                    color="C0" if c.arm == p.arm else next(others))
        ax.annotate(f"{c.cost:.3g} [{c.lo:.3g}, {c.hi:.3g}]", (j, c.cost), textcoords="offset points", xytext=(8, -3),
                    fontsize=7)
    ax.axhline(0, color="0.5", lw=0.8)
    ax.set_xticks(range(len(p.arms)), [c.arm for c in p.arms], fontsize=8)
    ax.set_xlim(-0.6, len(p.arms) - 0.4)
    ax.set_ylabel(_cost_label(study, p.endpoint, "the arm"), fontsize=8)
    ax.set_title(f"{study.groups} {p.longest} (T {p.longest_T:.0f}): each treated arm's cost", fontsize=8)


def draw(study: Study, rows: list[ExponentPanels]):
    """The matplotlib ``Figure`` of ``rows`` (``exponent_panels``): two panels per fit."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.9 * len(rows)))
    for i, p in enumerate(rows):
        _left(fig.add_subplot(len(rows), 2, 2 * i + 1), study, p)
        _right(fig.add_subplot(len(rows), 2, 2 * i + 2), study, p)
    fig.suptitle(f"{study.name}: cost against the answer length, mean over seeds with its 95% bootstrap interval",
                 fontsize=9)
    fig.tight_layout()
    return fig


def exponent_figure(study: Study, cols: dict, path: str | Path) -> Path:
    """Draw ``exponent_panels`` of ``cols`` (two panels per ``length_exponent`` fit) to the PNG ``path``."""
    path = Path(path)
    draw(study, exponent_panels(study, cols)).savefig(path, dpi=100)
    return path
