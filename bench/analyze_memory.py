"""Peak memory of ``timlab analyze`` on a large JSONL file, against the file's size.

Writes a seeded file of the analyze schema (``--mb`` megabytes: rows with id, step, prompt,
response, tokens, reward and two log-prob lists of 16-512 tokens at full double precision), then
runs ``python -m timlab analyze FILE --json OUT`` in a child process and reads the child's peak
resident set size from ``wait4``. A second child that only imports the analyzer gives the
baseline (Python, torch), so both the whole peak and the part the file adds are reported.

Usage: ``OMP_NUM_THREADS=1 python bench/analyze_memory.py [--mb 200] [--src DIR] [--work DIR]``;
``--src`` is the folder holding the ``timlab`` package to measure (default: this checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_file(path: Path, mb: float, seed: int) -> int:
    """A JSONL file of about ``mb`` megabytes; returns its number of rows."""
    rng = random.Random(seed)
    target = int(mb * 1e6)
    rows = size = 0
    with path.open("w") as f:
        while size < target:
            n = rng.randint(16, 512)
            train = [-rng.expovariate(2.0) for _ in range(n)]
            roll = [x + rng.gauss(0.0, 1e-3) if rng.random() < 0.8 else x for x in train]
            roll = [min(x, 0.0) for x in roll]
            line = json.dumps({"id": rows, "step": rows // 256, "prompt": "reverse: abcdef", "response": "fedcba",
                               "tokens": [rng.randrange(32000) for _ in range(n)], "reward": rng.random(),
                               "trainer_logprobs": train, "rollout_logprobs": roll}) + "\n"
            f.write(line)
            size += len(line)
            rows += 1
    return rows


def peak_rss_mib(cmd: list[str], *, src: Path, cwd: Path) -> tuple[float, float, int]:
    """(peak RSS in MiB, wall seconds, exit code) of one child process."""
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(p.pid, 0)
    return usage.ru_maxrss / 1024, time.time() - t0, os.waitstatus_to_exitcode(status)  # ru_maxrss is KiB on Linux


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=200.0, help="size of the generated file in MB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--src", default=str(REPO), help="folder holding the timlab package to measure")
    ap.add_argument("--work", help="folder for the file (default: a temporary one); an existing file is reused")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="timlab-analyze-mem-"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / f"logprobs_{args.mb:g}mb_seed{args.seed}.jsonl"
    if not data.exists():
        rows = write_file(data, args.mb, args.seed)
        print(f"wrote {data}: {rows} rows", flush=True)
    size_mib = data.stat().st_size / 2**20
    src = Path(args.src).resolve()
    base, _, _ = peak_rss_mib([sys.executable, "-c", "import timlab.experiments.diagnostics.analyze"], src=src, cwd=work)
    peak, wall, rc = peak_rss_mib([sys.executable, "-m", "timlab", "analyze", str(data), "--json", str(work / "out.json")],
                                  src=src, cwd=work)
    print(f"src {src}\nfile {size_mib:.1f} MiB, analyze rc {rc}, {wall:.0f} s\n"
          f"peak RSS {peak:.0f} MiB = {peak / size_mib:.2f}x the file; import-only baseline {base:.0f} MiB; "
          f"above the baseline {peak - base:.0f} MiB = {(peak - base) / size_mib:.2f}x the file")
    return 0 if rc in (0, 1) else 1


if __name__ == "__main__":
    sys.exit(main())
