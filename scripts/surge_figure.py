"""Figure behind docs/FINDINGS.md's surge-testbed section: greedy validation accuracy and mean
response length over training, mean over seeds (band: min-max), for chosen conditions of a sweep.

    python scripts/surge_figure.py sweeps/surge docs/img/surge_dose.png [CONDITION ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timlab.experiments.sweeps.runner import read_index  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_figure import band  # noqa: E402

DEFAULT = ["zero_mismatch", "bf16_rollout", "head_0.5", "head_1", "head_1.5", "head_2"]


def main() -> None:
    sweep, out = Path(sys.argv[1]), Path(sys.argv[2])
    conditions = sys.argv[3:] or DEFAULT
    index = read_index(sweep)
    fig = Figure(figsize=(11, 3.8))
    ax_acc, ax_len = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for i, cond in enumerate(c for c in conditions if c in set(index["condition"])):
        runs = index[(index["condition"] == cond) & (index["state"] == "finished")]
        frames = [pd.read_parquet(sweep / d / "metrics.parquet") for d in runs["run_dir"]]
        if not frames:
            continue
        label = f"{cond} ({len(frames)} seeds)"
        band(ax_acc, frames, "val/accuracy", f"C{i}", label)
        band(ax_len, [f[f["step"] > 0] for f in frames], "train/response_length_mean", f"C{i}", label, smooth=5)
    ax_acc.set(xlabel="step", ylabel="greedy val accuracy (pi, no injector)", ylim=(0, 1.02))
    ax_len.set(xlabel="step", ylabel="mean sampled response length (5-step mean)")
    ax_acc.legend(fontsize=7, loc="lower right")
    ax_acc.set_title("greedy accuracy of pi: mean over seeds, band min-max", fontsize=9)
    ax_len.set_title("sampled response length: mean over seeds, band min-max", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
