"""How a study's numbers are written in its tables: one home for every cell format the
generated FINDINGS blocks share (a change here changes every study's block, and
tests/test_findings.py says so).

- ``fmt(x)``: 3 decimals (or ``digits``), or 2 significant digits in e-notation below 0.01; ``-``
  for NaN/None.
- ``ci_text((lo, hi))``: ``[-0.0123, +0.0045]``; ``clip(ci, bounds)``: an interval within a
  bounded metric's range (an accuracy's t-interval never below 0).
- ``mean_cells(x)``: a group's mean with its 95% t- and seed-bootstrap intervals.
- ``comparison_cells(c)``: a ``stats.Comparison`` as ``mean [t] [bootstrap] | difference
  [bootstrap] | permutation p | Holm p``.
- ``splice_block(text, name, body)``: a FINDINGS file with one generated block replaced.
- ``plain_text(markdown)``: a block as a terminal shows it (tables aligned, no Markdown marks).
- ``spliced(path, blocks)``: each findings file holding one of ``blocks``, before and after;
  ``write_texts(texts)`` writes the after; ``write_blocks(path, blocks)``: both, atomically (a temporary sibling
  renamed over the file), so a full disk or a file-size limit leaves the file as it was; each block
  into the file of ``path``'s findings that holds it (``timlab.findings``).
"""

from __future__ import annotations

import math
import re

import numpy as np

from pathlib import Path

from timlab.errors import BadFileError, one_line
from timlab.experiments.studies.stats import bootstrap_ci, t_ci
from timlab.files import atomic_write_text, read_text
from timlab.findings import by_file


def fmt(x: float, digits: int = 3) -> str:
    """A number as the study tables print it: 3 decimals (or ``digits``), or e-notation below 0.01."""
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.1e}" if x != 0 and abs(x) < 0.01 else f"{x:.{digits}f}"


def ci_text(x: tuple[float, float]) -> str:
    """An interval as the study tables print it: ``[-0.0123, +0.0045]``."""
    return f"[{x[0]:+.4f}, {x[1]:+.4f}]"


def clip(ci: tuple[float, float], bounds: tuple[float, float] | None) -> tuple[float, float]:
    """``ci`` within ``bounds`` (None: unchanged): a t-interval of an accuracy stops at 0 and 1."""
    if bounds is None:
        return ci
    return max(ci[0], bounds[0]), min(ci[1], bounds[1])


def mean_cells(x, bounds: tuple[float, float] | None = None) -> str:
    """A group's mean with its 95% t- and seed-bootstrap intervals, as the study tables print it
    (NaN where a run has no value); the t-interval clipped to ``bounds``."""
    x = np.asarray(x, dtype=float)
    mu, lo, hi = t_ci(x) if np.isfinite(x).all() else (math.nan,) * 3
    b = bootstrap_ci(x) if np.isfinite(x).all() else (math.nan, math.nan)
    return f"{mu:+.4f} {ci_text(clip((lo, hi), bounds))} {ci_text(b)}"


def p_text(p: float) -> str:
    """A p value as the tables print it: 4 decimals, or 2 significant digits below 1e-4 (a Monte Carlo
    p of (hits + 1) / (draws + 1) is never 0, and must not read as 0.0000)."""
    return f"{p:.4f}" if p >= 1e-4 else f"{p:.1e}"


def comparison_cells(c) -> str:
    """A ``stats.Comparison`` as the study tables' cells: mean [t] [bootstrap] | difference
    [bootstrap] | permutation p | Holm p."""
    return (f"{c.mean:+.4f} {ci_text(c.t_ci)} {ci_text(c.boot_ci)} | {c.diff:+.4f} {ci_text(c.diff_ci)} | "
            f"{p_text(c.p)} | {p_text(c.p_holm)}")


def t_cells(x, digits: int = 3, bounds: tuple[float, float] | None = None) -> str:
    """A mean with its 95% t-interval, clipped to ``bounds``: ``0.978 [0.965, 0.990]``."""
    m, lo, hi = t_ci(x)
    lo, hi = clip((lo, hi), bounds)
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


_CELL_SPLIT = re.compile(r"(?<!\\)\|")
_RULE_CELL = re.compile(r":?-{3,}:?")


def _inner(row: str) -> str:
    """A table row without its outer pipes."""
    row = row.strip().removeprefix("|")
    return row[:-1] if row.endswith("|") and not row.endswith("\\|") else row


def _text_table(rows: list[str]) -> list[str]:
    """A Markdown table's lines as aligned plain-text columns (a ``---:`` column right-aligned)."""
    cells = [[c.strip().replace("\\|", "|") for c in _CELL_SPLIT.split(_inner(r))] for r in rows]
    rule = next((i for i, r in enumerate(cells) if r and all(_RULE_CELL.fullmatch(c) for c in r)), None)
    right = [c.endswith(":") for c in cells[rule]] if rule is not None else []
    body = [[_plain_inline(c) for c in r] for i, r in enumerate(cells) if i != rule]
    n = max(len(r) for r in body)
    body = [r + [""] * (n - len(r)) for r in body]
    width = [max(len(r[j]) for r in body) for j in range(n)]
    lines = ["  ".join(c.rjust(w) if j < len(right) and right[j] else c.ljust(w)
                       for j, (c, w) in enumerate(zip(r, width))).rstrip() for r in body]
    if rule is not None:
        lines.insert(rule, "  ".join("-" * w for w in width))
    return lines


def _plain_inline(text: str) -> str:
    return re.sub(r"\*\*(.+?)\*\*", r"\1", text).replace("`", "")


def plain_text(markdown: str) -> str:
    """A generated block as a terminal shows it: each table's columns aligned, with a dashed rule
    under its header, and no ``**`` or backticks (``study analyze --markdown``, and ``--write``
    into FINDINGS, keep the Markdown)."""
    out: list[str] = []
    table: list[str] = []
    for line in markdown.splitlines() + [""]:
        if line.lstrip().startswith("|"):
            table.append(line)
            continue
        if table:
            out += _text_table(table)
            table = []
        out.append(_plain_inline(line))
    return "\n".join(out[:-1])

def spliced(path: str | Path, blocks: dict[str, str]) -> dict[Path, tuple[str, str]]:
    """{file: (its text, that text with its blocks of ``blocks`` (name -> body) replaced)} for each
    file of ``path``'s findings that holds one of them (``timlab.findings.by_file``)."""
    out = {}
    for file, its in by_file(path, blocks).items():
        text = new = read_text(file, what="FINDINGS file")
        for name, body in its.items():
            new = splice_block(new, name, body, where=str(file))
        out[file] = (text, new)
    return out


def write_texts(texts: dict[Path, tuple[str, str]]) -> None:
    """``spliced``'s new texts written back, each file atomically: the new text is written to a
    temporary sibling and renamed over the file, so a write that fails (a full disk, a file-size
    limit) leaves that file exactly as it was and says so in one line."""
    for file, (_, new) in texts.items():
        try:
            atomic_write_text(file, new)
        except OSError as e:
            raise BadFileError(f"{file}: not written ({one_line(e)}); the file is unchanged") from None


def write_blocks(path: str | Path, blocks: dict[str, str]) -> None:
    """Replace the bodies of the generated blocks ``blocks`` (name -> body) in the FINDINGS file
    ``path`` or the page of it that holds each (``timlab.findings``), each file atomically
    (``write_texts``)."""
    write_texts(spliced(path, blocks))
