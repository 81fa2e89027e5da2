"""Fits a study registers on top of its comparisons: the dose law ``excess = -c * k3^alpha``.

``power_law``: over the dose arms (the arms whose name starts with a registered prefix, e.g.
``head_``) with a negative mean excess over the control (at least 3), least squares of
log(-excess per step) on log k3 (``stats.line_fit``: the same bits on every machine); refitted
on ``N_BOOT`` seed resamples (each arm's seeds and the control's resampled on their own, k3 with
its seeds) for percentile intervals of c, alpha and T = loss / (c * k3_ref^alpha), the steps a
persistent k3 of ``k3_ref`` takes to cost ``loss``; resamples that leave fewer than 3 negative
arms are dropped and counted. Every other treated arm is placed against the law (``off_fit``):
the 95% interval of its excess minus the law at its own k3, each fit replicate paired with a
resample of the arm's seeds, so it holds both the fit's uncertainty and the arm's seed noise.
With fewer than 3 negative arms there is no law; the section then bounds the steps to lose
``loss`` from the arm nearest ``k3_ref`` (its excess interval's lower end).

``length`` (a grouped study, e.g. one group per answer-length level): log(-excess) = a + alpha
log k3 + beta log T over the treated (group, arm) cells with a negative mean excess, T the group
control's mean response length, by ``stats.least_squares`` (plain-float QR, the same bits on
every CPU); rho = beta / alpha, with a seed-bootstrap interval, decides which dose T^rho * k3
the cost follows. ``threshold``: a threshold law k3*(T) tested cell by cell against the falls.
``predict``: another study's length fit, fitted three ways (free; one power of each dose), predicts
this study's cells at groups that fit did not see (``prediction_section``), and the predictions
written before the runs (``predictions_table``).

``length_exponent`` (a grouped study whose arm holds k3 fixed while T changes from group to group,
so ``length`` cannot separate k3 from T): cost = a * T^b through the groups, the cost of one arm
(``arm_cost``: its group's control minus it) against its group's T, by least squares of log cost
on log T (``stats.line_fit``); the 95% interval of b from seed resamples within each group, and the
registered tests that read it (``exponent_section``). A resample in which some group's cost is not
above 0 has no exponent (no log): it is counted, its share printed, and left out of the interval;
above the registered share (``max_undefined``) no test is decided.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from timlab.experiments.studies.stats import N_BOOT, bootstrap_diff_ci, least_squares, line_fit
from timlab.experiments.studies.text import fmt


def arm_cost(control, arm) -> float:
    """An arm's cost on an endpoint: the mean over its group's control runs minus the mean over its
    own runs (positive where the arm is lower: an accuracy or a log-odds lost)."""
    return float(np.mean(control) - np.mean(arm))


def cost_ci(control, arm) -> tuple[float, float]:
    """The 95% seed-bootstrap interval of ``arm_cost``: the family table's interval of the arm minus
    its control (``bootstrap_diff_ci(arm, control)``, the same resamples) negated, so a cost and the
    table's excess carry one interval wherever they are printed or drawn."""
    lo, hi = bootstrap_diff_ci(arm, control)
    return -hi, -lo


def fit_power(k3: np.ndarray, excess: np.ndarray) -> tuple[float, float] | None:
    """(c, alpha) of excess = -c * k3^alpha by least squares on log(-excess) vs log(k3), over the
    arms with a negative excess; None when fewer than 3 are negative."""
    keep = excess < 0
    if keep.sum() < 3:
        return None
    alpha, logc = line_fit([math.log(k) for k in k3[keep]], [math.log(-e) for e in excess[keep]])
    return float(math.exp(logc)), float(alpha)


def bootstrap_fit(head: dict[str, dict[str, np.ndarray]], control: np.ndarray, key: str, *, n: int = N_BOOT,
                  seed: int = 0) -> tuple[list[tuple[float, float, float]], int]:
    """Refit ``fit_power`` on ``n`` seed resamples (each dose arm's seeds and the control's resampled
    on their own, k3 resampled with its seeds). Returns (c, alpha, the resampled control mean) of
    each fit and the number of resamples that had fewer than 3 negative arms (no fit)."""
    rng = np.random.default_rng(seed)
    fits, failed = [], 0
    names = sorted(head)
    for _ in range(n):
        c = control[rng.integers(0, control.size, control.size)].mean()
        k3s, ex = [], []
        for a in names:
            i = rng.integers(0, head[a][key].size, head[a][key].size)
            k3s.append(head[a]["k3"][i].mean())
            ex.append(head[a][key][i].mean() - c)
        f = fit_power(np.array(k3s), np.array(ex) / 100)  # per step
        if f is None:
            failed += 1
        else:
            fits.append((*f, float(c)))
    return fits, failed


def pct(x, lo: float = 2.5, hi: float = 97.5) -> tuple[float, float]:
    """The (2.5%, 97.5%) percentiles of ``x``."""
    return float(np.percentile(x, lo)), float(np.percentile(x, hi))


def off_fit(fits: list[tuple[float, float, float]], arm_k3: np.ndarray, arm_x: np.ndarray, *, seed: int = 1,
            control: np.ndarray | None = None) -> tuple[float, float, float]:
    """How far an arm's excess (per step) lies from the fitted law at its own k3: (observed minus
    fitted, and its 95% percentile interval), each fit replicate paired with a resample of the
    arm's seeds (its k3 with them) against that replicate's control mean. ``control``: an arm of
    another study, whose excess is over its own control's seeds (resampled with each replicate)."""
    rng = np.random.default_rng(seed)
    d = []
    for c, alpha, ctrl in fits:
        i = rng.integers(0, arm_x.size, arm_x.size)
        if control is not None:
            ctrl = control[rng.integers(0, control.size, control.size)].mean()
        d.append((arm_x[i].mean() - ctrl) / 100 + c * arm_k3[i].mean() ** alpha)
    lo, hi = pct(d)
    return float(np.mean(d)), lo, hi


def _g(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.3g}"


def power_law_section(col: dict[str, dict[str, np.ndarray]], control: str, arms: list[str], prefix: str,
                      key: str, name: str, loss: float, what: str, k3_ref: float, verdicts: dict[str, bool],
                      dose_label: str = "head_perturb") -> list[str]:
    """The registered power-law fit of one slope endpoint ``key`` as lines of markdown: the law over
    the arms starting with ``prefix``, and every other arm of ``arms`` placed against it.
    ``col[arm]``: per-seed arrays (``k3`` and ``key``); ``verdicts[arm]``: the arm's rule verdict on
    ``key`` (the extrapolation note: is ``k3_ref`` below every dose arm that the rule found)."""
    head = {a: col[a] for a in arms if a.startswith(prefix)}
    real = [a for a in arms if not a.startswith(prefix)]
    ctrl = col[control][key]
    k3 = np.array([head[a]["k3"].mean() for a in sorted(head)])
    ex = np.array([(head[a][key].mean() - ctrl.mean()) / 100 for a in sorted(head)])
    fit = fit_power(k3, ex)
    if fit is None:
        near = min(head, key=lambda a: abs(math.log(head[a]["k3"].mean() / k3_ref)))
        dlo, dhi = bootstrap_diff_ci(head[near][key], ctrl)
        where = f"Bound from {near} (realized k3 {fmt(float(head[near]['k3'].mean()))}): "
        if dlo < 0:
            where += f"losing {what} takes more than {_g(loss / (-dlo / 100))} steps."
        else:  # the whole interval is a gain over the control: no finite loss rate fits the data
            where += (f"its excess slope's 95% interval [{dlo:+.4f}, {dhi:+.4f}] per 100 steps lies above 0, so no "
                      f"loss rate is consistent with the data and no finite number of steps to lose {what} follows.")
        return [f"Fit ({name}): fewer than 3 {dose_label} arms have a negative mean excess: no power law. {where}"]
    c, alpha = fit
    fits, failed = bootstrap_fit(head, ctrl, key)
    cs, als = np.array([f[0] for f in fits]), np.array([f[1] for f in fits])  # (fits,)
    ts = loss / (cs * k3_ref ** als)
    t = loss / (c * k3_ref ** alpha)
    eroding = [head[a]["k3"].mean() for a in head if verdicts[a]]
    extrap = not eroding or k3_ref < min(eroding)
    out = [f"Fit ({name}, per step): excess = -c * k3^alpha over {int((ex < 0).sum())} arms with a negative "
           f"mean excess: c = {_g(c)} [{_g(pct(cs)[0])}, {_g(pct(cs)[1])}], alpha = {alpha:.2f} "
           f"[{pct(als)[0]:.2f}, {pct(als)[1]:.2f}] ({len(fits)} resamples fitted, {failed} had fewer than "
           f"3 negative arms). Steps for a persistent k3 of {k3_ref:g} to cost {what}: {_g(t)} "
           f"[{_g(pct(ts)[0])}, {_g(pct(ts)[1])}]{' (an extrapolation: below the smallest eroding k3)' if extrap else ''}."]
    for a in real:
        kr = float(col[a]["k3"].mean())
        obs = (col[a][key].mean() - ctrl.mean()) / 100
        d, lo, hi = off_fit(fits, col[a]["k3"], col[a][key])
        ok = lo <= 0 <= hi
        out.append(f"- {a}: realized k3 {fmt(kr)}, excess {obs:+.2e} per step, minus the fit at its k3 "
                   f"{d:+.2e} [{lo:+.2e}, {hi:+.2e}]: {'agrees with the fit' if ok else 'off the curve'}.")
    return out + [""]


# ------------------------------------------------------------------------------ length and threshold
# A grouped study (``groups``: one control per group, e.g. a verbosity level) may fit the cost of
# each treated (group, arm) cell against its realized k3 and its group's answer length T (the
# group control's mean response length): ``length_section``; and test a threshold law
# k3*(T) = k3_star * (T / t_star)^exponent cell by cell (``threshold_section``). ``col`` maps
# (group, arm) to per-seed arrays of endpoints; ``treated`` lists the (group, arm) cells in order.


def fmt_loss(x: float, unbounded: float) -> str:
    """An extrapolated loss as the tables print it: ``fmt``, or "unbounded" above ``unbounded``
    (such a bound is set by a few resamples whose exponent runs off; its digits carry no information)."""
    return "unbounded" if x > unbounded else fmt(x)


def dose_name(rho: float) -> str:
    """The dose T^rho * k3 as the text names it: ``T * k3`` (rho 1), ``T^2 * k3`` (rho 2)."""
    return "T * k3" if rho == 1 else f"T^{rho:g} * k3"


def fit_cells(excess: np.ndarray, group: np.ndarray, *, min_cells: int = 4, min_groups: int = 2) -> np.ndarray | None:
    """The mask of the cells a length fit uses (negative excess), or None with fewer than
    ``min_cells`` such cells or fewer than ``min_groups`` groups among them."""
    keep = excess < 0
    return None if keep.sum() < min_cells or len(set(group[keep].tolist())) < min_groups else keep


def fit_length(k3: np.ndarray, T: np.ndarray, excess: np.ndarray, group: np.ndarray, *, min_cells: int = 4,
               min_groups: int = 2) -> tuple[float, float, float] | None:
    """(a, alpha, beta) of log(-excess) = a + alpha log k3 + beta log T by least squares
    (``stats.least_squares``: the same bits on every machine) over the cells with a negative
    excess; None with too few such cells or groups (``fit_cells``), or a rank-deficient design
    (k3 and T not separable)."""
    keep = fit_cells(excess, group, min_cells=min_cells, min_groups=min_groups)
    if keep is None:
        return None
    X = [[1.0, math.log(k), math.log(t)] for k, t in zip(k3[keep], T[keep])]  # (cells, 3)
    return least_squares(X, [math.log(-e) for e in excess[keep]])  # None: rank-deficient


def fit_shape(k3: np.ndarray, T: np.ndarray, excess: np.ndarray, group: np.ndarray, rho: float, *, min_cells: int = 4,
              min_groups: int = 2) -> tuple[float, float] | None:
    """(a, g) of log(-excess) = a + g log(T^rho k3): the cost as a power of one dose, by least
    squares over the cells with a negative excess; None where ``fit_length`` would have too few."""
    keep = fit_cells(excess, group, min_cells=min_cells, min_groups=min_groups)
    if keep is None:
        return None
    X = [[1.0, math.log(t ** rho * k)] for k, t in zip(k3[keep], T[keep])]  # (cells, 2)
    return least_squares(X, [math.log(-e) for e in excess[keep]])


def length_cells(col: dict, treated: list, key: str, *, control: str = "control", k3: str = "k3",
                 length: str = "length", rng: np.random.Generator | None = None):
    """(k3, T, excess, group) per treated cell: means over seeds (resampled with ``rng``), the
    excess over the group's control and T its control's mean ``length`` (resampled too)."""
    pick = (lambda x: x) if rng is None else (lambda x: x[rng.integers(0, x.size, x.size)])
    ctrl = {}
    for g in dict.fromkeys(g for g, _ in treated):
        i = pick(np.arange(col[g, control][key].size))
        ctrl[g] = (col[g, control][key][i].mean(), col[g, control][length][i].mean())
    ks, T, ex, group = [], [], [], []
    for g, a in treated:
        i = pick(np.arange(col[g, a][key].size))
        ks.append(col[g, a][k3][i].mean())
        ex.append(col[g, a][key][i].mean() - ctrl[g][0])
        T.append(ctrl[g][1])
        group.append(g)
    return np.array(ks), np.array(T), np.array(ex), np.array(group)


def length_section(col: dict, treated: list, key: str, label: str, *, control: str = "control", k3: str = "k3",
                   length: str = "length", k3_ref: float = 1e-3, at: tuple = (1000, 2000, 4000, 8000),
                   rho: tuple = (1.0, 2.0), min_cells: int = 4, min_groups: int = 2, unbounded: float = 10.0,
                   groups: str = "level", n: int = N_BOOT, seed: int = 0) -> list[str]:
    """The length fit of ``key`` as lines of markdown: ``fit_length`` over the treated cells,
    refitted on ``n`` seed resamples for a 95% interval of rho = beta / alpha, which decides
    between the doses T^rho * k3 of ``rho`` (the one whose rho alone the interval holds; neither;
    undecided); then the fitted loss at a realized k3 of ``k3_ref`` and each T of ``at``."""
    k3s, T, ex, group = length_cells(col, treated, key, control=control, k3=k3, length=length)
    head = f"**Length fit, {label}**: "
    limits = {"min_cells": min_cells, "min_groups": min_groups}
    fit = fit_length(k3s, T, ex, group, **limits)
    neg = int((ex < 0).sum())
    if fit is None:
        return [head + f"{neg} cells with a negative mean excess over {len(set(group[ex < 0].tolist()))} {groups}s "
                f"(needs {min_cells} over {min_groups}, with k3 and T separable): no fit; the result is stated per "
                f"{groups} in the tables above.", ""]
    a, alpha, beta = fit
    rng = np.random.default_rng(seed)
    reps, failed = [], 0
    for _ in range(n):
        f = fit_length(*length_cells(col, treated, key, control=control, k3=k3, length=length, rng=rng), **limits)
        if f is None:
            failed += 1
        else:
            reps.append(f)
    R = np.array(reps)  # (fits, 3)
    ratio = beta / alpha if alpha else math.nan
    out = [head + f"log(-excess) = a + alpha log k3 + beta log T over {neg} cells with a negative mean excess: "
           f"alpha = {alpha:.2f}, beta = {beta:.2f}, rho = beta / alpha = {ratio:.2f}"]
    if len(R) < n / 2:
        return out + [f"; only {len(R)} of {n} resamples could be fitted ({failed} had too few negative cells or "
                      f"{groups}s): no interval, no decision.", ""]
    rhos = R[:, 2] / R[:, 1]
    lo, hi = (float(np.percentile(rhos, q)) for q in (2.5, 97.5))
    holds = [dose_name(r) for r in rho if lo <= r <= hi]
    decision = (f"**{holds[0]}**" if len(holds) == 1 else "**neither**" if not holds else
                f"**undecided** (the interval holds {'both ' if len(holds) == 2 else ''}"
                f"{' and '.join(f'{r:g}' for r in rho if lo <= r <= hi)})")
    alo, ahi = (float(np.percentile(R[:, 1], q)) for q in (2.5, 97.5))
    blo, bhi = (float(np.percentile(R[:, 2], q)) for q in (2.5, 97.5))
    out = [out[0] + f" [95% bootstrap {lo:.2f}, {hi:.2f}] (alpha [{alo:.2f}, {ahi:.2f}], beta [{blo:.2f}, {bhi:.2f}]; "
           f"{len(R)} of {n} resamples fitted, {failed} had too few negative cells or {groups}s): {decision}.", "",
           f"Extrapolated {label.split(' (')[0]} lost at a realized k3 of {k3_ref:g}, beyond the T measured "
           f"({T.min():.0f}-{T.max():.0f}; a loss above what there is to lose means the fit predicts a fall; "
           f"\"unbounded\": above {unbounded:g}):", "",
           "| T | fitted loss | 95% bootstrap |", "|---:|---:|---:|"]
    for t in at:
        pts = np.array([math.exp(r[0] + r[1] * math.log(k3_ref) + r[2] * math.log(t)) for r in R])
        fit_t = math.exp(a + alpha * math.log(k3_ref) + beta * math.log(t))
        out.append(f"| {t:,} | {fmt_loss(fit_t, unbounded)} | [{fmt_loss(float(np.percentile(pts, 2.5)), unbounded)}, "
                   f"{fmt_loss(float(np.percentile(pts, 97.5)), unbounded)}] |")
    return out + [""]


def threshold_k3(T: float, *, k3_star: float = 1e-3, t_star: float = 465.0, exponent: float = -1.85) -> float:
    """A threshold law k3*(T) = k3_star x (T / t_star)^exponent (the threshold study's fit by default)."""
    return k3_star * (T / t_star) ** exponent


def threshold_section(col: dict, treated: list, tokens: dict, *, k3: str = "k3", fall: str = "fell",
                      k3_star: float = 1e-3, t_star: float = 465.0, exponent: float = -1.85, title: str = "",
                      note: str = "", groups: str = "level") -> list[str]:
    """The threshold law's test as lines of markdown: per treated cell, k3*(T) at its group's T
    (``tokens[group]``); a cell whose realized k3 lies above it should fall (``fall`` non-zero)
    in at least half its seeds, one below it in fewer; the count of cells that agree."""
    out = [f"**{title}**{note}", "", f"| {groups} | T | k3*(T) | arm | realized k3 | above k3* | falls | agrees |",
           "|---:|---:|---:|---|---:|---|---:|---|"]
    agree = 0
    for g, a in treated:
        star = threshold_k3(tokens[g], k3_star=k3_star, t_star=t_star, exponent=exponent)
        k = float(col[g, a][k3].mean())
        falls, n = int((col[g, a][fall] != 0).sum()), col[g, a][fall].size
        above = k > star
        ok = (falls >= n / 2) == above
        agree += ok
        out.append(f"| {g} | {tokens[g]:g} | {fmt(star)} | {a} | {fmt(k)} | {'yes' if above else 'no'} | "
                   f"{falls}/{n} | {'yes' if ok else 'no'} |")
    return out + ["", f"Cells that agree with the threshold fit: {agree} of {len(treated)}.", ""]


# ------------------------------------------------------------------------------ out-of-sample prediction
# ``predict`` (a grouped study that tests another study's length fit at groups it did not see): the
# other study's treated cells are fitted three ways (the free fit, and one power of each dose
# T^rho * k3), and each predicts this study's treated cells at their realized k3 and T.
FREE = "the registered fit (alpha, beta free)"
"""The free fit's name among the hypotheses (``predictors``)."""


def _elementwise(fn, k, t):
    """``fn(k, t)`` over broadcast arrays with the standard library's ``math`` (the same bits on every
    CPU, unlike numpy's SIMD exp and log): a float for scalar inputs, else an array of their shape."""
    kb, tb = np.broadcast_arrays(np.asarray(k, dtype=float), np.asarray(t, dtype=float))
    out = np.array([fn(a, b) for a, b in zip(kb.ravel().tolist(), tb.ravel().tolist())]).reshape(kb.shape)
    return float(out) if out.ndim == 0 else out


def predictors(k3, T, ex, group, *, rho: tuple = (1.0, 2.0), min_cells: int = 4, min_groups: int = 2) -> dict:
    """Each hypothesis fitted on the cells (``length_cells``' arrays), as a function (k3, T) ->
    predicted loss, or None where it has no fit: ``FREE`` (``fit_length``) and each dose of ``rho``
    (``fit_shape``, named by ``dose_name``)."""
    limits = {"min_cells": min_cells, "min_groups": min_groups}
    f = fit_length(k3, T, ex, group, **limits)
    out = {FREE: None if f is None else (lambda k, t, f=f: _elementwise(
        lambda kk, tt: math.exp(f[0] + f[1] * math.log(kk) + f[2] * math.log(tt)), k, t))}
    for r in rho:
        g = fit_shape(k3, T, ex, group, r, **limits)
        out[dose_name(r)] = None if g is None else (lambda k, t, g=g, r=r: _elementwise(
            lambda kk, tt: math.exp(g[0] + g[1] * math.log(tt ** r * kk)), k, t))
    return out


def predictions_table(col: dict, treated: list, key: str, *, T: float, k3_at: tuple, control: str = "control",
                      k3: str = "k3", length: str = "length", rho: tuple = (1.0, 2.0), min_cells: int = 4,
                      min_groups: int = 2, unbounded: float = 10.0, n: int = N_BOOT, seed: int = 0) -> list[str]:
    """The predictions written before a test's runs: each hypothesis (``predictors``) fitted on the
    treated cells, its loss at ``T`` and each k3 of ``k3_at``, with a 95% interval over ``n`` seed
    resamples of the cells (as ``prediction_section`` draws them)."""
    cells = dict(control=control, k3=k3, length=length)
    limits = {"rho": rho, "min_cells": min_cells, "min_groups": min_groups}
    full = length_cells(col, treated, key, **cells)
    pred = predictors(*full, **limits)
    rng = np.random.default_rng(seed)
    reps = [predictors(*length_cells(col, treated, key, rng=rng, **cells), **limits) for _ in range(n)]
    label = {FREE: "the registered fit, log loss = a + alpha log k3 + beta log T"}
    for r in rho:
        g = fit_shape(*full, r, min_cells=min_cells, min_groups=min_groups)
        label[dose_name(r)] = f"one power of {dose_name(r)} (exponent {g[1]:.2f})" if g else \
            f"one power of {dose_name(r)} (no fit)"
    out = [f"| hypothesis fitted on the {len(treated)} cells | " + " | ".join(f"k3 {k:.1e}" for k in k3_at) + " |",
           "|---|" + "---:|" * len(k3_at)]
    for h, f in pred.items():
        row = []
        for k in k3_at:
            v = np.array([r[h](k, T) for r in reps if r[h] is not None])
            row.append("no fit" if f is None else
                       f"{fmt_loss(float(f(k, T)), unbounded)} [{fmt_loss(float(np.percentile(v, 2.5)), unbounded)}, "
                       f"{fmt_loss(float(np.percentile(v, 97.5)), unbounded)}]")
        out.append(f"| {label[h]} | " + " | ".join(row) + " |")
    return out


@dataclass(frozen=True)
class Predicted:
    """One hypothesis' prediction of one test cell (``prediction_test``)."""

    hypothesis: str
    """``FREE`` or a dose's name (``dose_name``)."""
    point: float | None
    """The loss fitted on every cell predicts at the test cell's realized k3 and T; None: no fit."""
    lo: float = math.nan
    """The 2.5th percentile of the prediction over the joint resamples."""
    hi: float = math.nan
    """Its 97.5th percentile."""
    d: float = math.nan
    """D = measured loss - ``point``."""
    d_lo: float = math.nan
    """The 2.5th percentile of D over the joint resamples."""
    d_hi: float = math.nan
    """Its 97.5th percentile."""
    verdict: str = "no fit"
    """consistent (D's interval holds 0), under-predicts (the cost is larger), over-predicts (the cost is
    smaller), or no fit (the hypothesis failed in more than half the resamples)."""
    failed: int = 0
    """Resamples in which the hypothesis had no fit."""


@dataclass(frozen=True)
class LossCell:
    """One treated (group, arm) cell's measured loss, as the out-of-sample test and its figure read it."""

    group: str
    arm: str
    k3: float
    """The cell's realized k3 (mean over its seeds)."""
    T: float
    """Its group control's mean ``length``."""
    loss: float
    """The measured loss: its group control's mean minus its mean (``arm_cost``)."""
    lo: float
    """The lower end of the loss' 95% seed-bootstrap interval (``cost_ci``)."""
    hi: float
    """Its upper end."""


def loss_cells(col: dict, treated: list, key: str, *, control: str = "control", k3: str = "k3",
               length: str = "length") -> list[LossCell]:
    """Each treated cell's ``LossCell`` of ``key`` (``length_cells``' means, ``cost_ci``'s interval)."""
    ks, T, ex, _ = length_cells(col, treated, key, control=control, k3=k3, length=length)
    return [LossCell(g, a, float(k), float(t), float(-e), *cost_ci(col[g, control][key], col[g, a][key]))
            for (g, a), k, t, e in zip(treated, ks, T, ex)]


@dataclass(frozen=True)
class TestCell(LossCell):
    """One treated cell of the test study with each hypothesis' prediction of its loss."""

    predicted: tuple[Predicted, ...] = ()
    """Per hypothesis, in ``predictors``' order."""


def prediction_test(colf: dict, fit_treated: list, col: dict, treated: list, key: str, *, control: str = "control",
                    k3: str = "k3", length: str = "length", rho: tuple = (1.0, 2.0), min_cells: int = 4,
                    min_groups: int = 2, n: int = N_BOOT, seed: int = 0) -> list[TestCell]:
    """The out-of-sample test: each hypothesis (``predictors``) fitted on the fit study's cells
    (``colf``, ``fit_treated``) predicts each test cell's loss of ``key`` at its realized k3 and T; D =
    measured - predicted, with 95% percentile intervals over ``n`` joint resamples of both studies'
    seeds (an interval of D holding 0: consistent)."""
    cells = dict(control=control, k3=k3, length=length)
    limits = {"rho": rho, "min_cells": min_cells, "min_groups": min_groups}
    pred = predictors(*length_cells(colf, fit_treated, key, **cells), **limits)
    rng = np.random.default_rng(seed)
    D, P = {h: [] for h in pred}, {h: [] for h in pred}
    failed = dict.fromkeys(pred, 0)
    for _ in range(n):
        fr = predictors(*length_cells(colf, fit_treated, key, rng=rng, **cells), **limits)
        kt, Tt, et, _ = length_cells(col, treated, key, rng=rng, **cells)
        for h, f in fr.items():
            if f is None:
                failed[h] += 1
            else:
                P[h].append(f(kt, Tt))
                D[h].append(-et - P[h][-1])
    out = []
    for i, cell in enumerate(loss_cells(col, treated, key, **cells)):
        row = []
        for h, f in pred.items():
            if f is None or len(D[h]) < n / 2:
                row.append(Predicted(h, None, failed=failed[h]))
                continue
            d = np.array(D[h])[:, i]
            dlo, dhi = (float(np.percentile(d, q)) for q in (2.5, 97.5))
            p_pt = float(f(cell.k3, cell.T))
            plo, phi = (float(np.percentile(np.array(P[h])[:, i], q)) for q in (2.5, 97.5))
            v = ("consistent" if dlo <= 0 <= dhi else
                 "under-predicts (the cost is larger)" if dlo > 0 else "over-predicts (the cost is smaller)")
            row.append(Predicted(h, p_pt, plo, phi, cell.loss - p_pt, dlo, dhi, v, failed[h]))
        out.append(TestCell(**dataclasses.asdict(cell), predicted=tuple(row)))
    return out


def prediction_section(colf: dict, fit_treated: list, col: dict, treated: list, key: str, *, control: str = "control",
                       k3: str = "k3", length: str = "length", rho: tuple = (1.0, 2.0), min_cells: int = 4,
                       min_groups: int = 2, groups: str = "level", n: int = N_BOOT, seed: int = 0) -> list[str]:
    """The out-of-sample test (``prediction_test``) as lines of markdown: per treated test cell and
    hypothesis, the measured loss, the predicted one and D with their 95% intervals, then one verdict
    line per cell: which dose holds out of sample, and whether the free fit's extrapolation holds."""
    cells = prediction_test(colf, fit_treated, col, treated, key, control=control, k3=k3, length=length, rho=rho,
                            min_cells=min_cells, min_groups=min_groups, n=n, seed=seed)
    out = ["**The out-of-sample test** (accuracy-level loss over steps 50-150 predicted from the fit's cells at "
           "each test cell's realized k3 and T; D = measured loss - predicted, 95% bootstrap over joint resamples of "
           "both studies' seeds; D's interval holding 0 = consistent)", "",
           f"| {groups} | arm | realized k3 | T | measured loss [95% bootstrap] | hypothesis | predicted loss [95% bootstrap] | "
           "D [95% bootstrap] | verdict |", "|---:|---|---:|---:|---:|---|---:|---:|---|"]
    for c in cells:
        head = f"| {c.group} | {c.arm} | {fmt(c.k3)} | {c.T:.1f} | {fmt(c.loss)} [{fmt(c.lo)}, {fmt(c.hi)}] |"
        for p in c.predicted:
            out.append(f"{head} {p.hypothesis} | no fit ({p.failed} of {n} resamples failed) | - | no fit |"
                       if p.point is None else
                       f"{head} {p.hypothesis} | {fmt(p.point)} [{fmt(p.lo)}, {fmt(p.hi)}] | "
                       f"{p.d:+.4f} [{p.d_lo:+.4f}, {p.d_hi:+.4f}] | {p.verdict} |")
    out.append("")
    for c in cells:
        v = {p.hypothesis: p.verdict for p in c.predicted}
        held = [dose_name(r) for r in rho if v[dose_name(r)] == "consistent"]
        shape = (f"**{held[0]}** holds out of sample" if len(held) == 1 else "**neither** shape predicts it" if not held
                 else f"**does not discriminate** ({'both' if len(held) == 2 else 'all'} consistent)")
        free = v[FREE]
        out.append(f"{groups.capitalize()} {c.group}, {c.arm}: {shape}; the registered fit's extrapolation: "
                   f"{'**holds**' if free == 'consistent' else f'**{free}**'}.")
    return out + [""]


# ------------------------------------------------------------------------------ length exponent
# ``length_exponent`` (a grouped study, one arm at a fixed k3 in every group): how the arm's cost
# grows with its group's answer length T. ``col`` maps (group, arm) to per-seed arrays of endpoints.
def fit_exponent(T: list[float], cost: list[float]) -> tuple[float, float] | None:
    """(a, b) of cost = a * T^b by least squares of log cost on log T (``stats.line_fit``: the same
    bits on every machine); None when a cost is not above 0 (it has no log) or the T are not at
    least two distinct values."""
    if len(T) < 2 or not all(c > 0 for c in cost):
        return None
    b, log_a = line_fit([math.log(t) for t in T], [math.log(c) for c in cost])
    return None if math.isnan(b) else (math.exp(log_a), b)


def exponent_points(col: dict, groups: list, key: str, *, control: str, arm: str, length: str,
                    rng: np.random.Generator | None = None) -> tuple[list[float], list[float]]:
    """(T, cost) per group: T its control's mean ``length``, cost ``arm_cost`` of ``arm`` on ``key``;
    with ``rng``, each group's control seeds (T with them) and arm seeds resampled on their own."""
    pick = (lambda x: x) if rng is None else (lambda x: x[rng.integers(0, x.size, x.size)])
    T, cost = [], []
    for g in groups:
        i = pick(np.arange(col[g, control][key].size))
        T.append(float(col[g, control][length][i].mean()))
        cost.append(arm_cost(col[g, control][key][i], pick(col[g, arm][key])))
    return T, cost


def interval_passes(test: str, x: float, lo: float, hi: float) -> bool:
    """One condition of an exponent test on the interval [lo, hi] (``registration.INTERVAL_TESTS``)."""
    return {"holds": lo <= x <= hi, "excludes": not lo <= x <= hi, "below": hi < x, "above": lo > x}[test]


def exponent_section(col: dict, groups: list, key: str, label: str, *, control: str, arm: str, length: str,
                     tests: tuple = (), max_undefined: float = 0.5, group_name: str = "group", n: int = N_BOOT,
                     seed: int = 0) -> tuple[list[str], dict]:
    """The length exponent of ``arm``'s cost on ``key`` as lines of markdown, and each test's
    decision ({test name: True, False, or None for no decision}): ``fit_exponent`` through the
    ``groups`` that have the arm (the text names them; through two, b = log(c2 / c1) / log(T2 /
    T1)), refitted on ``n`` resamples (``exponent_points``) for the 95% percentile interval of b
    over the resamples that have one; a test is decided only where the point estimate exists and at
    most ``max_undefined`` of the resamples have no exponent."""
    groups = [g for g in groups if (g, arm) in col and (g, control) in col]
    head = f"**Length exponent, {label}**: "
    if len({float(col[g, control][length].mean()) for g in groups}) < 2:
        return [head + f"{arm} is in fewer than 2 valid {group_name}s of distinct T (" + (", ".join(groups) or "none")
                + "): no exponent, no test decided.",
                ""], {t.name: None for t in tests}
    T, cost = exponent_points(col, groups, key, control=control, arm=arm, length=length)
    point = fit_exponent(T, cost)
    rng = np.random.default_rng(seed)
    bs, undefined = [], 0
    for _ in range(n):
        f = fit_exponent(*exponent_points(col, groups, key, control=control, arm=arm, length=length, rng=rng))
        if f is None:
            undefined += 1
        else:
            bs.append(f[1])
    share = undefined / n
    per = "; ".join(f"{g}: T {t:.1f}, cost {fmt(c)} [{fmt(lo)}, {fmt(hi)}]" for g, t, c, (lo, hi) in
                    zip(groups, T, cost, (cost_ci(col[g, control][key], col[g, arm][key]) for g in groups)))
    lo, hi = pct(bs) if bs else (math.nan, math.nan)
    what = (f"{arm}'s cost ({control} minus {arm}) = a * T^b over {len(groups)} {group_name}s, "
            f"{', '.join(groups[:-1])} and {groups[-1]} (T: the {group_name}'s "
            f"{control} mean {length}; least squares of log cost on log T), 95% bootstrap over {n:,} resamples of each "
            f"{group_name}'s {arm} and {control} seeds, {undefined} ({100 * share:.1f}%) without an exponent (a cost "
            f"<= 0 in some {group_name}; left out of the interval)")
    if point is None:
        out = [head + f"b undefined: a cost is not above 0 ({per}); {what}: [{lo:.2f}, {hi:.2f}]."]
        why = "no decision (b undefined at the point estimate)"
    else:
        out = [head + f"b = {point[1]:.2f} [{lo:.2f}, {hi:.2f}] (a = {point[0]:.3g}; {what}). Per {group_name}: {per}."]
        why = (f"no decision (b undefined in {100 * share:.1f}% of resamples, above the registered "
               f"{100 * max_undefined:g}%)" if share > max_undefined else "")
    decided = {}
    out.append("")
    for t in tests:
        conds = ", ".join(f"{c} {x:g}" for c, x in t.conditions)
        ok = None if point is None or why else all(interval_passes(c, x, lo, hi) for c, x in t.conditions)
        decided[t.name] = ok
        out.append(f"- {t.name} (b's interval {conds}): {why or (t.then if ok else t.otherwise)}.")
    return out + [""] * bool(tests), decided
