"""Do two sweeps of the same spec hold the same bits? Compares every run both hold, by run id.

    timlab --isa avx2 sweep docs/examples/erosion_probe.yaml --out /tmp/probe_pinned
    python bench/isa_repeat.py sweeps/erosion_probe /tmp/probe_pinned

Two runs are identical when their metrics tables, without the wall-clock columns
(``timlab.rundir.metrics_log.without_timings``), hold the same steps and, in every column both
logged, the same values bit for bit (NaN equal to NaN). Columns only one side logged (a metric
added since the other sweep ran) are listed, not compared. Prints one line per run that differs (the first step and column where
it does) and a total; exits 1 if any run differs or the sweeps share no run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from timlab.rundir import read_metrics
from timlab.rundir.metrics_log import first_difference


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    args = ap.parse_args(argv)
    runs = sorted(p.name for p in args.a.iterdir() if (p / "metrics.parquet").exists()
                  and (args.b / p.name / "metrics.parquet").exists())
    if not runs:
        print(f"{args.a} and {args.b} share no run")
        return 1
    differ, only = 0, set()
    for run in runs:
        ma, mb = read_metrics(args.a / run), read_metrics(args.b / run)
        only |= {f"{c} (only in {args.a})" for c in set(ma.columns) - set(mb.columns)}
        only |= {f"{c} (only in {args.b})" for c in set(mb.columns) - set(ma.columns)}
        diff = first_difference(ma, mb)
        if diff is not None:
            differ += 1
            print(f"{run}: {diff}")
    if only:
        print("not compared: " + ", ".join(sorted(only)))
    print(f"{len(runs)} runs in both; {len(runs) - differ} identical in every value both logged, {differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
