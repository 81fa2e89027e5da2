"""Held-out predictor studies: which per-step statistic of a mismatch predicts its cost on kinds the
fit has not seen (Study H2 in docs/FINDINGS.md; docs/studies.md, "Held-out predictor studies").

Used by ``timlab study check|analyze`` for a study file with ``kind: heldout`` and by
``scripts/findings_tables.py`` for its two FINDINGS blocks. Where a ``kind: predictor`` study
(``timlab.experiments.studies.predictor``) re-runs other studies' committed runs to recompute its
candidates and tests on a second sweep dosed by k3, a held-out study's cells all live in one sweep
of its own (an ordinary study file, ``runs``, whose ``timlab study run`` freezes and runs it and
whose validity gates this analysis), every candidate is logged by the runs themselves, and the
kinds are split by the registration into those the fit sees and those it is tested on:

1. per cell (an arm of the runs study other than its control; its kind is the ``kind`` group of
   ``kind_pattern`` matched on the arm): the cost, the control's mean minus the cell's over seeds of
   each run's mean ``cost.metric`` over ``cost.window``, and each candidate's value, the mean over the
   cell's seeds of each run's mean of the candidate over ``window`` (a candidate with ``times`` is the
   per-step product of its metric with the positive part of the ``times`` metric, averaged over the
   steps where both are defined);
2. the fit on the fit kinds' cells (``predictor.fit_all``: one slope through the origin, weights
   1 / the cell's bootstrap cost variance, the leave-one-kind-out error; resamples draw each cell's
   seeds once for its cost and its candidate values, ``Cells.paired``);
3. the signal condition: Cochran's Q over the held-out cells' costs (weights 1 / their cost
   variances, chi-square with cells - 1 degrees of freedom); p >= ``signal.alpha`` gives
   "no verdict";
4. each held-out cell's prediction b S +- 1.96 sqrt(S^2 var(b) + e^2) (``predictor.prediction``) and
   the decision over the held-out cells (``oos.decide``: each candidate's error with its interval,
   the paired difference against the reference, coverage, the winner).

Nothing is read from a run's metrics until the runs study is complete and valid (its INCOMPLETE or
VOID line is the blocks' text until then).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from timlab.experiments.studies.predictor import (Candidate, Cells, N_BOOT, _keys, _window, cell_point,
                                                  check_frozen as predictor_check_frozen,
                                                  cost_variances, fit_all, prediction)
from timlab.experiments.studies.stats import cochran_q
from timlab.experiments.studies.oos import OosCells, _shown as shown, decide, results_text
from timlab.experiments.studies.registration import StudyError, registration_hash, study_mapping

TOP = ("study", "kind", "runs", "kind_pattern", "kinds", "window", "cost", "candidates", "reference", "signal", "boot",
       "findings", "regime", "frozen", "notes")
UNHASHED = ("frozen", "notes")
"""Left out of the hash: the freeze itself and prose."""

CALIBRATION = Path(__file__).resolve().parents[2] / "data" / "harm2_calibration.json"
"""Where ``timlab study analyze FILE --write`` ships the winner's fit when the signal condition holds
(Study H2's rule 4; ``timlab.experiments.diagnostics.harm_prediction`` reads it before Study H's record)."""

ROLES = ("fit", "heldout")
"""What a kind is to the study: fitted on, or held out for the test."""


@dataclass(frozen=True)
class HeldoutStudy:
    """A held-out predictor study file, validated."""

    name: str
    source: str
    runs: str
    """The ordinary study file whose sweep holds every cell and the control."""
    kind_pattern: str
    """A regular expression every arm but the control matches in full, with the group ``kind``."""
    kinds: dict
    """kind -> role (``ROLES``)."""
    window: tuple
    """[first, last] training step over which a candidate's per-run mean is taken."""
    cost_metric: str
    cost_window: tuple
    candidates: tuple
    reference: str
    alpha: float
    """The signal condition's level: Cochran's Q p below it means the held-out costs differ."""
    boot: int
    findings: tuple | None
    """(file, fit block, test block), or None."""
    regime: str
    hash: str
    frozen: str

    def role(self, role: str) -> list[str]:
        return [k for k, r in self.kinds.items() if r == role]


def heldout_from_dict(d: Any, *, root: str | Path = ".", source: str = "<dict>") -> HeldoutStudy:
    """Validate a held-out study file's mapping (one-line ``StudyError`` naming the field)."""
    d = _keys(d, TOP, ("study", "kind", "runs", "kind_pattern", "kinds", "window", "cost", "candidates", "reference"),
              source)
    if d["kind"] != "heldout":
        raise StudyError(f"{source}: kind: {d['kind']!r} is not a held-out study (valid: heldout)")
    try:
        rx = re.compile(str(d["kind_pattern"]))
    except re.error as e:
        raise StudyError(f"{source}: kind_pattern: not a regular expression ({e})") from None
    if "kind" not in rx.groupindex:
        raise StudyError(f"{source}: kind_pattern: needs the named group kind, got {sorted(rx.groupindex)}")
    kinds = d["kinds"]
    if not isinstance(kinds, dict) or not kinds or any(r not in ROLES for r in kinds.values()):
        raise StudyError(f"{source}: kinds: expected a mapping kind -> role ({', '.join(ROLES)}), got {kinds!r}")
    fit, held = [k for k, r in kinds.items() if r == "fit"], [k for k, r in kinds.items() if r == "heldout"]
    if len(fit) < 2 or not held:
        raise StudyError(f"{source}: kinds: needs >= 2 fit kinds (leaving one kind out) and >= 1 held-out kind; got "
                         f"fit {fit}, heldout {held}")
    cost = _keys(d["cost"], ("metric", "window"), ("metric", "window"), f"{source}: cost")
    cands = []
    for i, c in enumerate(d["candidates"] or []):
        c = _keys(c, ("name", "metric", "absolute", "times"), ("name", "metric"), f"{source}: candidates[{i}]")
        cands.append(Candidate(str(c["name"]), str(c["metric"]), bool(c.get("absolute", False)), str(c.get("times", ""))))
    names = [c.name for c in cands]
    if len(set(names)) != len(names) or not names:
        raise StudyError(f"{source}: candidates: names must be unique and at least one; got {names}")
    if d["reference"] not in names:
        raise StudyError(f"{source}: reference: {d['reference']!r} is not a candidate (valid: {', '.join(names)})")
    sig = _keys(d.get("signal") or {"alpha": 0.05}, ("alpha",), ("alpha",), f"{source}: signal")
    if not isinstance(sig["alpha"], float) or not 0 < sig["alpha"] < 1:
        raise StudyError(f"{source}: signal.alpha: expected a number in (0, 1), got {sig['alpha']!r}")
    boot = d.get("boot", N_BOOT)
    if not isinstance(boot, int) or boot < 10:
        raise StudyError(f"{source}: boot: expected an integer >= 10, got {boot!r}")
    findings = None
    if d.get("findings") is not None:
        f = _keys(d["findings"], ("file", "fit", "test"), ("file", "fit", "test"), f"{source}: findings")
        findings = (str(Path(root) / f["file"]), str(f["fit"]), str(f["test"]))
    return HeldoutStudy(
        name=str(d["study"]), source=source, runs=str(Path(root) / d["runs"]), kind_pattern=str(d["kind_pattern"]),
        kinds=dict(kinds), window=_window(d["window"], f"{source}: window"), cost_metric=str(cost["metric"]),
        cost_window=_window(cost["window"], f"{source}: cost.window"), candidates=tuple(cands),
        reference=str(d["reference"]), alpha=float(sig["alpha"]), boot=boot, findings=findings,
        regime=str(d.get("regime", "")), hash=registration_hash({k: v for k, v in d.items() if k not in UNHASHED}),
        frozen=str(d.get("frozen", "")))


def is_heldout(d: Any) -> bool:
    return isinstance(d, dict) and d.get("kind") == "heldout"


def load_heldout(path: str | Path) -> HeldoutStudy | None:
    """The held-out study in the study file ``path``, or None when the file is of another kind."""
    p, d = study_mapping(path)
    return heldout_from_dict(d, root=p.parent, source=str(p)) if is_heldout(d) else None


def check_frozen(st: HeldoutStudy) -> None:
    predictor_check_frozen(st, "held-out study")


# ------------------------------------------------------------------------------ the runs
def candidate_mean(m: pd.DataFrame, c: Candidate, window: tuple[int, int]) -> float:
    """One run's mean of candidate ``c`` over the training steps in ``window`` (NaN when not logged)."""
    rows = m[(m["step"] >= window[0]) & (m["step"] <= window[1])]
    if c.metric not in rows.columns or (c.times and c.times not in rows.columns):
        return float("nan")
    v = rows[c.metric].astype(float)
    if c.times:
        v = v * rows[c.times].astype(float).clip(lower=0.0)
    v = v.dropna()
    return float(v.mean()) if len(v) else float("nan")


def _runs_study(st: HeldoutStudy):
    from timlab.experiments.studies.registration import load_study

    return load_study(st.runs)


@dataclass
class HeldoutData:
    """The fit kinds' cells and the held-out kinds' cells (each with its kind, per-seed costs and candidate
    values, and answer length)."""

    fit: Cells
    held: Cells


def collect(st: HeldoutStudy, root: str | Path = ".") -> tuple[str, str, HeldoutData | None]:
    """(status, the runs study's analysis text, the cells) once the runs study is complete and valid;
    (status, its INCOMPLETE or VOID text, None) before."""
    from timlab.experiments.studies.blocks import block_dirs
    from timlab.experiments.studies.engine import analyze, planned_runs
    from timlab.experiments.studies.predictor import LENGTH_METRIC, _window_mean
    from timlab.rundir import read_metrics

    rs = _runs_study(st)
    res = analyze(rs, root=root)
    if res.status != "complete":
        return res.status, res.text, None
    dirs = block_dirs(rs, None, root)
    planned = planned_runs(rs)
    per: dict[str, list[tuple[float, dict, float]]] = {}
    for p in planned:
        m = read_metrics(dirs[p.block] / p.run_id)
        vals = {c.name: candidate_mean(m, c, st.window) for c in st.candidates}
        per.setdefault(p.arm, []).append((_window_mean(m, st.cost_metric, st.cost_window), vals,
                                          _window_mean(m, LENGTH_METRIC, st.window)))
    ctrl = np.array([x[0] for x in per.pop(rs.control)])
    absolute = {c.name: c.absolute for c in st.candidates}
    fit, held = (Cells([], [], [], [], [], [], absolute, paired=True) for _ in range(2))
    rx = re.compile(st.kind_pattern)
    for arm, runs in per.items():
        m = rx.fullmatch(arm)
        if m is None or m.group("kind") not in st.kinds:
            raise StudyError(f"{st.source}: kind_pattern/kinds: arm {arm!r} of {rs.source} has no registered kind "
                             f"(kinds: {', '.join(st.kinds)})")
        cells = fit if st.kinds[m.group("kind")] == "fit" else held
        cells.names.append(arm)
        cells.kinds.append(m.group("kind"))
        cells.control.append(ctrl)
        cells.control_key.append("control")
        cells.arm.append(np.array([x[0] for x in runs]))
        cells.values.append({c.name: np.array([x[1][c.name] for x in runs]) for c in st.candidates})
        cells.lengths.append(float(np.mean([x[2] for x in runs])))
    for role, cells in (("fit", fit), ("heldout", held)):
        missing = sorted(set(st.role(role)) - set(cells.kinds))
        if missing:
            raise StudyError(f"{st.source}: kinds: {role} kind(s) {', '.join(missing)} have no cell in {rs.source}")
    return "complete", res.text, HeldoutData(fit, held)


# ------------------------------------------------------------------------------ the analysis
@dataclass
class HeldoutResult:
    status: str
    fit_text: str
    test_text: str
    fits: dict | None = None
    decision: dict | None = None
    signal: tuple | None = None
    data: HeldoutData | None = None


def _g(x: float) -> str:
    return f"{x:.3g}"


def registration_lines(st: HeldoutStudy) -> list[str]:
    """What the blocks say before any data: the split and the candidates, and the registration's hash."""
    cands = ", ".join(f"{c.name} (`{c.metric}`" + (f" x max(`{c.times}`, 0)" if c.times else "")
                      + (", abs" if c.absolute else "") + ")" for c in st.candidates)
    return [f"Registration {st.hash[:12]} ({'frozen' if st.frozen else 'NOT frozen'}): fit kinds "
            f"{', '.join(st.role('fit'))}; held-out kinds {', '.join(st.role('heldout'))}; candidates {cands}, each a "
            f"run's mean over training steps {st.window[0]}-{st.window[1]}; cost = control minus cell, mean "
            f"`{st.cost_metric}` over steps {st.cost_window[0]}-{st.cost_window[1]}; reference {st.reference}; "
            f"signal condition Cochran's Q p < {st.alpha:g}; {st.boot} resamples."]


def fit_text(st: HeldoutStudy, data: HeldoutData, fits: dict) -> str:
    names = [c.name for c in st.candidates]
    lines = [f"**The fit** on {len(data.fit.names)} cells of {len(set(data.fit.kinds))} fit kinds "
             f"({', '.join(dict.fromkeys(data.fit.kinds))}): cost = b x S through the origin, weights 1 / the cell's "
             f"cost variance; each candidate's cell value the mean over its seeds of each run's mean over steps "
             f"{st.window[0]}-{st.window[1]}; {st.boot} joint resamples", "",
             "| cell | kind | cost [95% bootstrap] | " + " | ".join(f"{n}: S" for n in names) + " |",
             "|---|---|---:|" + "---:|" * len(names)]
    S = {n: cell_point(data.fit, n)[0] for n in names}
    cost = cell_point(data.fit, names[0])[1]
    for i, (cell, kind) in enumerate(zip(data.fit.names, data.fit.kinds)):
        lo, hi = _cost_ci(data.fit, i, st.boot)
        lines.append(f"| {cell} | {kind} | {cost[i]:+.4f} [{lo:+.4f}, {hi:+.4f}] | "
                     + " | ".join(_g(S[n][i]) for n in names) + " |")
    lines += ["", "| candidate | slope b [95%] | in-sample RMSE | leave-one-kind-out RMSE [95%] | "
                  f"{st.reference}'s LOKO RMSE minus its [95%, paired] |", "|---|---|---:|---|---|"]
    for n in names:
        f = fits[n]
        gain = "-" if n == st.reference else f"{f['gain']:+.4f} [{f['gain_ci'][0]:+.4f}, {f['gain_ci'][1]:+.4f}]"
        lines.append(f"| {n} | {_g(f['b'])} [{_g(f['b_ci'][0])}, {_g(f['b_ci'][1])}] | {f['rmse_in']:.4f} | "
                     f"{f['loko']:.4f} [{f['loko_ci'][0]:.4f}, {f['loko_ci'][1]:.4f}] | {gain} |")
    return "\n".join(lines)


def _cost_ci(cells: Cells, i: int, boot: int, seed: int = 3) -> tuple[float, float]:
    from timlab.experiments.studies.stats import bootstrap_diff_ci

    return bootstrap_diff_ci(np.asarray(cells.control[i]), np.asarray(cells.arm[i]), n=boot, seed=seed)


def test_text(st: HeldoutStudy, data: HeldoutData, fits: dict) -> tuple[str, dict | None, tuple]:
    """The test block's text after the runs: the signal condition, the predictions and the decision."""
    held = data.held
    names = [c.name for c in st.candidates]
    var = cost_variances(held, boot=st.boot)
    costs = cell_point(held, names[0])[1]
    q, df, p = cochran_q(costs, var)
    signal = (q, df, p)
    preds = {n: [(S, *prediction(fits[n]["b"], fits[n]["b_var"], fits[n]["loko"], S))
                 for S in cell_point(held, n)[0]] for n in names}
    lines = [f"**Signal condition**: Cochran's Q over the {len(costs)} held-out cells' costs = {q:.1f} on {df} df, "
             f"p = {p:.2g}: " + ("**the held-out costs differ** (p < " if p < st.alpha else
                                 "**the held-out costs are not shown to differ** (p >= ") + f"{st.alpha:g}).", "",
             "**Held-out predictions** (b S +- 1.96 sqrt(S^2 var(b) + e^2), b and var(b) from the fit above, e the "
             "candidate's leave-one-kind-out error)", "",
             "| cell | kind | " + " | ".join(f"{n}: predicted [95%]" for n in names) + " |",
             "|---|---|" + "---|" * len(names)]
    for i, (cell, kind) in enumerate(zip(held.names, held.kinds)):
        lines.append(f"| {cell} | {kind} | " + " | ".join(
            f"{preds[n][i][1]:+.4f} [{preds[n][i][2]:+.4f}, {preds[n][i][3]:+.4f}]" for n in names) + " |")
    cells = OosCells(list(held.names), list(held.kinds), [], list(held.control_key), list(held.control), list(held.arm))
    dec = decide(cells, preds, st.reference, boot=st.boot)
    regime = (f"{st.regime}; held-out answers of {min(held.lengths):.0f}-{max(held.lengths):.0f} tokens "
              f"({len(held.names)} cells of {len(set(held.kinds))} kinds)")
    verdict = None
    if p >= st.alpha:
        verdict = (f"Verdict: **no verdict: the held-out cells' costs do not differ** (Cochran's Q p = {p:.2g} >= "
                   f"{st.alpha:g}); the errors above decide nothing. Regime: {regime}.")
        dec = {**dec, "no_verdict": True}
    return "\n".join(lines) + "\n\n" + results_text(cells, preds, dec, regime, verdict=verdict), dec, signal


def analyze_heldout(st: HeldoutStudy, root: str | Path = ".") -> HeldoutResult:
    """The registered analysis (module docstring); INCOMPLETE or VOID until the runs study is complete
    and valid."""
    check_frozen(st)
    head = "\n".join(registration_lines(st))
    status, runs_text, data = collect(st, root)
    if data is None:
        line = f"{head}\n\nRuns ({shown(_runs_study(st).source)}): {runs_text}"
        return HeldoutResult(status, line, f"{head}\n\n{status.upper()}: the test waits for every run of the sweep "
                                               "and for the fit.")
    names = [c.name for c in st.candidates]
    fits = fit_all(data.fit, names, st.reference, boot=st.boot)
    test, dec, signal = test_text(st, data, fits)
    fit = f"{head}\n\nRuns ({shown(_runs_study(st).source)}), their own analysis:\n\n{runs_text.strip()}\n\n" \
          f"{fit_text(st, data, fits)}"
    return HeldoutResult("complete", fit, f"{head}\n\n{test}", fits, dec, signal, data)


def calibration_record(st: HeldoutStudy, res: HeldoutResult, params: int | None) -> dict | None:
    """The record ``timlab check`` and ``timlab analyze`` read: ``predictor.calibration_record`` of the fit
    cells (``params``: the policy's parameter count) and the held-out decision, labelled with the study;
    None when the analysis is not complete or the signal condition did not hold (then nothing ships)."""
    from timlab.experiments.studies.predictor import calibration_record as record

    if res.status != "complete" or res.decision is None or res.decision.get("no_verdict"):
        return None
    cells = dataclasses.replace(res.data.fit, params=[params] * len(res.data.fit.names))
    return {**record(st, res.fits, cells, res.decision),
            "label": "Study H2" if st.name == "harm2" else f"study {st.name}"}


def policy_params(st: HeldoutStudy, root: str | Path = ".") -> int | None:
    """The parameter count of the runs' policy, from the first run's config (its architecture); None
    where that run has no config.yaml."""
    from timlab.experiments.studies.blocks import block_dirs
    from timlab.experiments.studies.engine import planned_runs
    from timlab.experiments.studies.evidence import config_params, run_config

    rs = _runs_study(st)
    p = planned_runs(rs)[0]
    run = block_dirs(rs, None, root)[p.block] / p.run_id
    return config_params(run_config(run)) if (run / "config.yaml").is_file() else None


def blocks(st: HeldoutStudy, res: HeldoutResult | None = None) -> dict[str, str]:
    """{fit block: its text, test block: its text} (the study file's ``findings``)."""
    if st.findings is None:
        return {}
    res = res or analyze_heldout(st)
    return {st.findings[1]: res.fit_text, st.findings[2]: res.test_text}
