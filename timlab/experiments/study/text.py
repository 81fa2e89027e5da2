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
- ``write_blocks(path, blocks)``: those replacements written back atomically (a temporary sibling
  renamed over the file), so a full disk or a file-size limit leaves the file as it was.
"""

from __future__ import annotations

import math
import re

import numpy as np

from pathlib import Path

from timlab.errors import BadFileError, one_line
from timlab.experiments.stats import bootstrap_ci, t_ci
from timlab.files import atomic_write_text, read_text


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


def comparison_cells(c) -> str:
    """A ``stats.Comparison`` as the study tables' cells: mean [t] [bootstrap] | difference
    [bootstrap] | permutation p | Holm p."""
    return (f"{c.mean:+.4f} {ci_text(c.t_ci)} {ci_text(c.boot_ci)} | {c.diff:+.4f} {ci_text(c.diff_ci)} | "
            f"{c.p:.4f} | {c.p_holm:.4f}")


def t_cells(x, digits: int = 3) -> str:
    """A mean with its 95% t-interval: ``0.978 [0.965, 0.990]``."""
    m, lo, hi = t_ci(x)
    return f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


MARKER = re.compile(r"<!--\s*/?\s*findings:")
"""What opens a FINDINGS block marker (``<!-- findings:NAME -->`` / ``<!-- /findings:NAME -->``): a
block body may not hold one (it would end the block early), so study text holding one is refused."""


def splice_block(text: str, name: str, body: str, *, where: str = "FINDINGS") -> str:
    """``text`` with the body of ``<!-- findings:NAME -->...<!-- /findings:NAME -->`` replaced by
    ``body``; a body that holds a block marker is refused (each write would duplicate what follows it)."""
    if m := MARKER.search(body):
        raise BadFileError(f"{where}: block {name}: the new text holds a FINDINGS block marker ({m.group(0)!r}); "
                           f"nothing written")
    pat = re.compile(rf"(<!-- findings:{re.escape(name)} -->\n)(?:.*?\n)?(<!-- /findings:{re.escape(name)} -->)", re.S)
    if not pat.search(text):
        raise BadFileError(f"{where}: no block <!-- findings:{name} -->")
    return pat.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


def write_blocks(path: str | Path, blocks: dict[str, str]) -> None:
    """Replace the bodies of the generated blocks ``blocks`` (name -> body) in the FINDINGS file
    ``path``, atomically: the new text is written to a temporary sibling and renamed over the file,
    so a write that fails (a full disk, a file-size limit) leaves the file exactly as it was and
    says so in one line."""
    path = Path(path)
    text = read_text(path, what="FINDINGS file")
    for name, body in blocks.items():
        text = splice_block(text, name, body, where=str(path))
    try:
        atomic_write_text(path, text)
    except OSError as e:
        raise BadFileError(f"{path}: not written ({one_line(e)}); the file is unchanged") from None
