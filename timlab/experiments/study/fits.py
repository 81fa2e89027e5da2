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
"""

from __future__ import annotations

import math

import numpy as np

from timlab.experiments.stats import N_BOOT, bootstrap_diff_ci, line_fit
from timlab.experiments.study.text import fmt


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
