"""The surge testbed's FINDINGS blocks (docs/findings/surge-testbed.md and the verdicts): its
conditions, the verdict tests of P1-P6, P3's indicators before a collapse, the collapse-threshold
cells and the 300-step 16-digit runs. Each block is a function of ``common.load_runs()``'s table.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from timlab.experiments.studies.findings_blocks.common import (DOSE_SWEEPS, INDICATORS, LEARNED_AT, PRE, SWEEPS,
                                                               fmt, frac_ci, perm, runs_of, seeds, sig)
from timlab.experiments.studies.stats import line_fit
from timlab.experiments.studies.threshold import REALISTIC_K3, threshold_study
from timlab.experiments.sweeps.tables import md_table
from timlab.rundir import read_metrics


SURGE = [  # (condition, label) in the order FINDINGS lists them
    ("zero_mismatch", "zero mismatch"), ("bf16_rollout", "bf16 rollout"), ("head_0.5", "head_perturb 0.5"),
    ("head_1", "head_perturb 1"), ("head_1.5", "head_perturb 1.5"), ("head_2", "head_perturb 2"),
    ("zero_mismatch+lr_2e-5", "zero mismatch, lr 2e-5"), ("head_1+lr_2e-5", "head_perturb 1, lr 2e-5"),
    ("head_1+length_decay_P60", "head_perturb 1 + length decay, P = 60"),
    ("head_1+token_tis", "head_perturb 1 + token TIS"),
    ("head_1+length_decay_P60+token_tis", "head_perturb 1 + length decay P = 60 + token TIS"),
]


def surge_conditions(R: pd.DataFrame) -> str:
    rows = []
    for cond, label in SURGE:
        g = runs_of(R, "surge", cond)
        n, k = len(g), int(g["collapsed"].sum())
        steps = g.loc[g["collapsed"], "steps_to_collapse"]
        learned = g["learned_step"].dropna()
        k3 = g["k3_kl_mean"].mean()
        rows.append({
            "condition": label,
            "realized k3": "0 (bitwise)" if k3 == 0 and cond == "zero_mismatch" else sig(k3),
            "collapsed [95% CI] (steps)": frac_ci(k, n) + (f" ({', '.join(f'{s:g}' for s in sorted(steps))})" if k else ""),
            "final accuracy (range)": f"{fmt(g['final_accuracy'].mean())} ({fmt(g['final_accuracy'].min())}-"
                                      f"{fmt(g['final_accuracy'].max())})",
            "peak accuracy": fmt(g["peak_accuracy"].mean(), 3),
            f"accuracy >= {LEARNED_AT:g} (median step)": f"{len(learned)}/{n}" + (f" ({learned.median():g})" if len(learned) else ""),
            "response length first / last 10 steps": f"{g['len0'].mean():.1f} / {g['len1'].mean():.1f}",
            "surge detector fired": f"{int(g['surge_fired'].notna().sum())}/{n}",
        })
    sec = R.loc[R["sweep"] == "surge", "seconds"]
    return md_table(rows) + (f"\n\nA run's logged step and evaluation times (`train/step_time_s` + `time/eval_s`) sum "
                             f"to {sec.min():.0f}-{sec.max():.0f} s on the shared machine (one thread per run).")


def _test_row(claim: str, what: str, a: pd.DataFrame, b: pd.DataFrame, col: str, note: str = "") -> dict:
    x, y = a[col].dropna().to_numpy(), b[col].dropna().to_numpy()
    d = 1 if all(float(v).is_integer() for v in [*x, *y]) and col != "collapsed" else 3  # steps: one decimal
    return {"claim": claim, "comparison (A vs B)": what, "A per seed (mean)": f"{seeds(x)} ({fmt(x.mean(), d)})",
            "B per seed (mean)": f"{seeds(y)} ({fmt(y.mean(), d)})",
            "mean A - mean B, exact permutation p": perm(x, y), "note": note}


def verdict_tests(R: pd.DataFrame) -> str:
    s = lambda c: runs_of(R, "surge", c)  # noqa: E731
    t = lambda c: runs_of(R, "threshold", c)  # noqa: E731
    rows = [
        _test_row("P1", "final accuracy: zero mismatch vs head_perturb 2", s("zero_mismatch"), s("head_2"),
                  "final_accuracy"),
        _test_row("P1", "collapsed (1/0): head_perturb 2 vs zero mismatch", s("head_2"), s("zero_mismatch"),
                  "collapsed", "4/5 vs 0/5"),
        _test_row("P2 sooner", "collapse step: head_perturb 1.5 (k3 0.78) vs 2 (k3 2.5), collapsed runs only",
                  s("head_1.5"), s("head_2"), "steps_to_collapse", "4 vs 4: the smallest possible p is 2/70 = 0.029"),
        _test_row("P2 more damage", "final accuracy: head_perturb 1.5 vs 2", s("head_1.5"), s("head_2"), "final_accuracy"),
        _test_row("P4", "final accuracy: head_perturb 1, lr 2e-5 vs 2e-4", s("head_1+lr_2e-5"), s("head_1"),
                  "final_accuracy", "neither LR collapses at this dose"),
        _test_row("P4", "collapsed (1/0): head_perturb 1.5, lr 1e-4 vs 2e-4", t("head_d4_lr1e-4_m1.5"), s("head_1.5"),
                  "collapsed", "half the LR, not 10x lower"),
        _test_row("P4", "final accuracy: head_perturb 1.5, lr 1e-4 vs 2e-4", t("head_d4_lr1e-4_m1.5"), s("head_1.5"),
                  "final_accuracy"),
        _test_row("P5", "final accuracy: head_perturb 1, length decay P = 60 vs constant LR",
                  s("head_1+length_decay_P60"), s("head_1"), "final_accuracy",
                  "no zero-mismatch + decay control was run"),
        _test_row("P5", "peak accuracy: head_perturb 1, length decay P = 60 vs constant LR",
                  s("head_1+length_decay_P60"), s("head_1"), "peak_accuracy"),
        _test_row("P6", "final accuracy: head_perturb 1, token TIS vs no remedy", s("head_1+token_tis"), s("head_1"),
                  "final_accuracy"),
        _test_row("P6", "final accuracy: head_perturb 1, TIS + length decay vs TIS", s("head_1+length_decay_P60+token_tis"),
                  s("head_1+token_tis"), "final_accuracy", "one seed of A never learned (0.30)"),
        _test_row("small TIM", "final accuracy: head_perturb 0.5 (k3 0.022) vs zero mismatch", s("head_0.5"),
                  s("zero_mismatch"), "final_accuracy"),
        _test_row("small TIM", f"post-learning slope (accuracy per 100 steps): head_perturb 1 vs zero mismatch",
                  s("head_1"), s("zero_mismatch"), "slope"),
        _test_row("small TIM", "post-learning slope: head_perturb 0.5 vs zero mismatch", s("head_0.5"),
                  s("zero_mismatch"), "slope"),
        _test_row("realistic TIM", "final accuracy: bf16 rollout vs zero mismatch", s("bf16_rollout"),
                  s("zero_mismatch"), "final_accuracy"),
    ]
    return md_table(rows)


def _pre_collapse_ratios(R: pd.DataFrame) -> pd.DataFrame:
    """Per collapsed head_perturb run at 4-16 digits (lr 2e-4) with an early window to compare:
    each indicator's mean over the PRE steps before the collapse step over its mean over the PRE
    steps before those (> 1: the indicator rose before the collapse)."""
    rows = []
    for r in R[R["sweep"].isin(DOSE_SWEEPS) & R["collapsed"]].itertuples():
        if not r.condition.startswith("head_") or "_d2_" in r.condition or "lr" in r.condition:
            continue
        c = r.steps_to_collapse
        if c < 2 * PRE + 1:
            continue
        df = read_metrics(r.dir)
        late = df[(df["step"] >= c - PRE) & (df["step"] < c)]
        early = df[(df["step"] >= c - 2 * PRE) & (df["step"] < c - PRE)]
        rows.append({"run": f"{r.condition} seed {r.seed}", "step": c,
                     **{k: late[m].mean() / early[m].mean() for k, m in INDICATORS.items()}})
    return pd.DataFrame(rows)


def p3(R: pd.DataFrame) -> str:
    rows = []
    for cond, label in SURGE[:6]:
        g = runs_of(R, "surge", cond)
        corr = []
        for d in g["dir"]:
            df = read_metrics(d)
            df = df[df["step"] > 0]
            k3, gn = df["rollout_corr/k3_kl"], df["train/grad_norm"]
            if k3.std() > 0 and gn.std() > 0:
                corr.append(float(np.corrcoef(k3, gn)[0, 1]))
        rows.append({"condition": label, "train/grad_norm_ema, run mean (range)":
                     f"{fmt(g['grad_norm_ema'].mean())} ({fmt(g['grad_norm_ema'].min())}-{fmt(g['grad_norm_ema'].max())})",
                     "per-step corr(k3, grad norm) per run": seeds(corr) if corr else "- (k3 constant 0)"})
    out = md_table(rows)
    mism = R[R["sweep"].isin(DOSE_SWEEPS) & (R["k3_kl_mean"] > 0)]
    fell = mism["k3_last"] < mism["k3_first"]
    h15 = runs_of(R, "surge", "head_1.5")
    out += (f"\n\nRealized k3 over the last 10 steps is below the first 10 steps' in {int(fell.sum())} of {len(mism)} "
            f"mismatched runs (surge, threshold, threshold_d16); at head_perturb 1.5: {fmt(h15['k3_first'].mean())} -> "
            f"{fmt(h15['k3_last'].min())}-{fmt(h15['k3_last'].max())}.")
    ratios = _pre_collapse_ratios(R)
    rows = [{"run (collapse step)": f"{r['run']} ({r['step']:g})",
             **{k: fmt(r[k]) for k in INDICATORS}} for _, r in ratios.iterrows()]
    rose = {k: int((ratios[k] > 1).sum()) for k in INDICATORS}
    summary = ", ".join(f"{k} {rose[k]}/{len(ratios)} ({fmt(ratios[k].min())}-{fmt(ratios[k].max())})" for k in INDICATORS)
    return (out + "\n\nBefore each collapse at step >= 41 (head_perturb, lr 2e-4, 4-16 digits): each indicator's mean "
            f"over the {PRE} steps before the collapse step / its mean over the {PRE} steps before those "
            "(> 1 = it rose):\n\n" + md_table(rows) + f"\n\nRose before the collapse: {summary}.")


def _cell_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    return line_fit([math.log10(p[0]) for p in points], [math.log10(p[1]) for p in points])


def threshold(R: pd.DataFrame) -> str:
    res = threshold_study([SWEEPS / "surge", SWEEPS / "threshold", SWEEPS / "threshold_d16"])
    plateau = R[R["sweep"].isin(DOSE_SWEEPS)]
    rows = []
    for c in res.cells:
        if c.family not in ("head_perturb", "logit_noise") or (c.family == "logit_noise" and c.lr != 2e-4):
            continue
        if c.family == "head_perturb" and c.lr not in (1e-4, 2e-4):
            continue
        doses = "; ".join(f"{sig(d.k3)} ({d.n_collapsed}/{d.n})" for d in c.doses.itertuples() if d.dose > 0)
        lo_hi = f"[{sig(c.lo)}, {sig(c.hi)}]" if math.isfinite(c.hi) else f"> {sig(c.lo)}"
        rows.append({"cell": f"{c.family}, {c.scale} digits, lr {c.lr:g}", "realized k3 per dose (collapsed)": doses,
                     "k3* bracket": lo_hi, "T at the bracket": f"{c.T:.1f}"})
    out = md_table(rows)
    controls = []
    for sweep, cond, digits in (("threshold", "zero_d2", 2), ("surge", "zero_mismatch", 4), ("threshold", "zero_d8", 8),
                                ("threshold_d16", "zero_d16", 16)):
        g = runs_of(R, sweep, cond)
        controls.append({"zero-mismatch control": f"{digits} digits", "greedy accuracy at step 0": fmt(g["start_accuracy"].mean()),
                         "final (range)": f"{fmt(g['final_accuracy'].mean())} ({fmt(g['final_accuracy'].min())}-"
                                          f"{fmt(g['final_accuracy'].max())})",
                         "peak (range)": f"{fmt(g['peak_accuracy'].min())}-{fmt(g['peak_accuracy'].max())}",
                         "response length first / last 10 steps": f"{g['len0'].mean():.1f} / {g['len1'].mean():.1f}",
                         "T (mean over the run)": f"{g['response_length_mean'].mean():.1f}",
                         "surge detector fired": f"{int(g['surge_fired'].notna().sum())}/{len(g)}"})
    out += "\n\n" + md_table(controls)
    # fits over the head_perturb lr 2e-4 cells with both bounds: through the geometric midpoints, and over
    # every choice of one end of each bracket (how far the bracket widths alone move the slope)
    cells = {c.scale: c for c in res.cells if c.family == "head_perturb" and c.lr == 2e-4
             and math.isfinite(c.lo) and math.isfinite(c.hi)}
    lines = []
    for scales in ((2, 4, 8), (2, 4, 8, 16)):
        pts = [(cells[s].T, cells[s].k3_star) for s in scales]
        slope, icpt = _cell_fit(pts)
        t_star = 10 ** ((math.log10(REALISTIC_K3) - icpt) / slope)
        ends = []
        for pick in np.ndindex(*([2] * len(scales))):
            e = [(cells[s].T, (cells[s].lo, cells[s].hi)[i]) for s, i in zip(scales, pick)]
            sl, ic = _cell_fit(e)
            ends.append((sl, 10 ** ((math.log10(REALISTIC_K3) - ic) / sl)))
        sl = [e[0] for e in ends]
        ts = [e[1] for e in ends]
        line = (f"- {len(scales)} cells ({', '.join(map(str, scales))} digits): k3* ~ T^{slope:.2f} through the bracket "
                f"midpoints, k3* = {REALISTIC_K3:g} at T ~ {t_star:.0f}; over every choice of one end of each bracket "
                f"the slope spans {min(sl):.2f} to {max(sl):.2f} and the T at k3* = {REALISTIC_K3:g} spans "
                f"{min(ts):.0f}-{max(ts):.0f}.")
        if scales == (2, 4, 8):
            pred = [10 ** (icpt + slope * math.log10(T)) for T in (60, 50)]
            line += f" Its prediction at T 50-60 (the 16-digit cell): k3* {pred[0]:.3f}-{pred[1]:.3f}."
        lines.append(line)
    counts = []
    for sweep, label in (("surge", "surge (4 digits)"), ("threshold", "threshold (2, 4, 8 digits)"),
                         ("threshold_d16", "threshold_d16 (16 digits)")):
        g = plateau[plateau["sweep"] == sweep]
        d2 = g["condition"].str.contains("_d2_")
        counts.append(f"{label}: {int(g['collapsed'].sum())} of {len(g)} runs collapsed under the default rule, "
                      f"{int(g['collapsed_plateau'].sum())} under the plateau rule"
                      + (f" (all {int(g.loc[d2, 'collapsed_plateau'].sum())} at 2 digits)" if d2.any() else ""))
    return out + "\n\n" + "\n".join(lines) + "\n- Plateau rule (learned at 0.5; `timlab runs DIR --rule plateau`): " + \
        "; ".join(counts) + "."


def d16_300(R: pd.DataFrame) -> str:
    rows = []
    for cond, label in (("zero_d16", "zero mismatch"), ("head_d16_m0.5", "head_perturb 0.5"),
                        ("head_d16_m0.75", "head_perturb 0.75")):
        g = runs_of(R, "threshold_d16_300", cond)
        at150, span = [], []
        for d in g["dir"]:
            ev = read_metrics(d).dropna(subset=["val/accuracy"]).set_index("step")["val/accuracy"]
            at150.append(ev.loc[150])
            late = ev[ev.index >= 60]
            span.append((late.min(), late.max()))
        rows.append({
            "condition": label, "realized k3 (300 steps)": sig(g["k3_kl_mean"].mean()),
            "accuracy at step 150 per seed": seeds(at150), "at step 300 per seed": seeds(g["final_accuracy"]),
            "range over steps 60-300": f"{fmt(min(s[0] for s in span))}-{fmt(max(s[1] for s in span))}",
            "collapsed: default rule / min-peak 0.5 / plateau": f"{int(g['collapsed'].sum())}/5 / "
                                                                 f"{int(g['collapsed_min_peak'].sum())}/5 / "
                                                                 f"{int(g['collapsed_plateau'].sum())}/5",
        })
    return md_table(rows)
