"""The numbers behind docs/FINDINGS.md and its pages, recomputed from the committed sweeps under sweeps/.

    python scripts/findings_tables.py            # print every generated table
    python scripts/findings_tables.py --write    # rewrite the generated blocks of the findings
    python scripts/findings_tables.py --check    # exit 1 if a findings file differs from the data
    python scripts/findings_tables.py DIR...     # the generic per-condition tables of any sweeps

docs/FINDINGS.md (the verdicts) or one of its pages (docs/findings/*.md, one per study) holds each
table between ``<!-- findings:NAME -->`` and ``<!-- /findings:NAME -->`` (``timlab.findings`` finds
which); ``tests/test_findings.py`` fails when the committed text differs from what this script
computes. Statistics (``timlab.experiments.studies.stats``): two-sided exact
permutation tests of a difference in means (every relabeling enumerated: 252 for 5 vs 5, whose
smallest possible p is 2/252 = 0.008), and 95% Clopper-Pearson intervals for collapse fractions.
Collapses follow the sweeps' rule (``timlab.experiments.studies.collapse``) unless a column says
``plateau`` (the plateau rule, a sustained fall from the learned level).
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timlab.experiments.studies.collapse import judge, run_summary  # noqa: E402
from timlab.rundir import read_metrics  # noqa: E402
from timlab.rundir.metrics_log import first_difference  # noqa: E402
from timlab.experiments.studies.stats import bootstrap_diff_ci, clopper_pearson, line_fit, permutation_test  # noqa: E402
from timlab.experiments.studies.engine import analyze, endpoint_values, planned_runs, predictions  # noqa: E402
from timlab.experiments.studies.registration import load_study  # noqa: E402
from timlab.experiments.studies.oos import blocks as predictor_study_blocks  # noqa: E402
from timlab.experiments.studies.predictor import load_predictor  # noqa: E402
from timlab.experiments.studies.heldout import analyze_heldout, blocks as heldout_blocks, load_heldout  # noqa: E402
from timlab.experiments.studies.text import fmt as study_fmt, splice_block, write_blocks  # noqa: E402
from timlab.experiments.studies.threshold import REALISTIC_K3, threshold_study  # noqa: E402
from timlab.experiments.sweeps.tables import generic, md_table, surge_step  # noqa: E402
from timlab.experiments.studies import early_warning, early_warning2  # noqa: E402
from timlab.findings import INDEX, by_file  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
import e3_tables  # noqa: E402
import harm2_sweeps  # noqa: E402
import erosion_tables  # noqa: E402
import moe_tables  # noqa: E402

FINDINGS = INDEX
"""The findings index; its pages (docs/findings/*.md) hold most blocks."""
SWEEPS = ROOT / "sweeps"
STUDIES = ROOT / "docs" / "examples" / "studies"
"""The study files (``timlab study``): each writes the FINDINGS block its ``findings`` names."""
LEARNED_AT = 0.6
"""A surge-testbed run has learned once greedy accuracy reaches this (the scratchpad switch)."""
SLOPE_LAG = 20
"""The post-learning slope starts this many steps after a run first reaches ``LEARNED_AT``."""
PRE = 20
"""Steps in each window of the before-a-collapse comparison (P3)."""
DOSE_SWEEPS = ("surge", "threshold", "threshold_d16")
"""The dose sweeps at 150 steps (P3's counts and the before-a-collapse table read only these)."""
INDICATORS = {"k3": "rollout_corr/k3_kl", "log-ppl abs diff": "rollout_corr/log_ppl_abs_diff",
              "sum form": "mismatch/log_ppl_abs_diff_sum", "grad norm": "train/grad_norm"}


# ------------------------------------------------------------------------------- formatting
def fmt(x: float, digits: int = 2) -> str:
    """A number as FINDINGS writes it: fixed decimals (2 here), or 2 significant digits below 0.01."""
    return study_fmt(x, digits)


def frac_ci(k: int, n: int) -> str:
    lo, hi = clopper_pearson(k, n)
    return f"{k}/{n} [{lo:.2f}, {hi:.2f}]"


def perm(a, b) -> str:
    r = permutation_test(a, b)
    diff = f"{r.diff:+.1f}" if all(float(v).is_integer() for v in [*a, *b]) and abs(r.diff) > 1 else f"{r.diff:+.3f}"
    return f"{diff}, p = {r.p:.3f}" + (" (the floor)" if r.p <= r.floor + 1e-12 else "")


def sig(x: float) -> str:
    """Two significant digits (realized k3 spans 1e-4 to 7)."""
    return "0" if x == 0 else f"{x:.2g}"


def seeds(x) -> str:
    x = list(x)
    if all(float(v).is_integer() for v in x):
        return ", ".join(f"{int(v)}" for v in x)
    return ", ".join(fmt(v) for v in x)


# ------------------------------------------------------------------------------- data
def load_runs() -> pd.DataFrame:
    """One row per run of the committed sweeps: sweep, condition, seed, the run summary (default
    rule) and the plateau rule's verdict, the post-learning slope and a few curve statistics."""
    rows = []
    for sweep in (*DOSE_SWEEPS, "threshold_d16_300"):
        for d in sorted(p for p in (SWEEPS / sweep).glob("*__*") if p.is_dir()):
            cond, seed = re.fullmatch(r"(.+)__seed(\d+)__[0-9a-f]+", d.name).groups()
            s = run_summary(d)
            df = read_metrics(d)
            div = {"diverged": s["state"] == "diverged"}  # a diverged run's step: status.json, as run_summary
            ev = df.dropna(subset=["val/accuracy"])
            train = df[df["step"] > 0]
            hit = ev.loc[ev["val/accuracy"] >= LEARNED_AT, "step"]
            learned = float(hit.iloc[0]) if len(hit) else math.nan
            slope = math.nan
            if math.isfinite(learned):
                w = ev[ev["step"] >= learned + SLOPE_LAG]
                if len(w) >= 3:
                    slope = line_fit(w["step"], w["val/accuracy"])[0] * 100
            cfg = yaml.safe_load((d / "config.yaml").read_text())
            k3 = train["rollout_corr/k3_kl"]
            rows.append({"sweep": sweep, "condition": cond, "seed": int(seed), "dir": d, **s,
                         "start_accuracy": float(ev["val/accuracy"].iloc[0]),
                         "surge_fired": surge_step(train, cfg["scheduler"]),
                         "k3_first": k3.iloc[:10].mean(), "k3_last": k3.iloc[-10:].mean(),
                         "collapsed_plateau": judge(df, rule="plateau", **div) is not None,
                         "collapsed_min_peak": judge(df, min_peak=0.5, **div) is not None,
                         "learned_step": learned, "slope": slope,
                         "len0": train["train/response_length_mean"].iloc[:10].mean(),
                         "len1": train["train/response_length_mean"].iloc[-10:].mean(),
                         "grad_norm_ema": train["train/grad_norm_ema"].mean(),
                         "seconds": df["train/step_time_s"].sum() + df["time/eval_s"].fillna(0).sum()})
    return pd.DataFrame(rows)


def runs_of(R: pd.DataFrame, sweep: str, cond: str) -> pd.DataFrame:
    g = R[(R["sweep"] == sweep) & (R["condition"] == cond)].sort_values("seed")
    if g.empty:
        raise KeyError(f"no runs of {sweep}/{cond}")
    return g


# ------------------------------------------------------------------------------- blocks
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


def step_k3(name: str, window: tuple[int, int]) -> dict[tuple[str, str], list[pd.Series]]:
    """{(group, arm): each run's per-step realized k3 over the steps of ``window``} of the study file
    ``name`` (every block's runs; group "" in an ungrouped study), read from its committed runs."""
    from timlab.experiments.studies.blocks import block_dirs

    study = load_study(STUDIES / name)
    dirs = block_dirs(study, root=ROOT)
    per = {}
    for run in planned_runs(study):
        df = read_metrics(dirs[run.block] / run.run_id)
        k3 = df.loc[(df["step"] >= window[0]) & (df["step"] <= window[1]), "rollout_corr/k3_kl"].dropna()
        per.setdefault((run.group, run.arm), []).append(k3)
    return per


def l1_k3_steps(R: pd.DataFrame) -> str:
    """Study L1's realized k3 step by step (descriptive, not a registered endpoint): per run over
    steps 10-40 its median, mean, largest step and share of steps above 1e-2, then the mean over
    seeds of each (the median's median beside it). The registered mechanism table has the mean only."""
    per = {(int(g), a): [(k3.median(), k3.mean(), k3.max(), float((k3 > 1e-2).mean())) for k3 in runs]
           for (g, a), runs in step_k3("l1.yaml", (10, 40)).items()}
    rows = []
    for (restate, arm), v in sorted(per.items()):
        if arm == "control":
            continue
        med, mean, top, above = (np.array(x) for x in zip(*v))
        median = f"{fmt(med.mean(), 3)}; {fmt(np.median(med), 3)}"
        rows.append({"restate": restate, "arm": arm, "seeds": len(v),
                     "median k3 (mean over seeds; median over seeds)": median, "mean k3": fmt(mean.mean(), 3),
                     "largest step (median over seeds)": fmt(np.median(top), 3),
                     "share of steps above 1e-2": f"{above.mean():.2f}"})
    return md_table(rows)


def p1_pairs(R: pd.DataFrame) -> str:
    """Study P1, descriptive (not a registered test): each redraw arm against redraw_1 on the primary
    endpoint (the accuracy level over evaluations at steps 50-150), with the mean magnitude the
    controller chose (steps 10-150): how the cost moves with the persistence at a similar weight-space
    size. Exact permutation p, no correction; bootstrap interval of the difference. Both columns are
    the study's registered endpoints (``acc_level``, ``mag``) as its analysis computes them."""
    cols = endpoint_values(load_study(STUDIES / "p1.yaml"), root=ROOT)[""]
    ref = cols["redraw_1"]["acc_level"]
    rows = []
    for arm in ("persist", "redraw_25", "redraw_5"):
        a = cols[arm]["acc_level"]
        lo, hi = bootstrap_diff_ci(ref, a)
        r = permutation_test(ref, a)
        rows.append({"arm": arm, "mean magnitude": f"{cols[arm]['mag'].mean():.3f}",
                     "redraw_1 (magnitude %.3f) minus arm [95%% bootstrap]" % cols["redraw_1"]["mag"].mean():
                         f"{r.diff:+.4f} [{lo:+.4f}, {hi:+.4f}]",
                     "exact permutation p": f"{r.p:.4f}"})
    return md_table(rows)


def p2_persistence(R: pd.DataFrame) -> str:
    """Study P2's runs re-run after the analysis with the persistence metrics (sweeps/p2_rerun, same
    spec, same machine): how many are bit for bit the committed runs in every value both logged, and
    per mismatch arm the mean over seeds of each run's mean persistence over steps 10-150, with each
    seed's moving-average persistence beside its realized k3 and its cost (the registered ``k3``
    endpoint, and the control's accuracy level minus its own). Descriptive, not a registered test."""
    study = load_study(STUDIES / "p2.yaml")
    cols = endpoint_values(study, root=ROOT)[""]
    control = cols["control"]["acc_level"].mean()
    same, per = 0, {}
    for run in planned_runs(study):
        a, b = read_metrics(ROOT / study.out / run.run_id), read_metrics(SWEEPS / "p2_rerun" / run.run_id)
        same += first_difference(a, b) is None
        if run.arm != "control":
            w = b[(b["step"] >= 10) & (b["step"] <= 150)]
            per.setdefault(run.arm, []).append([w[k].mean() for k in ("mismatch/persistence_lag1",
                                                                      "mismatch/persistence_ema",
                                                                      "mismatch/persistence_reliability")])
    rows = []
    for arm, v in per.items():
        v = np.array(v)
        rows.append({"arm": arm, "persistence_lag1": f"{v[:, 0].mean():.2f}", "persistence_ema": f"{v[:, 1].mean():.2f}",
                     "reliability": f"{v[:, 2].mean():.2f}",
                     "per seed 0-7: persistence_ema / realized k3 (steps 10-150) / cost": ", ".join(
                         f"{e:.2f} / {k:.4f} / {control - c:.3f}"
                         for e, k, c in zip(v[:, 1], cols[arm]["k3"], cols[arm]["acc_level"]))})
    n = len(planned_runs(study))
    return (f"{same} of {n} re-run runs identical to the committed ones in every value both logged.\n\n"
            + md_table(rows))


def p2_amd(R: pd.DataFrame) -> str:
    """Study P2's extension, block amd alone (seeds 8-15, descriptive beside the registered pooled test):
    each seed's persistence_ema, realized k3 (steps 10-150) and cost (the block's control level minus its
    own), and rule 1's comparison in this block alone (redraw_1 minus persist, exact permutation p). The
    registered endpoints as the study's engine computes them, with persistence_ema's level added."""
    import dataclasses

    from timlab.experiments.studies.engine import BLOCK
    from timlab.experiments.studies.registration import Endpoint

    study = load_study(STUDIES / "p2_16.yaml")
    study = dataclasses.replace(study, endpoints=(*study.endpoints, Endpoint(
        "pers", "mismatch/persistence_ema", "level", (10, 150))))
    amd = float([b.name for b in study.blocks].index("amd"))
    cols = {arm: {k: v[c[BLOCK] == amd] for k, v in c.items()} for arm, c in endpoint_values(study, root=ROOT)[""].items()}
    control = cols["control"]["acc_level"].mean()
    rows = [{"arm": arm, "per seed 8-15: persistence_ema / realized k3 (steps 10-150) / cost": ", ".join(
                 f"{e:.2f} / {k:.4f} / {control - a:.3f}"
                 for a, k, e in zip(cols[arm]["acc_level"], cols[arm]["k3"], cols[arm]["pers"]))}
            for arm in ("persist", "redraw_1")]
    r = permutation_test(cols["redraw_1"]["acc_level"], cols["persist"]["acc_level"])
    return (md_table(rows) + f"\n\nBlock amd alone, redraw_1 minus persist: {r.diff:+.4f}, exact permutation p = "
            f"{r.p:.4f} ({r.n_relabelings:,} relabelings).")


# ------------------------------------------------------------------------------- re-analysis (issue 56, item 4)
# Descriptive numbers an independent re-analysis asked FINDINGS to state beside three verdicts (E3c, L1, H1);
# none is a registered test.
def _grouped_cells(name: str) -> tuple[dict, list]:
    """A grouped study's registered endpoints keyed by (group, arm), and its treated cells in order."""
    study = load_study(STUDIES / name)
    cols = endpoint_values(study, root=ROOT)
    col = {(g, a): v for g, per in cols.items() for a, v in per.items()}
    return col, [(g, a) for g, a in col if a != study.control]


def e3c_reading(R: pd.DataFrame) -> str:
    """What E3c's shape test turned on: E3b's three fits (the registered free fit and one power of
    each dose, ``fits.predictors``) at E3c's realized k3, at E3b's longest T (in sample) and at
    E3c's T; and the exponent of T that carries the registered fit's cost at E3b's longest T to
    E3c's measured cost, b = beta + log(measured / predicted) / log(T_E3c / T_longest), over the
    registered test's 2,000 joint resamples of both studies' seeds (``fits.prediction_test``'s draws)."""
    from timlab.experiments.studies import fits as F

    colf, fitted = _grouped_cells("e3b.yaml")
    col, test = _grouped_cells("e3c.yaml")
    kf, Tf, exf, gf = F.length_cells(colf, fitted, "acc_level")
    k, T, ex, _ = (float(x[0]) for x in F.length_cells(col, test, "acc_level"))
    longest = float(Tf.max())
    pred = F.predictors(kf, Tf, exf, gf)
    law = {F.FREE: tuple(F.fit_length(kf, Tf, exf, gf)[1:])}  # (k3's exponent, T's)
    for rho in (1.0, 2.0):
        g = F.fit_shape(kf, Tf, exf, gf, rho)[1]
        law[F.dose_name(rho)] = (g, rho * g)

    def exponent(kf, Tf, exf, gf, k, T, loss):
        a, alpha, beta = F.fit_length(kf, Tf, exf, gf)
        t0 = float(Tf.max())
        return beta + math.log(loss / math.exp(a + alpha * math.log(k) + beta * math.log(T))) / math.log(T / t0)

    rng = np.random.default_rng(0)  # the registered test's draws: E3b's cells, then E3c's, per resample
    bs = []
    for _ in range(F.N_BOOT):
        cells = F.length_cells(colf, fitted, "acc_level", rng=rng)
        kt, Tt, et, _ = F.length_cells(col, test, "acc_level", rng=rng)
        if F.fit_length(*cells) is not None and -et[0] > 0:
            bs.append(exponent(*cells, float(kt[0]), float(Tt[0]), float(-et[0])))
    rows = [{"hypothesis (E3b's cells)": h, "cost as": f"k3^{law[h][0]:.2f} T^{law[h][1]:.2f}",
             f"at T = {longest:.1f} (E3b's longest, in sample)": fmt(f(k, longest), 4),
             f"at T = {T:.1f} (E3c)": fmt(f(k, T), 4)} for h, f in pred.items()]
    r = {t: pred["T^2 * k3"](k, t) / pred["T * k3"](k, t) for t in (longest, T)}
    lo, hi = (float(np.percentile(bs, q)) for q in (2.5, 97.5))
    return (f"At E3c's realized k3 {study_fmt(k)} (E3b's cells realized {study_fmt(float(kf.min()))} to "
            f"{study_fmt(float(kf.max()))}):\n\n" + md_table(rows) + "\n\n"
            f"T^2 * k3's prediction over T * k3's: {r[longest]:.2f}x at T = {longest:.1f}, {r[T]:.2f}x at T = {T:.1f}.\n\n"
            f"The exponent of T that carries the registered fit's cost at T = {longest:.1f} (at k3 {study_fmt(k)}) to "
            f"E3c's measured {fmt(-ex, 4)} at T = {T:.1f}: b = {exponent(kf, Tf, exf, gf, k, T, -ex):.2f} "
            f"[95% bootstrap {lo:.2f}, {hi:.2f}] ({len(bs)} of {F.N_BOOT} joint resamples of both studies' seeds).")


def l1_against_e3b(R: pd.DataFrame) -> str:
    """E3b's three fits (``fits.predictions_table``, as E3c's predictions were written) at L1's
    longest length, its control's mean response length T, and at each of two summaries of the
    spread arm's realized k3 over steps 10-40: the median per step (per run, then the mean over
    seeds; block l1-k3-steps) and the mean (the registered ``k3`` endpoint, E3b's own summary of
    its cells' k3), beside what L1 measured there. L1's registration compares its costs within L1;
    this comparison is descriptive."""
    from timlab.experiments.studies.fits import arm_cost, cost_ci, predictions_table

    colf, fitted = _grouped_cells("e3b.yaml")
    col, _ = _grouped_cells("l1.yaml")
    ctrl, spread = col["109", "control"], col["109", "spread"]
    T = float(ctrl["length"].mean())
    median = float(np.mean([k3.median() for k3 in step_k3("l1.yaml", (10, 40))["109", "spread"]]))
    mean = float(spread["k3"].mean())
    lo, hi = cost_ci(ctrl["acc_level"], spread["acc_level"])
    table = predictions_table(colf, fitted, "acc_level", T=T, k3_at=(median, mean))
    return (f"At T = {T:.1f} (L1, restate 109, its control's mean response length); spread's realized k3 over "
            f"steps 10-40: median {study_fmt(median)}, mean {study_fmt(mean)}\n\n" + "\n".join(table) + "\n\n"
            f"Measured (L1, spread, restate 109, steps 10-40): "
            f"{fmt(arm_cost(ctrl['acc_level'], spread['acc_level']), 3)} [{fmt(lo, 3)}, {fmt(hi, 3)}].")


def h1_k3_steps(R: pd.DataFrame) -> str:
    """Study H1's realized k3 step by step over the late window (steps 1500-2000; descriptive, not a
    registered endpoint): per run its median, mean and share of steps above 0.1 and above 1 nat per
    token, then the mean over seeds of each."""
    rows = []
    for (_, arm), runs in step_k3("h1.yaml", (1500, 2000)).items():
        if arm == "control":
            continue
        rows.append({"arm": arm, "seeds": len(runs), "median k3": fmt(np.mean([k.median() for k in runs]), 3),
                     "mean k3": fmt(np.mean([k.mean() for k in runs]), 3),
                     "share of steps above 0.1": f"{np.mean([(k > 0.1).mean() for k in runs]):.3f}",
                     "share of steps above 1": f"{np.mean([(k > 1).mean() for k in runs]):.3f}"})
    return md_table(rows)


def harm2_k3_steps(R: pd.DataFrame) -> str:
    """Study H2's realized k3 step by step over the candidates' window (steps 1-25; descriptive, not a
    registered endpoint): per run its median, mean and share of steps above 1 nat per token, then the
    mean over seeds of each; each cell's cost per unit of mean k3 (the fit and test blocks' cost)."""
    study = load_study(STUDIES / "harm2_runs.yaml")
    cost = endpoint_values(study, root=ROOT)[""]
    control = cost["control"]["acc"].mean()
    rows = []
    for (_, arm), runs in step_k3("harm2_runs.yaml", (1, 25)).items():
        if arm == "control":
            continue
        mean, c = np.mean([k.mean() for k in runs]), control - cost[arm]["acc"].mean()
        rows.append({"cell": arm, "median k3": fmt(np.mean([k.median() for k in runs]), 3), "mean k3": fmt(mean, 3),
                     "share of steps above 1": f"{np.mean([(k > 1).mean() for k in runs]):.3f}",
                     "cost": f"{c:.3f}", "cost per unit of mean k3": fmt(c / mean, 3)})
    return md_table(rows)


BLOCKS = {"surge-conditions": surge_conditions, "verdict-tests": verdict_tests, "p3": p3, "threshold": threshold,
          "d16-300": d16_300, "l1-k3-steps": l1_k3_steps, "p1-pairs": p1_pairs, "p2-persistence": p2_persistence,
          "erosion-probe": lambda R: erosion_tables.probe(str(SWEEPS / "erosion_probe")),
          "erosion-pilot": lambda R: erosion_tables.slopes(str(SWEEPS / "erosion_pilot"), erosion_tables.START),
          "e3-starts": lambda R: e3_tables.starts(str(SWEEPS / "e3_starts")),
          "e3-followup": lambda R: e3_tables.followup(str(SWEEPS / "e3_starts_rl")),
          "e3b-probe": lambda R: erosion_tables.probe(str(SWEEPS / "e3b_probe")),
          "e3c-predictions": lambda R: predictions(load_study(STUDIES / "e3c.yaml"), root=ROOT),
          # E3c's study file names no FINDINGS block, and adding one would change its frozen registration's hash,
          # so its analysis is spliced here
          "e3c-study": lambda R: analyze(load_study(STUDIES / "e3c.yaml"), root=ROOT).text,
          # Study H1 as the early-warning benchmark's second test set (its INCOMPLETE line until H1 is complete)
          "early-warning-h1": lambda R: early_warning.format_test_set(early_warning.second_test(SWEEPS, "h1")),
          "early-warning-2": lambda R: early_warning2.report(SWEEPS),  # INCOMPLETE until Study LF is complete
          "moe-learn": lambda R: moe_tables.learn(str(SWEEPS / "surge_moe_learn")),
          "moe-pilot": lambda R: moe_tables.arms(str(SWEEPS / "moe_pilot")),
          "moe-calib": lambda R: moe_tables.arms(str(SWEEPS / "moe_calib")),
          "p2-amd": p2_amd,
          "harm2-k3-steps": harm2_k3_steps,
          "harm2-pilot": lambda R: harm2_sweeps.pilot_table(SWEEPS / "harm2_pilot")}
"""The generated blocks of the findings (docs/FINDINGS.md and its pages), by marker name (with ``study_blocks``)."""
def late_falls_k3(R: pd.DataFrame) -> str:
    """Study LF's falls (registered as reported after the runs): each fallen run's fall step and, over
    the 25 steps before it, the median and mean per-step k3, the controller's target and magnitude."""
    from timlab.experiments.studies.blocks import block_dirs
    from timlab.experiments.studies.collapse import before_falls

    study = load_study(STUDIES / "late_falls.yaml")
    dirs = block_dirs(study, root=ROOT)
    runs = {r.run_id: read_metrics(dirs[r.block] / r.run_id) for r in planned_runs(study) if r.arm != "control"}
    keys = ("rollout_corr/k3_kl", "mismatch/target_k3", "mismatch/magnitude")
    rows = [{"run": f["run"].split("__")[0], "fall step": f["fall step"],
             "median k3": fmt(f[keys[0]][0], 3), "mean k3": fmt(f[keys[0]][1], 3),
             "target (median)": fmt(f[keys[1]][0], 3), "magnitude (median)": f"{f[keys[2]][0]:.2f}"}
            for f in before_falls(runs, keys, 25, rule="plateau")]
    return md_table(rows) if rows else "No run fell."


BLOCKS.update({"e3c-reading": e3c_reading, "l1-e3b": l1_against_e3b, "h1-k3-steps": h1_k3_steps,
               "late-falls-k3": late_falls_k3})


def study_blocks() -> dict:
    """{FINDINGS block: its study file's analysis} of every study file under ``STUDIES`` (sweep
    directories relative to the repository)."""
    out = {}
    for path in sorted(STUDIES.glob("*.yaml")):
        hst = load_heldout(path)
        if hst is not None:  # a held-out predictor study (Study H2): two blocks from one analysis
            if hst.findings:
                once = functools.cache(lambda hst=hst: heldout_blocks(hst, analyze_heldout(hst, root=ROOT)))
                out.update({name: (lambda R, name=name, once=once: once()[name]) for name in hst.findings[1:]})
            continue
        pst = load_predictor(path)
        if pst is not None and pst.findings:  # a predictor study (Study H): two blocks from one analysis
            once = functools.cache(lambda pst=pst: predictor_study_blocks(pst))
            out.update({name: (lambda R, name=name, once=once: once()[name]) for name in pst.findings[1:]})
        elif pst is None and (s := load_study(path)).findings:
            out[s.findings[1]] = lambda R, s=s: analyze(s, root=ROOT).text
    return out


BLOCKS.update(study_blocks())


def render(R: pd.DataFrame | None = None) -> dict[str, str]:
    R = load_runs() if R is None else R
    return {name: fn(R) for name, fn in BLOCKS.items()}


def splice(text: str, blocks: dict[str, str], where: str | Path = FINDINGS) -> str:
    """``text`` with each ``<!-- findings:NAME -->...<!-- /findings:NAME -->`` body replaced."""
    for name, body in blocks.items():
        text = splice_block(text, name, body, where=str(where))
    return text


def spliced(blocks: dict[str, str]) -> dict[Path, tuple[str, str]]:
    """{findings file: (its committed text, that text with its blocks replaced by ``blocks``)}, for
    each file that holds one of ``blocks``."""
    out = {}
    for path, its in by_file(FINDINGS, blocks).items():
        text = path.read_text()
        out[path] = (text, splice(text, its, where=path))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="*", help="sweep directories for the generic tables (default: FINDINGS' blocks)")
    ap.add_argument("--write", action="store_true", help="rewrite the generated blocks of docs/FINDINGS.md and its pages")
    ap.add_argument("--check", action="store_true", help="exit 1 if a findings file differs from the data")
    args = ap.parse_args(argv)
    if args.dirs:
        print(generic(args.dirs))
        return 0
    blocks = render()
    if not (args.write or args.check):
        for name, body in blocks.items():
            print(f"## {name}\n\n{body}\n")
        return 0
    texts = spliced(blocks)
    if args.write:
        write_blocks(FINDINGS, blocks)  # each file atomically: a failed write leaves that file as it was
        print(f"wrote {len(blocks)} blocks to {len(texts)} files: {', '.join(str(p.relative_to(ROOT)) for p in texts)}")
    elif args.check:
        stale = [p for p, (text, new) in texts.items() if new != text]
        for p in stale:
            print(f"{p} differs from the committed sweeps; run python scripts/findings_tables.py --write")
        if stale:
            return 1
        print(f"{FINDINGS} and its pages ({len(texts)} files): every generated block matches the data")
    return 0


if __name__ == "__main__":
    sys.exit(main())
