"""What the persistence statistics read for each kind of mismatch (docs/metrics.md, "Persistence").

    python bench/persistence_kinds.py [--start runs/erosion_start] [--steps 60] [--json out.json]

Trains the surge preset for ``--steps`` steps from ``--start`` (default: the preset's own SFT warm
start, built once if missing) under each kind, one seed, and prints per kind the median realized k3
and the mean of ``mismatch/persistence_lag1``, ``mismatch/persistence_ema`` and
``mismatch/persistence_reliability`` over steps 3 on.
Kinds: zero mismatch; head_perturb 0.6 with one direction for the run, redrawn every 25 steps and
every step (studies P1 and P2's arms); one step of staleness; an fp8 rollout; logit noise 0.3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KINDS = {
    "zero mismatch": ["mismatch.injector=none"],
    "head_perturb 0.6, one direction": ["mismatch.injector=head_perturb", "mismatch.magnitude=0.6"],
    "head_perturb 0.6, redrawn every 25": ["mismatch.injector=head_perturb", "mismatch.magnitude=0.6",
                                          "mismatch.redraw_every=25"],
    "head_perturb 0.6, redrawn every step": ["mismatch.injector=head_perturb", "mismatch.magnitude=0.6",
                                            "mismatch.redraw_every=1"],
    "stale 1": ["mismatch.injector=stale", "mismatch.magnitude=1"],
    "fp8 rollout": ["mismatch.injector=fp8"],
    "logit noise 0.3": ["mismatch.injector=logit_noise", "mismatch.magnitude=0.3"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", default="", help="model folder to start from (default: the surge preset's warm start)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    import pandas as pd
    import torch

    from timlab.config import resolve
    from timlab.machine import summary
    from timlab.trainer.run import train

    torch.set_num_threads(1)
    start = [f"model.path={args.start}"] if args.start else []
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, over in KINDS.items():
            cfg = resolve(preset="surge", overrides=start + over + [
                f"run.steps={args.steps}", f"run.eval_every={args.steps}", f"run.checkpoint_every={args.steps}",
                "run.progress=false"])
            run = Path(tmp) / str(len(rows))
            train(cfg, run)
            m = pd.read_parquet(run / "metrics.parquet")
            m = m[m["step"] >= 3]
            rows.append({"kind": name, "k3 (median)": float(m["rollout_corr/k3_kl"].median()),
                         "persistence_lag1 (mean)": float(m["mismatch/persistence_lag1"].mean()),
                         "persistence_ema (mean)": float(m["mismatch/persistence_ema"].mean()),
                         "persistence_reliability (mean)": float(m["mismatch/persistence_reliability"].mean())})
            r = rows[-1]
            print(f"{name:<38} k3 {r['k3 (median)']:.2e}  lag1 {r['persistence_lag1 (mean)']:+.3f}  "
                  f"ema {r['persistence_ema (mean)']:+.3f}  reliability {r['persistence_reliability (mean)']:+.3f}",
                  flush=True)
    print(f"computed with {summary()}; start {args.start or 'the surge warm start'}, {args.steps} steps, seed 0")
    if args.json:
        Path(args.json).write_text(json.dumps({"start": args.start, "steps": args.steps, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
