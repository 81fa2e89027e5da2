"""When did a run collapse? A documented rule, per-run summaries and per-condition tables.

The collapse rule (claims P1/P2 of docs/claims.md):

    A run collapses at the first evaluation e where val/accuracy < frac x peak(e), with
    peak(e) the best val/accuracy over the evaluations up to e and peak(e) >= min_peak,
    and where every evaluation of the next ``window`` evaluations (e included) stays below
    that line; OR the run diverged (status.json state "diverged", or a logged non-finite
    ``train/loss``), in which case it collapsed at the step that diverged.

Choices worth knowing:

- Evaluations are the rows with a finite ``val/accuracy`` (step 0 holds the initial one).
- ``min_peak`` keeps a model that never learned (peak near 0) from "collapsing" on noise.
- Near the end of a run fewer than ``window`` evaluations may remain. With
  ``allow_truncated=True`` (the default) a drop that stays below the line until the run
  ends counts as a collapse, even if only one evaluation is left: a run that ends collapsed is
  reported as collapsed rather than given the benefit of the doubt. Pass
  ``allow_truncated=False`` to require ``window`` full evaluations.
- The step reported is the step of the first evaluation below the line (not the end of the
  window), so steps-to-collapse does not depend on ``window`` or ``eval_every`` beyond the
  evaluation grid.
- A divergence's step is status.json's ``step`` (the step whose loss/logits/gradients were
  non-finite; its row is never logged), else the last logged step + 1.

A second rule, ``plateau`` (``rule="plateau"``; ``--rule plateau`` in ``timlab runs``,
``timlab threshold`` and ``timlab report``), is keyed to the level a run has *learned*, for
runs that start from or reach a good policy (learn-then-inject, ``timlab export``):

    The run has learned at its first evaluation L with val/accuracy >= learned_at. Its plateau
    after evaluation e >= L is the best mean of ``level_window`` consecutive evaluations within
    L..e (the mean of L..e while fewer have passed). It collapses at the first evaluation i > L
    whose accuracy is below frac x (plateau after i - 1) and stays below that same line for
    ``window`` (>= 2) consecutive evaluations, all of which must exist (no truncated window,
    so a single evaluation never makes a collapse, not even the last one); OR it diverges after
    it has learned. A run that never reaches ``learned_at`` cannot collapse under this rule.

Under it a fall before learning (the early exploration falls the ``peak`` rule counts at
head_perturb >= 1.5 on the surge testbed) is not a collapse, and a level is one the run held
for ``level_window`` evaluations, not one lucky evaluation.

Departure from the papers: the seed papers call a collapse by eye from training curves (reward,
K3 KL, gradient norm); this rule uses the deployed policy's own greedy accuracy so that a
sampler that learns to pre-compensate for its bias (docs/claims.md) is not mistaken for
a healthy run.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from timlab.errors import UsageError
from timlab.rundir import COMPLETE_STATES, PENDING, RunDir

DEFAULT_FRAC = 0.5
"""A collapse is val/accuracy below this fraction of its running peak."""
DEFAULT_WINDOW = 3
"""... for this many consecutive evaluations."""
DEFAULT_MIN_PEAK = 0.05
"""... once the running peak is at least this (an untrained model cannot collapse)."""
LATE_EVALS = 3
"""``late_accuracy`` is the mean val/accuracy of a run's last this-many evaluations (fewer if it
has fewer): the level it ends at, less noisy than the one final evaluation."""

RULES = ("peak", "plateau")
"""The collapse rules: ``peak`` (the default, above) and ``plateau`` (a fall from the learned level)."""
DEFAULT_RULE = "peak"
DEFAULT_LEARNED_AT = 0.5
"""plateau rule: a run has learned once val/accuracy reaches this."""
DEFAULT_LEVEL_WINDOW = 3
"""plateau rule: the learned level is the best mean of this many consecutive evaluations."""
DEFAULT_PLATEAU_WINDOW = 2
"""plateau rule: a fall must last this many consecutive evaluations (at least 2)."""

# COMPLETE_STATES (finished, diverged): run states whose outcome counts in per-condition
# statistics (failed, guard_failed, running and pending runs are counted separately, never as
# collapsed or stable).


def check_rule(rule: str) -> str:
    """``rule`` if it names a collapse rule, else a one-line error listing the valid ones."""
    if rule not in RULES:
        raise UsageError(f"collapse rule {rule!r} is unknown; valid choices: {', '.join(RULES)}")
    return rule


def rule_options(*, rule: str | None = None, min_peak: float | None = None, learned_at: float | None = None) -> dict:
    """The ``run_summary`` keyword arguments for a re-judged collapse (None: not given), with a
    one-line error for an option the chosen rule does not take (``min_peak`` belongs to the
    peak rule, ``learned_at`` to the plateau rule)."""
    name = check_rule(rule or DEFAULT_RULE)
    if name == "plateau" and min_peak is not None:
        raise UsageError("min_peak (--min-peak) belongs to the peak rule; the plateau rule takes learned_at (--learned-at)")
    if name == "peak" and learned_at is not None:
        raise UsageError("learned_at (--learned-at) belongs to the plateau rule; add --rule plateau")
    given = {"rule": rule, "min_peak": min_peak, "learned_at": learned_at}
    return {k: v for k, v in given.items() if v is not None}


def describe_rule(*, rule: str = DEFAULT_RULE, frac: float = DEFAULT_FRAC, window: int | None = None,
                  min_peak: float = DEFAULT_MIN_PEAK, allow_truncated: bool = True,
                  learned_at: float = DEFAULT_LEARNED_AT, level_window: int = DEFAULT_LEVEL_WINDOW) -> str:
    """The collapse rule as one sentence (the report and the docs state it)."""
    if check_rule(rule) == "plateau":
        window = DEFAULT_PLATEAU_WINDOW if window is None else window
        return (f"Plateau rule: a run has learned at its first evaluation with val/accuracy >= {learned_at:g}; its "
                f"plateau is the best mean of {level_window} consecutive evaluations since then. It collapses at the "
                f"first later evaluation below {frac:g} x the plateau reached before it that stays below that line for "
                f"{window} consecutive evaluations (never a single evaluation, never a window cut short by the end of "
                f"the run), or when it diverges after learning; a run that never learned cannot collapse.")
    window = DEFAULT_WINDOW if window is None else window
    tail = (" (or until the run ends, if fewer evaluations remain)" if allow_truncated else "")
    return (f"A run collapses at the first evaluation where val/accuracy falls below {frac:g} x its running peak "
            f"(the best val/accuracy so far, required to be at least {min_peak:g}) and stays below it for "
            f"{window} consecutive evaluations{tail}, or when the run diverges (non-finite loss, logits or "
            f"gradients); steps-to-collapse is the step of the first evaluation below the line.")


def _diverged_at(df: pd.DataFrame) -> int | None:
    """First logged step with a non-finite train/loss, if any."""
    if "train/loss" not in df.columns or df.empty:
        return None
    loss = pd.to_numeric(df["train/loss"], errors="coerce").to_numpy(dtype=float)
    logged = ~pd.isna(df["train/loss"]).to_numpy()  # NaN = not logged this step; +-inf = diverged
    bad = logged & ~np.isfinite(loss)
    return int(df["step"].to_numpy()[bad][0]) if bad.any() else None


def collapse_step(df: pd.DataFrame, *, frac: float = DEFAULT_FRAC, window: int = DEFAULT_WINDOW,
                  min_peak: float = DEFAULT_MIN_PEAK, diverged: bool = False, diverged_step: int | None = None,
                  allow_truncated: bool = True) -> int | None:
    """The step at which the run collapsed under the module's rule, or None if it did not.

    ``df`` is a run's metrics table (``step`` and ``val/accuracy`` columns; ``train/loss`` is
    checked for non-finite values). ``diverged=True`` marks a run that stopped on non-finite
    values; it collapsed at ``diverged_step`` (default: last logged step + 1) unless the
    accuracy rule fired earlier.
    """
    if window < 1:
        raise UsageError(f"window must be >= 1, got {window}")
    if not 0 < frac <= 1:
        raise UsageError(f"frac must be in (0, 1], got {frac}")
    df = df.sort_values("step") if "step" in df.columns else df
    candidates: list[int] = []

    if "val/accuracy" in df.columns:
        ev = df.loc[df["val/accuracy"].notna(), ["step", "val/accuracy"]]
        ev = ev[np.isfinite(ev["val/accuracy"].to_numpy(dtype=float))]
        steps = ev["step"].to_numpy()
        acc = ev["val/accuracy"].to_numpy(dtype=float)
        peak = np.maximum.accumulate(acc) if len(acc) else acc
        below = (acc < frac * peak) & (peak >= min_peak)  # (E,)
        for i in np.flatnonzero(below):
            run = below[i : i + window]
            if run.all() and (len(run) == window or allow_truncated):
                candidates.append(int(steps[i]))
                break

    nonfinite = _diverged_at(df)
    if nonfinite is not None:
        candidates.append(nonfinite)
    if diverged:
        if diverged_step is None:
            diverged_step = int(df["step"].max()) + 1 if len(df) and "step" in df.columns else 0
        candidates.append(int(diverged_step))
    return min(candidates) if candidates else None


def plateau_levels(acc: np.ndarray, learned: int, level_window: int = DEFAULT_LEVEL_WINDOW) -> np.ndarray:
    """(E,) the plateau after each evaluation (NaN before ``learned``, the index of the first
    learned evaluation): the best mean of ``level_window`` consecutive evaluations within
    learned..e, or the mean of learned..e while fewer than ``level_window`` have passed."""
    level = np.full(len(acc), math.nan)
    best = -math.inf
    for e in range(learned, len(acc)):
        n = e - learned + 1
        if n < level_window:
            level[e] = float(acc[learned : e + 1].mean())
            continue
        best = max(best, float(acc[e - level_window + 1 : e + 1].mean()))
        level[e] = best
    return level


def plateau_collapse_step(df: pd.DataFrame, *, frac: float = DEFAULT_FRAC, window: int = DEFAULT_PLATEAU_WINDOW,
                          learned_at: float = DEFAULT_LEARNED_AT, level_window: int = DEFAULT_LEVEL_WINDOW,
                          diverged: bool = False, diverged_step: int | None = None) -> int | None:
    """The step at which the run fell from its learned plateau (the module's ``plateau`` rule),
    or None. ``df``, ``diverged`` and ``diverged_step`` as in ``collapse_step``."""
    if window < 2:
        raise UsageError(f"plateau rule: window must be >= 2 (no single-evaluation collapses), got {window}")
    if level_window < 1:
        raise UsageError(f"plateau rule: level_window must be >= 1, got {level_window}")
    if not 0 < frac <= 1:
        raise UsageError(f"frac must be in (0, 1], got {frac}")
    df = df.sort_values("step") if "step" in df.columns else df
    steps, acc = np.array([], dtype=np.int64), np.array([], dtype=float)
    if "val/accuracy" in df.columns:
        ev = df.loc[df["val/accuracy"].notna(), ["step", "val/accuracy"]]
        ev = ev[np.isfinite(ev["val/accuracy"].to_numpy(dtype=float))]
        steps, acc = ev["step"].to_numpy(), ev["val/accuracy"].to_numpy(dtype=float)
    hit = np.flatnonzero(acc >= learned_at)
    if not hit.size:
        return None  # never learned: nothing to fall from
    first = int(hit[0])
    candidates: list[int] = []
    level = plateau_levels(acc, first, level_window)  # (E,)
    for i in range(first + 1, len(acc) - window + 1):
        line = frac * level[i - 1]
        if (acc[i : i + window] < line).all():
            candidates.append(int(steps[i]))
            break
    learned_step = int(steps[first])
    nonfinite = _diverged_at(df)
    if nonfinite is not None and nonfinite > learned_step:
        candidates.append(nonfinite)
    if diverged:
        if diverged_step is None:
            diverged_step = int(df["step"].max()) + 1 if len(df) and "step" in df.columns else 0
        if diverged_step > learned_step:
            candidates.append(int(diverged_step))
    return min(candidates) if candidates else None


def judge(df: pd.DataFrame, *, rule: str = DEFAULT_RULE, frac: float = DEFAULT_FRAC, window: int | None = None,
          min_peak: float = DEFAULT_MIN_PEAK, allow_truncated: bool = True, learned_at: float = DEFAULT_LEARNED_AT,
          level_window: int = DEFAULT_LEVEL_WINDOW, diverged: bool = False, diverged_step: int | None = None
          ) -> int | None:
    """The collapse step of a metrics table under ``rule`` (``peak``: ``collapse_step`` with
    frac, window, min_peak, allow_truncated; ``plateau``: ``plateau_collapse_step`` with frac,
    window, learned_at, level_window). ``window=None``: the rule's default."""
    if check_rule(rule) == "plateau":
        return plateau_collapse_step(df, frac=frac, window=DEFAULT_PLATEAU_WINDOW if window is None else window,
                                     learned_at=learned_at, level_window=level_window, diverged=diverged,
                                     diverged_step=diverged_step)
    return collapse_step(df, frac=frac, window=DEFAULT_WINDOW if window is None else window, min_peak=min_peak,
                         diverged=diverged, diverged_step=diverged_step, allow_truncated=allow_truncated)


# ------------------------------------------------------------------------------- one run
def _col(df: pd.DataFrame | None, name: str) -> np.ndarray:
    """Finite values of a column (empty if absent)."""
    if df is None or name not in df.columns:
        return np.array([], dtype=float)
    x = pd.to_numeric(df[name], errors="coerce").to_numpy(dtype=float)
    return x[np.isfinite(x)]


def _mean(x: np.ndarray) -> float:
    return float(x.mean()) if x.size else math.nan


def _max(x: np.ndarray) -> float:
    return float(x.max()) if x.size else math.nan


def _last(x: np.ndarray) -> float:
    return float(x[-1]) if x.size else math.nan


def late_accuracy(df: pd.DataFrame | None, evals: int = LATE_EVALS) -> float:
    """Mean val/accuracy of the last ``evals`` finite evaluations (NaN without any)."""
    acc = _col(df.sort_values("step") if df is not None and "step" in df.columns else df, "val/accuracy")
    return _mean(acc[-evals:])


def accuracy_auc(df: pd.DataFrame) -> float:
    """Area under val/accuracy against step (trapezoid over the evaluations), divided by the
    steps it spans: the run's average accuracy, in [0, 1]. One evaluation: that accuracy."""
    if df is None or "val/accuracy" not in df.columns:
        return math.nan
    ev = df.loc[df["val/accuracy"].notna()].sort_values("step")
    acc = ev["val/accuracy"].to_numpy(dtype=float)
    steps = ev["step"].to_numpy(dtype=float)
    ok = np.isfinite(acc)
    acc, steps = acc[ok], steps[ok]
    if acc.size == 0:
        return math.nan
    if acc.size == 1 or steps[-1] == steps[0]:
        return float(acc[-1])
    area = float(np.sum((acc[1:] + acc[:-1]) * np.diff(steps)) / 2)
    return area / float(steps[-1] - steps[0])


SUMMARY_KEYS = (
    "state", "message", "last_step", "total_steps", "peak_accuracy", "final_accuracy", "late_accuracy", "auc_accuracy",
    "collapsed", "steps_to_collapse", "k3_kl_mean", "log_ppl_abs_diff_mean", "abs_diff_mean",
    "grad_norm_max", "response_length_mean", "response_length_final", "response_length_peak", "surge_step",
    "decay_period",
)
"""The keys of ``run_summary`` (and the summary columns of a sweep's index.parquet)."""


def run_summary(run_dir: str | Path, *, rule: str = DEFAULT_RULE, frac: float = DEFAULT_FRAC, window: int | None = None,
                min_peak: float = DEFAULT_MIN_PEAK, allow_truncated: bool = True,
                learned_at: float = DEFAULT_LEARNED_AT, level_window: int = DEFAULT_LEVEL_WINDOW) -> dict:
    """Summary statistics of one run directory (keys: ``SUMMARY_KEYS``; NaN where unknown).
    ``collapsed`` and ``steps_to_collapse`` follow ``rule`` and its options (see ``judge``).

    Realized mismatch is the mean over logged steps of ``rollout_corr/k3_kl``,
    ``rollout_corr/log_ppl_abs_diff`` and ``mismatch/abs_diff_mean``; ``surge_step`` and
    ``decay_period`` are the last known values of the length-decay scheduler's columns.
    """
    rd = RunDir(run_dir)
    status = rd.read_status()
    df = rd.read_metrics()
    state = status.get("state", PENDING if df is None else "unknown")
    acc = _col(df, "val/accuracy")
    length = _col(df, "train/response_length_mean")
    steps = _col(df, "step")
    if df is not None:
        cstep = judge(df, rule=rule, frac=frac, window=window, min_peak=min_peak, allow_truncated=allow_truncated,
                      learned_at=learned_at, level_window=level_window, diverged=state == "diverged",
                      diverged_step=status.get("step") if state == "diverged" else None)
    else:
        check_rule(rule)
        cstep = status.get("step", 0) if state == "diverged" and rule == "peak" else None
    return {
        "state": state,
        "message": str(status.get("message", "")),
        "last_step": _max(steps),
        "total_steps": float(status["total_steps"]) if "total_steps" in status else math.nan,
        "peak_accuracy": _max(acc),
        "final_accuracy": _last(acc),
        "late_accuracy": late_accuracy(df),
        "auc_accuracy": accuracy_auc(df),
        "collapsed": cstep is not None,
        "steps_to_collapse": float(cstep) if cstep is not None else math.nan,
        "k3_kl_mean": _mean(_col(df, "rollout_corr/k3_kl")),
        "log_ppl_abs_diff_mean": _mean(_col(df, "rollout_corr/log_ppl_abs_diff")),
        "abs_diff_mean": _mean(_col(df, "mismatch/abs_diff_mean")),
        "grad_norm_max": _max(_col(df, "train/grad_norm")),
        "response_length_mean": _mean(length),
        "response_length_final": _last(length),
        "response_length_peak": _max(length),
        "surge_step": _last(_col(df, "scheduler/surge_step")),
        "decay_period": _last(_col(df, "scheduler/decay_period")),
    }


# ------------------------------------------------------------------------------- conditions
def condition_table(index_df: pd.DataFrame, by: str = "condition") -> pd.DataFrame:
    """Per-condition statistics over seeds, one row per value of ``by``.

    Only runs whose state is finished or diverged count (``n``); the others (failed,
    guard_failed, running, pending) are counted in ``n_incomplete``. Columns: n,
    n_incomplete, collapse_frac, n_collapsed, peak_accuracy_mean/std, final_accuracy_mean/std,
    late_accuracy_mean/std, auc_accuracy_mean, median_steps_to_collapse (over the runs that collapsed; NaN if none),
    k3_kl_mean (mean over seeds of each run's mean realized K3 KL), log_ppl_abs_diff_mean.
    """
    if by not in index_df.columns:
        raise UsageError(f"condition_table: no column {by!r}; valid choices: {', '.join(map(str, index_df.columns))}")
    rows = []
    for name, g in index_df.groupby(by, sort=False, dropna=False):
        done = g[g["state"].isin(COMPLETE_STATES)]
        collapsed = done["collapsed"].astype(bool)
        steps = pd.to_numeric(done.loc[collapsed, "steps_to_collapse"], errors="coerce").dropna()

        def stat(col: str, fn: str) -> float:
            x = pd.to_numeric(done[col], errors="coerce").dropna() if col in done.columns else pd.Series(dtype=float)
            if x.empty or (fn == "std" and len(x) < 2):
                return math.nan
            return float(getattr(x, fn)(ddof=1)) if fn == "std" else float(getattr(x, fn)())

        rows.append({
            by: name,
            "n": len(done),
            "n_incomplete": len(g) - len(done),
            "n_collapsed": int(collapsed.sum()),
            "collapse_frac": float(collapsed.mean()) if len(done) else math.nan,
            "median_steps_to_collapse": float(steps.median()) if len(steps) else math.nan,
            "peak_accuracy_mean": stat("peak_accuracy", "mean"),
            "peak_accuracy_std": stat("peak_accuracy", "std"),
            "final_accuracy_mean": stat("final_accuracy", "mean"),
            "final_accuracy_std": stat("final_accuracy", "std"),
            "late_accuracy_mean": stat("late_accuracy", "mean"),
            "late_accuracy_std": stat("late_accuracy", "std"),
            "auc_accuracy_mean": stat("auc_accuracy", "mean"),
            "k3_kl_mean": stat("k3_kl_mean", "mean"),
            "log_ppl_abs_diff_mean": stat("log_ppl_abs_diff_mean", "mean"),
        })
    return pd.DataFrame(rows)


__all__ = ["collapse_step", "plateau_collapse_step", "plateau_levels", "judge", "check_rule", "rule_options", "RULES", "DEFAULT_RULE",
           "DEFAULT_LEARNED_AT", "DEFAULT_LEVEL_WINDOW", "DEFAULT_PLATEAU_WINDOW", "run_summary", "condition_table", "accuracy_auc", "late_accuracy", "LATE_EVALS", "describe_rule",
           "SUMMARY_KEYS", "COMPLETE_STATES", "DEFAULT_FRAC", "DEFAULT_WINDOW", "DEFAULT_MIN_PEAK"]


def before_falls(runs: dict[str, pd.DataFrame], metrics: tuple[str, ...], steps: int = 25, **rule) -> list[dict]:
    """For each run of ``runs`` (name -> its metrics) that falls under ``judge(**rule)``: its fall
    step F and, per metric of ``metrics``, the median and mean of the logged values over the
    ``steps`` steps before it, steps F - steps + 1 .. F (descriptive: what a run held just before it
    fell). Runs that do not fall are left out; the order is the order of ``runs``."""
    out = []
    for name, m in runs.items():
        f = judge(m, **rule)
        if f is None:
            continue
        w = m[(m["step"] > f - steps) & (m["step"] <= f)]
        row = {"run": name, "fall step": int(f)}
        for k in metrics:
            x = pd.to_numeric(w[k], errors="coerce").dropna() if k in w else pd.Series(dtype=float)
            row[k] = (float(x.median()), float(x.mean())) if len(x) else (math.nan, math.nan)
        out.append(row)
    return out
