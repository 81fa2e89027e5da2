"""Effects between conditions, with margin and intervals: what a sweep's headline rests on.

A count of collapses at a threshold is fragile when the runs of a condition sit near the line
(issue 29: a head_perturb 2 condition whose seeds all ended at 0.3-0.5, around a line of 0.38, gave
4/5 on one CPU and 1/5 on another). An effect here is a difference of means over seeds of one
per-run number (a ``run_summary`` key; default ``late_accuracy``, the mean of a run's last 3
evaluations), reported with

- the difference ``diff`` = mean(condition) - mean(reference);
- its percentile bootstrap interval (``stats.bootstrap_diff_ci``: each group's seeds resampled
  with replacement, ``N_BOOT`` draws, seed 0, so the interval is deterministic; with 5 seeds a
  group has only 126 distinct resamples, and percentile intervals of tiny groups are too narrow
  rather than too wide: read them with the permutation p beside them);
- the exact two-sided permutation p of that difference (``stats.permutation_test``) and the
  smallest p the design can give (5 vs 5 seeds: 2/252 = 0.0079).

An effect *holds* when its interval excludes 0 and p is at most ``ALPHA``. With 5 seeds per
group that needs the two groups almost separated; nothing is corrected for multiple comparisons.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import pandas as pd

from timlab.errors import UsageError
from timlab.experiments.studies.stats import bootstrap_diff_ci, permutation_test
from timlab.rundir import COMPLETE_STATES

LEVEL = 0.95
"""Coverage of the bootstrap interval."""
N_BOOT = 10_000
"""Bootstrap draws of an effect's interval."""
ALPHA = 0.05
"""An effect holds when its interval excludes 0 and its permutation p is at most this."""


@dataclass(frozen=True)
class Effect:
    """mean(metric | condition) - mean(metric | reference) over the seeds that finished or diverged."""

    condition: str
    """The condition compared."""
    reference: str
    """What it is compared with."""
    metric: str
    """The per-run summary key compared (e.g. ``late_accuracy``)."""
    n: int
    """Runs of the condition with a finite value."""
    n_ref: int
    """Runs of the reference with a finite value."""
    mean: float
    """Mean over the condition's runs."""
    ref_mean: float
    """Mean over the reference's runs."""
    diff: float
    """mean - ref_mean."""
    lo: float
    """Lower end of the ``LEVEL`` bootstrap interval of diff."""
    hi: float
    """Upper end."""
    p: float
    """Exact two-sided permutation p of diff."""
    p_floor: float
    """The smallest p this design can give."""

    @property
    def holds(self) -> bool:
        """The interval excludes 0 and p <= ALPHA."""
        return (self.lo > 0 or self.hi < 0) and self.p <= ALPHA


def _values(index_df: pd.DataFrame, by: str, name: str, metric: str) -> list[float]:
    if name not in set(index_df[by]):
        raise UsageError(f"no runs of {by} {name!r}; valid choices: {', '.join(map(str, dict.fromkeys(index_df[by])))}")
    g = index_df[(index_df[by] == name) & index_df["state"].isin(COMPLETE_STATES)]
    x = pd.to_numeric(g[metric], errors="coerce").to_numpy(dtype=float)
    return [float(v) for v in x if math.isfinite(v)]


def effect(index_df: pd.DataFrame, condition: str, reference: str, *, metric: str = "late_accuracy",
           by: str = "condition") -> Effect:
    """The effect of ``condition`` against ``reference`` on ``metric`` (see the module docstring)."""
    for col in (by, metric, "state"):
        if col not in index_df.columns:
            raise UsageError(f"effect: no column {col!r} in the index; valid choices: {', '.join(map(str, index_df.columns))}")
    a, b = _values(index_df, by, condition, metric), _values(index_df, by, reference, metric)
    if not a or not b:
        raise UsageError(f"effect of {condition!r} vs {reference!r} on {metric}: no finished run with a value "
                         f"({len(a)} and {len(b)})")
    test = permutation_test(a, b)
    lo, hi = bootstrap_diff_ci(a, b, level=LEVEL, n=N_BOOT)
    return Effect(condition, reference, metric, len(a), len(b), sum(a) / len(a), sum(b) / len(b), test.diff, lo, hi,
                  test.p, test.floor)


def effect_table(index_df: pd.DataFrame, comparisons: list[tuple[str, str]], *, metric: str = "late_accuracy",
                 by: str = "condition") -> pd.DataFrame:
    """One row per (condition, reference) pair: the ``Effect`` fields and ``holds``."""
    rows = []
    for cond, ref in comparisons:
        e = effect(index_df, cond, ref, metric=metric, by=by)
        rows.append({**asdict(e), "holds": e.holds})
    return pd.DataFrame(rows)


def format_effect(diff: float, lo: float, hi: float, p: float) -> str:
    """``-0.291 [-0.33, -0.25], p = 0.008``."""
    return f"{diff:+.3f} [{lo:+.3f}, {hi:+.3f}], p = {p:.2g}"


__all__ = ["Effect", "effect", "effect_table", "format_effect", "LEVEL", "ALPHA"]


def paired_table(index_df: pd.DataFrame, comparisons: list[tuple[str, str]], *,
                 metrics: tuple[str, ...] = ("late_accuracy", "final_accuracy"), by: str = "condition") -> pd.DataFrame:
    """One row per comparison with every metric's effect side by side: ``condition``,
    ``reference``, ``n``, ``n_ref``, ``p_floor``, and per metric M: ``M_mean``, ``M_ref_mean``,
    ``M_diff``, ``M_lo``, ``M_hi``, ``M_p``, ``M_holds``."""
    rows = []
    for cond, ref in comparisons:
        row: dict = {"condition": cond, "reference": ref}
        for m in metrics:
            e = effect(index_df, cond, ref, metric=m, by=by)
            row.update({"n": e.n, "n_ref": e.n_ref, "p_floor": e.p_floor})
            row.update({f"{m}_{k}": v for k, v in (("mean", e.mean), ("ref_mean", e.ref_mean), ("diff", e.diff),
                                                   ("lo", e.lo), ("hi", e.hi), ("p", e.p), ("holds", e.holds))})
        rows.append(row)
    return pd.DataFrame(rows)


def effects_view(table: pd.DataFrame, metrics: tuple[str, ...] = ("late_accuracy", "final_accuracy")) -> pd.DataFrame:
    """``paired_table`` as shown (CLI, report, README): one text cell per metric."""
    out = {"comparison": [f"{c} - {r}" for c, r in zip(table["condition"], table["reference"])],
           "seeds": [f"{n} vs {m}" for n, m in zip(table["n"], table["n_ref"])]}
    for m in metrics:
        out[f"{m.replace('_', ' ')}: diff [{LEVEL:.0%} CI], p"] = [
            format_effect(d, lo, hi, p) + (" *" if h else "")
            for d, lo, hi, p, h in zip(table[f"{m}_diff"], table[f"{m}_lo"], table[f"{m}_hi"], table[f"{m}_p"],
                                       table[f"{m}_holds"])]
    return pd.DataFrame(out)


HOLDS_NOTE = (f"diff = mean over seeds of the condition minus the reference's; [{LEVEL:.0%} CI] a percentile bootstrap "
              "(seeds resampled within each group); p an exact two-sided permutation test (5 vs 5 seeds: it cannot go "
              f"below 0.0079); * = the interval excludes 0 and p <= {ALPHA:g}. late accuracy = mean greedy val/accuracy "
              "of a run's last 3 evaluations; final = its last one.")
"""The legend of ``effects_view`` (the CLI and the report print it)."""

__all__ += ["paired_table", "effects_view", "HOLDS_NOTE"]
