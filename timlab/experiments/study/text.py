"""How a study's numbers are written in its tables: one home for every cell format the
generated FINDINGS blocks share (a change here changes every study's block, and
tests/test_findings.py says so).

- ``fmt(x)``: 3 decimals (or ``digits``), or 2 significant digits in e-notation below 0.01; ``-``
  for NaN/None.
- ``ci_text((lo, hi))``: ``[-0.0123, +0.0045]``.
- ``mean_cells(x)``: a group's mean with its 95% t- and seed-bootstrap intervals.
- ``comparison_cells(c)``: a ``stats.Comparison`` as ``mean [t] [bootstrap] | difference
  [bootstrap] | permutation p | Holm p``.
- ``splice_block(text, name, body)``: a FINDINGS file with one generated block replaced.
"""

from __future__ import annotations

import math
import re

import numpy as np

from timlab.errors import BadFileError
from timlab.experiments.stats import bootstrap_ci, t_ci


def fmt(x: float, digits: int = 3) -> str:
    """A number as the study tables print it: 3 decimals (or ``digits``), or e-notation below 0.01."""
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.1e}" if x != 0 and abs(x) < 0.01 else f"{x:.{digits}f}"


def ci_text(x: tuple[float, float]) -> str:
    """An interval as the study tables print it: ``[-0.0123, +0.0045]``."""
    return f"[{x[0]:+.4f}, {x[1]:+.4f}]"


def mean_cells(x) -> str:
    """A group's mean with its 95% t- and seed-bootstrap intervals, as the study tables print it
    (NaN where a run has no value)."""
    x = np.asarray(x, dtype=float)
    mu, lo, hi = t_ci(x) if np.isfinite(x).all() else (math.nan,) * 3
    b = bootstrap_ci(x) if np.isfinite(x).all() else (math.nan, math.nan)
    return f"{mu:+.4f} {ci_text((lo, hi))} {ci_text(b)}"


def p_text(p: float) -> str:
    """A p value as the tables print it: 4 decimals, or 2 significant digits below 1e-4 (a Monte Carlo
    p of (hits + 1) / (draws + 1) is never 0, and must not read as 0.0000)."""
    return f"{p:.4f}" if p >= 1e-4 else f"{p:.1e}"


def comparison_cells(c) -> str:
    """A ``stats.Comparison`` as the study tables' cells: mean [t] [bootstrap] | difference
    [bootstrap] | permutation p | Holm p."""
    return (f"{c.mean:+.4f} {ci_text(c.t_ci)} {ci_text(c.boot_ci)} | {c.diff:+.4f} {ci_text(c.diff_ci)} | "
            f"{p_text(c.p)} | {p_text(c.p_holm)}")


def t_cells(x, digits: int = 3) -> str:
    """A mean with its 95% t-interval: ``0.978 [0.965, 0.990]``."""
    m, lo, hi = t_ci(x)
    return f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def splice_block(text: str, name: str, body: str, *, where: str = "FINDINGS") -> str:
    """``text`` with the body of ``<!-- findings:NAME -->...<!-- /findings:NAME -->`` replaced by ``body``."""
    pat = re.compile(rf"(<!-- findings:{re.escape(name)} -->\n)(?:.*?\n)?(<!-- /findings:{re.escape(name)} -->)", re.S)
    if not pat.search(text):
        raise BadFileError(f"{where}: no block <!-- findings:{name} -->")
    return pat.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)
