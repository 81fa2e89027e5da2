"""The numbers behind docs/FINDINGS.md and its pages, recomputed from the committed sweeps under sweeps/.

    python scripts/findings_tables.py            # print every generated table
    python scripts/findings_tables.py --write    # rewrite the generated blocks of the findings
    python scripts/findings_tables.py --check    # exit 1 if a findings file differs from the data
    python scripts/findings_tables.py DIR...     # the generic per-condition tables of any sweeps

docs/FINDINGS.md (the verdicts) or one of its pages (docs/findings/*.md, one per study) holds each
table between ``<!-- findings:NAME -->`` and ``<!-- /findings:NAME -->`` (``timlab.findings`` finds
which); ``tests/test_findings.py`` fails when the committed text differs from what this script
computes. The blocks and their statistics live in ``timlab.experiments.studies.findings_blocks``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timlab.experiments.studies.findings_blocks import BLOCKS, FINDINGS, ROOT, render  # noqa: E402,F401
from timlab.experiments.studies.text import spliced, write_texts  # noqa: E402
from timlab.experiments.sweeps.tables import generic  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="*", help="sweep directories for the generic tables (default: FINDINGS' blocks)")
    ap.add_argument("--write", action="store_true", help="rewrite the generated blocks of docs/FINDINGS.md and its pages")
    ap.add_argument("--check", action="store_true", help="exit 1 if a findings file differs from the data")
    args = ap.parse_args(argv)
    if args.dirs:
        print(generic(args.dirs))
        return 0
    blocks = render()
    if not (args.write or args.check):
        for name, body in blocks.items():
            print(f"## {name}\n\n{body}\n")
        return 0
    texts = spliced(FINDINGS, blocks)
    if args.write:
        write_texts(texts)  # each file atomically: a failed write leaves that file as it was
        print(f"wrote {len(blocks)} blocks to {len(texts)} files: {', '.join(str(p.relative_to(ROOT)) for p in texts)}")
    elif args.check:
        stale = [p for p, (text, new) in texts.items() if new != text]
        for p in stale:
            print(f"{p} differs from the committed sweeps; run python scripts/findings_tables.py --write")
        if stale:
            return 1
        print(f"{FINDINGS} and its pages ({len(texts)} files): every generated block matches the data")
    return 0


if __name__ == "__main__":
    sys.exit(main())
