"""Predictor studies: which per-step statistic of a mismatch predicts the accuracy it costs, across kinds.

Used by ``timlab study check|recompute|analyze`` for a study file with ``kind: predictor``
(docs/studies.md, "Predictor studies"; Study H in docs/FINDINGS.md is one). Where the ordinary
study file (``registration``) holds one sweep and compares its arms, a predictor study holds no
sweep of its own: its cells are (study, group, arm) cells of *other* studies' committed sweeps,
each with its kind of mismatch. Per cell:

- the **cost**: the mean over the control's seeds minus the mean over the arm's seeds of each run's
  mean ``cost.metric`` over ``cost.window`` (read from the committed runs, all their seeds);
- each **candidate's value**: the mean over the re-run seeds of each run's mean of the candidate's
  metric over ``window``, read from the recompute table (``timlab.experiments.studies.recompute``,
  which re-runs the start of each committed run because the committed runs predate the
  candidates); signed candidates (``absolute: true``) enter as the absolute value of that mean.

Per candidate S: cost_c = b x S_c, one slope through the origin (every candidate and every cost is
0 at zero mismatch), weighted least squares with weights 1 / (the cell's bootstrap variance of its
cost), solved in plain Python floats (``math.fsum``), so a published slope is the same on every
machine. The **leave-one-kind-out error**: for each kind, fit on the other kinds' cells, predict
the kind's cells; the root mean square of (observed - predicted) over all cells. Intervals come
from ``boot`` joint resamples (each cell's arm seeds, each group's control seeds and each cell's
re-run seeds resampled, the fits redone), the same resamples for every candidate, so the difference
of two candidates' errors is paired. Departures from a textbook WLS: the weights stay those of the
point estimate in every resample (a resample's own variances would need a nested bootstrap), and a
cell's variance is floored at ``VAR_FLOOR`` so that one cell of identical seeds cannot take the fit.

The out-of-sample part (the file ``oos`` names: predictions before its runs, the decision after)
is ``timlab.experiments.studies.oos``, which also runs the whole analysis (``oos.analyze_study``) and
writes the blocks (``oos.analyze_and_write``); this module does not import it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from timlab.experiments.studies.registration import StudyError, refuse_markers, registration_hash
from timlab.experiments.studies.text import ci_text

VAR_FLOOR = 1e-8
"""Smallest cost variance a cell's weight is computed from (accuracy^2; a standard error of 1e-4)."""

N_BOOT = 2000
"""Resamples for every interval unless the study file says otherwise."""

KINDS_HELP = "a kind name such as head, stale, numerical"

LENGTH_METRIC = "train/response_length_mean"
"""A cell's answer length: its runs' mean of this metric over ``window`` (the calibrated lengths)."""


@dataclass(frozen=True)
class Candidate:
    """One candidate statistic."""

    name: str
    """How tables name it, e.g. ``k3``."""
    metric: str
    """The logged metric it is read from, e.g. ``rollout_corr/k3_kl`` (docs/metrics.md)."""
    absolute: bool = False
    """Signed statistics enter as the absolute value of the cell's mean."""
    times: str = ""
    """Another logged metric: the candidate is then, at each step, ``metric`` times the positive part of
    this one (held-out studies; e.g. k3 x persistence)."""


@dataclass(frozen=True)
class Source:
    """The cells one committed study contributes."""

    name: str
    """The study's short name, e.g. ``E1``."""
    sweep: str
    """Its committed sweep directory (relative to the working directory, like ``out``)."""
    pattern: str
    """A regular expression every run's condition matches in full, with groups ``arm`` and ``seed``
    and optionally ``group`` (each group is compared with its own control)."""
    control: str
    """The zero-mismatch arm of each group."""
    cells: dict
    """Arm -> kind, for the arms that are cells of the fit."""
    beside: dict
    """Arm -> kind, for the arms reported beside the fit, not in it."""


@dataclass(frozen=True)
class Start:
    """A learned start the re-runs need, and how to rebuild it."""

    path: str
    """The model folder the runs' ``model.path`` names, relative to the working directory."""
    sha256: str
    """SHA-256 of its model.safetensors, as its study registered it."""
    build: tuple
    """timlab command lines (without ``timlab`` and ``--isa``) that rebuild it, run in order."""
    cost: float
    """Its registered rebuild cost in CPU-s (for the budget line)."""


@dataclass(frozen=True)
class PredictorStudy:
    """A predictor study file, validated."""

    name: str
    """The study's name."""
    isa: str
    """The instruction-set pin the committed runs were made under (``avx2``); the re-runs need it."""
    last_step: int
    """Re-runs run steps 0 to this step."""
    seeds: tuple
    """The seeds of each cell (and of nothing else) that are re-run."""
    window: tuple
    """[first, last] training step over which a candidate's per-run mean is taken."""
    cost_metric: str
    """The metric the cost is measured on (``val/accuracy``)."""
    cost_window: tuple
    """[first, last] evaluation steps of the cost window."""
    candidates: tuple
    """The candidate statistics, in table order."""
    reference: str
    """The candidate every other is compared with (``k3``)."""
    sources: tuple
    """The studies whose cells are fitted."""
    starts: tuple
    """The starts the re-runs need."""
    table: str
    """The recompute table (relative to the working directory)."""
    boot: int
    """Resamples per interval."""
    findings: tuple | None
    """(file, in-sample block, out-of-sample block), or None."""
    calibration: str
    """Where the analysis writes its calibration record ("" for nowhere)."""
    regime: str
    """The regime the fit is calibrated in, as the shipped prediction states it."""
    hash: str
    """The registration hash."""
    oos: str
    """The out-of-sample study file (a sweep with ``predicted_by``), or "" (not part of the hash: its
    doses come from a probe run after the freeze, and it freezes itself at its first run)."""
    frozen: str
    """The hash the file says was frozen ("" when not yet frozen)."""


def _keys(d: Any, allowed: tuple, required: tuple, where: str) -> dict:
    if not isinstance(d, dict):
        raise StudyError(f"{where}: expected a mapping, got {type(d).__name__}")
    unknown = sorted(set(d) - set(allowed))
    if unknown:
        raise StudyError(f"{where}: unknown key {unknown[0]!r} (valid: {', '.join(allowed)})")
    missing = [k for k in required if k not in d]
    if missing:
        raise StudyError(f"{where}: missing {missing[0]!r}")
    return d


def _window(v: Any, where: str) -> tuple[int, int]:
    if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and x >= 0 for x in v) and v[0] <= v[1]):
        raise StudyError(f"{where}: expected [first step, last step], two integers >= 0, first <= last; got {v!r}")
    return int(v[0]), int(v[1])


def _kinds(v: Any, where: str) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(x, str) and x for k, x in v.items()):
        raise StudyError(f"{where}: expected a mapping arm -> kind ({KINDS_HELP}); got {v!r}")
    return dict(v)


TOP = ("study", "kind", "isa", "rerun", "window", "cost", "candidates", "reference", "sources", "starts", "table",
       "boot", "findings", "calibration", "regime", "frozen", "notes", "oos")
UNHASHED = ("frozen", "notes", "oos")
"""Left out of the hash: the freeze itself, prose, and the out-of-sample file (``PredictorStudy.oos``)."""


def predictor_from_dict(d: Any, *, root: str | Path = ".", source: str = "<dict>") -> PredictorStudy:
    """Validate a predictor study file's mapping (one-line ``StudyError`` naming the field)."""
    d = _keys(d, TOP, ("study", "kind", "isa", "rerun", "window", "cost", "candidates", "reference", "sources",
                       "table"), source)
    refuse_markers(d, source)
    if d["kind"] != "predictor":
        raise StudyError(f"{source}: kind: {d['kind']!r} is not a predictor study (valid: predictor)")
    if d["isa"] not in ("avx2", "native"):
        raise StudyError(f"{source}: isa: {d['isa']!r} (valid: avx2, native)")
    rr = _keys(d["rerun"], ("last_step", "seeds"), ("last_step", "seeds"), f"{source}: rerun")
    if not isinstance(rr["last_step"], int) or rr["last_step"] < 1:
        raise StudyError(f"{source}: rerun.last_step: expected an integer >= 1, got {rr['last_step']!r}")
    if not (isinstance(rr["seeds"], list) and rr["seeds"] and all(isinstance(s, int) and s >= 0 for s in rr["seeds"])):
        raise StudyError(f"{source}: rerun.seeds: expected a non-empty list of seeds, got {rr['seeds']!r}")
    window = _window(d["window"], f"{source}: window")
    if window[1] > rr["last_step"]:
        raise StudyError(f"{source}: window ends at step {window[1]}, after rerun.last_step {rr['last_step']}")
    cost = _keys(d["cost"], ("metric", "window"), ("metric", "window"), f"{source}: cost")
    cands = []
    for i, c in enumerate(d["candidates"] or []):
        c = _keys(c, ("name", "metric", "absolute"), ("name", "metric"), f"{source}: candidates[{i}]")
        cands.append(Candidate(str(c["name"]), str(c["metric"]), bool(c.get("absolute", False))))
    names = [c.name for c in cands]
    if len(set(names)) != len(names) or not names:
        raise StudyError(f"{source}: candidates: names must be unique and at least one; got {names}")
    if d["reference"] not in names:
        raise StudyError(f"{source}: reference: {d['reference']!r} is not a candidate (valid: {', '.join(names)})")
    starts = []
    for i, s in enumerate(d.get("starts") or []):
        s = _keys(s, ("path", "sha256", "build", "cost"), ("path", "sha256", "build"), f"{source}: starts[{i}]")
        if not re.fullmatch(r"[0-9a-f]{64}", str(s["sha256"])):
            raise StudyError(f"{source}: starts[{i}].sha256: expected 64 hex digits, got {s['sha256']!r}")
        starts.append(Start(str(s["path"]), str(s["sha256"]), tuple(str(x) for x in s["build"] or []),
                            float(s.get("cost", 0.0))))
    sources = []
    for i, s in enumerate(d["sources"] or []):
        w = f"{source}: sources[{i}]"
        s = _keys(s, ("name", "sweep", "pattern", "control", "cells", "beside"),
                  ("name", "sweep", "pattern", "cells"), w)
        try:
            rx = re.compile(str(s["pattern"]))
        except re.error as e:
            raise StudyError(f"{w}.pattern: not a regular expression ({e})") from None
        if not {"arm", "seed"} <= set(rx.groupindex):
            raise StudyError(f"{w}.pattern: needs the named groups arm and seed, got {sorted(rx.groupindex)}")
        sources.append(Source(str(s["name"]), str(s["sweep"]), str(s["pattern"]), str(s.get("control", "control")),
                              _kinds(s["cells"], f"{w}.cells"), _kinds(s.get("beside"), f"{w}.beside")))
    kinds = {k for s in sources for k in s.cells.values()}
    if len(kinds) < 2:
        raise StudyError(f"{source}: sources: the cells span {len(kinds)} kind(s); leaving one kind out needs >= 2")
    findings = None
    if d.get("findings") is not None:
        f = _keys(d["findings"], ("file", "insample", "oos"), ("file", "insample", "oos"), f"{source}: findings")
        findings = (str(Path(root) / f["file"]), str(f["insample"]), str(f["oos"]))
    boot = d.get("boot", N_BOOT)
    if not isinstance(boot, int) or boot < 10:
        raise StudyError(f"{source}: boot: expected an integer >= 10, got {boot!r}")
    registration = {k: v for k, v in d.items() if k not in UNHASHED}
    return PredictorStudy(
        name=str(d["study"]), isa=str(d["isa"]), last_step=int(rr["last_step"]), seeds=tuple(rr["seeds"]),
        window=window, cost_metric=str(cost["metric"]), cost_window=_window(cost["window"], f"{source}: cost.window"),
        candidates=tuple(cands), reference=str(d["reference"]), sources=tuple(sources), starts=tuple(starts),
        table=str(d["table"]), boot=boot, findings=findings,
        calibration=str(d.get("calibration", "")), regime=str(d.get("regime", "")),
        hash=registration_hash(registration), frozen=str(d.get("frozen", "")),
        oos=str(Path(root) / d["oos"]) if d.get("oos") else "")


def is_predictor(d: Any) -> bool:
    """True for a study file's mapping that declares ``kind: predictor``."""
    return isinstance(d, dict) and d.get("kind") == "predictor"


def check_frozen(st, kind: str = "predictor study") -> None:
    """A frozen registration (``st``: a predictor or held-out study) must still have its hash (no amendment
    mechanism: change means a new study)."""
    if st.frozen and st.frozen != st.hash:
        raise StudyError(f"study {st.name}: the registration changed after it was frozen (frozen {st.frozen[:12]}, "
                         f"now {st.hash[:12]}); a frozen {kind} is not edited")


# ------------------------------------------------------------------------------ its runs
@dataclass(frozen=True)
class SourceRun:
    """One committed run of a source study."""

    source: str
    run: str
    """The run directory's name (``<condition>__<hash>``)."""
    path: Path
    group: str
    arm: str
    seed: int


def source_runs(st: PredictorStudy, src: Source) -> list[SourceRun]:
    """Every committed run of ``src`` whose arm is a cell, beside the fit, or the control."""
    rx = re.compile(src.pattern)
    root = Path(src.sweep)
    if not root.is_dir():
        raise StudyError(f"sources {src.name}: sweep {root} not found")
    out = []
    for p in sorted(root.iterdir()):
        if not p.is_dir() or not ((p / "config.yaml").exists() or (p / "metrics.parquet").exists()):
            continue
        m = rx.fullmatch(p.name.split("__")[0])
        if m is None:
            raise StudyError(f"sources {src.name}: run {p.name} does not match pattern {src.pattern!r}")
        arm = m.group("arm")
        if arm in src.cells or arm in src.beside or arm == src.control:
            g = m.groupdict().get("group") or ""
            out.append(SourceRun(src.name, p.name, p, g, arm, int(m.group("seed"))))
    return out


def rerun_list(st: PredictorStudy) -> list[SourceRun]:
    """The runs the recompute re-runs: each cell's (and beside-cell's) registered seeds; controls
    are not re-run (their guard held every candidate at exactly 0 at every step)."""
    return [r for src in st.sources for r in source_runs(st, src)
            if r.arm != src.control and r.seed in st.seeds]


@dataclass(frozen=True)
class SourceCell:
    """One (group, arm) cell of a source study, with the runs its cost is read from."""

    name: str
    """``source/group/arm`` (``source/arm`` in an ungrouped sweep)."""
    kind: str
    """Its kind as the study file names it (``head``, ``stale``, ...)."""
    group: str
    """Its group ("" in an ungrouped sweep): its control is that group's."""
    control: list
    """The group's control runs (``SourceRun``), shared by the group's cells."""
    arm: list
    """The cell's runs, every committed seed."""
    fitted: bool
    """In the fit (``Source.cells``), or reported beside it (``Source.beside``)."""


def source_cells(src: Source, runs: list[SourceRun]) -> list[SourceCell]:
    """The cells of ``src`` (then the arms beside the fit) in each group, in the order the fit takes them;
    ``runs``: ``source_runs`` of ``src``. The cost of a cell is its control's mean minus its own."""
    out = []
    for g in dict.fromkeys(r.group for r in runs):
        ctrl = [r for r in runs if r.group == g and r.arm == src.control]
        for arm, kind in [*src.cells.items(), *src.beside.items()]:
            mine = [r for r in runs if r.group == g and r.arm == arm]
            if mine:
                out.append(SourceCell("/".join(x for x in (src.name, g, arm) if x), kind, g, ctrl, mine, arm in src.cells))
    return out


# ------------------------------------------------------------------------------ the fits (pure)
def fit_origin(S, c, w) -> float:
    """Weighted least squares through the origin: b = sum w S c / sum w S^2 (plain floats)."""
    num = math.fsum(float(wi) * float(si) * float(ci) for si, ci, wi in zip(S, c, w))
    den = math.fsum(float(wi) * float(si) ** 2 for si, wi in zip(S, w))
    return num / den if den > 0 else float("nan")


def loko_rmse(S, c, w, kinds) -> float:
    """Leave-one-kind-out prediction error: for each kind, the slope fitted on the other kinds'
    cells predicts its cells; the root mean square of observed - predicted over all cells."""
    S, c, w, kinds = list(S), list(c), list(w), list(kinds)
    sq = []
    for k in dict.fromkeys(kinds):
        idx = [i for i, x in enumerate(kinds) if x != k]
        b = fit_origin([S[i] for i in idx], [c[i] for i in idx], [w[i] for i in idx])
        sq += [(c[i] - b * S[i]) ** 2 for i, x in enumerate(kinds) if x == k]
    return math.sqrt(math.fsum(sq) / len(sq)) if sq else float("nan")


def rmse_in(S, c, w) -> float:
    """In-sample root mean square error of the one-slope fit."""
    b = fit_origin(S, c, w)
    return math.sqrt(math.fsum((ci - b * si) ** 2 for si, ci in zip(S, c)) / len(c))


def prediction(b: float, b_var: float, rmse: float, S: float) -> tuple[float, float, float]:
    """(predicted cost, 95% interval) of a new cell at statistic S: b S +- 1.96 sqrt(S^2 var(b) + rmse^2),
    the slope's own uncertainty and the leave-one-kind-out error of a kind the fit has not seen."""
    half = 1.96 * math.sqrt(S * S * b_var + rmse * rmse)
    return b * S, b * S - half, b * S + half


@dataclass
class Cells:
    """The fit's input: per cell its kind, per-seed costs and per-seed candidate values."""

    names: list
    """``source/group/arm`` per cell."""
    kinds: list
    control: list
    """Per cell: the per-seed cost-window means of its group's control (one array shared by the group's cells)."""
    control_key: list
    """Per cell: the key of its control, so a resample draws each control once for all its cells."""
    arm: list
    """Per cell: the per-seed cost-window means of the arm."""
    values: list
    """Per cell: {candidate: per-re-run-seed window means}."""
    absolute: dict
    """Candidate -> whether it enters as an absolute value."""
    lengths: list = dataclasses.field(default_factory=list)
    """Per cell: its arm runs' mean answer length (``LENGTH_METRIC``) over the candidates' window."""
    params: list = dataclasses.field(default_factory=list)
    """Per cell: its policy's parameter count (from its start's weights; None where the start is absent)."""
    paired: bool = False
    """True when a cell's candidate values come from the same runs as its cost (one value per arm
    seed, in the same order): a resample then draws the arm's seeds once for both."""


def cell_point(cells: Cells, cand: str) -> tuple[np.ndarray, np.ndarray]:
    """(S, cost) per cell at the point estimate."""
    S = np.array([_value(v[cand], cells.absolute[cand]) for v in cells.values])
    cost = np.array([np.mean(c) - np.mean(a) for c, a in zip(cells.control, cells.arm)])
    return S, cost


def _value(x, absolute: bool) -> float:
    m = float(np.mean(x))
    return abs(m) if absolute else m


def cost_variances(cells: Cells, *, boot: int, seed: int = 0) -> np.ndarray:
    """Each cell's bootstrap variance of its cost (control and arm seeds resampled on their own)."""
    rng = np.random.default_rng(seed)
    out = []
    for c, a in zip(cells.control, cells.arm):
        bc = np.asarray(c)[rng.integers(0, len(c), (boot, len(c)))].mean(axis=1)
        ba = np.asarray(a)[rng.integers(0, len(a), (boot, len(a)))].mean(axis=1)
        out.append(max(float(np.var(bc - ba)), VAR_FLOOR))
    return np.array(out)


def fit_all(cells: Cells, candidates: list[str], reference: str, *, boot: int, seed: int = 1) -> dict:
    """Per candidate: the slope b, its bootstrap interval and variance, the in-sample RMSE, the
    leave-one-kind-out RMSE with its interval, and the paired difference (reference's LOKO RMSE
    minus the candidate's) with its interval. Every interval from the same ``boot`` joint resamples."""
    w = 1.0 / cost_variances(cells, boot=boot)
    point = {k: cell_point(cells, k) for k in candidates}
    res = {k: {"b": fit_origin(S, c, w), "rmse_in": rmse_in(S, c, w), "loko": loko_rmse(S, c, w, cells.kinds)}
           for k, (S, c) in point.items()}
    rng = np.random.default_rng(seed)
    reps = {k: {"b": [], "loko": []} for k in candidates}
    n = len(cells.names)
    for _ in range(boot):
        ctrl = {}
        cost, S = np.empty(n), {k: np.empty(n) for k in candidates}
        for i in range(n):
            key = cells.control_key[i]
            if key not in ctrl:
                c = np.asarray(cells.control[i])
                ctrl[key] = float(c[rng.integers(0, len(c), len(c))].mean())
            a = np.asarray(cells.arm[i])
            arm_pick = rng.integers(0, len(a), len(a))
            cost[i] = ctrl[key] - float(a[arm_pick].mean())
            v0 = next(iter(cells.values[i].values()))
            # the same re-run seeds for every candidate; the arm's own seeds where the values are theirs
            pick = arm_pick if cells.paired else rng.integers(0, len(v0), len(v0))
            for k in candidates:
                S[k][i] = _value(np.asarray(cells.values[i][k])[pick], cells.absolute[k])
        for k in candidates:
            reps[k]["b"].append(fit_origin(S[k], cost, w))
            reps[k]["loko"].append(loko_rmse(S[k], cost, w, cells.kinds))
    ref = np.array(reps[reference]["loko"])
    for k in candidates:
        b, lk = np.array(reps[k]["b"]), np.array(reps[k]["loko"])
        res[k]["b_ci"] = _pct(b)
        res[k]["b_var"] = float(np.var(b))
        res[k]["loko_ci"] = _pct(lk)
        res[k]["gain"] = res[reference]["loko"] - res[k]["loko"]
        res[k]["gain_ci"] = _pct(ref - lk)
    return res


def _pct(x) -> tuple[float, float]:
    x = np.asarray(x, dtype=float)
    x = x[np.isfinite(x)]
    return (float(np.percentile(x, 2.5)), float(np.percentile(x, 97.5))) if len(x) else (float("nan"),) * 2


def power_alpha(S: np.ndarray, cost: np.ndarray) -> tuple[float, int]:
    """Descriptive power fit log(cost) = a + alpha log S over the cells with cost > 0 and S > 0:
    (alpha, cells), NaN with fewer than 3 cells."""
    from timlab.experiments.studies.stats import line_fit

    keep = (cost > 0) & (S > 0)
    if keep.sum() < 3:
        return float("nan"), int(keep.sum())
    slope, _ = line_fit(np.log(S[keep]), np.log(cost[keep]))
    return float(slope), int(keep.sum())


# ------------------------------------------------------------------------------ the analysis
def _window_mean(m: pd.DataFrame, metric: str, window: tuple[int, int]) -> float:
    if metric not in m.columns:
        return float("nan")
    v = m[(m["step"] >= window[0]) & (m["step"] <= window[1])][metric].dropna()
    return float(v.mean()) if len(v) else float("nan")


@dataclass
class PredictorResult:
    """What ``analyze_predictor`` found."""

    status: str
    """``complete``, ``incomplete`` or ``void``."""
    insample: str
    """The harm-insample block's text."""
    fits: dict = dataclasses.field(default_factory=dict)
    """Per candidate: the fit's numbers (``fit_all``)."""
    cells: Cells | None = None
    left_out: list = dataclasses.field(default_factory=list)
    """Cells left out because a re-run did not repeat its committed run."""
    oos: str = ""
    """The harm-oos block's text (``timlab.experiments.studies.oos.oos_block``)."""
    decision: dict | None = None
    """The out-of-sample decision, once its runs are complete (``oos.decide``)."""


def incomplete_line(st: PredictorStudy, done: set[str], planned: list[SourceRun]) -> str:
    missing = [r for r in planned if r.run not in done]
    by = {}
    for r in missing:
        by.setdefault(r.source, 0)
        by[r.source] += 1
    what = ", ".join(f"{s} {n}" for s, n in by.items())
    return (f"INCOMPLETE: {len(planned) - len(missing)} of {len(planned)} re-runs are in {st.table} (missing: {what}); "
            "no candidate value is read before the recompute is complete (the registration is blind).")


def read_table(path: str | Path) -> pd.DataFrame | None:
    p = Path(path)
    return pd.read_parquet(p) if p.exists() else None


def analyze_predictor(st: PredictorStudy) -> PredictorResult:
    """The registered in-sample analysis, refused (INCOMPLETE) until every re-run is in the table.
    The out-of-sample block is ``timlab.experiments.studies.oos``'s (``analyze_study`` runs both)."""
    from timlab.rundir import read_metrics

    check_frozen(st)
    planned = rerun_list(st)
    table = read_table(st.table)
    done = set() if table is None else set(table["run"])
    if any(r.run not in done for r in planned):
        return PredictorResult("incomplete", incomplete_line(st, done, planned), oos=INCOMPLETE_OOS)
    repeat = table.groupby("run")["repeat"].first()
    bad = {r.run for r in planned if repeat[r.run] != "ok"}
    cells = Cells([], [], [], [], [], [], {c.name: c.absolute for c in st.candidates})
    beside, left_out = [], []
    for src in st.sources:
        runs = source_runs(st, src)
        ms = {r.run: read_metrics(r.path) for r in runs}
        acc = {r.run: _window_mean(ms[r.run], st.cost_metric, st.cost_window) for r in runs}
        controls = {}  # one array per group, shared by its cells (a resample draws it once)
        for sc in source_cells(src, runs):
            ctrl = controls.setdefault(sc.group, np.array([acc[r.run] for r in sc.control]))
            mine = sc.arm
            reruns = [r for r in mine if r.seed in st.seeds]
            if any(r.run in bad for r in reruns):
                left_out.append(f"{sc.name} ({', '.join(r.run for r in reruns if r.run in bad)} did not repeat)")
                continue
            vals = {}
            for c in st.candidates:
                vals[c.name] = np.array([_window_mean(table[table["run"] == r.run], c.metric, st.window)
                                         for r in reruns])
            entry = (sc.name, sc.kind, ctrl, f"{src.name}/{sc.group}", np.array([acc[r.run] for r in mine]), vals)
            if sc.fitted:
                cells_add(cells, entry)
                cells.lengths.append(float(np.mean([_window_mean(ms[r.run], LENGTH_METRIC, st.window) for r in mine])))
                cells.params.append(start_params(mine[0].path))
            else:
                beside.append(entry)
    if len(set(cells.kinds)) < 2:
        raise StudyError(f"study {st.name}: the cells that repeat span {len(set(cells.kinds))} kind(s); leaving one "
                         "kind out needs >= 2 (left out: " + "; ".join(left_out) + ")")
    names = [c.name for c in st.candidates]
    fits = fit_all(cells, names, st.reference, boot=st.boot)
    text = insample_text(st, cells, fits, beside, left_out)
    return PredictorResult("complete", text, fits, cells, left_out)


def start_params(run: Path) -> int | None:
    """The parameter count of the start a committed run names (its config's ``model.path``), read
    from the safetensors header of its weights; None when the run's config or the start is not on
    this machine."""
    import struct

    from timlab.yaml_io import load_yaml

    if not (run / "config.yaml").is_file():
        return None
    cfg = load_yaml((run / "config.yaml").read_text(encoding="utf-8"), str(run / "config.yaml"), StudyError)
    weights = Path(str((cfg.get("model") or {}).get("path") or "")) / "model.safetensors"
    if not weights.is_file():
        return None
    with open(weights, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return int(sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__"))


def cells_add(cells: Cells, entry) -> None:
    name, kind, ctrl, key, arm, vals = entry
    cells.names.append(name)
    cells.kinds.append(kind)
    cells.control.append(ctrl)
    cells.control_key.append(key)
    cells.arm.append(arm)
    cells.values.append(vals)


def _g(x: float) -> str:
    return "nan" if not math.isfinite(x) else f"{x:.3g}"


def insample_text(st: PredictorStudy, cells: Cells, fits: dict, beside: list, left_out: list) -> str:
    """The harm-insample block: one row per candidate (its fits, errors and descriptive power-fit exponent)."""
    kinds = list(dict.fromkeys(cells.kinds))
    lines = [f"**In sample** ({len(cells.names)} cells of {len(kinds)} kinds: "
             + ", ".join(f"{k} {cells.kinds.count(k)}" for k in kinds)
             + f"; cost = control - arm, mean {st.cost_metric} over steps {st.cost_window[0]}-{st.cost_window[1]}; "
             f"each candidate's mean over steps {st.window[0]}-{st.window[1]} of re-runs of seeds "
             f"{', '.join(map(str, st.seeds))}; {st.boot} joint resamples)", "",
             "| candidate | slope b [95%] | in-sample RMSE | leave-one-kind-out RMSE [95%] "
             f"| {st.reference}'s LOKO RMSE minus its [95%, paired] | power-fit exponent (cells) |",
             "|---|---|---:|---|---|---|"]
    for c in st.candidates:
        f = fits[c.name]
        S, cost = cell_point(cells, c.name)
        alpha, n = power_alpha(S, cost)
        gain = "-" if c.name == st.reference else f"{f['gain']:+.4f} {ci_text(f['gain_ci'])}"
        lines.append(f"| {c.name} (`{c.metric}`{', abs' if c.absolute else ''}) | {_g(f['b'])} {_ci_g(f['b_ci'])} "
                     f"| {f['rmse_in']:.4f} | {f['loko']:.4f} {ci_text(f['loko_ci'])} | {gain} | {_g(alpha)} ({n}) |")
    best = min(st.candidates, key=lambda c: fits[c.name]["loko"]).name
    beats = [c.name for c in st.candidates if c.name != st.reference and fits[c.name]["gain_ci"][0] > 0]
    lines += ["", f"Smallest leave-one-kind-out error in sample: **{best}**. In sample, "
              + (f"**{', '.join(beats)}** predict(s) better than {st.reference} (paired interval above 0)" if beats
                 else f"no candidate's paired interval lies above 0: **none beats {st.reference} in sample**")
              + ". This is not the verdict: the registered verdict is out of sample (harm-oos)."]
    if beside:
        lines += ["", "Beside the fit (not in it): " + "; ".join(
            f"{name} ({kind}) cost {np.mean(ctrl) - np.mean(arm):+.4f}" for name, kind, ctrl, _, arm, _ in beside)]
    if left_out:
        lines += ["", "Left out (a re-run did not repeat its committed run bit for bit): " + "; ".join(left_out)]
    return "\n".join(lines)


def _ci_g(ci) -> str:
    return f"[{_g(ci[0])}, {_g(ci[1])}]"


def calibration_record(st: PredictorStudy, fits: dict, cells: Cells, decision: dict | None = None) -> dict:
    """The record ``timlab check`` and ``timlab analyze`` read: each candidate's slope, its variance and
    its leave-one-kind-out RMSE, the regime, the range of each candidate's values, of the answer
    lengths and of the policies' parameter counts in the fit; the winner only once the out-of-sample
    ``decision`` exists (``oos.decide``), with its error, whether it beats the reference and whether
    it is miscalibrated."""
    rec = {"study": st.name, "hash": st.hash, "regime": st.regime, "reference": st.reference, "winner": None,
           "candidates": {}}
    lengths = [x for x in cells.lengths if math.isfinite(x)]
    rec["lengths"] = [min(lengths), max(lengths)] if lengths else None
    known = [p for p in cells.params if p]
    rec["params"] = [min(known), max(known)] if known else None
    for c in st.candidates:
        S, _ = cell_point(cells, c.name)
        f = fits[c.name]
        rec["candidates"][c.name] = {"metric": c.metric, "absolute": c.absolute, "b": f["b"], "b_var": f["b_var"],
                                     "loko": f["loko"], "range": [float(np.min(S)), float(np.max(S))]}
    if decision is not None:
        w = decision["winner"]
        d = decision["per"][w]
        rec["winner"] = w
        rec["oos"] = {"rmse": d["rmse"], "rmse_ci": list(d["rmse_ci"]), "beats_reference": w in decision["beats"],
                      "miscalibrated": bool(d["miscalibrated"]), "covered": int(d["covered"]), "cells": decision["cells"]}
    return rec


def write_calibration(path: str | Path, rec: dict) -> Path:
    from timlab.files import atomic_write_text

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(p, json.dumps(rec, indent=1, sort_keys=True) + "\n")
    return p


def load_predictor(path: str | Path) -> PredictorStudy | None:
    """The predictor study in the study file ``path``, or None when the file is an ordinary study file."""
    from timlab.experiments.studies.registration import study_mapping

    p, d = study_mapping(path)
    return predictor_from_dict(d, root=p.parent, source=str(p)) if is_predictor(d) else None


INCOMPLETE_OOS = ("INCOMPLETE: the in-sample fits (part a) do not exist yet; no out-of-sample prediction is written "
                  "before them, and no out-of-sample run starts before its prediction.")
"""The oos block until the in-sample analysis is complete."""
