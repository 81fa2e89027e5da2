"""Benchmark: the k3 controller's fixed step against its adaptive step (``mismatch.target_adapt``).

    OMP_NUM_THREADS=1 python bench/controller_track.py --start runs/l1_start_r1 [--seeds 0 1 2 3]
        [--figure docs/img/controller_tracking.png] [--json OUT]

The script re-executes itself under the AVX2 pin (``timlab --isa avx2``) before torch loads. Runs,
each once with the fixed law and once with the adaptive one, head_perturb, one torch thread:

- ``demo``: ``--preset demo``, ``mismatch.target_k3=1e-2``, 30 steps (issue 40's criterion: the
  median k3 over steps 10-30 within [0.5, 2]x the target), seed 0;
- ``sharp``: Study L1's shortest learned start (``--start``, a model folder; T ~ 30, the answer
  near-deterministic, so k3 grows about as magnitude^13) with L1's settings (surge preset,
  scratch_add with restate 1, 4 prompts x 8 samples, 40 steps, 256 validation prompts every 10
  steps), ``mismatch.target_k3=1e-3``, one run per seed (run.seed = mismatch.seed).

Printed per run, over the window (steps 10-30 for demo, 10-40 for sharp): the median, mean and max
of the realized k3 in units of the target, the share of steps whose k3 is within [0.5, 2]x the
target, and the magnitude's range and median step-to-step factor (x2 for a fixed law gone bang-bang).
The pooled lines take the seeds' windows together (the magnitude move there includes the jumps
between seeds' windows, 3 of ~120). The figure shows, on the sharp start, the realized k3 and the magnitude per step under
both laws, with the target.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timlab.machine import pin_env  # noqa: E402  (imports no torch)

if (env := pin_env("avx2")) is not None:  # the pin must be in the environment before torch loads
    os.execve(sys.executable, [sys.executable, *sys.argv], env)

import argparse  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from timlab.config import resolve  # noqa: E402
from timlab.files import write_json  # noqa: E402
from timlab.machine import summary as machine_summary  # noqa: E402
from timlab.trainer.run import train  # noqa: E402

LAWS = {"fixed": "false", "adaptive": "true"}
DEMO = {"preset": "demo", "target": 1e-2, "window": (10, 30),
        "set": {"mismatch.injector": "head_perturb", "mismatch.target_k3": 1e-2, "run.steps": 30}}
SHARP = {"preset": "surge", "target": 1e-3, "window": (10, 40),
         "set": {"task.kwargs.scratch_frac": 1.0, "task.n_val": 256, "rollout.prompts_per_step": 4,
                 "run.eval_every": 10, "run.checkpoint_every": 20, "run.steps": 40, "task.kwargs.restate": 1,
                 "rollout.max_new_tokens": 48, "mismatch.injector": "head_perturb", "mismatch.target_k3": 1e-3}}
BAND = (0.5, 2.0)
"""The tracking band, in units of the target (issue 40's criterion for the median)."""


def run(name: str, spec: dict, sets: dict, tmp: Path) -> pd.DataFrame:
    cfg = resolve(preset=spec["preset"], overrides=[f"{k}={v}" for k, v in
                                                    {**spec["set"], "run.progress": "false", **sets}.items()])
    t0, c0 = time.perf_counter(), time.process_time()
    train(cfg, tmp / name)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    df = pd.read_parquet(tmp / name / "metrics.parquet").sort_values("step")
    df = df[df["step"] > 0].set_index("step")
    df.attrs["cpu_s"], df.attrs["wall_s"] = cpu, wall
    return df


def scores(df: pd.DataFrame, target: float, window: tuple[int, int]) -> dict:
    lo, hi = window
    r = df.loc[lo:hi, "rollout_corr/k3_kl"].to_numpy() / target
    m = df.loc[lo:hi, "mismatch/magnitude"].to_numpy()
    return {"median": float(np.median(r)), "mean": float(r.mean()), "max": float(r.max()),
            "in_band": float(((r >= BAND[0]) & (r <= BAND[1])).mean()), "steps": int(len(r)),
            "m_move": float(np.exp(np.median(np.abs(np.diff(np.log(m)))))), "m_lo": float(m.min()),
            "m_hi": float(m.max()), "cpu_s": round(df.attrs["cpu_s"], 1)}


def line(name: str, s: dict) -> str:
    return (f"{name:<18} median {s['median']:<7.3g} mean {s['mean']:<7.3g} max {s['max']:<7.3g} "
            f"in [0.5, 2]x {s['in_band']:4.0%} | magnitude {s['m_lo']:.3g}-{s['m_hi']:.3g}, median move "
            f"x{s['m_move']:.3f} ({s['steps']} steps, {s['cpu_s']:.0f} CPU-s)")


def figure(runs: dict[tuple[str, int], pd.DataFrame], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    colors = {"fixed": "tab:red", "adaptive": "tab:blue"}
    seeds = sorted({s for _, s in runs})
    for (law, seed), df in sorted(runs.items()):
        first = seed == seeds[0]
        kw = {"color": colors[law], "lw": 1.6 if first else 0.7, "alpha": 0.95 if first else 0.45}
        label = f"{law} step (seed {seed}; thin: seeds {', '.join(map(str, seeds[1:]))})" if first else None
        ax.plot(df.index, df["rollout_corr/k3_kl"].clip(lower=1e-7), marker="o", ms=2.5 if first else 0, label=label, **kw)
        bx.plot(df.index, df["mismatch/magnitude"], **kw)
    ax.axhline(target, color="k", lw=1, ls="--", label=f"target {target:g}")
    ax.axhspan(target * BAND[0], target * BAND[1], color="k", alpha=0.07, label="[0.5, 2]x target")
    ax.set_yscale("log")
    ax.set_ylabel("realized k3 of the step's batch")
    ax.set_title("k3 controller on a sharp start (Study L1, T ~ 30; k3 ~ magnitude^13): fixed vs adaptive step",
                 fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    bx.set_yscale("log")
    bx.set_ylabel("head_perturb magnitude")
    bx.set_xlabel("training step")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"figure: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", required=True, help="the sharp start: a model folder (Study L1's runs/l1_start_r1)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--figure", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{machine_summary()}, {torch.get_num_threads()} thread", flush=True)
    out: dict = {"demo": {}, "sharp": {}}
    sharp_runs: dict[tuple[str, int], pd.DataFrame] = {}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"demo preset, target {DEMO['target']:g}, steps {DEMO['window'][0]}-{DEMO['window'][1]} "
              "(k3 in units of the target):")
        for law, flag in LAWS.items():
            df = run(f"demo_{law}", DEMO, {"mismatch.target_adapt": flag}, Path(tmp))
            out["demo"][law] = scores(df, DEMO["target"], DEMO["window"])
            print("  " + line(law, out["demo"][law]), flush=True)
        print(f"sharp start {args.start}, target {SHARP['target']:g}, steps {SHARP['window'][0]}-{SHARP['window'][1]}:")
        for seed in args.seeds:
            for law, flag in LAWS.items():
                df = run(f"sharp_{law}_s{seed}", SHARP, {"model.path": args.start, "mismatch.target_adapt": flag,
                                                          "run.seed": seed, "mismatch.seed": seed}, Path(tmp))
                sharp_runs[law, seed] = df
                out["sharp"][f"{law}_s{seed}"] = scores(df, SHARP["target"], SHARP["window"])
                print("  " + line(f"{law} seed {seed}", out["sharp"][f"{law}_s{seed}"]), flush=True)
        for law in LAWS:  # the seeds' windows pooled
            pooled = pd.concat([sharp_runs[law, s].loc[SHARP["window"][0]:SHARP["window"][1]] for s in args.seeds])
            pooled.attrs["cpu_s"] = sum(sharp_runs[law, s].attrs["cpu_s"] for s in args.seeds)
            out["sharp"][f"{law}_pooled"] = scores(pooled.reset_index(drop=True), SHARP["target"], (0, len(pooled)))
            print("  " + line(f"{law} pooled", out["sharp"][f"{law}_pooled"]))
    if args.figure:
        figure(sharp_runs, SHARP["target"], args.figure)
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
