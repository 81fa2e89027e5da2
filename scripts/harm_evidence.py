"""The evidence record that ``timlab check`` and ``timlab analyze`` answer from, rebuilt from the committed sweeps.

    python scripts/harm_evidence.py            # print the record
    python scripts/harm_evidence.py --write    # rewrite timlab/data/harm_evidence.json
    python scripts/harm_evidence.py --check    # exit 1 if the committed record differs from the sweeps

What each cell holds and how it is computed: ``timlab.experiments.studies.evidence``; tests/test_harm_evidence.py
keeps the committed record equal to what this rebuilds.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timlab.experiments.studies import evidence  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"rewrite {evidence.EVIDENCE.relative_to(ROOT)}")
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed record differs from the sweeps")
    args = ap.parse_args(argv)
    os.chdir(ROOT)  # the study files name their sweeps relative to the repository root
    rec = evidence.build(ROOT)
    text = evidence.text(rec)
    if args.write:
        evidence.write(rec)
        print(f"wrote {evidence.EVIDENCE.relative_to(ROOT)}: {len(rec['cells'])} cells")
    elif args.check:
        same = evidence.EVIDENCE.exists() and evidence.EVIDENCE.read_text(encoding="utf-8") == text
        print("harm evidence: " + ("in step with sweeps/" if same else "DIFFERS from sweeps/ (--write)"))
        return 0 if same else 1
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
