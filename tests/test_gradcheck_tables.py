"""FINDINGS' gradcheck tables (``timlab.gradcheck.tables``) from the committed ``timlab gradcheck
--json`` files, and the command FINDINGS names for them (``python scripts/gradcheck_tables.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from timlab.gradcheck.tables import dose_table, length_tables

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "gradcheck_results"


def test_dose_rows_from_the_committed_json():
    rows = dose_table(RESULTS).splitlines()
    assert len(rows) == 2 + len(list(RESULTS.glob("dose*.json")))
    # dose8k_fp16.json: k3 1.448e-05, 98.4% of the answers the same, noise floor 0.01754
    fp16 = next(r for r in rows if "(dose8k_fp16)" in r)
    assert fp16.startswith("| precision 0 (8192 samples) (dose8k_fp16) | 1.4e-05 | 0.0218 / 0.0014 | 0.98 | ")
    assert "| 0.0175 |" in fp16
    # no mismatch: k3 0, every answer the same, no bias
    assert next(r for r in rows if "(dose_none)" in r).startswith("| none 0 (dose_none) | 0 | 0 / 0 | 1.00 | ")


def test_the_command_findings_names_prints_the_package_tables():
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "gradcheck_tables.py"), str(RESULTS)],
                         capture_output=True, text=True, check=True).stdout
    assert out == f"{dose_table(RESULTS)} \n\n{length_tables(RESULTS)}\n"
    assert "fitted ||bias|| ~ T^" in out
