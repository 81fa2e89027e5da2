"""Tables of the MoE surge testbed and its study (docs/findings/moe.md), from sweeps' run directories;
the tables live in ``timlab.experiments.studies.findings_blocks.moe``.

    python scripts/moe_tables.py learn sweeps/surge_moe_learn   # the zero-mismatch learning check, per seed
    python scripts/moe_tables.py arms sweeps/moe_pilot          # per arm: realized k3, routing flips, accuracy, cost
    python scripts/moe_tables.py layers sweeps/moe              # per arm and sparse layer: flip fraction
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timlab.experiments.studies.findings_blocks.moe import arms, layers, learn  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", choices=("learn", "arms", "layers"))
    ap.add_argument("sweep")
    a = ap.parse_args(argv)
    print({"learn": learn, "arms": arms, "layers": layers}[a.table](a.sweep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
