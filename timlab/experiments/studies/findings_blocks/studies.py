"""The per-study descriptive FINDINGS blocks: numbers FINDINGS states beside a study's registered
analysis (Studies L1, P1, P2, E3c, H1, H2, LF), none of them a registered test. Each reads the study
file under ``common.STUDIES`` and its committed runs.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from timlab.experiments.studies.engine import endpoint_values, planned_runs
from timlab.experiments.studies.findings_blocks.common import (ROOT, STUDIES, SWEEPS, fmt, grouped_cells, step_k3,
                                                             study_runs)
from timlab.experiments.studies.registration import load_study
from timlab.experiments.studies.stats import bootstrap_diff_ci, permutation_test
from timlab.experiments.studies.text import fmt as study_fmt
from timlab.experiments.sweeps.tables import md_table
from timlab.rundir import read_metrics
from timlab.rundir.metrics_log import first_difference


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
def e3c_reading(R: pd.DataFrame) -> str:
    """What E3c's shape test turned on: E3b's three fits (the registered free fit and one power of
    each dose, ``fits.predictors``) at E3c's realized k3, at E3b's longest T (in sample) and at
    E3c's T; and the exponent of T that carries the registered fit's cost at E3b's longest T to
    E3c's measured cost, b = beta + log(measured / predicted) / log(T_E3c / T_longest), over the
    registered test's 2,000 joint resamples of both studies' seeds (``fits.prediction_test``'s draws)."""
    from timlab.experiments.studies import fits as F

    colf, fitted = grouped_cells("e3b.yaml")
    col, test = grouped_cells("e3c.yaml")
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

    colf, fitted = grouped_cells("e3b.yaml")
    col, _ = grouped_cells("l1.yaml")
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


def late_falls_k3(R: pd.DataFrame) -> str:
    """Study LF's falls (registered as reported after the runs): each fallen run's fall step and, over
    the 25 steps before it, the median and mean per-step k3, the controller's target and magnitude."""
    from timlab.experiments.studies.collapse import before_falls

    runs = {r.run_id: m for r, m in study_runs("late_falls.yaml") if r.arm != "control"}
    keys = ("rollout_corr/k3_kl", "mismatch/target_k3", "mismatch/magnitude")
    rows = [{"run": f["run"].split("__")[0], "fall step": f["fall step"],
             "median k3": fmt(f[keys[0]][0], 3), "mean k3": fmt(f[keys[0]][1], 3),
             "target (median)": fmt(f[keys[1]][0], 3), "magnitude (median)": f"{f[keys[2]][0]:.2f}"}
            for f in before_falls(runs, keys, 25, rule="plateau")]
    return md_table(rows) if rows else "No run fell."


