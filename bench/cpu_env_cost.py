"""What the MKL and oneDNN settings of ``timlab.model`` cost on this CPU (``machine.exact_cpu_env``).

    python bench/cpu_env_cost.py [--steps 20]

Each measurement runs twice in child processes: with the settings (as importing ``timlab.model`` makes them)
and without (``TIMLAB_KEEP_CPU_ENV=1``: MKL and oneDNN as torch ships them). Measured: a
``--steps``-step surge run from its cached SFT start (the exact fp32 path, one thread; wall time of
the steps as the run logs them), and fp32 and bf16 linears at (512, 1024) x (1024, 1024), one
thread (median of 20 calls). Prints each time and the ratio with / without. On a CPU where
``exact_cpu_env()`` is empty (AMD) the two agree by construction.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from timlab import machine  # noqa: E402  (imports no torch)

GEMM = """
import json, time, torch, torch.nn.functional as F
import timlab.model  # noqa: F401  (applies the exact path's MKL and oneDNN settings)
torch.set_num_threads(1)
out = {}
for dt in (torch.float32, torch.bfloat16):
    x, w = torch.randn(512, 1024).to(dt), torch.randn(1024, 1024).to(dt)
    F.linear(x, w)
    ts = []
    for _ in range(20):
        t0 = time.perf_counter(); F.linear(x, w); ts.append(time.perf_counter() - t0)
    out[str(dt)[6:]] = sorted(ts)[len(ts) // 2] * 1e3
print(json.dumps(out))
"""

TRAIN = """
import json, sys, tempfile, torch, pandas as pd
from timlab.config import resolve
from timlab.trainer.run import train
torch.set_num_threads(1)
with tempfile.TemporaryDirectory() as d:
    steps = int(sys.argv[1])
    train(resolve(preset="surge", overrides=[f"run.steps={steps}", f"run.eval_every={steps}",
                                            f"run.checkpoint_every={steps}", "run.progress=false"]), d)
    m = pd.read_parquet(d + "/metrics.parquet")
    print(json.dumps({"step_s": float(m["train/step_time_s"].dropna().iloc[1:].median())}))
"""


def child(code: str, keep: bool, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in machine.exact_cpu_env()}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    if keep:
        env[machine.KEEP_CPU_ENV] = "1"
    res = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    print(f"CPU vendor {machine.cpu_vendor()}; settings: {machine.exact_cpu_env() or 'none on this CPU'}")
    gw, gk = child(GEMM, False), child(GEMM, True)
    for dt in ("float32", "bfloat16"):
        print(f"linear (512, 1024) x (1024, 1024) {dt:<9}: {gw[dt]:7.2f} ms with, {gk[dt]:7.2f} ms without "
              f"(ratio {gw[dt] / gk[dt]:.2f})")
    tw, tk = child(TRAIN, False, str(args.steps)), child(TRAIN, True, str(args.steps))
    print(f"surge RL step (median of steps 2-{args.steps}): {tw['step_s']:.3f} s with, {tk['step_s']:.3f} s without "
          f"(ratio {tw['step_s'] / tk['step_s']:.2f})")


if __name__ == "__main__":
    main()
