"""One self-contained HTML report of a set of runs: curves per condition, dose-response, tables.

``build_report(inputs, out_html)`` takes ONE sweep directory (its index.parquet names the runs
and their conditions) or a list of run directories (grouped by the config keys that differ
between them, the seed excepted). The HTML holds everything: the plots are matplotlib PNGs
embedded as base64 ``data:`` URIs, the style is inline, nothing is fetched.

Sections: the collapse rule (stated by ``collapse.describe_rule``), a table of conditions,
the dose-response plot (collapse fraction and median steps-to-collapse against the realized
K3 KL of each condition, claim P2 of docs/claims.md), one plot per metric against step with the mean
over seeds as a line and the min-max range over seeds as a band (the length-decay scheduler's
surge step and LR decay points drawn as vertical lines), gradient diagnostics when runs logged
the in-run gradcheck (bias, cosine, SNR per step, and the collapsed runs aligned on their
collapse step), a table of runs, and the runs that lack some plotted metric (they are listed by
name and drawn wherever they have data).

Plots are drawn with matplotlib's Agg canvas on ``Figure`` objects, never through pyplot, so
building a report does not touch the global backend of the caller's process.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from timlab.config import ConfigError, load_run_config
from timlab.errors import UsageError
from timlab.experiments.reports import page
from timlab.files import atomic_write_text
from timlab.rundir import CONFIG, METRICS, STATUS, read_metrics
from timlab.experiments.studies.collapse import (
                                                 DEFAULT_FRAC, DEFAULT_MIN_PEAK, DEFAULT_RULE, check_rule, condition_table, describe_rule,
                                                 run_summary,
                                                 )

CLAIMS = {
    "P2": "the larger the mismatch, the sooner and the more often runs collapse",
    "P3": "the mismatch and the gradient norm rise together before a collapse",
    "P7": "mismatch grows with response length, and a length surge precedes instability",
}
"""What each claim the report cites says, in a few words (docs/claims.md has them in full)."""


def claim(*names: str) -> str:
    """Claims cited with what they claim: ``claim P3 (the mismatch and ...)``."""
    said = " and ".join(f"{n} ({CLAIMS[n]})" for n in names)
    return f"claim{'s' if len(names) > 1 else ''} {said}"


PLOTS: tuple[tuple[str, str, str], ...] = (
    ("train/reward_mean", "Training reward",
     "Mean reward of the sampled rollouts. These come from the rollout side, so with an injected mismatch "
     "this is the sampler's reward, not the reward of the policy being trained."),
    ("val/accuracy", "Validation accuracy",
     "Greedy accuracy of the trainer's own policy, decoded without the injector: what would be deployed. "
     "The collapse rule reads this curve."),
    ("rollout_corr/log_ppl_abs_diff", "Mismatch: |log-perplexity difference| (verl)",
     "Per-sequence |mean-token log mu - mean-token log pi|, averaged over the batch (verl's "
     "rollout_corr/log_ppl_abs_diff). Zero when rollout and trainer agree bit for bit."),
    ("rollout_corr/k3_kl", "Mismatch: K3 KL (verl)",
     "Token-mean of exp(r) - r - 1 with r = log pi - log mu: the realized training-inference mismatch."),
    ("train/grad_norm_ema", "Gradient norm (smoothed)",
     "Exponential moving average of the global gradient norm before clipping. A rise together with the "
     f"mismatch indicators before a collapse would support {claim('P3')}."),
    ("train/response_length_mean", "Mean response length",
     f"Mean sampled response length in tokens. A surge in length tends to precede instability: {claim('P7')}; "
     "dashed lines mark the length-decay scheduler's detected surge."),
    ("train/lr", "Learning rate",
     "LR used for each update. Dashed lines mark the detected response-length surge, dotted lines the "
     "length-decay scheduler's halvings (when the scheduler is length_decay)."),
)
"""(metric, title, explanation) of each per-step plot; a run lacking one of these is reported."""

_MARK_SURGE = ("train/response_length_mean", "train/lr")

GRAD_PLOTS: tuple[tuple[str, str, str], ...] = (
    ("gradcheck/rel_bias", "Relative gradient bias",
     "||g_tim - g_exact|| / ||g_exact|| at the run's current weights (timlab gradcheck, run.gradcheck_every): how far "
     f"the injected mismatch moves the policy gradient, noise-corrected. Does it rise before a collapse, as "
     f"{claim('P3', 'P7')} would have it?"),
    ("gradcheck/cosine_plugin", "Cosine(g_tim, g_exact), plug-in",
     "Cosine between the mean gradients from mismatched and from exact rollouts. Sampling noise alone pulls it "
     "below 1 (compare conditions at equal run.gradcheck_samples); the noise-corrected gradcheck/cosine is logged "
     "too, but is NaN whenever one of the two gradients is not resolved, which at in-run sample sizes is often."),
    ("gradcheck/snr_exact", "Gradient SNR per sequence (exact rollouts)",
     "||E g||^2 / tr Cov(one sequence's gradient) under the trainer's own policy; a batch of N sequences has N times "
     "this. Beyond Precision argues the gradient becomes noise-dominated before collapse."),
    ("gradcheck/snr_tim", "Gradient SNR per sequence (mismatched rollouts)",
     "The same for the gradient the run actually follows (rollouts with the injector)."),
)
"""Per-step plots drawn when runs logged in-run gradcheck metrics (not required of every run)."""
@dataclass
class ReportResult:
    path: Path
    n_runs: int
    missing: list[tuple[str, list[str]]] = field(default_factory=list)
    """(run name, plotted metrics it lacks) for each run that lacks any."""


@dataclass
class _Run:
    name: str
    run_dir: Path
    group: str
    df: pd.DataFrame | None
    summary: dict


# ------------------------------------------------------------------------------- inputs
def _config_labels(dirs: list[Path], group_by: str) -> list[str]:
    """Group label of each run directory: a config key's value, or (``condition``) the config
    keys that differ between the runs, the seed excepted."""
    from timlab.experiments.sweeps.spec import IGNORED_CONFIG_KEYS, SEED_KEY

    flat = []
    for d in dirs:
        try:
            flat.append(load_run_config(d).to_flat_dict())
        except (FileNotFoundError, ConfigError):
            flat.append({})
    if group_by != "condition":
        known = set().union(*flat)
        if group_by not in known:
            raise UsageError(f"--group-by {group_by!r}: not a config key of these runs (e.g. mismatch.magnitude) "
                             "and not 'condition'")
        return [f"{group_by}={f.get(group_by, '?')}" for f in flat]
    keys = sorted(set().union(*flat) - {SEED_KEY, *IGNORED_CONFIG_KEYS})
    varying = [k for k in keys if len({repr(f.get(k)) for f in flat}) > 1]
    labels = [", ".join(f"{k}={f.get(k)}" for k in varying) for f in flat]
    return [lab or "all runs" for lab in labels]


def _collect(inputs: list[str | Path] | str | Path, group_by: str, rule: dict) -> tuple[list[_Run], str]:
    from timlab.experiments.sweeps.runner import INDEX_FILE, read_index

    from timlab.experiments.sweeps.index import find_sweep_dir

    paths = [Path(inputs)] if isinstance(inputs, (str, Path)) else [Path(p) for p in inputs]
    if not paths:
        raise UsageError("report: no inputs (give one sweep directory or run directories)")
    if len(paths) == 1:
        paths = [find_sweep_dir(paths[0])]  # a demo's folder: its sweep
    for p in paths:
        if not p.is_dir():
            raise FileNotFoundError(f"report: {p} is not a directory")
    sweeps = [p for p in paths if (p / INDEX_FILE).exists()]
    if sweeps:
        if len(paths) > 1:
            raise UsageError(f"report: {sweeps[0]} is a sweep directory; pass it alone, or pass run directories")
        index = read_index(paths[0])
        if group_by not in index.columns:
            raise UsageError(f"--group-by {group_by!r}: no such index column; e.g. condition, spec_condition, "
                             "mismatch.magnitude")
        dirs = [paths[0] / d for d in index["run_dir"]]
        names = list(index["run_id"])
        labels = [str(v) for v in index[group_by]]
        source = f"sweep {paths[0]}"
    else:
        for p in paths:
            if not any((p / f).exists() for f in (CONFIG, METRICS, STATUS)):
                raise FileNotFoundError(f"report: {p} is neither a run directory nor a sweep directory")
        dirs = paths
        names = [p.name for p in paths]
        if len(set(names)) < len(names):
            names = [str(p) for p in paths]
        labels = _config_labels(paths, group_by)
        source = f"{len(paths)} run director{'y' if len(paths) == 1 else 'ies'}"
    runs = [_Run(n, d, g, read_metrics(d), run_summary(d, **rule)) for n, d, g in zip(names, dirs, labels)]
    return runs, source


def _missing(run: _Run) -> list[str]:
    if run.df is None:
        return [m for m, _, _ in PLOTS]
    out = []
    for m, _, _ in PLOTS:
        if m not in run.df.columns or not np.isfinite(pd.to_numeric(run.df[m], errors="coerce")).any():
            out.append(m)
    return out


# ------------------------------------------------------------------------------- plots
def _colors(groups: list[str]) -> dict[str, tuple]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(groups) <= 10 else "tab20"]
    return {g: cmap(i % cmap.N) for i, g in enumerate(groups)}


def _series(run: _Run, metric: str) -> pd.Series | None:
    if run.df is None or metric not in run.df.columns:
        return None
    s = pd.to_numeric(run.df[metric], errors="coerce")
    s.index = run.df["step"].to_numpy()
    s = s[np.isfinite(s.to_numpy(dtype=float))]
    s = s[~s.index.duplicated(keep="last")]
    return s if len(s) else None


def _decay_steps(run: _Run) -> list[float]:
    """Steps where the length-decay scheduler lowered the LR (known decay period only)."""
    lr, period = _series(run, "train/lr"), _series(run, "scheduler/decay_period")
    if lr is None or period is None:
        return []
    drops = lr.index[1:][np.diff(lr.to_numpy()) < 0]
    return [float(s) for s in drops]


SAME_CURVE_STYLES = (dict(ls="--", marker="x", ms=6), dict(ls=":", marker="+", ms=7), dict(ls="-.", marker="1", ms=7))
"""How a condition whose curve equals an earlier condition's is drawn, so neither hides the other."""


def _group_curves(runs: list[_Run], g: str, metric: str) -> pd.DataFrame | None:
    """The condition's runs' values of ``metric``: (steps, runs in seed order), or None."""
    series = {r.name: s for r in runs if r.group == g and (s := _series(r, metric)) is not None}
    return pd.concat(series, axis=1).sort_index() if series else None


def _equal(a: pd.DataFrame | None, b: pd.DataFrame | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and np.array_equal(a.index, b.index) and np.array_equal(a.to_numpy(), b.to_numpy(),
                                                                                         equal_nan=True)


def _same_as(curves: dict[str, tuple]) -> dict[str, str]:
    """{condition: the earlier condition whose curves (a tuple of frames each) it equals value
    for value}."""
    same: dict[str, str] = {}
    items = list(curves.items())
    for i, (g, frames) in enumerate(items):
        for h, other in items[:i]:
            if h not in same and all(_equal(a, b) for a, b in zip(frames, other)):
                same[g] = h
                break
    return same


def identical_conditions(runs: list[_Run], groups: list[str]) -> dict[str, str]:
    """Conditions whose runs trained identically to an earlier condition's (the same validation
    accuracy, reward and K3 curves on every seed; e.g. a remedy that never acts): {later: earlier}."""
    keys = ("val/accuracy", "train/reward_mean", "rollout_corr/k3_kl")
    curves = {g: tuple(_group_curves(runs, g, k) for k in keys) for g in groups}
    return _same_as({g: c for g, c in curves.items() if c[0] is not None})


def _metric_plot(runs: list[_Run], groups: list[str], colors: dict, metric: str, title: str) -> str | None:
    fig = page.new_figure()
    ax = fig.add_subplot()
    drew = False
    marks = {"surge": False, "decay": False}
    curves = {g: w for g in groups if (w := _group_curves(runs, g, metric)) is not None}
    same = _same_as({g: (w,) for g, w in curves.items()})
    for g, wide in curves.items():  # wide: (steps, seeds)
        steps = wide.index.to_numpy(dtype=float)
        mean, lo, hi = wide.mean(axis=1), wide.min(axis=1), wide.max(axis=1)
        sparse = metric.startswith("val/")
        label = f"{g} (n={wide.shape[1]})"
        style = dict(marker="o" if sparse else None, ms=3)
        if g in same:
            label += f": same curve as {same[g]}"
            style = dict(SAME_CURVE_STYLES[list(same).index(g) % len(SAME_CURVE_STYLES)],
                         markevery=max(1, len(steps) // 12))
        ax.plot(steps, mean, color=colors[g], lw=1.6, label=label, **style)
        if wide.shape[1] > 1:
            ax.fill_between(steps, lo, hi, color=colors[g], alpha=0.18, lw=0)
        drew = True
        if metric in _MARK_SURGE:
            for r in runs:
                if r.group != g:
                    continue
                surge = r.summary.get("surge_step", math.nan)
                if np.isfinite(surge):
                    ax.axvline(surge, color=colors[g], ls="--", lw=1, alpha=0.7)
                    marks["surge"] = True
                if metric == "train/lr":
                    for s in _decay_steps(r):
                        ax.axvline(s, color=colors[g], ls=":", lw=1, alpha=0.7)
                        marks["decay"] = True
    if not drew:
        return None
    if metric == "train/lr":
        vals = np.concatenate([s.to_numpy(dtype=float) for r in runs if (s := _series(r, metric)) is not None])
        if (vals > 0).all() and vals.max() > vals.min():  # a constant LR stays linear: one value has no log range
            ax.set_yscale("log")
    handles, labels = ax.get_legend_handles_labels()
    from matplotlib.lines import Line2D

    if marks["surge"]:
        handles.append(Line2D([], [], color="gray", ls="--"))
        labels.append("response-length surge")
    if marks["decay"]:
        handles.append(Line2D([], [], color="gray", ls=":"))
        labels.append("LR halving")
    ax.legend(handles, labels, fontsize=8, **page.LEGEND_OUTSIDE)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(title + " (line: mean over seeds; band: min-max)", fontsize=10)
    ax.grid(alpha=0.3)
    return page.png_uri(fig)


def _collapse_aligned_plot(runs: list[_Run], colors: dict) -> str | None:
    """gradcheck metrics of the collapsed runs against steps relative to each run's collapse:
    every run faintly, and per condition the median over runs in 10-step bins."""
    keys = ("gradcheck/rel_bias", "gradcheck/snr_tim", "rollout_corr/k3_kl")
    chosen = [r for r in runs if np.isfinite(r.summary.get("steps_to_collapse", math.nan))
              and _series(r, keys[0]) is not None]
    if not chosen:
        return None
    fig = page.new_figure(11.0, 3.4)
    axes = fig.subplots(1, len(keys))
    for ax, key in zip(axes, keys):
        log = key != "gradcheck/rel_bias"
        for g in dict.fromkeys(r.group for r in chosen):
            pts = []
            for r in (r for r in chosen if r.group == g):
                s = _series(r, key)
                if s is None:
                    continue
                x = s.index.to_numpy(dtype=float) - float(r.summary["steps_to_collapse"])
                y = s.to_numpy(dtype=float)
                if log:
                    x, y = x[y > 0], y[y > 0]
                ax.plot(x, y, color=colors[g], lw=0.6, alpha=0.3)
                pts.append(pd.DataFrame({"x": x, "y": y}))
            if not pts:
                continue
            df = pd.concat(pts)
            med = df.groupby(np.floor(df["x"] / 10) * 10 + 5)["y"].median()
            ax.plot(med.index, med.to_numpy(), color=colors[g], lw=2.2, marker="o", ms=3,
                    label=f"{g}: median of {len(pts)} runs (10-step bins)")
        ax.axvline(0, color="k", ls="--", lw=1)
        ax.set_xlabel("steps relative to collapse")
        ax.set_title(key, fontsize=9)
        ax.grid(alpha=0.3)
        if log:
            ax.set_yscale("log")
    axes[-1].legend(*axes[0].get_legend_handles_labels(), fontsize=7, **page.LEGEND_OUTSIDE)
    return page.png_uri(fig)


DOSE_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
"""Each condition's marker in the dose-response plot (hollow, so that markers at one point nest)."""


def _dose_points(t: pd.DataFrame, col: str) -> list[tuple[str, float, float, float]]:
    """(condition, x, y, marker size) of each finite point; a condition at (or within 5% in x and
    3% of the y range of) an earlier one's point gets a smaller marker, drawn inside it instead
    of over it."""
    pts = [(str(r["group"]), float(r["k3_kl_mean"]), float(r[col])) for _, r in t.iterrows() if np.isfinite(r[col])]
    span = max((abs(y) for *_, y in pts), default=1.0) or 1.0
    out = []
    for i, (g, x, y) in enumerate(pts):
        k = sum(abs(x - px) <= 0.05 * max(abs(x), abs(px)) and abs(y - py) <= 0.03 * span for _, px, py in pts[:i])
        out.append((g, x, y, max(20.0, 150.0 * 0.6 ** k)))
    return out


def _dose_response_plot(table: pd.DataFrame, colors: dict) -> str | None:
    t = table[np.isfinite(table["k3_kl_mean"].to_numpy(dtype=float))]
    if t.empty:
        return None
    fig = page.new_figure(11, 3.8)
    x = t["k3_kl_mean"].to_numpy(dtype=float)
    pos = x[x > 0]
    marker = {g: DOSE_MARKERS[i % len(DOSE_MARKERS)] for i, g in enumerate(t["group"])}
    axes = fig.subplots(1, 2, sharex=True)
    for ax, (col, ylabel) in zip(axes, (("collapse_frac", "fraction of seeds collapsed"),
                                        ("median_steps_to_collapse", "median steps to collapse"))):
        points = _dose_points(t, col)
        for g, px, py, size in points:
            ax.scatter(px, py, s=size, marker=marker[g], facecolors="none", edgecolors=colors.get(g, "k"),
                       linewidths=1.6, zorder=3)
        if pos.size:
            ax.set_xscale("symlog", linthresh=float(pos.min()))
        if col == "collapse_frac":
            ax.set_ylim(-0.05, 1.05)
        else:  # steps from 0: one collapsed condition is one point at its height, not an axis of +-0.05
            top = max((py for *_, py, _ in points), default=1.0)
            ax.set_ylim(0, top * 1.15 + 1)
            ax.set_title("conditions with no collapse have no point" if len(points) != 1
                         else f"only {points[0][0]} collapsed (median step {points[0][2]:g})", fontsize=8)
        ax.set_xlabel("realized K3 KL (mean over steps, then seeds)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], marker=marker[g], ls="", mfc="none", mec=colors.get(g, "k"), mew=1.6)
               for g in t["group"]]
    fig.axes[1].legend(handles, [str(g) for g in t["group"]], fontsize=7, **page.LEGEND_OUTSIDE)
    return page.png_uri(fig)


# ------------------------------------------------------------------------------- html
def mean_pm_std(mean: float, std: float) -> str:
    """A mean +- std over seeds as the report and the demo's terminal table print it: ``0.500 +- 0.075``."""
    if not np.isfinite(mean):
        return "-"
    return f"{mean:.3f}" + (f" +- {std:.3f}" if np.isfinite(std) else "")


def _condition_view(table: pd.DataFrame, rule: str) -> pd.DataFrame:
    """The condition table as shown: mean +- std (over seeds) in one cell; the collapse columns
    name the rule that judged them."""
    return pd.DataFrame({
        "condition": table["group"],
        "runs": table["n"],
        "incomplete": table["n_incomplete"],
        f"collapsed ({rule} rule)": [f"{c}/{n}" for c, n in zip(table["n_collapsed"], table["n"])],
        "collapse frac": table["collapse_frac"],
        f"median steps to collapse ({rule} rule)": table["median_steps_to_collapse"],
        "peak accuracy": [mean_pm_std(m, s) for m, s in zip(table["peak_accuracy_mean"], table["peak_accuracy_std"])],
        "final accuracy": [mean_pm_std(m, s) for m, s in zip(table["final_accuracy_mean"], table["final_accuracy_std"])],
        "late accuracy": [mean_pm_std(m, s) for m, s in zip(table["late_accuracy_mean"], table["late_accuracy_std"])],
        "accuracy AUC": table["auc_accuracy_mean"],
        "K3 KL": table["k3_kl_mean"],
        "|log ppl diff|": table["log_ppl_abs_diff_mean"],
    })


def _effects_section(effects: pd.DataFrame) -> list[str]:
    from timlab.experiments.studies.effects import HOLDS_NOTE, effects_view

    return ["<h2>Headline: effects with intervals</h2>", f'<p class="note">{html.escape(HOLDS_NOTE)}</p>',
            page.table(effects_view(effects), left=("comparison",))]


def build_report(inputs: list[str | Path] | str | Path, out_html: str | Path, *, group_by: str = "condition",
                 title: str = "timlab report", rule: str = DEFAULT_RULE, effects: pd.DataFrame | None = None,
                 note: str | None = None) -> ReportResult:
    """Write one self-contained HTML report of ONE sweep directory or a list of run directories.
    ``rule``: the collapse rule its verdicts use (``collapse.RULES``). ``effects``: an
    ``effects.paired_table``, shown first as the headline (the demo passes its comparisons).
    ``note``: a paragraph under the opening line (the demo names the machine it computed on)."""
    runs, source = _collect(inputs, group_by, {"rule": check_rule(rule)})
    groups = list(dict.fromkeys(r.group for r in runs))
    colors = _colors(groups)
    missing = [(r.name, m) for r in runs if (m := _missing(r))]

    index_df = pd.DataFrame([{"run": r.name, "group": r.group, **r.summary} for r in runs])
    table = condition_table(index_df, by="group")
    run_cols = ["run", "group", "state", "last_step", "peak_accuracy", "final_accuracy", "auc_accuracy", "collapsed",
                "steps_to_collapse", "k3_kl_mean", "log_ppl_abs_diff_mean", "grad_norm_max", "surge_step"]

    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{page.STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p>{len(runs)} runs in {len(groups)} condition{"s" if len(groups) != 1 else ""}, from {html.escape(source)}; '
        f"grouped by <code>{html.escape(group_by)}</code>. Seeds of a condition are summarized as a mean line "
        "and a min-max band.</p>",
        *([f'<p class="note">{html.escape(note)}</p>'] if note else []),
        *(_effects_section(effects) if effects is not None else []),
        "<h2>Collapse rule</h2>",
        f'<p class="rule">{html.escape(describe_rule(rule=rule, frac=DEFAULT_FRAC, min_peak=DEFAULT_MIN_PEAK))}</p>',
        "<h2>Conditions</h2>",
        '<p class="note">Per condition: runs = runs that finished or diverged (incomplete: failed, guard_failed, '
        "running or pending runs, left out of the statistics); collapsed = how many of those collapsed; median "
        "steps to collapse over the runs that collapsed; accuracies are greedy val/accuracy, mean +- std over "
        "seeds (late: the mean of a run's last 3 evaluations; AUC: the average accuracy over the run); realized mismatch = each run's mean over steps of "
        "rollout_corr/k3_kl and rollout_corr/log_ppl_abs_diff, averaged over seeds.</p>",
        page.table(_condition_view(table, rule), left=("condition",)),
        "<h2>Dose-response</h2>",
        '<p class="note">Collapse fraction and median steps-to-collapse of each condition against its realized '
        f"K3 KL, a test of {claim('P2')}. Markers of conditions at the same point are drawn one inside the other.</p>",
        page.img(_dose_response_plot(table, colors), "dose-response"),
        "<h2>Training curves</h2>",
    ]
    same = identical_conditions(runs, groups)
    if same:
        pairs = "; ".join(f"{html.escape(g)} = {html.escape(h)}" for g, h in same.items())
        parts.append(f'<p class="note"><strong>Identical conditions:</strong> {pairs}. Their runs have the same '
                     "validation accuracy, reward and K3 curves on every seed (the setting that differs never acted), "
                     "so each later one is drawn dashed with its own markers over the earlier one.</p>")
    for metric, heading, text in PLOTS:
        parts += [f"<h3>{html.escape(heading)} <code>{html.escape(metric)}</code></h3>",
                  f'<p class="note">{html.escape(text)}</p>',
                  page.img(_metric_plot(runs, groups, colors, metric, heading), metric)]
    if any(_series(r, GRAD_PLOTS[0][0]) is not None for r in runs):
        parts += ["<h2>Gradient diagnostics</h2>",
                  '<p class="note">From the in-run gradcheck (run.gradcheck_every): the policy gradient under exact '
                  "rollouts vs under this run's injector, at the run's weights every K steps. Runs without it are "
                  "left out of these plots.</p>"]
        for metric, heading, text in GRAD_PLOTS:
            parts += [f"<h3>{html.escape(heading)} <code>{html.escape(metric)}</code></h3>",
                      f'<p class="note">{html.escape(text)}</p>',
                      page.img(_metric_plot(runs, groups, colors, metric, heading), metric)]
        aligned = _collapse_aligned_plot(runs, colors)
        if aligned is not None:
            parts += ["<h3>Before a collapse</h3>",
                      '<p class="note">Each collapsed run (faint), aligned on its collapse step (dashed line), and the '
                      "median over runs in 10-step bins (bold): relative gradient bias, gradient SNR under the "
                      "injector (log scale; checks with a zero estimate left out), and the realized K3 KL. A rise "
                      f"before 0 is the early warning of {claim('P3', 'P7')}.</p>", page.img(aligned, "aligned on collapse")]
    from timlab.experiments.sweeps.index import RULE_COLUMNS

    shown = index_df[[c for c in run_cols if c in index_df.columns]]
    shown = shown.rename(columns={c: f"{c} ({rule} rule)" for c in RULE_COLUMNS})
    parts += ["<h2>Runs</h2>", page.table(shown, left=("run", "group", "state"), fit=True)]
    parts.append("<h2>Runs with missing metrics</h2>")
    if missing:
        parts.append('<p class="note">These runs lack the metrics listed (absent or never finite); the plots '
                     "above use every metric they do have.</p><ul>")
        for name, ms in missing:
            state = next(r.summary["state"] for r in runs if r.name == name)
            why = " (no metrics.parquet)" if next(r.df is None for r in runs if r.name == name) else ""
            parts.append(f"<li><b>{html.escape(name)}</b> [{html.escape(state)}]{why}: "
                         + ", ".join(f"<code>{html.escape(m)}</code>" for m in ms) + "</li>")
        parts.append("</ul>")
    else:
        parts.append('<p class="note">None: every run has every plotted metric.</p>')
    parts.append("</body></html>")

    out = Path(out_html)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "\n".join(parts))
    return ReportResult(out, len(runs), missing)


__all__ = ["build_report", "ReportResult", "PLOTS", "GRAD_PLOTS"]
