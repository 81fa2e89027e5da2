"""Numbers behind docs/FINDINGS.md, computed from a demo (or any sweep) directory.

    python scripts/findings_tables.py demo_out/runs [more sweep dirs...]

Prints markdown: the per-condition table (collapse fraction, steps to collapse, peak/final/AUC
accuracy, realized k3), the gradient-norm comparison behind P3, and the mismatch-by-length
table behind P7 (aggregated over every step of every run with a non-zero mismatch).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timlab.experiments.collapse import condition_table  # noqa: E402
from timlab.experiments.sweep import read_index  # noqa: E402
from timlab.schedulers.length_decay import SurgeDetector  # noqa: E402


def conditions(index: pd.DataFrame) -> str:
    t = condition_table(index)
    cols = ["condition", "n", "n_collapsed", "median_steps_to_collapse", "peak_accuracy_mean", "final_accuracy_mean",
            "final_accuracy_std", "auc_accuracy_mean", "k3_kl_mean"]
    t = t[[c for c in cols if c in t.columns]]
    return t.to_markdown(index=False, floatfmt=".3g")


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
    return pd.DataFrame(rows).to_markdown(index=False, floatfmt=".3g")


def _surge_step(df: pd.DataFrame, row: pd.Series) -> float:
    """Where the run's own surge detector settings fire on its mean response length (NaN: never)."""
    det = SurgeDetector(float(row["scheduler.surge_ratio"]), int(row["scheduler.surge_window"]))
    for step, length in zip(df["step"], df["train/response_length_mean"]):
        if np.isfinite(length) and det.update(int(step), float(length)):
            return float(step)
    return float("nan")


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
            rec["surge"].append(_surge_step(train, row))
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
    return pd.DataFrame(rows).to_markdown(index=False)


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
    slope = np.polyfit(np.log(mids[ok]), np.log(y[ok]), 1)[0] if ok.sum() >= 2 else float("nan")
    return t.to_markdown(index=False, floatfmt=".4g") + f"\n\nlog-log slope of the sum form against length: {slope:.2f}"


def main() -> None:
    frames = []
    for d in sys.argv[1:]:
        idx = read_index(d)
        idx["run_dir"] = [str(Path(d) / r) if not Path(r).is_absolute() else r for r in idx["run_dir"]]
        frames.append(idx)
    index = pd.concat(frames, ignore_index=True)
    index = index[index["state"].isin(["finished", "diverged"])]  # complete runs only
    print("## Conditions\n")
    print(conditions(index))
    print("\n## Learning and response length\n")
    print(learning(index))
    print("\n## Gradient norm (P3)\n")
    print(grad_norms(index))
    mismatched = index[index["mismatch.injector"] != "none"]
    print("\n## Mismatch by response length (P7), runs with an injected mismatch\n")
    print(by_length(mismatched))


if __name__ == "__main__":
    main()
