"""Tables of the erosion study (docs/FINDINGS.md, "Erosion study"), from its sweeps' run directories.

    python scripts/erosion_tables.py probe sweeps/erosion_probe    # dose -> realized k3 on the learned policy
    python scripts/erosion_tables.py slopes sweeps/erosion_pilot   # per-arm slopes, guard check, cost
    python scripts/erosion_tables.py study sweeps/erosion          # the pre-registered analysis

``probe``: per condition, the realized k3 (mean of ``rollout_corr/k3_kl`` over a run's steps, then
over its runs) with the range over runs, and the median wall time of a training step.

``slopes``: per run, the OLS slope of ``val/accuracy`` over the evaluations at steps >= ``--from``
(50, as pre-registered), per 100 steps, and its realized k3 over the same steps; per condition, the
mean over seeds with a 95% t-interval, each run's mean k3 over its first and last 20 steps, the excess over the ``control`` condition with an exact
two-sided permutation p (``timlab.experiments.stats``), whether every control step kept k3 exactly
0 and every token bitwise equal, and the wall-clock cost per RL step (training step time plus its
share of evaluation time; one thread per run, so an upper bound on CPU-seconds per step on a
shared machine). It has no gold log-prob column (the pilot ran before ``val/gold_logprob`` existed).

``study``: the analysis pre-registered in FINDINGS, on the full study only (11 arms x 8 seeds,
500 steps; a sweep with fewer finished runs gets a progress line and no endpoint: no interim
analysis). Per run, over the evaluations at steps 50-500: the OLS slopes (per 100 steps) of
``val/accuracy`` and ``val/gold_logprob``, their mean levels, the realized k3 (mean of
``rollout_corr/k3_kl``), the k3 of the first and last 20 steps, a fall under the plateau rule and
the step-500 values. Per arm and endpoint: the mean with its 95% t- and seed-bootstrap intervals;
against the control, the excess with its bootstrap interval (each arm's seeds resampled on their
own), the exact permutation p (8 vs 8: all 12,870 relabelings) and the Holm-adjusted p over the
10 treatment arms; an arm erodes when the excess is negative, Holm p < 0.05 and the bootstrap
interval excludes 0. The power-law fit excess = -c * k3^alpha (per step) over the head_perturb arms
with a negative mean excess (at least 3), refitted on each of 2,000 seed resamples for intervals
of c, alpha and T = loss / (c * 1e-3^alpha) (0.1 accuracy, or 1 nat of gold log-prob); the fits
whose resample left fewer than 3 negative arms are dropped and counted. A realistic arm agrees
with the fit when the 95% interval of its excess minus the fitted law at its realized k3 holds 0
(``off_fit``: each fit replicate paired with a resample of the arm's seeds, so the band holds the
fit's uncertainty and the arm's own seed noise).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timlab.experiments.collapse import judge  # noqa: E402
from timlab.rundir import read_metrics  # noqa: E402
from timlab.experiments.stats import (N_BOOT, bootstrap_ci, bootstrap_diff_ci, clopper_pearson,  # noqa: E402
                                      compare_family, line_fit, permutation_test, t_ci)
from timlab.experiments.sweep import INDEX_FILE, read_index  # noqa: E402
from timlab.rundir import DIVERGED, FINISHED, GUARD_FAILED  # noqa: E402

CONTROL = "control"
"""The zero-mismatch arm's condition name in the erosion specs."""
HEAD = "head_"
"""Prefix of the head_perturb arms (``head_<dose>``): the arms the power law is fitted over."""
STUDY = {"arms": 11, "seeds": 8, "steps": 500, "start": 50, "min_start_accuracy": 0.95}
"""The registered design: arms, seeds per arm, steps per run, first step of the window, and the
validity bar for the control's step-0 accuracy."""
ENDPOINTS = (("acc_slope", "accuracy slope per 100 steps"), ("gold_slope", "gold log-prob slope per 100 steps"),
             ("acc_level", "mean accuracy, steps 50-500"), ("gold_level", "mean gold log-prob, steps 50-500"))
"""The co-primary endpoints: (key, label)."""
LOSS = {"acc_slope": (0.1, "0.1 accuracy"), "gold_slope": (1.0, "1 nat of gold log-prob")}
"""The loss whose step count T the fit predicts, per slope endpoint."""
K3_REF = 1e-3
"""The realized k3 the study's headline answer is for."""


def fmt(x: float) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.1e}" if x != 0 and abs(x) < 0.01 else f"{x:.3f}"


def ci_text(x: tuple[float, float]) -> str:
    """An interval as the study tables print it: ``[-0.0123, +0.0045]``."""
    return f"[{x[0]:+.4f}, {x[1]:+.4f}]"


def mean_cells(x) -> str:
    """A group's mean with its 95% t- and seed-bootstrap intervals, as the study tables print it
    (NaN where a run has no value)."""
    x = np.asarray(x, dtype=float)
    mu, lo, hi = t_ci(x) if np.isfinite(x).all() else (math.nan,) * 3
    b = bootstrap_ci(x) if np.isfinite(x).all() else (math.nan, math.nan)
    return f"{mu:+.4f} {ci_text((lo, hi))} {ci_text(b)}"


def comparison_cells(c) -> str:
    """A ``stats.Comparison`` as the study tables' cells: mean [t] [bootstrap] | difference
    [bootstrap] | permutation p | Holm p."""
    return (f"{c.mean:+.4f} {ci_text(c.t_ci)} {ci_text(c.boot_ci)} | {c.diff:+.4f} {ci_text(c.diff_ci)} | "
            f"{c.p:.4f} | {c.p_holm:.4f}")


def seed_ranges(seeds) -> str:
    """[0, 1, 2, 5] -> '0-2, 5' (sorted)."""
    s, parts = sorted(seeds), []
    for x in s:
        if parts and x == parts[-1][1] + 1:
            parts[-1][1] = x
        else:
            parts.append([x, x])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in parts)


def grouped_seeds(conditions: list[str], label=None) -> str:
    """Conditions named ``<group>_s<seed>`` as ``<group> seeds 0-2, 7, <other> seed 3`` in
    first-seen order; ``label(condition)`` names a condition's group (default: ``arm``); a
    condition without a seed suffix is listed by its label alone."""
    by: dict[str, list[int]] = {}
    for c in conditions:
        m = re.fullmatch(r".+_s(\d+)", c)
        by.setdefault((label or arm)(c), []).extend([int(m.group(1))] if m else [])
    return ", ".join(f"{g} seed{'s' if len(s) > 1 else ''} {seed_ranges(s)}" if s else g for g, s in by.items())


def incomplete_line(want: list[str], done: set[str], steps: int, label=None) -> str:
    """The one line a pre-registered analysis prints instead of any number while runs of ``want``
    are not in ``done`` (no interim analysis); missing runs grouped by ``grouped_seeds``."""
    missing = [c for c in want if c not in done]
    return (f"INCOMPLETE: {len(want) - len(missing)} of {len(want)} runs finished at step {steps} "
            f"(missing: {grouped_seeds(missing, label)}); no endpoint is computed before the study is complete "
            f"(no interim analysis).")


def runs(sweep: str) -> list[tuple[pd.Series, pd.DataFrame]]:
    """(index row, metrics) of every run of a sweep that has metrics."""
    out = []
    for _, row in read_index(sweep).iterrows():
        d = Path(row["run_dir"])
        d = d if d.is_absolute() else Path(sweep) / row["run_id"]
        m = read_metrics(d)
        if m is not None:
            out.append((row, m))
    return out


def arm(condition: str) -> str:
    """The arm of a condition: its name without a trailing ``_s<seed>`` (one condition per seed)."""
    return re.sub(r"_s\d+$", "", condition)


def probe(sweep: str) -> str:
    rows: dict[str, list[tuple[float, float]]] = {}
    for row, m in runs(sweep):
        rows.setdefault(arm(row["spec_condition"]), []).append(
            (float(m["rollout_corr/k3_kl"].mean()), float(m["train/step_time_s"].median())))
    lines = ["| condition | runs | realized k3 (mean) | range | median wall s per training step |",
             "|---|---:|---:|---:|---:|"]
    for c, r in rows.items():
        k = [x[0] for x in r]
        lines.append(f"| {c} | {len(k)} | {fmt(float(np.mean(k)))} | {fmt(min(k))}-{fmt(max(k))} | "
                     f"{np.mean([x[1] for x in r]):.2f} |")
    return "\n".join(lines)


def run_slope(m: pd.DataFrame, start: int) -> tuple[float, float]:
    """(accuracy slope per 100 steps over evaluations at steps >= start, mean k3 over those steps)."""
    ev = m[["step", "val/accuracy"]].dropna()
    ev = ev[ev["step"] >= start]
    slope = line_fit(ev["step"], ev["val/accuracy"])[0] * 100 if len(ev) >= 2 else math.nan
    return slope, float(m.loc[m["step"] >= start, "rollout_corr/k3_kl"].mean())


def slopes(sweep: str, start: int) -> str:
    per: dict[str, dict[str, list]] = {}
    guard_ok, step_s = True, []
    for row, m in runs(sweep):
        s, k3 = run_slope(m, start)
        d = per.setdefault(arm(row["spec_condition"]), {"slope": [], "k3": [], "path": [], "level": [], "trend": []})
        k = m.sort_values("step")["rollout_corr/k3_kl"]
        d["trend"].append((float(k.iloc[:20].mean()), float(k.iloc[-20:].mean())))
        ev = m[["step", "val/accuracy"]].dropna()
        d["slope"].append(s), d["k3"].append(k3)
        at = dict(zip(ev["step"], ev["val/accuracy"]))
        d["path"].append((at.get(0, math.nan), at.get(start, math.nan), float(ev["val/accuracy"].iloc[-1])))
        d["level"].append(float(ev.loc[ev["step"] >= start, "val/accuracy"].mean()))
        if arm(row["spec_condition"]) == CONTROL:
            t = m[m["step"] >= 1]  # step 0 is the evaluation of the start alone (no rollout)
            guard_ok &= bool(len(t) == int(m["step"].max()) and (t["rollout_corr/k3_kl"] == 0).all()
                             and (t["mismatch/frac_bitwise_equal"] == 1).all())
        steps = int(m["step"].max())
        step_s.append((float(m["train/step_time_s"].sum()) + float(m["time/eval_s"].sum())) / steps)
    ctrl = per.get(CONTROL, {})
    lines = [f"| arm | seeds | realized k3 (steps >= {start}) | k3 first 20 -> last 20 steps (per seed) | "
             f"accuracy at 0 -> {start} -> last (per seed) | accuracy slope per 100 steps from {start} (95% t) | "
             f"excess over control (permutation p) | mean accuracy from {start} minus control |",
             "|---|---:|---:|---|---|---:|---:|---:|"]
    for c, d in per.items():
        mu, lo, hi = t_ci(d["slope"])
        path = "; ".join(" -> ".join(f"{x:.3f}" for x in p) for p in d["path"])
        if c != CONTROL and ctrl:
            p = permutation_test(d["slope"], ctrl["slope"])
            ex = f"{p.diff:+.3f} (p {p.p:.2f}, floor {p.floor:.2f})"
            level = f"{float(np.mean(d['level']) - np.mean(ctrl['level'])):+.3f}"
        else:
            ex, level = "-", "-"
        trend = "; ".join(f"{fmt(a)} -> {fmt(b)}" for a, b in d["trend"])
        lines.append(f"| {c} | {len(d['slope'])} | {fmt(float(np.mean(d['k3'])))} | {trend} | {path} | "
                     f"{mu:+.3f} [{lo:+.3f}, {hi:+.3f}] | {ex} | {level} |")
    lines.append("")
    lines.append(f"Control guard (k3 exactly 0 and every token bitwise equal at every step): "
                 f"{'held' if guard_ok else 'BROKEN'}. Wall seconds per RL step (train + eval share), "
                 f"mean over {len(step_s)} runs: {np.mean(step_s):.2f} (range {min(step_s):.2f}-{max(step_s):.2f}).")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ the study
def _slope(ev: pd.DataFrame, col: str) -> float:
    """OLS slope per 100 steps of ``col`` over the rows of ``ev`` (NaN with < 2 points)."""
    e = ev[["step", col]].dropna() if col in ev.columns else ev.iloc[:0]
    return line_fit(e["step"], e[col])[0] * 100 if len(e) >= 2 else math.nan


def run_endpoints(m: pd.DataFrame, start: int = STUDY["start"], *, diverged: bool = False) -> dict:
    """One run's endpoints (see the module docstring); steps are the metrics' ``step`` column."""
    m = m.sort_values("step")
    ev = m[m["val/accuracy"].notna()]
    win = ev[ev["step"] >= start]
    k3 = m["rollout_corr/k3_kl"]
    gold = "val/gold_logprob" in m.columns
    return {
        "acc_slope": _slope(win, "val/accuracy"), "gold_slope": _slope(win, "val/gold_logprob") if gold else math.nan,
        "acc_level": float(win["val/accuracy"].mean()),
        "gold_level": float(win["val/gold_logprob"].mean()) if gold else math.nan,
        "k3": float(m.loc[m["step"] >= start, "rollout_corr/k3_kl"].mean()),
        "k3_first": float(k3[m["step"] >= 1].iloc[:20].mean()), "k3_last": float(k3.iloc[-20:].mean()),
        "start_acc": float(ev["val/accuracy"].iloc[0]), "final_acc": float(ev["val/accuracy"].iloc[-1]),
        "final_gold": float(ev["val/gold_logprob"].iloc[-1]) if gold else math.nan,
        "fell": judge(m, rule="plateau", diverged=diverged) is not None,
        "guard": bool((m.loc[m["step"] >= 1, "rollout_corr/k3_kl"] == 0).all()
                      and (m.loc[m["step"] >= 1, "mismatch/frac_bitwise_equal"] == 1).all()),
        "steps": int(m["step"].max()), "rows": int((m["step"] >= 1).sum()),
    }


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
    """Refit ``fit_power`` on ``n`` seed resamples (each head arm's seeds and the control's resampled
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


def off_fit(fits: list[tuple[float, float, float]], arm_k3: np.ndarray, arm_x: np.ndarray, *, seed: int = 1,
            control: np.ndarray | None = None) -> tuple[float, float, float]:
    """How far a realistic arm's excess (per step) lies from the fitted law at its own k3:
    (observed minus fitted, and its 95% percentile interval), each fit replicate paired with a
    resample of the arm's seeds (its k3 with them) against that replicate's control mean, so the
    interval holds both the fit's uncertainty and the arm's own seed noise. ``control``: an arm of
    another study, whose excess is over its own control's seeds (resampled with each replicate)."""
    rng = np.random.default_rng(seed)
    d = []
    for c, alpha, ctrl in fits:
        i = rng.integers(0, arm_x.size, arm_x.size)
        if control is not None:
            ctrl = control[rng.integers(0, control.size, control.size)].mean()
        d.append((arm_x[i].mean() - ctrl) / 100 + c * arm_k3[i].mean() ** alpha)
    lo, hi = _pct(d)
    return float(np.mean(d)), lo, hi


def _pct(x, lo: float = 2.5, hi: float = 97.5) -> tuple[float, float]:
    return float(np.percentile(x, lo)), float(np.percentile(x, hi))


def _g(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.3g}"


def sweep_states(sweep: str, steps: int, is_control) -> tuple[list[str], set[str]]:
    """(the control conditions the zero-mismatch guard stopped, sorted; the conditions finished at
    ``steps`` or diverged) of a sweep, states and steps read live from each run's status.json; both
    empty when the sweep has no index yet. ``is_control(condition)`` picks the control runs."""
    if not (Path(sweep) / INDEX_FILE).exists():
        return [], set()
    idx = read_index(sweep)
    rows = list(zip(idx["spec_condition"], idx["state"], idx["last_step"]))
    tripped = sorted(c for c, s, _ in rows if is_control(c) and s == GUARD_FAILED)
    return tripped, {c for c, s, n in rows if (s == FINISHED and n == steps) or s == DIVERGED}


def collect(sweep: str, design: dict = STUDY, *, key=arm, endpoints=run_endpoints) -> dict[str, list[dict]]:
    """Per group (``key(spec_condition)``, default: the arm), the endpoints
    (``endpoints(metrics, start, diverged=...)``, default ``run_endpoints``; another study passes
    its own per-run analysis) and the ``condition`` of each run that counts: every finished run at
    its last step, and every diverged run (none is excluded for its outcome; a diverged run is a
    fall, with its endpoints over the evaluations it reached)."""
    per: dict[str, list[dict]] = {}
    if not (Path(sweep) / "index.parquet").exists():
        return per  # not started (or not committed yet)
    for row, m in runs(sweep):
        if (row["state"] == "finished" and int(m["step"].max()) == design["steps"]) or row["state"] == "diverged":
            per.setdefault(key(row["spec_condition"]), []).append(
                {"condition": row["spec_condition"],
                 **endpoints(m, design["start"], diverged=row["state"] == "diverged")})
    return per


def study(sweep: str, *, design: dict = STUDY) -> str:
    """The pre-registered analysis of a study sweep as markdown (see the module docstring)."""
    return analyse(collect(sweep, design), design=design)


def analyse(per: dict[str, list[dict]], *, design: dict = STUDY) -> str:
    """The pre-registered analysis of per-arm run endpoints (``collect``) as markdown."""
    done = sum(len(v) for v in per.values())
    want = design["arms"] * design["seeds"]
    if done < want or len(per) != design["arms"] or CONTROL not in per:
        counts = ", ".join(f"{a} {len(v)}" for a, v in per.items()) or "none"
        return (f"INCOMPLETE: {done} of {want} runs finished at step {design['steps']} ({counts}); "
                f"no endpoint is computed before the study is complete (no interim analysis).")
    ctrl = per[CONTROL]
    valid = all(r["guard"] and r["rows"] == design["steps"] for r in ctrl) and \
        all(r["start_acc"] >= design["min_start_accuracy"] for r in ctrl)
    out = [f"Validity: control guard (k3 exactly 0, every token bitwise equal, every step) "
           f"{'held' if all(r['guard'] for r in ctrl) else 'BROKEN'}; control step-0 accuracy "
           f"{min(r['start_acc'] for r in ctrl):.3f} (bar {design['min_start_accuracy']}): "
           f"{'VALID' if valid else 'VOID (re-run, do not analyse)'}.", ""]
    if not valid:
        return "\n".join(out)
    arms = [a for a in per if a != CONTROL]
    col = {a: {k: np.array([r[k] for r in per[a]], float) for k in ("k3", *dict(ENDPOINTS))} for a in per}
    verdict: dict[str, dict[str, bool]] = {a: {} for a in arms}
    for key, label in ENDPOINTS:
        c = col[CONTROL][key]
        cmp = compare_family({a: col[a][key] for a in arms}, {a: c for a in arms})
        out += [f"**{label}**", "",
                "| arm | realized k3 | mean [95% t] [95% bootstrap] | excess over control [95% bootstrap] | "
                "permutation p | Holm p | erodes |", "|---|---:|---:|---:|---:|---:|---|"]
        out.append(f"| {CONTROL} | 0 | {mean_cells(c)} | - | - | - | - |")
        for a in arms:
            r = cmp[a]
            erodes = verdict[a][key] = r.below()
            out.append(f"| {a} | {fmt(float(col[a]['k3'].mean()))} | {comparison_cells(r)} | "
                       f"{'**yes**' if erodes else f'no (costs {r.cost_bound()})'} |")
        out.append("")
    # secondary: falls, k3 trend, final values
    out += ["**Secondary**", "", "| arm | falls (plateau rule) [95% Clopper-Pearson] | k3 first 20 -> last 20 steps "
            "(mean over seeds) | accuracy at step 500 [95% t] | gold log-prob at step 500 [95% t] |",
            "|---|---:|---|---:|---:|"]
    for a in per:
        k = sum(r["fell"] for r in per[a])
        clo, chi = clopper_pearson(k, len(per[a]))
        fa, fg = t_ci([r["final_acc"] for r in per[a]]), t_ci([r["final_gold"] for r in per[a]])
        out.append(f"| {a} | {k}/{len(per[a])} [{clo:.2f}, {chi:.2f}] | "
                   f"{fmt(float(np.mean([r['k3_first'] for r in per[a]])))} -> "
                   f"{fmt(float(np.mean([r['k3_last'] for r in per[a]])))} | {fa[0]:.3f} [{fa[1]:.3f}, {fa[2]:.3f}] | "
                   f"{fg[0]:.3f} [{fg[1]:.3f}, {fg[2]:.3f}] |")
    out.append("")
    # the fit
    head = {a: col[a] for a in arms if a.startswith(HEAD)}
    real = [a for a in arms if not a.startswith(HEAD)]
    for key, (loss, what) in LOSS.items():
        name = dict(ENDPOINTS)[key].replace(" per 100 steps", "")
        k3 = np.array([head[a]["k3"].mean() for a in sorted(head)])
        ex = np.array([(head[a][key].mean() - col[CONTROL][key].mean()) / 100 for a in sorted(head)])
        fit = fit_power(k3, ex)
        if fit is None:
            near = min(head, key=lambda a: abs(math.log(head[a]["k3"].mean() / K3_REF)))
            dlo, dhi = bootstrap_diff_ci(head[near][key], col[CONTROL][key])
            where = f"Bound from {near} (realized k3 {fmt(float(head[near]['k3'].mean()))}): "
            if dlo < 0:
                where += f"losing {what} takes more than {_g(loss / (-dlo / 100))} steps."
            else:  # the whole interval is a gain over the control: no finite loss rate fits the data
                where += (f"its excess slope's 95% interval [{dlo:+.4f}, {dhi:+.4f}] per 100 steps lies above 0, so no "
                          f"loss rate is consistent with the data and no finite number of steps to lose {what} follows.")
            out.append(f"Fit ({name}): fewer than 3 head_perturb arms have a negative mean excess: no power law. {where}")
            continue
        c, alpha = fit
        fits, failed = bootstrap_fit(head, col[CONTROL][key], key)
        cs, als = np.array([f[0] for f in fits]), np.array([f[1] for f in fits])  # (fits,)
        ts = loss / (cs * K3_REF ** als)
        t = loss / (c * K3_REF ** alpha)
        eroding = [head[a]["k3"].mean() for a in head if verdict[a][key]]
        extrap = not eroding or K3_REF < min(eroding)
        out.append(f"Fit ({name}, per step): excess = -c * k3^alpha over {int((ex < 0).sum())} arms with a negative "
                   f"mean excess: c = {_g(c)} [{_g(_pct(cs)[0])}, {_g(_pct(cs)[1])}], alpha = {alpha:.2f} "
                   f"[{_pct(als)[0]:.2f}, {_pct(als)[1]:.2f}] ({len(fits)} resamples fitted, {failed} had fewer than "
                   f"3 negative arms). Steps for a persistent k3 of {K3_REF:g} to cost {what}: {_g(t)} "
                   f"[{_g(_pct(ts)[0])}, {_g(_pct(ts)[1])}]{' (an extrapolation: below the smallest eroding k3)' if extrap else ''}.")
        for a in real:
            kr = float(col[a]["k3"].mean())
            obs = (col[a][key].mean() - col[CONTROL][key].mean()) / 100
            d, lo, hi = off_fit(fits, col[a]["k3"], col[a][key])
            ok = lo <= 0 <= hi
            out.append(f"- {a}: realized k3 {fmt(kr)}, excess {obs:+.2e} per step, minus the fit at its k3 "
                       f"{d:+.2e} [{lo:+.2e}, {hi:+.2e}]: {'agrees with the fit' if ok else 'off the curve'}.")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", choices=("probe", "slopes", "study"))
    ap.add_argument("sweep")
    ap.add_argument("--from", dest="start", type=int, default=50, help="first step of the slope window (default 50)")
    a = ap.parse_args(argv)
    print({"probe": lambda: probe(a.sweep), "slopes": lambda: slopes(a.sweep, a.start),
           "study": lambda: study(a.sweep)}[a.table]())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
