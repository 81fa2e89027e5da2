"""Tables of Study E3's calibration sweeps (docs/findings/e3.md); the tables live in
``timlab.experiments.studies.findings_blocks.e3``. E3's pre-registered analyses (E3, E3b, E3c, E3d)
are study files: ``timlab study analyze docs/examples/studies/e3.yaml``.

    python scripts/e3_tables.py starts sweeps/e3_starts
    python scripts/e3_tables.py followup sweeps/e3_starts_rl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timlab.experiments.studies.findings_blocks.e3 import ANSWER_TOKENS, followup, starts  # noqa: E402,F401

TABLES = {"starts": starts, "followup": followup}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("table", choices=list(TABLES))
    p.add_argument("sweep", help="the sweep (starts) or the folder of run directories (followup)")
    a = p.parse_args(argv)
    print(TABLES[a.table](a.sweep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
