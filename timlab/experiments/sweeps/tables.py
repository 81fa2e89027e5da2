"""Per-condition tables of any sweep directories, as markdown: the conditions (collapses, accuracy,
realized k3), learning and response length, the gradient norm against k3, and the mismatch by
response length (from each run's distributions.jsonl).

Used by ``python scripts/findings_tables.py DIR...`` (``generic``) and by the FINDINGS blocks that
share its helpers (``md_table``, ``surge_step``). Plain markdown without pandas' ``to_markdown``
(which needs tabulate).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from timlab.experiments.studies.collapse import condition_table
from timlab.experiments.studies.stats import line_fit
from timlab.experiments.sweeps.runner import read_index
from timlab.schedulers.length_decay import SurgeDetector


def md_table(rows: list[dict]) -> str:
    """A markdown table of rows (dicts with the same keys); text columns left, the rest right."""
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def surge_step(train: pd.DataFrame, sched: dict) -> float:
    """The step at which the run's own surge-detector settings fire on its mean response length
    (NaN: never)."""
    det = SurgeDetector(float(sched["surge_ratio"]), int(sched["surge_window"]))
    for step, length in zip(train["step"], train["train/response_length_mean"]):
        if np.isfinite(length) and det.update(int(step), float(length)):
            return float(step)
    return math.nan


def df_md(df: pd.DataFrame, floatfmt: str = "") -> str:
    """A DataFrame as a markdown table (pandas' to_markdown needs tabulate; this does not)."""
    cell = lambda v: (format(v, floatfmt) if floatfmt and isinstance(v, (float, np.floating)) else str(v))  # noqa: E731
    return md_table([{c: cell(v) for c, v in r.items()} for r in df.to_dict("records")])


def conditions(index: pd.DataFrame) -> str:
    t = condition_table(index)
    cols = ["condition", "n", "n_collapsed", "median_steps_to_collapse", "peak_accuracy_mean", "final_accuracy_mean",
            "final_accuracy_std", "auc_accuracy_mean", "k3_kl_mean"]
    t = t[[c for c in cols if c in t.columns]]
    return df_md(t, ".3g")


def grad_norms(index: pd.DataFrame) -> str:
    """Mean train/grad_norm_ema over the first 20 steps and over the whole run, per condition,
    and the per-step Pearson correlation of k3 with the grad norm inside mismatched runs."""
    rows = []
    for cond, g in index.groupby("condition", sort=False):
        early, whole, corr = [], [], []
        for d in g["run_dir"]:
            df = pd.read_parquet(Path(d) / "metrics.parquet").iloc[1:]
            early.append(df["train/grad_norm_ema"].iloc[:20].mean())
            whole.append(df["train/grad_norm_ema"].mean())
            k3, gn = df["rollout_corr/k3_kl"], df["train/grad_norm"]
            if k3.std() > 0 and gn.std() > 0:
                corr.append(np.corrcoef(k3, gn)[0, 1])
        rows.append({"condition": cond, "grad_norm_ema steps 1-20": np.mean(early), "grad_norm_ema all steps": np.mean(whole),
                     "corr(k3, grad_norm) per step": np.mean(corr) if corr else float("nan")})
    return df_md(pd.DataFrame(rows), ".3g")


def learning(index: pd.DataFrame, gain: float = 0.15, learned_at: float = 0.6) -> str:
    """Does RL learn, and do answers surge? Per condition, mean (min-max) over seeds of: greedy
    accuracy at the start and at the end, the seeds whose final accuracy gained >= ``gain``,
    training reward and mean response length over the first and the last 10 steps, and the step
    at which the surge detector (the run's scheduler settings) fires on the response length, and
    the first evaluation with greedy accuracy >= ``learned_at`` (how fast the run learns)."""
    rows = []
    for cond, g in index.groupby("condition", sort=False):
        rec: dict[str, list] = {k: [] for k in ("start", "final", "rew0", "rew1", "len0", "len1", "surge", "learned")}
        for d, (_, row) in zip(g["run_dir"], g.iterrows()):
            df = pd.read_parquet(Path(d) / "metrics.parquet").sort_values("step")
            acc = df["val/accuracy"].dropna()
            train = df[df["step"] > 0]
            rec["start"].append(acc.iloc[0])
            rec["final"].append(acc.iloc[-1])
            rec["rew0"].append(train["train/reward_mean"].iloc[:10].mean())
            rec["rew1"].append(train["train/reward_mean"].iloc[-10:].mean())
            rec["len0"].append(train["train/response_length_mean"].iloc[:10].mean())
            rec["len1"].append(train["train/response_length_mean"].iloc[-10:].mean())
            rec["surge"].append(surge_step(train, {"surge_ratio": row["scheduler.surge_ratio"], "surge_window": row["scheduler.surge_window"]}))
            ev = df.dropna(subset=["val/accuracy"])
            hit = ev.loc[ev["val/accuracy"] >= learned_at, "step"]
            rec["learned"].append(float(hit.iloc[0]) if len(hit) else float("nan"))
        a = {k: np.array(v, dtype=float) for k, v in rec.items()}
        fired = a["surge"][np.isfinite(a["surge"])]
        learned = a["learned"][np.isfinite(a["learned"])]
        rows.append({
            "condition": cond, "n": len(g),
            "greedy acc start": f"{a['start'].mean():.2f}",
            "final": f"{a['final'].mean():.2f} ({a['final'].min():.2f}-{a['final'].max():.2f})",
            f"seeds gaining >= {gain:g}": f"{int((a['final'] - a['start'] >= gain).sum())}/{len(g)}",
            "reward first/last 10": f"{a['rew0'].mean():.2f} / {a['rew1'].mean():.2f}",
            "length first/last 10": f"{a['len0'].mean():.1f} / {a['len1'].mean():.1f}",
            "length ratio": f"{(a['len1'] / a['len0']).mean():.2f} ({(a['len1'] / a['len0']).min():.2f}-"
                            f"{(a['len1'] / a['len0']).max():.2f})",
            "surge detected": f"{len(fired)}/{len(g)}" + (f", median step {np.median(fired):g}" if len(fired) else ""),
            f"acc >= {learned_at:g}": f"{len(learned)}/{len(g)}" + (f", median step {np.median(learned):g}" if len(learned) else ""),
        })
    return df_md(pd.DataFrame(rows))


def by_length(index: pd.DataFrame) -> str:
    """Sequence-count-weighted mean |sum_t r| and per-token |r| per response-length bucket."""
    edges, counts, sums, means = None, None, None, None
    for d in index["run_dir"]:
        path = Path(d) / "distributions.jsonl"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            rec = json.loads(line).get("by_length")
            if not rec:
                continue
            c = np.array(rec["counts"], dtype=float)
            if edges is None:
                edges = rec["edges"]
                counts, sums, means = np.zeros_like(c), np.zeros_like(c), np.zeros_like(c)
            counts += c
            sums += c * np.array(rec["mean_abs_sum_diff"])
            means += c * np.array(rec["mean_abs_diff"])
    if edges is None or counts.sum() == 0:
        return "(no by_length data)"
    rows = []
    for i, n in enumerate(counts):
        if n:
            rows.append({"length": f"[{edges[i]:g}, {edges[i + 1]:g})", "sequences": int(n),
                         "mean abs sum-form diff (Eq. 8)": sums[i] / n, "mean per-token abs diff": means[i] / n})
    t = pd.DataFrame(rows)
    mids = np.array([(edges[i] + edges[i + 1]) / 2 for i, n in enumerate(counts) if n])
    y = t["mean abs sum-form diff (Eq. 8)"].to_numpy()
    ok = (y > 0) & (mids > 0)
    slope = line_fit([math.log(v) for v in mids[ok]], [math.log(v) for v in y[ok]])[0] if ok.sum() >= 2 else float("nan")
    return df_md(t, ".4g") + f"\n\nlog-log slope of the sum form against length: {slope:.2f}"


def generic(dirs: list[str]) -> str:
    """The per-condition tables of any sweep directories: conditions, learning and response
    length, the gradient norm, and mismatch by response length (from distributions.jsonl)."""
    frames = []
    for d in dirs:
        idx = read_index(d)
        idx["run_dir"] = [str(Path(d) / r) if not Path(r).is_absolute() else r for r in idx["run_dir"]]
        frames.append(idx)
    index = pd.concat(frames, ignore_index=True)
    index = index[index["state"].isin(["finished", "diverged"])]  # complete runs only
    mismatched = index[index["mismatch.injector"] != "none"]
    return "\n".join(["## Conditions\n", conditions(index), "\n## Learning and response length\n", learning(index),
                      "\n## Gradient norm (P3)\n", grad_norms(index),
                      "\n## Mismatch by response length (P7), runs with an injected mismatch\n", by_length(mismatched)])
