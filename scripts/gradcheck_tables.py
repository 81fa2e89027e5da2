"""Markdown tables for docs/FINDINGS.md from `timlab gradcheck --json` files and a gradcheck sweep.

    python scripts/gradcheck_tables.py docs/gradcheck_results [--sweep sweeps/gradcheck]

The tables live in ``timlab.gradcheck.tables``; this is the command FINDINGS names.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timlab.gradcheck.tables import main  # noqa: E402

if __name__ == "__main__":
    main()
