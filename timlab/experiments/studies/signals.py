"""Signals before falls: does a per-step training metric rise before a run falls, and how often
does it rise in the runs that do not fall? A ``signals`` fit of a study file (docs/studies.md).

Used by ``engine.run_record`` (per run: each signal's rise step and, for a fall, its value at the
fall against its start) and ``engine._fits`` (the section). The rule, for one signal of one run
(one row per step, steps >= 1):

- its reference is its median over the ``reference`` steps; it *rises* at the first step t after
  ``rise_after`` whose ``trail``-step trailing mean exceeds ``factor`` x the reference;
- a fall at step F > ``early`` is *warned* when the signal rose before it (lead F - t > 0); a run
  of the same arms that did not fall but whose signal rose is a false alarm; the signal *warns
  usefully* when it warns more than half the falls and the upper end of the false-alarm rate's
  95% Clopper-Pearson interval lies below the lower end of the warned rate's;
- a fall at F <= ``early`` leaves no room for a reference and a rise: each signal's trailing mean
  at F over its mean over the ``start`` steps is listed instead (descriptive).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from timlab.experiments.studies.stats import clopper_pearson


def rise_step(s: pd.Series, factor: float, *, reference: tuple[int, int] = (21, 60), trail: int = 10,
              after: int = 60) -> int | None:
    """The first step t > ``after`` at which the ``trail``-step trailing mean of ``s`` (indexed by
    step, one row per step) exceeds ``factor`` x its median over ``reference``; None if it never does."""
    ref = s[(s.index >= reference[0]) & (s.index <= reference[1])].median()
    if not math.isfinite(ref):
        return None
    rolled = s.rolling(trail).mean()
    hit = rolled[(rolled.index > after) & (rolled > factor * ref)]
    return int(hit.index[0]) if len(hit) else None


def vs_start(s: pd.Series, step: int, *, start: tuple[int, int] = (1, 5), trail: int = 10) -> float:
    """The ``trail``-step trailing mean of ``s`` at ``step`` (its last steps up to it) over its mean over ``start``."""
    first = float(s[(s.index >= start[0]) & (s.index <= start[1])].mean())
    at = float(s[s.index <= step].iloc[-trail:].mean())
    return at / first if first > 0 else math.nan


def series(m: pd.DataFrame, sig) -> pd.Series | None:
    """One signal's per-step values (steps >= 1, indexed by step; ``sig``: a ``registration.Signal``),
    or None when the run does not log it (or its ``over`` is not positive at every step)."""
    train = m[m["step"] >= 1].set_index("step")
    if sig.metric not in train.columns:
        return None
    s = train[sig.metric]
    if sig.over:
        if sig.over not in train.columns or not (train[sig.over] > 0).all():
            return None
        s = s / train[sig.over] ** sig.power
    return s.dropna()


def run_signals(m: pd.DataFrame, fit, fall: float) -> dict[str, float]:
    """One run's ``rise:<signal>`` (the rise step, NaN: none) and ``at_fall:<signal>`` (its value at
    the fall over its start, NaN without a fall) for each signal of a ``signals`` fit."""
    out = {}
    m = m.sort_values("step")
    for sig in fit.signals:
        s = series(m, sig)
        r = None if s is None else rise_step(s, sig.factor, reference=fit.reference, trail=fit.trail,
                                             after=fit.rise_after)
        out[f"rise:{sig.name}"] = math.nan if r is None else float(r)
        out[f"at_fall:{sig.name}"] = (vs_start(s, int(fall), start=fit.start, trail=fit.trail)
                                      if s is not None and math.isfinite(fall) else math.nan)
    return out


def _times(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.2f}x"


def signals_section(col: dict, fit) -> list[str]:
    """The section of a ``signals`` fit (see the module docstring); ``col``: {arm: {key: values over
    its runs}} holding the fit's fall-step ``endpoint`` and each run's ``run_signals``."""
    F, names = fit.endpoint, [s.name for s in fit.signals]
    has = {s.name: (lambda a, p=s.arms: a.startswith(p)) for s in fit.signals}
    fallen = [(a, i) for a, c in col.items() for i, f in enumerate(c[F]) if math.isfinite(f)]
    late = [(a, i) for a, i in fallen if col[a][F][i] > fit.early]
    early = [(a, i) for a, i in fallen if col[a][F][i] <= fit.early]
    step = lambda a, i: int(col[a][F][i])  # noqa: E731
    rise = lambda a, i, n: col[a][f"rise:{n}"][i]  # noqa: E731
    base = fit.signals[0].factor
    other = [f"{s.factor:g}x for {s.name}" for s in fit.signals if s.factor != base]
    out = [f"**{fit.title or 'Signals before falls.'}** Falls at F > {fit.early}: {len(late)}; early falls (F <= {fit.early}): "
           f"{len(early)}. A signal rises at the first step t > {fit.rise_after} whose {fit.trail}-step trailing mean "
           f"exceeds {base:g}x its median over steps {fit.reference[0]}-{fit.reference[1]}"
           + (f" ({', '.join(other)})" if other else "") + "; lead = F - t.", ""]
    if len(late) < fit.min_falls:
        out.append(f"Fewer than {fit.min_falls} falls at F > {fit.early}: listed one by one, no rate computed." if late
                   else f"No fall at F > {fit.early}: no lead time to measure.")
        if late:
            out += ["", "| condition | seed | F | " + " | ".join(f"{n}: rise (lead)" for n in names) + " |",
                    "|---|---:|---:|" + "---|" * len(names)]
            for a, i in late:
                cells = [("-" if not math.isfinite(rise(a, i, n)) else f"{int(rise(a, i, n))} "
                          f"({step(a, i) - int(rise(a, i, n)):+d})") if has[n](a) else "n/a" for n in names]
                out.append(f"| {a} | {i} | {step(a, i)} | " + " | ".join(cells) + " |")
    else:
        arms = sorted({a for a, _ in late})
        only = [f"{s.name}: {s.arms.rstrip('_')} arms only" for s in fit.signals if s.arms]
        out += [f"Conditions with a fall at F > {fit.early}: {', '.join(arms)} (false alarms are counted among their "
                f"runs that did not fall" + "".join(f"; {x}" for x in only) + ").", "",
                "| signal | falls warned (lead > 0) [95% Clopper-Pearson] | lead times where it rose: median (range) | "
                "false alarms [95% Clopper-Pearson] | warns usefully |", "|---|---:|---:|---:|---|"]
        for n in names:
            fl = [(a, i) for a, i in late if has[n](a)]
            ok = [(a, i) for a in arms if has[n](a) for i, f in enumerate(col[a][F]) if not math.isfinite(f)]
            if not fl:
                out.append(f"| {n} | no fall in its arms | - | - | - |")
                continue
            leads = sorted(step(a, i) - int(rise(a, i, n)) for a, i in fl if math.isfinite(rise(a, i, n)))
            warned = sum(x > 0 for x in leads)
            alarms = sum(math.isfinite(rise(a, i, n)) for a, i in ok)
            wci = clopper_pearson(warned, len(fl))
            aci = clopper_pearson(alarms, len(ok)) if ok else (math.nan, math.nan)
            useful = bool(ok and warned > len(fl) / 2 and aci[1] < wci[0])
            lead = f"{float(np.median(leads)):+.0f} ({leads[0]:+d} to {leads[-1]:+d})" if leads else "never rose"
            fa = f"{alarms}/{len(ok)} [{aci[0]:.2f}, {aci[1]:.2f}]" if ok else "no run stayed up"
            out.append(f"| {n} | {warned}/{len(fl)} [{wci[0]:.2f}, {wci[1]:.2f}] | {lead} | {fa} | "
                       f"{'**yes**' if useful else 'no'} |")
    if early:
        out += ["", f"Early falls (F <= {fit.early}), each signal's {fit.trail}-step trailing mean at F over its mean "
                f"over steps {fit.start[0]}-{fit.start[1]}:", "",
                "| condition | seed | F | " + " | ".join(names) + " |", "|---|---:|---:|" + "---:|" * len(names)]
        for a, i in early:
            cells = [_times(col[a][f"at_fall:{n}"][i]) if has[n](a) else "n/a" for n in names]
            out.append(f"| {a} | {i} | {step(a, i)} | " + " | ".join(cells) + " |")
    return out
