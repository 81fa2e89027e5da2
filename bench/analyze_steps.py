"""CPU time of ``timlab analyze`` per distinct step, against a baseline build (issue #22 finding 8).

Writes a seeded JSONL file of ``--steps`` rows, each its own step with one token (the worst case
for the per-step table: every row is a step), then, in a child process per build, times
``analyze_file`` + ``format_analysis`` (what ``timlab analyze FILE`` does, without the import) with
``time.process_time`` and checks that both builds give the same result (JSON text equal).

The baseline is a git ref of this repository (``--baseline``, e.g. the commit before the
vectorized per-step table), exported with ``git archive`` into a temporary folder.

Usage: ``OMP_NUM_THREADS=1 python bench/analyze_steps.py [--steps 20000] [--baseline REF]``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, time
import timlab
from timlab.experiments.diagnostics.analyze import analyze_file, format_analysis
t = time.process_time()
result = analyze_file(sys.argv[1])
text = format_analysis(result)
cpu = time.process_time() - t
json.dump(result, open(sys.argv[2], "w"), sort_keys=True, default=str)
print(json.dumps({"package": timlab.__file__, "cpu_s": cpu, "steps": len(result["per_step"]), "lines": text.count("\\n") + 1}))
"""


def write_file(path: Path, steps: int, seed: int) -> None:
    """``steps`` rows, row i at step i, one token each (log-probs near the sample file's)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(steps):
            t = -rng.expovariate(2.0)
            f.write(json.dumps({"step": i, "trainer_logprobs": [t], "rollout_logprobs": [min(0.0, t + rng.gauss(0, 1e-3))],
                                "reward": rng.random()}) + "\n")


def measure(src: Path, data: Path, out_json: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    p = subprocess.run([sys.executable, "-c", CHILD, str(data), str(out_json)], env=env, capture_output=True,
                       text=True, check=True, cwd=data.parent)  # not the checkout: -c puts the cwd first on sys.path
    out = json.loads(p.stdout.strip().splitlines()[-1])
    if not Path(out["package"]).resolve().is_relative_to(src.resolve()):
        raise SystemExit(f"measured {out['package']}, not the build in {src}")
    return out


def export(ref: str, dest: Path) -> Path:
    """The ``timlab`` package of git ref ``ref`` under ``dest``; returns ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / "src.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", "-o", str(archive), ref, "timlab"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return dest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20_000, help="distinct steps (= rows) in the generated file")
    ap.add_argument("--baseline", help="git ref to compare with (default: none, this build only)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "steps.jsonl"
        write_file(data, args.steps, args.seed)
        builds = {"this build": REPO}
        if args.baseline:
            builds[f"baseline {args.baseline}"] = export(args.baseline, tmp / "baseline")
        results = {}
        for name, src in builds.items():
            results[name] = measure(src, data, tmp / f"{len(results)}.json")
            r = results[name]
            print(f"{name:>24}: {r['cpu_s']:8.3f} CPU s for {r['steps']} steps = {1e3 * r['cpu_s'] / r['steps']:.4f} ms/step", flush=True)
        if args.baseline:
            new, old = results["this build"], results[f"baseline {args.baseline}"]
            same = (tmp / "0.json").read_text() == (tmp / "1.json").read_text()
            print(f"speed-up: {old['cpu_s'] / new['cpu_s']:.1f}x; results identical (JSON text): {same}")
            return 0 if same else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
