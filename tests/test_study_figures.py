"""timlab/experiments/studies/figures.py: the figure of a grouped study with a ``length_exponent``
fit, on planted L1-shaped sweeps (tests/test_study_l1.py's lengths, arms and levels): the plotted
costs, intervals and lines against hand-computed means, a cost at or below 0 on the log axis, a fit
through chosen groups only, and the refusal of an incomplete sweep."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from matplotlib.colors import to_rgba

from study_sweep import write_sweep
from test_study_l1 import BASE, L1, SEEDS, STEPS, T, levels, metrics_of, power, registration
from timlab.experiments.studies.stats import compare_family, logit
from timlab.experiments.studies.engine import figure, planned_runs
from timlab.experiments.studies.registration import StudyError, freeze, study_from_dict
from timlab.experiments.studies.engine import valid_columns
from timlab.experiments.studies.figures import draw, exponent_figure, exponent_panels

COSTS = {**power(1.0, 1e-4), ("109", "hi"): 0.12, ("109", "lo"): 0.02}
"""spread loses 0.003, 0.03 and 0.1 at T 30, 300 and 1,000; at 1,000 hi loses 0.12 and lo 0.02."""


def planted(tmp_path, level: dict, names=None, **over):
    """The L1-shaped study and its sweep directory, the runs ``names`` (default all) at ``level``."""
    study = study_from_dict(registration(**over), root=tmp_path, source="l1_planted.yaml")
    ids = {p.name: p.run_id for p in planned_runs(study)}
    freeze(study, tmp_path / "sweep")
    write_sweep(tmp_path / "sweep", names or list(ids), metrics_of(level), STEPS, run_ids=ids)
    return study, tmp_path / "sweep"


def runs(level: dict, g: str, arm: str, f=lambda x: x) -> np.ndarray:
    """The planted levels of one (group, arm) cell's seeds, in seed order."""
    return np.array([f(level[f"r{g}_{arm}_s{s}"]) for s in range(SEEDS)])


def table_ci(ctrl: np.ndarray, arm: np.ndarray) -> tuple[float, float]:
    """The cost's interval as the analysis's family table has it (arm minus control), negated."""
    lo, hi = compare_family({"arm": arm}, {"arm": ctrl})["arm"].diff_ci
    return -hi, -lo


def test_the_plotted_costs_and_lines_are_the_planted_means(tmp_path):
    level = levels(COSTS)
    study, out = planted(tmp_path, level)
    acc, odds = exponent_panels(study, valid_columns(study, out))  # one row per length_exponent fit
    assert (acc.fit, acc.endpoint, acc.arm, odds.endpoint) == ("spread, accuracy", "acc", "spread", "acc_logit")
    # left: per length, control mean minus spread mean, its bootstrap interval, T the control's length
    assert [p.group for p in acc.points] == ["1", "31", "109"] and all(p.fitted for p in acc.points)
    assert [p.T for p in acc.points] == [30.0, 300.0, 1000.0]
    for p in acc.points:
        ctrl, arm = runs(level, p.group, "control"), runs(level, p.group, "spread")
        assert p.cost == pytest.approx(ctrl.mean() - arm.mean(), abs=1e-12)
        assert p.cost == pytest.approx(COSTS[p.group, "spread"], abs=2e-3)
        assert (p.lo, p.hi) == table_ci(ctrl, arm) and p.lo < p.cost < p.hi  # the table's interval
        assert 5e-4 < p.hi - p.lo < 4e-3  # two arms of 5 seeds with a noise of 1e-3 each
    # the fitted line: least squares of log cost on log T, through the mean point like the slope-1 line
    b, log_a = np.polyfit(np.log([30.0, 300.0, 1000.0]), np.log([p.cost for p in acc.points]), 1)
    assert acc.line == pytest.approx((math.exp(log_a), b), rel=1e-9) and b == pytest.approx(1.0, abs=0.05)
    t0, c0 = acc.through
    assert t0 == pytest.approx((30 * 300 * 1000) ** (1 / 3))
    assert c0 == pytest.approx(np.prod([p.cost for p in acc.points]) ** (1 / 3))
    assert acc.line[0] * t0 ** acc.line[1] == pytest.approx(c0)
    # right: every treated arm at the longest length, spec order
    assert (acc.longest, acc.longest_T) == ("109", 1000.0)
    assert [c.arm for c in acc.arms] == ["spread", "hi", "lo"]
    ctrl = runs(level, "109", "control")
    for c in acc.arms:
        assert c.cost == pytest.approx(ctrl.mean() - runs(level, "109", c.arm).mean(), abs=1e-12)
        assert c.cost == pytest.approx(COSTS["109", c.arm], abs=2e-3)
        assert (c.lo, c.hi) == table_ci(ctrl, runs(level, "109", c.arm))
    # the log-odds row: the same runs' costs in logits
    for p in odds.points:
        want = runs(level, p.group, "control", logit).mean() - runs(level, p.group, "spread", logit).mean()
        assert p.cost == pytest.approx(want, abs=1e-12)
    assert odds.arms[1].cost == pytest.approx(logit(BASE) - logit(BASE - 0.12), abs=0.02)
    png = figure(study, tmp_path / "l1.png", out)  # the CLI's path: the grouped study's dispatch
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 20_000


def test_a_cost_at_or_below_0_is_drawn_open_at_the_floor_and_has_no_line(tmp_path):
    level = levels({**COSTS, ("1", "spread"): -0.004})  # spread gains at the shortest length
    study, out = planted(tmp_path, level)
    acc = exponent_panels(study, valid_columns(study, out))[0]
    short = acc.points[0]
    assert short.cost == pytest.approx(runs(level, "1", "control").mean() - runs(level, "1", "spread").mean())
    assert short.cost < 0 and short.hi < 0
    assert acc.line is None and acc.through is None  # log cost has no value there: no exponent
    ax = draw(study, [acc]).axes[0]
    floor = 0.5 * min(x for p in acc.points for x in (p.cost, p.lo, p.hi) if x > 0)
    markers = [ln for ln in ax.get_lines() if ln.get_marker() == "o"]
    (open_,) = [ln for ln in markers if to_rgba(ln.get_markerfacecolor()) == to_rgba("white")]
    assert list(open_.get_xdata()) == [30.0] and list(open_.get_ydata()) == pytest.approx([floor])
    assert [float(ln.get_ydata()[0]) for ln in markers if ln is not open_] == [p.cost for p in acc.points[1:]]
    assert "cost <= 0: open marker at the axis floor" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert ax.get_yscale() == "log" and ax.get_ylim()[0] < floor
    assert len(ax.get_lines()) == len(markers) + 2 * 3  # no fit, no reference: only each point's two caps


def test_a_fit_through_chosen_groups_draws_its_line_through_them_only(tmp_path):
    # a registration whose fit names its groups (a ``groups:`` option) is read where it has one
    level = levels(COSTS)
    study, out = planted(tmp_path, level)
    fits = tuple(SimpleNamespace(**{**vars(f), "groups": (31, 109)}) if f.kind == "length_exponent" else f
                 for f in study.fits)
    acc = exponent_panels(dataclasses.replace(study, fits=fits), valid_columns(study, out))[0]
    assert [p.fitted for p in acc.points] == [False, True, True]
    cost = [p.cost for p in acc.points[1:]]
    b = math.log(cost[1] / cost[0]) / math.log(1000 / 300)
    assert acc.line == pytest.approx((cost[0] / 300 ** b, b), rel=1e-9)
    assert acc.through == pytest.approx((math.sqrt(300 * 1000), math.sqrt(cost[0] * cost[1])))


def test_an_incomplete_sweep_has_no_figure(tmp_path):
    level = levels(COSTS)
    names = [n for n in level if n != "r109_lo_s4"]
    study, out = planted(tmp_path, level, names=names)
    with pytest.raises(StudyError, match="no figure: INCOMPLETE: ") as e:
        figure(study, tmp_path / "no.png", out)
    assert "\n" not in str(e.value) and not (tmp_path / "no.png").exists()


def test_a_study_whose_every_group_is_void_has_no_figure(tmp_path):
    # every run starts at 0.95, below the bar: each restate is void and left out, nothing to plot
    study, out = planted(tmp_path, levels(COSTS), validity={"same_start": True, "start_bar": 0.99})
    with pytest.raises(StudyError) as e:
        figure(study, tmp_path / "no.png", out)
    assert str(e.value) == "l1_planted.yaml: no figure: every restate is void (its validity line), so no cost is plotted"


def test_study_l1s_file_gets_the_exponent_figure(tmp_path):
    """L1's own registration: four length_exponent fits (two tested, two descriptive) and a length
    fit; the figure is the exponent one, a row per tested fit (accuracy level and log-odds)."""
    d = yaml.safe_load(L1.read_text())
    study = study_from_dict(d, root=L1.parent, source=str(L1))
    fits = [f.name for f in study.fits if f.kind == "length_exponent"]
    assert fits == ["spread, accuracy level, T ~ 300 and 1,000", "spread, log-odds, T ~ 300 and 1,000",
                    "spread, accuracy level, three lengths (descriptive)", "spread, log-odds, three lengths (descriptive)"]
    fits = fits[:2]  # the figure draws the tested fits only: the three-length ones are descriptive
    assert any(f.kind == "length" for f in study.fits)
    ids = {p.name: p.run_id for p in planned_runs(study)}
    lengths = {"1": 31.0, "31": 301.0, "109": 1005.0}
    level = {n: BASE - (0 if "_control_" in n else 0.18 * lengths[n[1:].split("_")[0]] * 1e-3) for n in ids}

    def of(name: str):
        m = metrics_of(level)(name)
        m["train/response_length_mean"] *= lengths[name[1:].split("_")[0]] / T[name[1:].split("_")[0]]
        m.loc[m["step"] == 0, "val/accuracy"] = 0.97
        return m

    freeze(study, tmp_path / "l1")
    write_sweep(tmp_path / "l1", list(ids), of, STEPS, run_ids=ids)
    cols = valid_columns(study, tmp_path / "l1")
    rows = exponent_panels(study, cols)
    assert [r.fit for r in rows] == fits and [p.T for p in rows[0].points] == pytest.approx([31.0, 301.0, 1005.0])
    assert [p.fitted for p in rows[0].points] == [False, True, True]  # b through T ~ 300 and 1,000
    assert [c.arm for c in rows[0].arms] == ["spread", "hi", "lo"]
    assert [c.cost for c in rows[0].arms] == pytest.approx([0.18 * 1.005] * 3, abs=1e-9)
    assert rows[0].line[1] == pytest.approx(1.0, abs=1e-6)  # no noise: exactly T * k3
    assert exponent_figure(study, cols, tmp_path / "l1.png").read_bytes()[:4] == b"\x89PNG"
