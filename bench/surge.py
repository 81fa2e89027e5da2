"""Benchmark: is the surge testbed a testbed? Learning, length growth and cost of one run.

    OMP_NUM_THREADS=1 python bench/surge.py [--seeds 0] [--json OUT]

For each seed, one zero-mismatch run of ``--preset surge`` (the exact engine, the guard on) in a
temporary directory, with one torch thread. The SFT warm start is built (and cached under
``TIMLAB_CACHE``) first and timed on its own. Printed per run, each with its target and ratio:

- greedy validation accuracy gain, last evaluation minus the warm start (target >= 0.15);
- mean sampled response length over the last 10 steps / over the first 10 (target >= 2);
- CPU minutes of the RL run (``time.process_time``; target <= 10), and its wall time.

Targets are issue 12's: a testbed where RL clearly learns and answers get longer, cheap enough
for a 5-seed x 6-condition study in one session on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timlab.config import resolve  # noqa: E402
from timlab.files import write_json  # noqa: E402
from timlab.trainer.pretrain import ensure_warm_start  # noqa: E402
from timlab.trainer.run import train  # noqa: E402

TARGETS = {"accuracy_gain": 0.15, "length_ratio": 2.0, "cpu_minutes": 10.0}


def one_run(seed: int) -> dict:
    cfg = resolve(preset="surge", overrides=[f"run.seed={seed}", "run.progress=false"])
    with tempfile.TemporaryDirectory() as tmp:
        wall, cpu = time.perf_counter(), time.process_time()
        train(cfg, Path(tmp) / "run")
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        df = pd.read_parquet(Path(tmp) / "run" / "metrics.parquet").sort_values("step")
    acc = df["val/accuracy"].dropna()
    lengths = df.loc[df["step"] > 0, "train/response_length_mean"]
    assert (df["rollout_corr/k3_kl"].iloc[1:] == 0).all(), "zero mismatch was not zero"
    return {"seed": seed, "accuracy_start": float(acc.iloc[0]), "accuracy_final": float(acc.iloc[-1]),
            "accuracy_gain": float(acc.iloc[-1] - acc.iloc[0]),
            "length_first10": float(lengths.iloc[:10].mean()), "length_last10": float(lengths.iloc[-10:].mean()),
            "length_ratio": float(lengths.iloc[-10:].mean() / lengths.iloc[:10].mean()),
            "cpu_minutes": cpu / 60, "wall_minutes": wall / 60, "steps": int(df["step"].max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    wall, cpu = time.perf_counter(), time.process_time()
    warm = ensure_warm_start(resolve(preset="surge"))
    sft = {"cached": warm.cached, "cpu_minutes": (time.process_time() - cpu) / 60,
           "wall_minutes": (time.perf_counter() - wall) / 60}
    print(f"warm start: {warm.path} ({'cached' if warm.cached else 'built'}: {sft['cpu_minutes']:.2f} CPU-min, "
          f"{sft['wall_minutes']:.2f} min wall)")
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        r = one_run(seed)
        runs.append(r)
        print(f"seed {seed}: accuracy {r['accuracy_start']:.3f} -> {r['accuracy_final']:.3f} "
              f"(gain {r['accuracy_gain']:.3f}, target >= {TARGETS['accuracy_gain']}: ratio "
              f"{r['accuracy_gain'] / TARGETS['accuracy_gain']:.2f}); length {r['length_first10']:.1f} -> "
              f"{r['length_last10']:.1f} (x{r['length_ratio']:.2f}, target >= {TARGETS['length_ratio']}: ratio "
              f"{r['length_ratio'] / TARGETS['length_ratio']:.2f}); {r['steps']} steps in {r['cpu_minutes']:.2f} "
              f"CPU-min ({r['wall_minutes']:.2f} min wall; target <= {TARGETS['cpu_minutes']}: ratio "
              f"{r['cpu_minutes'] / TARGETS['cpu_minutes']:.2f})")
    if args.json:
        write_json(args.json, {"warm_start": sft, "runs": runs, "targets": TARGETS})


if __name__ == "__main__":
    main()
