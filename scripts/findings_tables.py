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
    print("## Conditions\n")
    print(conditions(index))
    print("\n## Gradient norm (P3)\n")
    print(grad_norms(index))
    mismatched = index[index["mismatch.injector"] != "none"]
    print("\n## Mismatch by response length (P7), runs with an injected mismatch\n")
    print(by_length(mismatched))


if __name__ == "__main__":
    main()
