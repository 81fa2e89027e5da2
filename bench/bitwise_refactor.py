"""Bit-for-bit check for refactors: fingerprints of a few real CLI runs, to compare before and after.

    OMP_NUM_THREADS=1 python bench/bitwise_refactor.py --out /tmp/ref.json            # before
    OMP_NUM_THREADS=1 python bench/bitwise_refactor.py --out /tmp/new.json --compare /tmp/ref.json

Runs ``timlab train`` on ``--preset smoke`` (5 steps; also in float16 and in bfloat16 with two
mini-batches, the loss-scale and master/compute-copy paths), ``--preset demo`` and ``--preset surge``
(6 steps each), and one small ``timlab gradcheck``, each in a fresh temporary folder through the
CLI (a subprocess of this interpreter, so only the command line is assumed, not the package's
internals). Each run's fingerprint is the SHA-256 of its metrics table without the wall-clock
columns (``time/*``, ``train/step_time_s``, ``train/tokens_per_s``), written as CSV with every
float in ``repr`` form, plus the SHA-256 of every tensor of every kept checkpoint's
``model.safetensors``; gradcheck's is the SHA-256 of its ``--json`` result without its wall-clock ``cost`` entries. ``--compare``
prints each run that differs and exits 1 if any does. The SFT warm starts come from the cache.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import load_file

from timlab.rundir.metrics_log import without_timings

TRAIN_RUNS = {
    "smoke": ["--preset", "smoke", "--set", "run.steps=5"],
    "smoke_fp16": ["--preset", "smoke", "--set", "run.steps=5", "--set", "model.dtype=float16"],
    "smoke_bf16": ["--preset", "smoke", "--set", "run.steps=5", "--set", "model.dtype=bfloat16",
                   "--set", "algorithm.mini_batches=2"],
    "demo": ["--preset", "demo", "--set", "run.steps=6", "--set", "run.eval_every=3", "--set", "run.checkpoint_every=3"],
    "surge": ["--preset", "surge", "--set", "run.steps=6", "--set", "run.eval_every=3", "--set", "run.checkpoint_every=3"],
}
GRADCHECK = ["--preset", "smoke", "--injector", "head_perturb", "--magnitude", "1", "--samples", "128",
             "--micro-batch", "8", "--buckets", "2", "--boot", "100", "--score-seqs", "4"]


def _timlab(args: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "timlab", *args, "--quiet"], check=True, stdout=subprocess.DEVNULL)


def _metrics_hash(path: Path) -> str:
    df = pd.read_parquet(path)
    df = without_timings(df)
    text = "\n".join([",".join(df.columns)] + [",".join(repr(v) for v in row) for row in df.itertuples(index=False)])
    return hashlib.sha256(text.encode()).hexdigest()


def _weights_hash(path: Path) -> str:
    h = hashlib.sha256()
    for name, t in sorted(load_file(str(path)).items()):
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fingerprint(which: list[str]) -> dict:
    out = {}
    with tempfile.TemporaryDirectory(prefix="bitwise_") as tmp:
        for name in which:
            if name == "gradcheck":
                dest = Path(tmp) / "gradcheck.json"
                _timlab(["gradcheck", *GRADCHECK, "--json", str(dest)])
                res = json.loads(dest.read_text())
                res["cost"] = {k: v for k, v in res.get("cost", {}).items() if not k.endswith("_s")}  # wall clock
                out[name] = {"json": hashlib.sha256(json.dumps(res, sort_keys=True).encode()).hexdigest()}
                continue
            run = Path(tmp) / name
            _timlab(["train", *TRAIN_RUNS[name], "--run-dir", str(run)])
            fp = {"metrics": _metrics_hash(run / "metrics.parquet")}
            for ckpt in sorted((run / "checkpoints").glob("step_*")):
                fp[ckpt.name] = _weights_hash(ckpt / "model.safetensors")
            out[name] = fp
            print(f"{name}: {fp}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="write the fingerprints here (JSON)")
    ap.add_argument("--compare", help="a reference written by an earlier --out")
    ap.add_argument("--only", default=",".join([*TRAIN_RUNS, "gradcheck"]), help="comma-separated subset")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    got = fingerprint(args.only.split(","))
    Path(args.out).write_text(json.dumps(got, indent=1))
    if not args.compare:
        return 0
    ref = json.loads(Path(args.compare).read_text())
    bad = [k for k in got if got[k] != ref.get(k)]
    for k in bad:
        print(f"DIFFERS: {k}\n  ref {ref.get(k)}\n  now {got[k]}")
    print("bit for bit: " + ("FAIL " + ",".join(bad) if bad else f"identical ({', '.join(got)})"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
