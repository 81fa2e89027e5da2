"""What the generated FINDINGS blocks share: where the committed data lies (``ROOT``, ``SWEEPS``,
``STUDIES``), the number formats FINDINGS writes, and the per-run table of the surge testbed's dose
sweeps (``load_runs``) that most of its blocks read.

Statistics (``timlab.experiments.studies.stats``): two-sided exact permutation tests of a difference
in means (every relabeling enumerated: 252 for 5 vs 5, whose smallest possible p is 2/252 = 0.008),
and 95% Clopper-Pearson intervals for collapse fractions. Collapses follow the sweeps' rule
(``timlab.experiments.studies.collapse``) unless a column says ``plateau`` (the plateau rule, a
sustained fall from the learned level).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd
import yaml

from timlab.experiments.studies.collapse import judge, run_summary
from timlab.experiments.studies.engine import endpoint_values, planned_runs
from timlab.experiments.studies.sweep_runs import PlannedRun
from timlab.experiments.studies.registration import load_study
from timlab.experiments.studies.stats import clopper_pearson, line_fit, permutation_test
from timlab.experiments.studies.text import fmt as study_fmt
from timlab.experiments.sweeps.tables import surge_step
from timlab.rundir import read_metrics

ROOT = Path(__file__).resolve().parents[4]
"""The repository root: the committed sweeps and study files are read relative to it."""
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


def study_runs(name: str) -> list[tuple[PlannedRun, pd.DataFrame]]:
    """Each planned run of the study file ``name`` (every block's) with its committed metrics."""
    from timlab.experiments.studies.blocks import block_dirs

    study = load_study(STUDIES / name)
    dirs = block_dirs(study, root=ROOT)
    return [(run, read_metrics(dirs[run.block] / run.run_id)) for run in planned_runs(study)]


def step_k3(name: str, window: tuple[int, int]) -> dict[tuple[str, str], list[pd.Series]]:
    """{(group, arm): each run's per-step realized k3 over the steps of ``window``} of the study file
    ``name`` (every block's runs; group "" in an ungrouped study), read from its committed runs."""
    per = {}
    for run, df in study_runs(name):
        k3 = df.loc[(df["step"] >= window[0]) & (df["step"] <= window[1]), "rollout_corr/k3_kl"].dropna()
        per.setdefault((run.group, run.arm), []).append(k3)
    return per


def grouped_cells(name: str) -> tuple[dict, list]:
    """A grouped study's registered endpoints keyed by (group, arm), and its treated cells in order."""
    study = load_study(STUDIES / name)
    cols = endpoint_values(study, root=ROOT)
    col = {(g, a): v for g, per in cols.items() for a, v in per.items()}
    return col, [(g, a) for g, a in col if a != study.control]


