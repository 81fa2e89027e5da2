"""Tables of the erosion study (docs/findings/erosion.md), from its sweeps' run directories; the tables
live in ``timlab.experiments.studies.findings_blocks.erosion``.

    python scripts/erosion_tables.py probe sweeps/erosion_probe    # dose -> realized k3 on the learned policy
    python scripts/erosion_tables.py slopes sweeps/erosion_pilot   # per-arm slopes, guard check, cost
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timlab.experiments.studies.findings_blocks.erosion import START, probe, slopes  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", choices=("probe", "slopes"))
    ap.add_argument("sweep")
    ap.add_argument("--from", dest="start", type=int, default=START, help="first step of the slope window (default 50)")
    a = ap.parse_args(argv)
    print(probe(a.sweep) if a.table == "probe" else slopes(a.sweep, a.start))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
