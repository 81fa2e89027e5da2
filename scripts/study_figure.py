"""Figures behind docs/FINDINGS.md's studies (erosion, MoE, E2): per arm, the mean over seeds
(band: min-max over seeds) of greedy accuracy, the gold answer's log-prob and the realized k3
(a 10-step rolling mean, log scale) against the RL step. An arm is a condition without its
``_s<seed>`` suffix (the studies list one condition per seed).

    python scripts/study_figure.py sweeps/moe docs/img/moe_study.png
    python scripts/study_figure.py sweeps/erosion docs/img/erosion_study.png control head_0.175 stale_1 --title "..."

With no ARM given, every arm of the sweep is drawn, in the order of the sweep's index.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timlab.experiments.studies.sweep_runs import arm, runs  # noqa: E402

PANELS = (("val/accuracy", "greedy val accuracy (pi, no injector)", 1, False),
          ("val/gold_logprob", "gold answer log-prob (pi)", 1, False),
          ("rollout_corr/k3_kl", "realized k3 (10-step mean)", 10, True))


def curves(frames: list[pd.DataFrame], col: str, smooth: int = 1) -> pd.DataFrame:
    """Per step, the mean, min and max over runs of ``col`` (each run's ``smooth``-step rolling mean
    first; steps where a run has no value are left out of that run)."""
    series = [f.set_index("step")[col].dropna().rolling(smooth, min_periods=1).mean() for f in frames]
    table = pd.concat(series, axis=1).sort_index()
    return pd.DataFrame({"mean": table.mean(axis=1), "min": table.min(axis=1), "max": table.max(axis=1)})


def band(ax, frames: list[pd.DataFrame], col: str, color: str, label: str, smooth: int = 1) -> None:
    """Draw ``curves``' mean as a line and its min-max as a shaded band."""
    c = curves(frames, col, smooth)
    steps = c.index.to_numpy()
    ax.plot(steps, c["mean"], color=color, label=label, lw=1.2)
    ax.fill_between(steps, c["min"], c["max"], color=color, alpha=0.12, lw=0)


def by_arm(sweep: str | Path) -> dict[str, list[pd.DataFrame]]:
    """The sweep's run metrics grouped by arm, in the order of the sweep's index."""
    out: dict[str, list[pd.DataFrame]] = {}
    for row, m in runs(str(sweep)):
        out.setdefault(arm(row["spec_condition"]), []).append(m)
    return out


def figure(sweep: str | Path, out: str | Path, arms: list[str] | None = None, title: str = "") -> Path:
    groups = by_arm(sweep)
    unknown = [a for a in arms or [] if a not in groups]
    if unknown:
        raise SystemExit(f"arm(s) {', '.join(unknown)} not in {sweep}; its arms: {', '.join(groups)}")
    fig = Figure(figsize=(14, 3.9))
    axes = [fig.add_subplot(1, len(PANELS), i + 1) for i in range(len(PANELS))]
    for i, name in enumerate(arms or list(groups)):
        frames = groups[name]
        for ax, (col, _, smooth, log) in zip(axes, PANELS):
            use = [f[f["step"] > 0] for f in frames] if log else frames
            if all(col in f for f in use):
                if log:  # k3 = 0 (a control) has no place on a log axis
                    use = [f.assign(**{col: f[col].where(f[col] > 0)}) for f in use]
                band(ax, use, col, f"C{i % 10}", f"{name} ({len(frames)} seeds)", smooth)
    for ax, (_, ylabel, _, log) in zip(axes, PANELS):
        ax.set(xlabel="RL step", ylabel=ylabel)
        if log:
            ax.set_yscale("log")
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(title or f"{sweep}: mean over seeds, band min-max", fontsize=9)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=100)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep")
    p.add_argument("out")
    p.add_argument("arms", nargs="*", help="arms to draw (default: all)")
    p.add_argument("--title", default="")
    a = p.parse_args(argv)
    print(f"wrote {figure(a.sweep, a.out, a.arms or None, a.title)}")
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
