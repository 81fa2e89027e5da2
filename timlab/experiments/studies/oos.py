"""The out-of-sample part of a predictor study: the probe's dose rule, the predictions written before
any out-of-sample run, and the decision rule applied once after them.

Home of a predictor study's whole analysis (``analyze_study``: the in-sample fits of
``timlab.experiments.studies.predictor``, then the ``oos`` block; ``timlab study analyze FILE --write``) and ``timlab study run|check`` of the out-of-sample study file that a predictor study
names in ``oos`` (docs/studies.md, "Predictor studies"; Study H's part (b) in docs/FINDINGS.md).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from timlab.experiments.studies.predictor import (PredictorResult, PredictorStudy, analyze_predictor, calibration_record,
                                                  write_calibration)
from timlab.experiments.studies.registration import StudyError
from timlab.findings import block_text


def round_sig(x: float, digits: int = 2) -> float:
    """``x`` rounded to ``digits`` significant digits (0.03147 -> 0.031)."""
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


def dose_for(magnitudes, k3s, target: float, *, digits: int = 2) -> float:
    """The magnitude that realizes k3 ``target``: log magnitude interpolated linearly against log k3
    between the two probed magnitudes whose realized k3 bracket the target (in magnitude order);
    where no pair brackets it, the line through the two probed points nearest the target in log k3,
    extrapolated. Rounded to ``digits`` significant digits. Every k3 must be > 0."""
    pts = sorted((float(m), float(k)) for m, k in zip(magnitudes, k3s))
    if len(pts) < 2 or any(m <= 0 or k <= 0 or not math.isfinite(k) for m, k in pts):
        raise ValueError(f"dose_for: needs >= 2 probed magnitudes with realized k3 > 0, got {pts}")
    lt = math.log(target)
    pair = next(((a, b) for a, b in zip(pts, pts[1:])
                 if min(a[1], b[1]) <= target <= max(a[1], b[1]) and a[1] != b[1]), None)
    if pair is None:
        near = sorted(pts, key=lambda p: abs(math.log(p[1]) - lt))
        pair = next(((near[0], q) for q in near[1:] if q[1] != near[0][1]), None)
        if pair is None:
            raise ValueError(f"dose_for: every probed magnitude realized the same k3 {pts[0][1]}; no slope")
    (m0, k0), (m1, k1) = pair
    t = (lt - math.log(k0)) / (math.log(k1) - math.log(k0))
    return round_sig(math.exp(math.log(m0) + t * (math.log(m1) - math.log(m0))), digits)


def dose_for_cost(doses, costs, target: float, *, log: bool = True, digits: int = 2) -> float:
    """The dose a pilot says costs ``target`` (Study H2's registered rule, docs/FINDINGS.md).

    On the dose axis x (log dose, or the dose itself with ``log=False``, for a dose that is already a
    log, like kv_cache's log2 scale), with h the step between the two lowest pilot doses: the pilot
    costs are made monotone in the dose (each replaced by the largest cost at or below its dose), an
    anchor of cost 0 is put one step h below the lowest dose, and x is interpolated linearly in the
    cost where this curve first reaches ``target``. Above the largest pilot cost, the last segment
    is extrapolated (a flat or falling one: none), at most one step h past the largest dose. Rounded
    to ``digits`` significant digits."""
    pts = sorted((float(d), float(c)) for d, c in zip(doses, costs))
    if len(pts) < 2 or any(not math.isfinite(c) for _, c in pts) or (log and any(d <= 0 for d, _ in pts)):
        raise ValueError(f"dose_for_cost: needs >= 2 pilot doses (> 0 on a log axis) with finite costs, got {pts}")
    xs = [math.log(d) if log else d for d, _ in pts]
    h = xs[1] - xs[0]
    env, top = [], -math.inf
    for _, c in pts:
        top = max(top, c)
        env.append(top)
    curve = [(xs[0] - h, 0.0), *zip(xs, env)]
    x = xs[-1] + h
    for (x0, c0), (x1, c1) in zip(curve, curve[1:]):
        if c1 >= target and c1 > c0:
            x = x0 + (x1 - x0) * (max(target, c0) - c0) / (c1 - c0)
            break
    else:
        (x0, c0), (x1, c1) = curve[-2], curve[-1]
        if c1 > c0:
            x = min(x1 + (x1 - x0) * (target - c1) / (c1 - c0), xs[-1] + h)
    return round_sig(math.exp(x) if log else x, digits)


def pilot_doses(doses, costs, targets=(0.02, 0.06), *, log: bool = True, digits: int = 2) -> tuple[float, ...]:
    """One dose per target cost (``dose_for_cost``, in target order); a dose that rounds to the one
    before it (or below it) moves half a pilot step above it, so that a kind's doses are distinct."""
    xs = sorted(float(d) for d in doses)
    h = (math.log(xs[1]) - math.log(xs[0])) if log else xs[1] - xs[0]
    out: list[float] = []
    for t in targets:
        d = dose_for_cost(doses, costs, t, log=log, digits=digits)
        if out and d <= out[-1]:
            d = round_sig(out[-1] * math.exp(h / 2) if log else out[-1] + h / 2, digits)
        out.append(d)
    return tuple(out)


# ------------------------------------------------------------------------------ the cells
def min_cover(n_cells: int) -> int:
    """A candidate whose 95% prediction intervals cover fewer than this many of ``n_cells`` observed
    costs is miscalibrated: half the cells, rounded up (Study H: 4 of its 7)."""
    return (n_cells + 1) // 2

PREDICTED = "**Out-of-sample predictions**"
"""How the predictions part of the block opens; ``check_predicted`` looks for the whole part."""


@dataclass
class OosCells:
    """The out-of-sample cells: per cell its name, kind, probe condition and (once run) per-seed costs."""

    names: list
    """``group/arm`` (``arm`` in an ungrouped sweep)."""
    kinds: list
    probe: list
    """The probe condition whose steps give the cell's candidate values."""
    control_key: list
    """The cell's group: its control is that group's control."""
    control: list = field(default_factory=list)
    """Per cell: the per-seed cost-window means of its group's control (after the runs)."""
    arm: list = field(default_factory=list)
    """Per cell: the per-seed cost-window means of the cell (after the runs)."""


def oos_cells(oos) -> OosCells:
    """The treated (group, arm) cells of the out-of-sample study ``oos`` (a ``Study`` with
    ``predicted_by``), in spec order, with the probe condition of each (its first run's condition
    without ``_s<seed>``)."""
    from timlab.experiments.studies.engine import planned_runs

    kinds = oos.predicted_by.kinds
    cells = OosCells([], [], [], [])
    for p in planned_runs(oos):
        if p.arm == oos.control:
            continue
        if p.arm not in kinds:
            raise StudyError(f"{oos.source}: predicted_by.kinds: arm {p.arm!r} has no kind (kinds: {', '.join(kinds)})")
        name = f"{p.group}/{p.arm}" if p.group else p.arm
        if name not in cells.names:
            cells.names.append(name)
            cells.kinds.append(kinds[p.arm])
            cells.probe.append(re.sub(r"_s\d+$", "", p.name))
            cells.control_key.append(p.group)
    return cells


def probe_values(pst, cells: OosCells, probe: str | Path) -> tuple[dict, list[str]]:
    """({candidate: [value per cell]}, missing probe conditions): each candidate's mean over the
    predictor study's ``window`` of the cell's probe run (absolute for ``absolute`` candidates)."""
    from timlab.experiments.studies.predictor import _value, _window_mean
    from timlab.rundir import read_metrics

    root = Path(probe)
    runs = {p.name.split("__")[0]: p for p in sorted(root.iterdir()) if p.is_dir()} if root.is_dir() else {}
    vals = {c.name: [] for c in pst.candidates}
    missing = []
    for cond in cells.probe:
        m = read_metrics(runs[cond]) if cond in runs else None
        if m is None or m["step"].max() < pst.window[1]:
            missing.append(cond)
            continue
        for c in pst.candidates:
            vals[c.name].append(_value([_window_mean(m, c.metric, pst.window)], c.absolute))
    return vals, missing


def probe_k3(probe: str | Path, metric: str = "rollout_corr/k3_kl", window: tuple[int, int] = (1, 25)) -> dict[str, float]:
    """{probe condition: its run's mean of ``metric`` over ``window``}, for every probe run on disk
    (what the probe's dose rule reads)."""
    from timlab.experiments.studies.predictor import _window_mean
    from timlab.rundir import read_metrics

    root = Path(probe)
    out = {}
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        m = read_metrics(p) if p.is_dir() else None
        if m is not None and len(m):
            out[p.name.split("__")[0]] = _window_mean(m, metric, window)
    return out


def predict_cells(fits: dict, values: dict) -> dict:
    """{candidate: [(S, predicted cost, low, high) per cell]} under each candidate's in-sample fit."""
    from timlab.experiments.studies.predictor import prediction

    return {k: [(S, *prediction(fits[k]["b"], fits[k]["b_var"], fits[k]["loko"], S)) for S in v]
            for k, v in values.items()}


def _g(x: float) -> str:
    return "nan" if not math.isfinite(x) else f"{x:.3g}"


def predictions_text(pst, cells: OosCells, preds: dict) -> str:
    """The predictions part of the oos block (written before any out-of-sample run)."""
    names = [c.name for c in pst.candidates]
    lines = [f"{PREDICTED} (written before any out-of-sample run; {len(cells.names)} cells; each cell's candidate "
             f"value is its probe run's mean over steps {pst.window[0]}-{pst.window[1]}, seed 0; the predicted cost is "
             "b S with the 95% interval b S +- 1.96 sqrt(S^2 var(b) + e^2), b and var(b) the in-sample slope and its "
             "bootstrap variance, e the candidate's leave-one-kind-out error)", "",
             "| cell | kind | " + " | ".join(f"{k}: S" for k in names) + " |",
             "|---|---|" + "---:|" * len(names)]
    for i, (n, kind) in enumerate(zip(cells.names, cells.kinds)):
        lines.append(f"| {n} | {kind} | " + " | ".join(_g(preds[k][i][0]) for k in names) + " |")
    lines += ["", "| cell | " + " | ".join(f"{k}: predicted cost [95%]" for k in names) + " |",
              "|---|" + "---|" * len(names)]
    for i, n in enumerate(cells.names):
        lines.append(f"| {n} | " + " | ".join(f"{preds[k][i][1]:+.4f} [{preds[k][i][2]:+.4f}, {preds[k][i][3]:+.4f}]"
                                              for k in names) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ the decision rule
def decide(cells: OosCells, preds: dict, reference: str, *, boot: int, seed: int = 2) -> dict:
    """The registered decision over the observed out-of-sample costs (control mean minus cell mean of
    each run's cost-window mean), the predictions fixed. Per candidate: the root mean square error
    over the cells with its 95% interval, the paired difference (the reference's error minus its) with
    its interval, from the same ``boot`` resamples of every cell's and every control's seeds, and the
    cells its intervals cover. The winner has the smallest error (ties: the earlier candidate); a
    candidate predicts better than the reference where its paired interval lies above 0; one whose
    intervals cover fewer than ``min_cover`` of the costs is miscalibrated."""
    cost = np.array([np.mean(c) - np.mean(a) for c, a in zip(cells.control, cells.arm)])
    names = list(preds)

    def rmse(k, c):
        return math.sqrt(math.fsum((float(ci) - p[1]) ** 2 for ci, p in zip(c, preds[k])) / len(c))

    res = {k: {"rmse": rmse(k, cost), "covered": sum(p[2] <= ci <= p[3] for ci, p in zip(cost, preds[k]))}
           for k in names}
    rng = np.random.default_rng(seed)
    reps = {k: [] for k in names}
    for _ in range(boot):
        ctrl = {}
        c = np.empty(len(cost))
        for i, key in enumerate(cells.control_key):
            if key not in ctrl:
                x = np.asarray(cells.control[i])
                ctrl[key] = float(x[rng.integers(0, len(x), len(x))].mean())
            a = np.asarray(cells.arm[i])
            c[i] = ctrl[key] - float(a[rng.integers(0, len(a), len(a))].mean())
        for k in names:
            reps[k].append(rmse(k, c))
    ref = np.array(reps[reference])
    for k in names:
        r = np.array(reps[k])
        res[k]["rmse_ci"] = _pct(r)
        res[k]["gain"] = res[reference]["rmse"] - res[k]["rmse"]
        res[k]["gain_ci"] = _pct(ref - r)
        res[k]["miscalibrated"] = res[k]["covered"] < min_cover(len(cost))
    winner = min(names, key=lambda k: res[k]["rmse"])
    beats = [k for k in names if k != reference and res[k]["gain_ci"][0] > 0]
    return {"cost": cost, "per": res, "winner": winner, "beats": beats, "reference": reference, "cells": len(cost),
            "min_cover": min_cover(len(cost))}


def _pct(x) -> tuple[float, float]:
    x = np.asarray(x, dtype=float)
    return float(np.percentile(x, 2.5)), float(np.percentile(x, 97.5))


def verdict_line(dec: dict, regime: str) -> str:
    """The verdict row: the winner, its error with its interval, whether it beats the reference, the
    miscalibrated candidates, and the regime."""
    ref, w, per = dec["reference"], dec["winner"], dec["per"]
    f = per[w]
    if w in dec["beats"]:
        what = f"**{w} predicts better than {ref}**"
    elif dec["beats"]:
        what = (f"**{', '.join(dec['beats'])} predict(s) better than {ref}** (paired interval above 0); the smallest "
                f"error is {w}'s")
    else:
        what = f"**none beats {ref}**"
    bad = [k for k in per if per[k]["miscalibrated"]]
    return (f"Verdict: {what}. Winner (smallest out-of-sample error): **{w}**, RMSE {f['rmse']:.4f} "
            f"[{f['rmse_ci'][0]:.4f}, {f['rmse_ci'][1]:.4f}] over {dec['cells']} cells"
            + (f"; miscalibrated (intervals cover fewer than {dec['min_cover']} of {dec['cells']} costs): "
               + ", ".join(bad) if bad else "; no candidate is miscalibrated")
            + f". Regime: {regime}.")


def results_text(cells: OosCells, preds: dict, dec: dict, regime: str, *, verdict: str | None = None) -> str:
    """The results part of the oos block, after the runs: each cell's observed cost, each candidate's
    error, paired difference and coverage, and the verdict row (``verdict_line``'s, or ``verdict`` where
    the caller's registration decides otherwise, e.g. a held-out study's signal condition)."""
    ref = dec["reference"]
    lines = ["**Out-of-sample results** (cost = the group's control minus the cell, each run's mean over the cost "
             "window, every seed; errors against the predictions above, intervals over resamples of the seeds, "
             "paired)", "",
             "| cell | kind | observed cost | " + " | ".join(f"{k} covers" for k in preds) + " |",
             "|---|---|---:|" + "---|" * len(preds)]
    for i, (n, kind) in enumerate(zip(cells.names, cells.kinds)):
        lines.append(f"| {n} | {kind} | {dec['cost'][i]:+.4f} | "
                     + " | ".join("yes" if p[i][2] <= dec["cost"][i] <= p[i][3] else "no" for p in preds.values()) + " |")
    lines += ["", f"| candidate | out-of-sample RMSE [95%] | {ref}'s RMSE minus its [95%, paired] | intervals covering "
                  "| miscalibrated |", "|---|---|---|---|---|"]
    for k, f in dec["per"].items():
        gain = "-" if k == ref else f"{f['gain']:+.4f} [{f['gain_ci'][0]:+.4f}, {f['gain_ci'][1]:+.4f}]"
        lines.append(f"| {k} | {f['rmse']:.4f} [{f['rmse_ci'][0]:.4f}, {f['rmse_ci'][1]:.4f}] | {gain} "
                     f"| {f['covered']} of {dec['cells']} | {'yes' if f['miscalibrated'] else 'no'} |")
    return "\n".join([*lines, "", verdict or verdict_line(dec, regime)])


# ------------------------------------------------------------------------------ the block and the gate
def _observed(pst, oos, cells: OosCells) -> list[float]:
    """Fill ``cells.control`` and ``cells.arm`` with each run's cost-window mean; returns each cell's
    mean answer length over the candidates' window (the out-of-sample lengths)."""
    from timlab.experiments.studies.blocks import sweep_dir
    from timlab.experiments.studies.engine import planned_runs
    from timlab.experiments.studies.predictor import LENGTH_METRIC, _window_mean
    from timlab.rundir import read_metrics

    out = sweep_dir(oos)
    acc, length = {}, {}
    for p in planned_runs(oos):
        m = read_metrics(out / p.run_id)
        key = (p.group, p.arm)
        acc.setdefault(key, []).append(_window_mean(m, pst.cost_metric, pst.cost_window))
        length.setdefault(key, []).append(_window_mean(m, LENGTH_METRIC, pst.window))
    lengths = []
    for name, g in zip(cells.names, cells.control_key):
        arm = name.split("/", 1)[1] if g else name
        cells.control.append(np.array(acc[(g, oos.control)]))
        cells.arm.append(np.array(acc[(g, arm)]))
        lengths.append(float(np.mean(length[(g, arm)])))
    return lengths


def _oos_study(pst):
    from timlab.experiments.studies.registration import load_study

    oos = load_study(pst.oos)
    if oos.predicted_by is None:
        raise StudyError(f"{pst.oos}: the out-of-sample study of {pst.name} needs predicted_by (docs/studies.md)")
    return oos


def _shown(path: str | Path) -> str:
    """``path`` as FINDINGS shows it: relative to the working directory (the repository root, where the
    documented commands run) when it lies under it, so the block does not depend on how the file was named."""
    p = Path(path).resolve()
    return str(p.relative_to(Path.cwd().resolve())) if p.is_relative_to(Path.cwd().resolve()) else str(path)


def oos_block(pst, res) -> tuple[str, dict | None]:
    """The oos block of a predictor study whose in-sample analysis ``res`` is complete, and the
    decision once the out-of-sample runs are: the predictions (from the probe) first, then the
    out-of-sample sweep's INCOMPLETE or VOID line, or its own analysis (the controls' validity, each
    cell's cost with its permutation p) followed by the results and the verdict."""
    from timlab.experiments.studies.engine import analyze

    if not pst.oos:
        return "NOT YET PREDICTED: the in-sample fits exist; the study names no out-of-sample file (oos).", None
    oos = _oos_study(pst)
    cells = oos_cells(oos)
    values, missing = probe_values(pst, cells, oos.predicted_by.probe)
    if missing:
        return (f"NOT YET PREDICTED: the in-sample fits exist; the probe {oos.predicted_by.probe} lacks "
                f"{', '.join(missing)} (each needs steps {pst.window[0]}-{pst.window[1]}).", None)
    preds = predict_cells(res.fits, values)
    text = predictions_text(pst, cells, preds)
    done = analyze(oos)
    if done.status != "complete":
        return f"{text}\n\nOut-of-sample runs ({_shown(oos.source)}): {done.text}", None
    lengths = _observed(pst, oos, cells)
    dec = decide(cells, preds, pst.reference, boot=pst.boot)
    regime = (f"{pst.regime} in sample; out of sample answers of {min(lengths):.0f}-{max(lengths):.0f} tokens "
              f"({len(cells.names)} cells of {len(set(cells.kinds))} kinds)")
    runs = f"Out-of-sample runs ({_shown(oos.source)}), their own analysis:\n\n{done.text.strip()}"
    return f"{text}\n\n{runs}\n\n{results_text(cells, preds, dec, regime)}", dec


def check_predicted(study) -> str:
    """Refuse (one-line ``StudyError``) to start a run of the out-of-sample ``study`` before its
    predictor study's oos block holds the predictions it would write now; returns a line saying
    they are there."""
    from timlab.experiments.studies.predictor import load_predictor

    pb = study.predicted_by
    pst = load_predictor(pb.study)
    if pst is None:
        raise StudyError(f"{study.source}: predicted_by.study: {pb.study} is not a predictor study (kind: predictor)")
    if not pst.oos or Path(pst.oos).resolve() != Path(study.source).resolve():
        raise StudyError(f"{study.source}: predicted_by.study: {pb.study} names {pst.oos or 'no'} out-of-sample file "
                         f"(oos), not this one")
    gate = "no out-of-sample run starts before its prediction"
    res = analyze_predictor(pst)
    if res.status != "complete":
        raise StudyError(f"study {study.name}: {gate}, and the in-sample fits of {pst.name} do not exist yet "
                         f"({res.insample.split(';')[0]})")
    cells = oos_cells(study)
    values, missing = probe_values(pst, cells, pb.probe)
    if missing:
        raise StudyError(f"study {study.name}: {gate}; the probe {pb.probe} lacks {', '.join(missing)}")
    want = predictions_text(pst, cells, predict_cells(res.fits, values))
    if pst.findings is None:
        raise StudyError(f"study {study.name}: {gate}; {pb.study} names no findings block to hold them")
    file, name = pst.findings[0], pst.findings[2]
    if want not in block_text(file, name):
        raise StudyError(f"study {study.name}: {gate}; block {name} of {file} does not hold the predictions: run "
                         f"`timlab study analyze {pb.study} --write` and commit it first")
    return f"the predictions of {len(cells.names)} cells are in block {name} of {file}"


def analyze_study(st: PredictorStudy) -> PredictorResult:
    """The registered analysis of a predictor study: the in-sample fits (INCOMPLETE until every re-run
    is in), then, once they exist, the out-of-sample block and its decision."""
    res = analyze_predictor(st)
    if res.status == "complete":
        res.oos, res.decision = oos_block(st, res)
    return res


def blocks(st: PredictorStudy, res: PredictorResult | None = None) -> dict[str, str]:
    """The study's FINDINGS blocks, name -> text."""
    res = analyze_study(st) if res is None else res
    if st.findings is None:
        return {}
    _, insample, oos = st.findings
    return {insample: res.insample, oos: res.oos}


def analyze_and_write(st: PredictorStudy, *, write: bool) -> PredictorResult:
    """The analysis; with ``write``, its blocks in FINDINGS and (once complete) the calibration record."""
    from timlab.experiments.studies.text import write_blocks

    res = analyze_study(st)
    if write and st.findings is not None:
        write_blocks(st.findings[0], blocks(st, res))
    if write and res.status == "complete" and st.calibration:
        write_calibration(st.calibration, calibration_record(st, res.fits, res.cells, res.decision))
    return res
