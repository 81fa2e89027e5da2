"""Overhead of the mismatch metric suite inside an RL step (target: <= 2% of step time).

Runs a short ``timlab train`` with the demo preset and an injected mismatch (so every metric has
non-trivial work), then reports sum(time/metrics_s) / sum(train/step_time_s) over the steps:
``time/metrics_s`` covers verl's rollout_corr/* set, timlab's mismatch/* extras, the ratio
histogram and the breakdowns by position, probability and length, all computed every step.

    OMP_NUM_THREADS=1 python bench/metrics_overhead.py [--steps 40] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timlab.config import resolve  # noqa: E402
from timlab.rundir import read_metrics  # noqa: E402
from timlab.trainer.run import train  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        cfg = resolve(preset=args.preset, overrides=[f"run.steps={args.steps}", "run.progress=false", "run.eval_every=1000",
                                                     "mismatch.injector=head_perturb", "mismatch.magnitude=0.5"])
        train(cfg, Path(d) / "run")
        df = read_metrics(Path(d) / "run").iloc[2:]  # skip step 0 (eval only) and the first step (warm-up)
    step = float(df["train/step_time_s"].sum())
    metrics = float(df["time/metrics_s"].sum())
    out = {"steps": len(df), "step_time_s_median": float(df["train/step_time_s"].median()),
           "metrics_time_s_median": float(df["time/metrics_s"].median()), "overhead_frac": metrics / step}
    print(f"metrics overhead: {100 * out['overhead_frac']:.2f}% of step time "
          f"(median step {out['step_time_s_median'] * 1000:.0f} ms, metrics {out['metrics_time_s_median'] * 1000:.1f} ms; target <= 2%)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
