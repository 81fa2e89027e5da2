"""Tables of Study E3, length at fixed difficulty (docs/FINDINGS.md, "Study E3"), from its sweeps.

    python scripts/e3_tables.py starts sweeps/e3_starts
    python scripts/e3_tables.py followup sweeps/e3_starts_rl
    python scripts/e3_tables.py study sweeps/e3                # the pre-registered analysis
    python scripts/e3_tables.py figure sweeps/e3 --out docs/img/e3_length.png
    python scripts/e3_tables.py predict sweeps/e3c             # E3c: E3b's fit tested at a new length

``starts``: the calibration of E3's learned starts (docs/examples/e3_starts.yaml): per condition
(verbosity level, SFT step count), the greedy accuracy and gold log-prob at the step-0 evaluation
(the SFT's own) and after 10 and 20 zero-mismatch RL steps, the step-0 gold log-prob per answer
token (over the level's mean worked answer + EOS), the share of GRPO groups kept (not all-equal:
0 means RL makes no update) and the mean sampled response length over steps 1-20.

``followup``: the run directories of a folder (the RL runs made after the calibration, from
chosen SFT lengths; FINDINGS gives their commands): each evaluation's greedy accuracy and gold
log-prob, and the share of GRPO groups kept.

``study``: the analysis pre-registered in FINDINGS ("Study E3"), run only when every condition of
the study's spec (``--spec``, default docs/examples/e3.yaml; one condition ``v<L>_<arm>_s<seed>``
per run) has finished at step 150 or diverged; before that one ``INCOMPLETE`` line (no interim
analysis), and a control stopped by the zero-mismatch guard voids the study at once. Per level:
validity (every control step keeps k3 exactly 0 and every token bitwise equal; every run of the
level evaluates its start identically at step 0, with accuracy >= 0.95; a level that fails is void
and left out of the tables and the fit); per run, the erosion study's endpoints (``study.endpoints.run_endpoints``) over the
evaluations at steps 50-150 and the mean sampled response length over those steps; per arm the
realized k3 with its intervals and, per endpoint, the excess over the level's control (bootstrap
interval, exact permutation p over the 252 relabelings of 5 vs 5, Holm over the level's 4
treatment arms); falls under the plateau rule with Clopper-Pearson intervals. The length fit:
log(-level loss) = a + alpha log k3 + beta log T over the (level, treatment arm) cells with a
negative mean accuracy-level excess (at least 4 cells over at least 2 valid levels), T the level's
control mean response length, refitted on 2,000 seed resamples; rho = beta / alpha decides between
T * k3 (rho = 1), T^2 * k3 (rho = 2), neither, or undecided; the fitted loss at k3 1e-3 and T =
1,000-8,000 (an extrapolation). The same fit on the accuracy slopes is secondary. The threshold
study's k3*(T) = 1e-3 (T / 465)^-1.85 is tested cell by cell: above it a cell should fall in at
least half its seeds, below it in fewer.

``predict``: the out-of-sample test pre-registered in FINDINGS ("Study E3c"), run only when both
its sweep (``--spec``, default docs/examples/e3c.yaml) and the fit's (``--fit``/``--fit-spec``,
default sweeps/e3b) are complete. The fit's cells (its valid levels) are fitted three ways: the
registered free fit (alpha, beta), and one power of T * k3 or of T^2 * k3 (``fit_shape``); each
predicts the accuracy-level loss of every treated cell of the test sweep (a level the fit did not
see) at that cell's realized k3 and its control's T. D = measured loss - predicted, with a 95%
bootstrap interval over 2,000 joint resamples of both studies' seeds: an interval holding 0 is
consistent. "T * k3 holds out of sample" when its prediction is consistent and T^2 * k3's is not
(and the reverse); then the test level's own tables, and the free fit over all levels together
(descriptive).

Study E3d (do E3b's level costs heal?) is a study file, analysed by the package:
``timlab study analyze docs/examples/studies/e3d.yaml`` (``timlab.experiments.study``).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timlab.experiments.study.endpoints import run_endpoints  # noqa: E402
from timlab.experiments.study.sweep_runs import collect, incomplete_line, runs, sweep_states  # noqa: E402
from timlab.experiments.study.text import comparison_cells, fmt, mean_cells  # noqa: E402
from timlab.experiments.stats import N_BOOT, bootstrap_ci, bootstrap_diff_ci, clopper_pearson, compare_family, least_squares, t_ci  # noqa: E402
from timlab.experiments.sweep import load_spec  # noqa: E402
from timlab.rundir import read_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

ANSWER_TOKENS = {0: 22, 1: 61, 2: 149, 3: 302}
"""Mean worked answer per verbosity level at 1-4-digit sums, in tokens (bench/verbosity.py, bench/RESULTS.md)."""


def starts(sweep: str) -> str:
    rows = []
    for row, m in runs(sweep):
        level, sft = map(int, re.fullmatch(r"v(\d)_sft(\d+)", row["spec_condition"]).groups())
        ev = m[["step", "val/accuracy", "val/gold_logprob"]].dropna().set_index("step")
        train = m[m["step"] > 0]
        rows.append((level, sft, ev, float(train["train/groups_kept_frac"].mean()),
                     float(train["train/response_length_mean"].mean())))
    lines = ["| level | SFT steps | accuracy at RL steps 0, 10, 20 | gold log-prob at 0, 10, 20 | "
             "step 0 per answer token | groups kept, steps 1-20 | sampled length |",
             "|---:|---:|---|---|---:|---:|---:|"]
    for level, sft, ev, kept, length in sorted(rows, key=lambda r: (r[0], r[1])):
        acc = ", ".join(f"{v:.3f}" for v in ev["val/accuracy"])
        gold = ", ".join(f"{v:.3g}" for v in ev["val/gold_logprob"])
        per_token = ev["val/gold_logprob"].iloc[0] / (ANSWER_TOKENS[level] + 1)
        lines.append(f"| {level} | {sft} | {acc} | {gold} | {per_token:.1e} | {kept:.2f} | {length:.1f} |")
    return "\n".join(lines)


def followup(folder: str) -> str:
    lines = ["| run | accuracy at each evaluation (step: value) | gold log-prob at each evaluation | groups kept |",
             "|---|---|---|---:|"]
    for d in sorted(p for p in Path(folder).iterdir() if (p / "metrics.parquet").exists()):
        m = read_metrics(d)
        ev = m[["step", "val/accuracy", "val/gold_logprob"]].dropna()
        acc = ", ".join(f"{int(s)}: {a:.3f}" for s, a in zip(ev["step"], ev["val/accuracy"]))
        gold = ", ".join(f"{g:.3g}" for g in ev["val/gold_logprob"])
        kept = float(m.loc[m["step"] > 0, "train/groups_kept_frac"].mean())
        lines.append(f"| {d.name} | {acc} | {gold} | {kept:.2f} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ the study
SPEC = ROOT / "docs" / "examples" / "e3.yaml"
"""The registered study's spec: its conditions (``v<L>_<arm>_s<seed>``) are the runs the analysis waits for."""
STUDY = {"steps": 150, "start": 50, "min_start_accuracy": 0.95}
"""The registered design besides the spec's runs: steps per run, the first step of the outcome
window, and the validity bar for each level's step-0 accuracy."""
CONTROL = "control"
"""The zero-mismatch arm's name in the spec's conditions."""
ENDPOINTS = (("acc_level", "mean accuracy"), ("acc_slope", "accuracy slope per 100 steps"),
             ("gold_level", "mean gold log-prob"), ("gold_slope", "gold log-prob slope per 100 steps"))
"""The primary endpoints (key, label); each is one Holm family per level (the level's treatment arms)."""
K3_REF = 1e-3
"""The realized k3 the extrapolation is for."""
T_EXTRAPOLATE = (1000, 2000, 4000, 8000)
"""Answer lengths (tokens) where real runs collapse: the fitted loss is extrapolated to them."""
MIN_CELLS, MIN_LEVELS = 4, 2
"""The length fit needs at least this many cells with a negative excess, over at least this many levels."""
UNBOUNDED = 10.0
"""A fitted loss above this (ten times all there is to lose, accuracy lying in [0, 1]) prints as
"unbounded": such a bound is set by a few resamples whose exponent runs off, its digits carry no
information, and they would differ with the last bits of the fit."""


def fmt_loss(x: float) -> str:
    """An extrapolated loss as the tables print it: ``fmt``, or "unbounded" above ``UNBOUNDED``."""
    return "unbounded" if x > UNBOUNDED else fmt(x)


RHO = {"T * k3": 1.0, "T^2 * k3": 2.0}
"""The two hypotheses for rho = beta / alpha."""
FIT_SWEEP = ROOT / "sweeps" / "e3b"
FIT_SPEC = ROOT / "docs" / "examples" / "e3b.yaml"
"""The sweep whose length fit E3c tests out of sample, and its spec."""
TEST_SPEC = ROOT / "docs" / "examples" / "e3c.yaml"
"""E3c's spec: the level the fit did not see (``predict``)."""


def threshold_k3(T: float) -> float:
    """The threshold study's fit, k3*(T) = 1e-3 x (T / 465)^-1.85 (FINDINGS, "Threshold")."""
    return 1e-3 * (T / 465) ** -1.85


def cell(condition: str) -> tuple[int, str]:
    """``v2_head_0.49_s3`` -> (2, 'head_0.49'): the (level, arm) of a condition."""
    m = re.fullmatch(r"v(\d+)_(.+)_s\d+", condition)
    if m is None:
        raise ValueError(f"condition {condition!r}: expected v<level>_<arm>_s<seed>")
    return int(m.group(1)), m.group(2)


def study_endpoints(m: pd.DataFrame, start: int = STUDY["start"], *, diverged: bool = False) -> dict:
    """One run's endpoints: the erosion study's over the evaluations at steps >= ``start``, the mean
    sampled response length over the training steps >= ``start``, and the step-0 evaluation."""
    out = run_endpoints(m, start, diverged=diverged)
    m = m.sort_values("step")
    ev = m[m["val/accuracy"].notna()]
    out.update({"length": float(m.loc[m["step"] >= start, "train/response_length_mean"].mean()),
                "start_step": int(ev["step"].iloc[0]), "start_gold": float(ev["val/gold_logprob"].iloc[0])})
    return out


def _refusal(sweep: str, want: list[str], design: dict) -> str | None:
    """The line printed instead of any number (a control stopped by the guard: VOID; runs
    missing: INCOMPLETE), or None when the study is complete. Reads run states only, no metrics."""
    tripped, done = sweep_states(sweep, design["steps"], lambda c: cell(c)[1] == CONTROL)
    if tripped:
        return (f"VOID: the zero-mismatch guard stopped {', '.join(tripped)} (every control step keeps k3 "
                f"exactly 0 and every token bitwise equal); the study is re-run, not analysed.")
    return _incomplete(want, done, design) if any(c not in done for c in want) else None


def study(sweep: str, *, spec: str | Path = SPEC, design: dict = STUDY) -> str:
    """The pre-registered analysis of the E3 sweep as markdown (FINDINGS' "Study E3")."""
    want = [c.name for c in load_spec(spec).conditions]
    refusal = _refusal(sweep, want, design)  # no run's metrics are read before the study is complete
    if refusal:
        return refusal
    per = collect(sweep, design, key=cell, endpoints=study_endpoints)
    return analyse(per, want, design=design)


def _incomplete(want: list[str], done: set[str], design: dict) -> str:
    return incomplete_line(want, done, design["steps"], label=lambda c: "v{} {}".format(*cell(c)))


def analyse(per: dict[tuple[int, str], list[dict]], want: list[str], *, design: dict = STUDY,
            n: int = N_BOOT) -> str:
    """The analysis of per-cell run endpoints (``collect`` with ``key=cell``, ``study_endpoints``)."""
    done = {r["condition"] for v in per.values() for r in v}
    if any(c not in done for c in want):
        return _incomplete(want, done, design)
    cells, per = _in_spec(per, want)
    levels = sorted({lv for lv, _ in cells})
    col = _columns(per, cells)
    out, valid = [], {}
    for lv in levels:
        valid[lv], line = _validity(per, cells, lv, design)
        out.append(line)
    out.append("")
    ok = [lv for lv in levels if valid[lv]]
    arms = {lv: [a for v, a in cells if v == lv and a != CONTROL] for lv in ok}
    T = {lv: float(col[lv, CONTROL]["length"].mean()) for lv in ok}
    out += _mechanism(col, ok, arms, T, design)
    erodes: dict[tuple[int, str, str], bool] = {}
    for key, label in ENDPOINTS:
        out += _outcome(col, ok, arms, key, f"{label}, evaluations at steps {design['start']}-{design['steps']}", erodes)
    out += _falls(per, ok, arms, design)
    treated = [(lv, a) for lv in ok for a in arms[lv]]
    out += _length_fit(col, treated, "acc_level", "mean accuracy (primary)", n=n)
    out += _length_fit(col, treated, "acc_slope", "accuracy slope per 100 steps (secondary)", n=n)
    out += _threshold(per, col, treated)
    return "\n".join(out)


def _in_spec(per: dict, want: list[str]) -> tuple[list, dict]:
    """The spec's (level, arm) cells in spec order, and each cell's runs that the spec names."""
    cells = list(dict.fromkeys(cell(c) for c in want))
    return cells, {k: [r for r in per[k] if r["condition"] in want] for k in cells}


def _columns(per: dict, cells: list) -> dict:
    """{(level, arm): {endpoint: per-seed array}} of the cells' run endpoints."""
    return {k: {e: np.array([r[e] for r in per[k]], float) for e in per[k][0] if e != "condition"} for k in cells}


def _validity(per: dict, cells: list, lv: int, design: dict) -> tuple[bool, str]:
    """Registered validity of one level: its controls' guard held at every step, and every run of the
    level evaluated the same start at step 0, at or above the accuracy bar."""
    guard = all(r["guard"] and r["rows"] == design["steps"] for r in per[lv, CONTROL])
    starts = {(r["start_step"], r["start_acc"], r["start_gold"]) for k in cells if k[0] == lv for r in per[k]}
    s0 = next(iter(starts))
    learned = s0[1] >= design["min_start_accuracy"]
    ok = guard and len(starts) == 1 and s0[0] == 0 and learned
    return ok, (f"Validity, level {lv}: control guard (k3 exactly 0, every token bitwise equal, every step) "
                f"{'held' if guard else 'BROKEN'}; step-0 evaluation "
                + (f"the same in all its runs (accuracy {s0[1]:.3f}, gold log-prob {s0[2]:.3f})" if len(starts) == 1
                   else f"DIFFERS between its runs ({len(starts)} distinct)")
                + ("" if learned or len(starts) > 1 else f", below the bar {design['min_start_accuracy']}")
                + f": {'VALID' if ok else 'VOID (left out of every table and the fit)'}.")


def _mechanism(col: dict, ok: list[int], arms: dict, T: dict, design: dict) -> list[str]:
    out = [f"**Realized mismatch and length** (means over steps {design['start']}-{design['steps']}, then over seeds)", "",
           "| level | arm | realized k3 [95% t] [95% bootstrap] | mean response length | T * k3 | T^2 * k3 |",
           "|---:|---|---:|---:|---:|---:|"]
    for lv in ok:
        for a in (CONTROL, *arms[lv]):
            c = col[lv, a]
            mu, lo, hi = t_ci(c["k3"])
            blo, bhi = bootstrap_ci(c["k3"])
            out.append(f"| {lv} | {a} | {fmt(mu)} [{fmt(lo)}, {fmt(hi)}] [{fmt(blo)}, {fmt(bhi)}] | "
                       f"{float(c['length'].mean()):.1f} | {fmt(T[lv] * mu)} | {fmt(T[lv] ** 2 * mu)} |")
    return out + ["", "T is the level's control mean response length (the fit's T).", ""]


def _outcome(col: dict, ok: list[int], arms: dict, key: str, label: str, erodes: dict) -> list[str]:
    out = [f"**{label}** (per level, Holm over the level's {_arms(max((len(v) for v in arms.values()), default=0))})", "",
           "| level | arm | mean [95% t] [95% bootstrap] | excess over control [95% bootstrap] | permutation p | "
           "Holm p | verdict |", "|---:|---|---:|---:|---:|---:|---|"]
    for lv in ok:
        ctrl = col[lv, CONTROL][key]
        cmp = compare_family({a: col[lv, a][key] for a in arms[lv]}, {a: ctrl for a in arms[lv]})
        out.append(f"| {lv} | {CONTROL} | {mean_cells(ctrl)} | - | - | - | - |")
        for a in arms[lv]:
            r = cmp[a]
            erodes[lv, a, key] = r.below()
            verdict = "**erodes**" if r.below() else f"no detectable erosion (costs {r.cost_bound()})"
            out.append(f"| {lv} | {a} | {comparison_cells(r)} | {verdict} |")
    return out + [""]


def _arms(k: int) -> str:
    return "1 treatment arm: no correction" if k == 1 else f"{k} treatment arms"


def _falls(per: dict, ok: list[int], arms: dict, design: dict) -> list[str]:
    out = ["**Falls and final values**", "", f"| level | arm | falls (plateau rule) [95% Clopper-Pearson] | "
           f"k3 first 20 -> last 20 steps | accuracy at step {design['steps']} [95% t] |", "|---:|---|---:|---|---:|"]
    for lv in ok:
        for a in (CONTROL, *arms[lv]):
            rs = per[lv, a]
            k = sum(r["fell"] for r in rs)
            clo, chi = clopper_pearson(k, len(rs))
            fa = t_ci([r["final_acc"] for r in rs])
            out.append(f"| {lv} | {a} | {k}/{len(rs)} [{clo:.2f}, {chi:.2f}] | "
                       f"{fmt(float(np.mean([r['k3_first'] for r in rs])))} -> "
                       f"{fmt(float(np.mean([r['k3_last'] for r in rs])))} | {fa[0]:.3f} [{fa[1]:.3f}, {fa[2]:.3f}] |")
    return out + [""]


def _fit_cells(excess: np.ndarray, level: np.ndarray) -> np.ndarray | None:
    """The mask of the cells a length fit uses (negative excess), or None with fewer than
    ``MIN_CELLS`` such cells or fewer than ``MIN_LEVELS`` levels among them."""
    keep = excess < 0
    return None if keep.sum() < MIN_CELLS or len(set(level[keep].tolist())) < MIN_LEVELS else keep


def fit_length(k3: np.ndarray, T: np.ndarray, excess: np.ndarray, level: np.ndarray) -> tuple[float, float, float] | None:
    """(a, alpha, beta) of log(-excess) = a + alpha log k3 + beta log T by least squares over the
    cells with a negative excess; None with fewer than ``MIN_CELLS`` such cells, fewer than
    ``MIN_LEVELS`` levels among them, or a rank-deficient design (k3 and T not separable)."""
    keep = _fit_cells(excess, level)
    if keep is None:
        return None
    X = [[1.0, math.log(k), math.log(t)] for k, t in zip(k3[keep], T[keep])]  # (cells, 3)
    return least_squares(X, [math.log(-e) for e in excess[keep]])  # None: rank-deficient


def _cells(col: dict, treated: list, key: str, rng: np.random.Generator | None = None):
    """(k3, T, excess, level) per treated cell: means over seeds (resampled with ``rng``), the
    excess over the level's control and T its control's mean response length (resampled too)."""
    pick = (lambda x: x) if rng is None else (lambda x: x[rng.integers(0, x.size, x.size)])
    ctrl = {}
    for lv in sorted({lv for lv, _ in treated}):
        i = pick(np.arange(col[lv, CONTROL][key].size))
        ctrl[lv] = (col[lv, CONTROL][key][i].mean(), col[lv, CONTROL]["length"][i].mean())
    k3, T, ex, level = [], [], [], []
    for lv, a in treated:
        i = pick(np.arange(col[lv, a][key].size))
        k3.append(col[lv, a]["k3"][i].mean())
        ex.append(col[lv, a][key][i].mean() - ctrl[lv][0])
        T.append(ctrl[lv][1])
        level.append(lv)
    return np.array(k3), np.array(T), np.array(ex), np.array(level)


def _length_fit(col: dict, treated: list, key: str, label: str, *, n: int = N_BOOT, seed: int = 0) -> list[str]:
    k3, T, ex, level = _cells(col, treated, key)
    head = f"**Length fit, {label}**: "
    fit = fit_length(k3, T, ex, level)
    neg = int((ex < 0).sum())
    if fit is None:
        return [head + f"{neg} cells with a negative mean excess over {len(set(level[ex < 0].tolist()))} levels "
                f"(needs {MIN_CELLS} over {MIN_LEVELS}, with k3 and T separable): no fit; the result is stated per level "
                f"in the tables above.", ""]
    a, alpha, beta = fit
    rng = np.random.default_rng(seed)
    reps, failed = [], 0
    for _ in range(n):
        f = fit_length(*_cells(col, treated, key, rng))
        if f is None:
            failed += 1
        else:
            reps.append(f)
    R = np.array(reps)  # (fits, 3)
    rho = beta / alpha if alpha else math.nan
    out = [head + f"log(-excess) = a + alpha log k3 + beta log T over {neg} cells with a negative mean excess: "
           f"alpha = {alpha:.2f}, beta = {beta:.2f}, rho = beta / alpha = {rho:.2f}"]
    if len(R) < n / 2:
        return out + [f"; only {len(R)} of {n} resamples could be fitted ({failed} had too few negative cells or "
                      f"levels): no interval, no decision.", ""]
    rhos = R[:, 2] / R[:, 1]
    lo, hi = (float(np.percentile(rhos, q)) for q in (2.5, 97.5))
    holds = {h: lo <= v <= hi for h, v in RHO.items()}
    decision = ("**T * k3**" if holds["T * k3"] and not holds["T^2 * k3"] else
                "**T^2 * k3**" if holds["T^2 * k3"] and not holds["T * k3"] else
                "**neither**" if not any(holds.values()) else "**undecided** (the interval holds both 1 and 2)")
    alo, ahi = (float(np.percentile(R[:, 1], q)) for q in (2.5, 97.5))
    blo, bhi = (float(np.percentile(R[:, 2], q)) for q in (2.5, 97.5))
    out = [out[0] + f" [95% bootstrap {lo:.2f}, {hi:.2f}] (alpha [{alo:.2f}, {ahi:.2f}], beta [{blo:.2f}, {bhi:.2f}]; "
           f"{len(R)} of {n} resamples fitted, {failed} had too few negative cells or levels): {decision}.", "",
           f"Extrapolated {label.split(' (')[0]} lost at a realized k3 of {K3_REF:g}, beyond the T measured "
           f"({T.min():.0f}-{T.max():.0f}; a loss above what there is to lose means the fit predicts a fall; \"unbounded\": above {UNBOUNDED:g}):", "",
           "| T | fitted loss | 95% bootstrap |", "|---:|---:|---:|"]
    for t in T_EXTRAPOLATE:
        pts = np.array([math.exp(r[0] + r[1] * math.log(K3_REF) + r[2] * math.log(t)) for r in R])
        fit_t = math.exp(a + alpha * math.log(K3_REF) + beta * math.log(t))
        out.append(f"| {t:,} | {fmt_loss(fit_t)} | [{fmt_loss(float(np.percentile(pts, 2.5)))}, "
                   f"{fmt_loss(float(np.percentile(pts, 97.5)))}] |")
    return out + [""]


def _threshold(per: dict, col: dict, treated: list) -> list[str]:
    out = ["**The threshold fit's test** (k3*(T) = 1e-3 x (T / 465)^-1.85 at each level's mean worked answer; "
           "a cell above it should fall in at least half its seeds, one below it in fewer)", "",
           "| level | T | k3*(T) | arm | realized k3 | above k3* | falls | agrees |", "|---:|---:|---:|---|---:|---|---:|---|"]
    agree = 0
    for lv, a in treated:
        star = threshold_k3(ANSWER_TOKENS[lv])
        k = float(col[lv, a]["k3"].mean())
        falls = sum(r["fell"] for r in per[lv, a])
        above = k > star
        ok = (falls >= len(per[lv, a]) / 2) == above
        agree += ok
        out.append(f"| {lv} | {ANSWER_TOKENS[lv]} | {fmt(star)} | {a} | {fmt(k)} | {'yes' if above else 'no'} | "
                   f"{falls}/{len(per[lv, a])} | {'yes' if ok else 'no'} |")
    return out + ["", f"Cells that agree with the threshold fit: {agree} of {len(treated)}.", ""]


def fit_shape(k3: np.ndarray, T: np.ndarray, excess: np.ndarray, level: np.ndarray, rho: float) -> tuple[float, float] | None:
    """(a, g) of log(-excess) = a + g log(T^rho k3): the cost as a power of one dose, T * k3 (rho 1)
    or T^2 * k3 (rho 2), by least squares over the cells with a negative excess; None where
    ``fit_length`` would have too few cells or levels."""
    keep = _fit_cells(excess, level)
    if keep is None:
        return None
    X = [[1.0, math.log(t ** rho * k)] for k, t in zip(k3[keep], T[keep])]  # (cells, 2)
    return least_squares(X, [math.log(-e) for e in excess[keep]])


def _elementwise(fn, k, t):
    """``fn(k, t)`` over broadcast arrays with the standard library's ``math`` (the same bits on every
    CPU, unlike numpy's SIMD exp and log): a float for scalar inputs, else an array of their shape."""
    kb, tb = np.broadcast_arrays(np.asarray(k, dtype=float), np.asarray(t, dtype=float))
    out = np.array([fn(a, b) for a, b in zip(kb.ravel().tolist(), tb.ravel().tolist())]).reshape(kb.shape)
    return float(out) if out.ndim == 0 else out


def _predictors(k3, T, ex, level) -> dict:
    """Each hypothesis fitted on the fit's cells, as a function (k3, T) -> predicted loss (None: no fit)."""
    out = {}
    f = fit_length(k3, T, ex, level)
    out["the registered fit (alpha, beta free)"] = None if f is None else (
        lambda k, t, f=f: _elementwise(lambda kk, tt: math.exp(f[0] + f[1] * math.log(kk) + f[2] * math.log(tt)), k, t))
    for h, rho in RHO.items():
        g = fit_shape(k3, T, ex, level, rho)
        out[h] = None if g is None else (lambda k, t, g=g, rho=rho: _elementwise(
            lambda kk, tt: math.exp(g[0] + g[1] * math.log(tt ** rho * kk)), k, t))
    return out


PREDICT_AT = {"T": 300.0, "k3": (1.0e-3, 1.3e-3, 1.6e-3)}
"""Where E3c's registered predictions were tabulated before its runs: level 3's T and the k3 its dose was expected to realize."""


def predictions(fit_sweep: str | Path = FIT_SWEEP, fit_spec: str | Path = FIT_SPEC, *, at: dict = PREDICT_AT,
                design: dict = STUDY, n: int = N_BOOT, seed: int = 0) -> str:
    """E3c's prediction table (FINDINGS, "Study E3c"): each hypothesis fitted on the fit sweep's
    treated cells (``_predictors``), its loss at ``at["T"]`` and each ``at["k3"]``, with a 95%
    interval over ``n`` seed resamples of the fit's cells (as ``_prediction`` draws them)."""
    want = [c.name for c in load_spec(fit_spec).conditions]
    refusal = _refusal(str(fit_sweep), want, design)
    if refusal:
        return f"{refusal} ({_shown(fit_sweep)})"
    cells, per = _in_spec(collect(str(fit_sweep), design, key=cell, endpoints=study_endpoints), want)
    col = _columns(per, cells)
    treated = [k for k in cells if k[1] != CONTROL]
    full = _cells(col, treated, "acc_level")
    pred = _predictors(*full)
    rng = np.random.default_rng(seed)
    reps = [_predictors(*_cells(col, treated, "acc_level", rng)) for _ in range(n)]
    label = {"the registered fit (alpha, beta free)": "the registered fit, log loss = a + alpha log k3 + beta log T"}
    for h, rho in RHO.items():
        g = fit_shape(*full, rho)
        label[h] = f"one power of {h} (exponent {g[1]:.2f})" if g else f"one power of {h} (no fit)"
    T = at["T"]
    out = [f"| hypothesis fitted on the {len(treated)} cells | " + " | ".join(f"k3 {k:.1e}" for k in at["k3"]) + " |",
           "|---|" + "---:|" * len(at["k3"])]
    for h, f in pred.items():
        row = []
        for k in at["k3"]:
            v = np.array([r[h](k, T) for r in reps if r[h] is not None])
            row.append("no fit" if f is None else
                       f"{fmt_loss(float(f(k, T)))} [{fmt_loss(float(np.percentile(v, 2.5)))}, "
                       f"{fmt_loss(float(np.percentile(v, 97.5)))}]")
        out.append(f"| {label[h]} | " + " | ".join(row) + " |")
    return "\n".join(out)


def predict(sweep: str, *, spec: str | Path = TEST_SPEC, fit_sweep: str | Path = FIT_SWEEP,
            fit_spec: str | Path = FIT_SPEC, design: dict = STUDY, n: int = N_BOOT, seed: int = 0) -> str:
    """E3c's pre-registered analysis (FINDINGS, "Study E3c"): the length fit of ``fit_sweep`` (E3b)
    predicts the accuracy-level cost of each treated cell of ``sweep`` (a level it did not see) at
    the cell's realized k3 and T; the measured cost is compared with each prediction. Both sweeps
    must be complete (no interim analysis)."""
    want_fit = [c.name for c in load_spec(fit_spec).conditions]
    want = [c.name for c in load_spec(spec).conditions]
    for where, names in ((fit_sweep, want_fit), (sweep, want)):
        refusal = _refusal(str(where), names, design)
        if refusal:
            return f"{refusal} ({_shown(where)})"
    per_fit = collect(str(fit_sweep), design, key=cell, endpoints=study_endpoints)
    per = collect(str(sweep), design, key=cell, endpoints=study_endpoints)
    return out_of_sample(per_fit, want_fit, per, want, design=design, n=n, seed=seed)


def out_of_sample(per_fit: dict, want_fit: list[str], per: dict, want: list[str], *, design: dict = STUDY,
                  n: int = N_BOOT, seed: int = 0) -> str:
    """``predict``'s analysis of per-cell run endpoints (``collect`` with ``key=cell``)."""
    fit_cells, per_fit = _in_spec(per_fit, want_fit)
    cells, per = _in_spec(per, want)
    if {lv for lv, _ in cells} & {lv for lv, _ in fit_cells}:
        raise ValueError("the test's levels must be levels the fit did not see")
    colf, col = _columns(per_fit, fit_cells), _columns(per, cells)
    out, fit_ok, ok = [], [], []
    for lv in sorted({lv for lv, _ in fit_cells}):
        valid, line = _validity(per_fit, fit_cells, lv, design)
        fit_ok += [lv] if valid else []
        out.append("The fit's " + line[0].lower() + line[1:])
    for lv in sorted({lv for lv, _ in cells}):
        valid, line = _validity(per, cells, lv, design)
        ok += [lv] if valid else []
        out.append("The test's " + line[0].lower() + line[1:])
    out.append("")
    if not ok:
        return "\n".join(out + ["No valid test level: no test."])
    arms = {lv: [a for v, a in cells if v == lv and a != CONTROL] for lv in ok}
    T = {lv: float(col[lv, CONTROL]["length"].mean()) for lv in ok}
    out += _mechanism(col, ok, arms, T, design)
    for key, label in ENDPOINTS:
        out += _outcome(col, ok, arms, key, f"{label}, evaluations at steps {design['start']}-{design['steps']}", {})
    out += _falls(per, ok, arms, design)
    fit_treated = [(lv, a) for lv, a in fit_cells if lv in fit_ok and a != CONTROL]
    treated = [(lv, a) for lv in ok for a in arms[lv]]
    out += _prediction(colf, fit_treated, col, treated, n=n, seed=seed)
    both = {**colf, **col}
    out += _length_fit(both, fit_treated + treated, "acc_level",
                       "mean accuracy over the fit's and the test's levels (descriptive)", n=n, seed=seed)
    return "\n".join(out + _threshold(per, col, treated))


def _prediction(colf: dict, fit_treated: list, col: dict, treated: list, *, n: int, seed: int) -> list[str]:
    """The registered test: per treated test cell and hypothesis, the measured accuracy-level loss
    minus the predicted one, D, with a 95% bootstrap interval over joint resamples of both studies'
    seeds; an interval holding 0 is consistent with the hypothesis."""
    k3, T, ex, _ = _cells(col, treated, "acc_level")
    pred = _predictors(*_cells(colf, fit_treated, "acc_level"))
    rng = np.random.default_rng(seed)
    D, P = {h: [] for h in pred}, {h: [] for h in pred}
    failed = dict.fromkeys(pred, 0)
    for _ in range(n):
        fr = _predictors(*_cells(colf, fit_treated, "acc_level", rng))
        kt, Tt, et, _ = _cells(col, treated, "acc_level", rng)
        for h, f in fr.items():
            if f is None:
                failed[h] += 1
            else:
                P[h].append(f(kt, Tt))
                D[h].append(-et - P[h][-1])
    out = ["**The out-of-sample test** (accuracy-level loss over steps 50-150 predicted from the fit's cells at "
           "each test cell's realized k3 and T; D = measured loss - predicted, 95% bootstrap over joint resamples of "
           "both studies' seeds; D's interval holding 0 = consistent)", "",
           "| level | arm | realized k3 | T | measured loss [95% bootstrap] | hypothesis | predicted loss [95% bootstrap] | "
           "D [95% bootstrap] | verdict |", "|---:|---|---:|---:|---:|---|---:|---:|---|"]
    verdicts: dict[tuple, dict[str, str]] = {}
    for i, (lv, a) in enumerate(treated):
        lo_m, hi_m = (-x for x in reversed(bootstrap_diff_ci(col[lv, a]["acc_level"], col[lv, CONTROL]["acc_level"])))
        for h, f in pred.items():
            if f is None or len(D[h]) < n / 2:
                verdicts.setdefault((lv, a), {})[h] = "no fit"
                out.append(f"| {lv} | {a} | {fmt(k3[i])} | {T[i]:.1f} | {fmt(-ex[i])} [{fmt(lo_m)}, {fmt(hi_m)}] | {h} | "
                           f"no fit ({failed[h]} of {n} resamples failed) | - | no fit |")
                continue
            d = np.array(D[h])[:, i]
            dlo, dhi = (float(np.percentile(d, q)) for q in (2.5, 97.5))
            p_pt = float(f(k3[i], T[i]))
            plo, phi = (float(np.percentile(np.array(P[h])[:, i], q)) for q in (2.5, 97.5))
            v = ("consistent" if dlo <= 0 <= dhi else
                 "under-predicts (the cost is larger)" if dlo > 0 else "over-predicts (the cost is smaller)")
            verdicts.setdefault((lv, a), {})[h] = v
            out.append(f"| {lv} | {a} | {fmt(k3[i])} | {T[i]:.1f} | {fmt(-ex[i])} [{fmt(lo_m)}, {fmt(hi_m)}] | {h} | "
                       f"{fmt(p_pt)} [{fmt(plo)}, {fmt(phi)}] | {-ex[i] - p_pt:+.4f} [{dlo:+.4f}, {dhi:+.4f}] | {v} |")
    out.append("")
    for (lv, a), v in verdicts.items():
        t1, t2 = (v[h] == "consistent" for h in RHO)
        shape = ("**T * k3** holds out of sample" if t1 and not t2 else "**T^2 * k3** holds out of sample" if t2 and not t1
                 else "**neither** shape predicts it" if not (t1 or t2) else "**does not discriminate** (both consistent)")
        free = v["the registered fit (alpha, beta free)"]
        out.append(f"Level {lv}, {a}: {shape}; the registered fit's extrapolation: "
                   f"{'**holds**' if free == 'consistent' else f'**{free}**'}.")
    return out + [""]


def _shown(path: str | Path) -> Path:
    """``path`` relative to the repository when it lies inside it (so committed text does not
    name this machine's folders), else absolute."""
    p = Path(path).resolve()
    return p.relative_to(ROOT) if p.is_relative_to(ROOT) else p


def figure(sweep: str, out: str | Path, *, spec: str | Path = SPEC, design: dict = STUDY) -> Path:
    """Each treated (level, arm) cell's excess mean accuracy over its level's control, with its 95%
    bootstrap interval, against realized k3, T * k3 and T^2 * k3 (T: the level's control mean
    response length): under the shape that holds, the levels fall on one curve. Only for a
    complete sweep (the study's own refusal otherwise)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    want = [c.name for c in load_spec(spec).conditions]
    refusal = _refusal(sweep, want, design)
    if refusal:
        raise SystemExit(refusal)
    per = collect(sweep, design, key=cell, endpoints=study_endpoints)
    cells, per = _in_spec(per, want)
    col = _columns(per, cells)
    levels = sorted({lv for lv, _ in cells})
    arms = list(dict.fromkeys(a for _, a in cells if a != CONTROL))
    fig = Figure(figsize=(14, 4))
    axes = [fig.add_subplot(1, 3, i + 1) for i in range(3)]
    for lv in levels:
        T = float(col[lv, CONTROL]["length"].mean())
        for j, a in enumerate(arms):
            c = col[lv, a]
            ex = float(c["acc_level"].mean() - col[lv, CONTROL]["acc_level"].mean())
            lo, hi = bootstrap_diff_ci(c["acc_level"], col[lv, CONTROL]["acc_level"])
            k = float(c["k3"].mean())
            for ax, x in zip(axes, (k, T * k, T * T * k)):
                ax.errorbar([x], [ex], yerr=[[ex - lo], [hi - ex]], fmt="osD^v"[j % 5], color=f"C{lv}", ms=5, capsize=2,
                            label=f"level {lv} (T {T:.0f})" if j == 0 else None)
    for ax, xl in zip(axes, ("realized k3", "T * k3", "T^2 * k3")):
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels overlap within a decade
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set(xlabel=xl, ylabel="mean accuracy minus the level's control")
    axes[0].legend(fontsize=7, loc="lower left")
    axes[1].set_title("markers: " + ", ".join(f"{'osD^v'[j % 5]} {a}" for j, a in enumerate(arms)), fontsize=8)
    fig.suptitle(f"{sweep}: accuracy cost of each (level, arm) cell, steps {design['start']}-{design['steps']}, "
                 f"mean over seeds with 95% bootstrap interval", fontsize=9)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=100)
    return out


TABLES = {"starts": starts, "followup": followup, "study": study, "predict": predict}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("table", choices=[*TABLES, "figure"])
    p.add_argument("sweep", help="the sweep (starts, study) or the folder of run directories (followup)")
    p.add_argument("--spec", help=f"the study's spec (default {SPEC.relative_to(ROOT)}; "
                                  f"predict: {TEST_SPEC.relative_to(ROOT)})")
    p.add_argument("--fit", default=str(FIT_SWEEP), help=f"predict: the sweep whose fit is tested "
                                                          f"(default {FIT_SWEEP.relative_to(ROOT)})")
    p.add_argument("--fit-spec", default=str(FIT_SPEC), help=f"predict: the fit sweep's spec "
                                                              f"(default {FIT_SPEC.relative_to(ROOT)})")
    p.add_argument("--out", help="the figure's file (figure only)")
    a = p.parse_args(argv)
    np.seterr(all="ignore")
    if a.table == "figure":
        if not a.out:
            p.error("figure needs --out FILE.png")
        print(f"wrote {figure(a.sweep, a.out, spec=a.spec or SPEC)}")
        return 0
    if a.table == "predict":
        print(predict(a.sweep, spec=a.spec or TEST_SPEC, fit_sweep=a.fit, fit_spec=a.fit_spec))
    else:
        print(study(a.sweep, spec=a.spec or SPEC) if a.table == "study" else TABLES[a.table](a.sweep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
