"""The collapse threshold k3* against response length, read from a sweep.

A threshold study is a sweep whose runs vary the injector's magnitude (the dose) within cells
that differ in response-length scale (a config column such as ``task.kwargs.max_digits``), and
optionally in injector family and learning rate (docs/examples/threshold.yaml). Runs with a
remedy (an IS correction or a non-constant LR schedule) form families of their own, e.g.
``head_perturb+token_truncate``. For each cell:

- per dose: the number of complete runs, how many collapsed (``timlab.experiments.studies.collapse``'s
  rule), the realized K3 KL (median over seeds of each run's mean ``rollout_corr/k3_kl``) and the
  response length T (mean over seeds of each run's mean ``train/response_length_mean``);
- k3* = the smallest realized K3 at which at least half of the seeds collapse, as an interval:
  ``hi`` = the K3 of the lowest dose that reaches the bar, ``lo`` = the K3 of the highest dose
  below ``hi`` that does not. No dose reaching the bar gives ``lo`` only (k3* above every dose
  tried); the lowest dose already reaching it gives ``hi`` only.

The fit is ``log10 k3* = a + b log10 T`` over cells with both bounds (point = geometric mean of
the bounds), per (family, learning rate), and the extrapolation is the T at which k3* falls to a
given realistic K3 (1e-3, a bf16 rollout of a dense model).

What the slope means. Beyond Precision's Theorem 3.1 bounds the gradient bias by 2 B Delta T^2
(Delta the per-token TV). If collapse set in at a fixed bias, Delta* would scale as T^-2, and
since K3 ~ Delta^2 for small mismatch, k3* as T^-4. A collapse set by a fixed *sequence*-level KL
(T x k3) would give T^-1. Both reference slopes are reported next to the measured one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from timlab.errors import UsageError
from timlab.experiments.studies.collapse import COMPLETE_STATES, DEFAULT_RULE, rule_options, run_summary
from timlab.experiments.studies.stats import line_fit
from timlab.experiments.sweeps.runner import read_index

DOSE = "mismatch.magnitude"
FAMILY = "mismatch.injector"
LR = "optim.lr"
BAR = 0.5
"""k3* is where at least this fraction of a dose's seeds collapse."""
REALISTIC_K3 = 1e-3
"""The extrapolation target: the K3 KL of a bf16 rollout against an fp32 trainer (dense model)."""
THEORY_SLOPES = {"T^2 bound, k3 ~ Delta^2": -4.0, "fixed sequence KL": -1.0}


@dataclass
class Cell:
    family: str
    lr: float
    scale: object
    doses: pd.DataFrame
    """One row per dose: dose, n, n_collapsed, collapse_frac, k3, T, final_accuracy_mean."""
    lo: float = math.nan
    hi: float = math.nan

    @property
    def T(self) -> float:
        """Response length at the threshold: the mean T of the doses that bracket k3* (of every
        dose when none does), since collapsing runs answer shorter than learning ones."""
        at = self.doses[self.doses["k3"].isin([self.lo, self.hi])]
        rows = at if len(at) else self.doses
        return float(rows["T"].mean()) if len(rows) else math.nan

    @property
    def k3_star(self) -> float:
        """Geometric mean of the bounds when both are known, else NaN."""
        return math.sqrt(self.lo * self.hi) if self.lo > 0 and self.hi > 0 else math.nan


@dataclass
class Fit:
    family: str
    lr: float
    slope: float
    intercept: float
    n_cells: int
    T_at_realistic: float
    """Response length at which the fitted k3* falls to ``REALISTIC_K3``."""


@dataclass
class ThresholdResult:
    scale: str
    cells: list[Cell]
    fits: list[Fit] = field(default_factory=list)
    rule: str = DEFAULT_RULE
    """The collapse rule the counts use (``collapse.RULES``), named in the printed table's header."""

    def table(self) -> pd.DataFrame:
        rows = []
        for c in self.cells:
            for r in c.doses.itertuples(index=False):
                rows.append({"family": c.family, "lr": c.lr, self.scale: c.scale, "dose": r.dose, "n": r.n,
                             "collapsed": f"{r.n_collapsed}/{r.n}", "k3": r.k3, "T": r.T,
                             "final_acc": r.final_accuracy_mean})
        return pd.DataFrame(rows)

    def summary(self) -> pd.DataFrame:
        return pd.DataFrame([{"family": c.family, "lr": c.lr, self.scale: c.scale, "T": c.T, "k3*_lo": c.lo,
                              "k3*_hi": c.hi, "k3*": c.k3_star} for c in self.cells])


def _family(row: pd.Series) -> str:
    """The injector, plus any remedy the run used (a run with TIS or a decaying LR is a cell of
    its own, never pooled with the plain injector's doses)."""
    parts = [str(row[FAMILY])]
    if str(row.get("scheduler.name", "constant")) != "constant":
        parts.append(str(row["scheduler.name"]))
    if str(row.get("correction.mode", "none")) != "none":
        parts.append(f"{row.get('correction.level', 'token')}_{row['correction.mode']}")
    if _set(row.get("correction.batch_normalize")):
        parts.append("self_normalized")
    if _set(row.get("correction.rs")):
        parts.append(f"rs_{row['correction.rs']}")
    if _set(row.get("correction.bypass_mode")):
        parts.append("bypass")
    if str(row.get("algorithm.loss_type", "ppo_clip")) not in ("ppo_clip", "nan", "None"):
        parts.append(str(row["algorithm.loss_type"]))
    return "+".join(parts)


def _set(value) -> bool:
    """Whether an index column holds a non-default setting (runs indexed before it existed hold NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return False
    return bool(value) and str(value).lower() not in ("false", "0", "")


def bracket(doses: pd.DataFrame, bar: float = BAR) -> tuple[float, float]:
    """(lo, hi) of k3* from per-dose rows with ``k3`` and ``collapse_frac`` (NaN where unknown)."""
    d = doses.dropna(subset=["k3"]).sort_values("k3")
    over = d[d["collapse_frac"] >= bar]
    hi = float(over["k3"].iloc[0]) if len(over) else math.nan
    under = d[(d["collapse_frac"] < bar) & ((d["k3"] < hi) if len(over) else True)]
    lo = float(under["k3"].iloc[-1]) if len(under) else math.nan
    return lo, hi


def threshold_study(sweep_dirs: str | Path | list[str | Path], *, scale: str = "task.kwargs.max_digits",
                    bar: float = BAR, target_k3: float = REALISTIC_K3, min_peak: float | None = None,
                    rule: str | None = None, learned_at: float | None = None) -> ThresholdResult:
    """Per-cell dose tables, k3* intervals and the k3*(T) fit of one or more threshold sweeps
    (read together: a cell's doses may come from different sweeps).

    ``min_peak``: re-judge every run with the collapse rule's ``min_peak`` set to this, e.g. 0.5
    to count only runs that fell after they had learned (None: the sweep's own verdicts, whose
    rule also counts a fall below half of the warm start's accuracy). ``rule="plateau"`` (with
    ``learned_at``): re-judge every run with the plateau rule, a fall from the learned level
    (``collapse.plateau_collapse_step``)."""
    dirs = [Path(d) for d in (sweep_dirs if isinstance(sweep_dirs, (list, tuple)) else [sweep_dirs])]
    frames = []
    for sweep_dir in dirs:
        index = read_index(sweep_dir)
        for col in (scale, DOSE, FAMILY, LR):
            if col not in index.columns:
                raise UsageError(f"{sweep_dir}: index has no column {col!r}; valid choices: "
                                 f"{', '.join(c for c in index.columns if '.' in c)}")
        index["run_path"] = [sweep_dir / str(d) for d in index["run_dir"]]
        frames.append(index)
    index = pd.concat(frames, ignore_index=True)
    done = index[index["state"].isin(COMPLETE_STATES)].copy()
    done["family"] = [_family(r) for _, r in done.iterrows()]
    options = rule_options(rule=rule, min_peak=min_peak, learned_at=learned_at)
    summaries = [run_summary(p, **options) for p in done["run_path"]]  # one read of each run's metrics
    done["T"] = [s["response_length_mean"] for s in summaries]
    if options:
        done["collapsed"] = [s["collapsed"] for s in summaries]
    cells = []
    for (family, lr, sc), g in done.groupby(["family", LR, scale], sort=True):
        rows = []
        for dose, gd in g.groupby(DOSE, sort=True):
            collapsed = gd["collapsed"].astype(bool)
            rows.append({"dose": float(dose), "n": len(gd), "n_collapsed": int(collapsed.sum()),
                         "collapse_frac": float(collapsed.mean()),
                         "k3": float(pd.to_numeric(gd["k3_kl_mean"], errors="coerce").median()),
                         "T": float(gd["T"].mean()),
                         "final_accuracy_mean": float(pd.to_numeric(gd["final_accuracy"], errors="coerce").mean())})
        doses = pd.DataFrame(rows)
        lo, hi = bracket(doses, bar)
        cells.append(Cell(str(family), float(lr), sc, doses, lo, hi))
    result = ThresholdResult(scale, cells, rule=options.get("rule", DEFAULT_RULE))
    for (family, lr), group in pd.Series(cells).groupby([[c.family for c in cells], [c.lr for c in cells]]):
        pts = [(c.T, c.k3_star) for c in group if math.isfinite(c.k3_star) and c.T > 0]
        if len(pts) < 2:
            continue
        slope, intercept = line_fit([math.log10(p[0]) for p in pts], [math.log10(p[1]) for p in pts])
        t_star = 10 ** ((math.log10(target_k3) - intercept) / slope) if slope < 0 else math.inf
        result.fits.append(Fit(family, lr, float(slope), float(intercept), len(pts), float(t_star)))
    return result


def format_threshold(result: ThresholdResult) -> str:
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    table = result.table().rename(columns={"collapsed": f"collapsed[{result.rule}]"})
    lines = ["per dose:", table.to_string(index=False, float_format=fmt, na_rep="-"), "",
             f"k3* (smallest realized K3 at which >= {BAR:g} of the seeds collapse):",
             result.summary().to_string(index=False, float_format=fmt, na_rep="-")]
    if result.fits:
        lines.append("")
        refs = ", ".join(f"{k}: {v:g}" for k, v in THEORY_SLOPES.items())
        for f in result.fits:
            lines.append(f"fit {f.family} lr={f.lr:g}: k3* ~ T^{f.slope:.2f} over {f.n_cells} cells ({refs}); "
                         f"k3* = {REALISTIC_K3:g} at T ~ {f.T_at_realistic:.3g}")
    else:
        lines.append("\nno fit: fewer than two cells of one family and learning rate have both bounds of k3*")
    return "\n".join(lines)


def plot_threshold(result: ThresholdResult, out_png: str | Path) -> Path:
    """k3* intervals against T per (family, lr), log-log, with the fits and the realistic K3."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4.2))
    ax = fig.add_subplot(1, 1, 1)
    keys = sorted({(c.family, c.lr) for c in result.cells})
    for i, key in enumerate(keys):
        color = f"C{i}"
        for c in (c for c in result.cells if (c.family, c.lr) == key):
            lo = c.lo if math.isfinite(c.lo) else None
            hi = c.hi if math.isfinite(c.hi) else None
            if lo and hi:
                ax.plot([c.T, c.T], [lo, hi], color=color, lw=3)
                ax.plot([c.T], [c.k3_star], "o", color=color)
            elif lo:
                ax.plot([c.T], [lo], "^", color=color)  # k3* above every dose tried
            elif hi:
                ax.plot([c.T], [hi], "v", color=color)  # k3* at or below the lowest dose
        ax.plot([], [], "o-", color=color, label=f"{key[0]}, lr {key[1]:g}")
        for f in (f for f in result.fits if (f.family, f.lr) == key):
            ts = np.logspace(math.log10(max(1.0, min(c.T for c in result.cells) / 2)),
                             math.log10(min(f.T_at_realistic, 1e5) if math.isfinite(f.T_at_realistic) else 1e3), 50)
            ax.plot(ts, 10 ** (f.intercept + f.slope * np.log10(ts)), "--", color=color,
                    label=f"fit: T^{f.slope:.2f}")
    ax.axhline(REALISTIC_K3, color="gray", ls=":", label=f"bf16 rollout (K3 {REALISTIC_K3:g})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("mean response length T (tokens)")
    ax.set_ylabel("collapse threshold k3*")
    ax.plot([], [], "^", color="gray", label="above every dose tried")
    ax.plot([], [], "v", color="gray", label="at or below the lowest dose")
    ax.set_title(f"How much mismatch makes at least {BAR:.0%} of the seeds collapse, by answer length\n"
                 "(bar: between the two doses tried around it)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    out = Path(out_png)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    return out


__all__ = ["threshold_study", "format_threshold", "plot_threshold", "bracket", "ThresholdResult", "Cell", "Fit",
           "BAR", "REALISTIC_K3", "THEORY_SLOPES"]
