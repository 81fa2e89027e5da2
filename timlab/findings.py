"""Which file of the findings holds a generated block: one home for the answer.

The findings are an index (docs/FINDINGS.md: the verdicts) and its pages (docs/findings/*.md: one
per study, the folder named like the index in lower case). Each generated block
(``<!-- findings:NAME -->`` ... ``<!-- /findings:NAME -->``) lives in exactly one of those files. A
study file names the index (``findings: {file: ../../FINDINGS.md, ...}``; that key is part of its
frozen registration, so it stays as frozen), and the block is found across the index and its pages.
``scripts/findings_tables.py --write/--check``, ``timlab study analyze --write`` and the tests use
these functions.

- ``files(index)``: the index, then its pages in name order.
- ``opens(name)``: the line that opens block NAME.
- ``holders(index, names)``: the file that holds each block NAME, each file read once (the index
  itself when none does, so a missing block is reported against the file a study names); two files
  holding one block are refused. ``block_file(index, name)``: the same for one block.
- ``by_file(index, blocks)``: blocks (name -> body) grouped by the file that holds each.
- ``block_text(index, name)``: the block's body ("" when no file holds it).
- ``read_all(index)``: the index and its pages as one text (verdict rows with the blocks they quote).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from timlab.errors import BadFileError
from timlab.files import read_text

INDEX = Path(__file__).resolve().parents[1] / "docs" / "FINDINGS.md"
"""The repository's findings index (its pages are docs/findings/*.md)."""


def pages_dir(index: str | Path) -> Path:
    """The folder of ``index``'s pages: beside it, named like it in lower case (docs/findings/; a
    study file's ``../../FINDINGS.md`` gives docs/findings, not docs/examples/studies/../../findings)."""
    index = Path(os.path.normpath(index))
    return index.parent / index.stem.lower()


def files(index: str | Path = INDEX) -> list[Path]:
    """``index``, then its pages (``*.md`` in ``pages_dir(index)``) in name order."""
    index = Path(index)
    folder = pages_dir(index)
    pages = sorted(p for p in folder.glob("*.md") if p.is_file()) if folder.is_dir() else []
    return [index] + [p for p in pages if p.resolve() != index.resolve()]


def opens(name: str) -> re.Pattern:
    """The line that opens block ``name`` (a marker alone on its line; prose that quotes a marker
    inside a sentence opens nothing)."""
    return re.compile(rf"^<!-- findings:{re.escape(name)} -->$", re.M)


def holders(index: str | Path, names) -> dict[str, Path]:
    """{name: the file among ``files(index)`` whose text holds ``<!-- findings:NAME -->``} for each of
    ``names``, reading each file once; ``index`` for a name no file holds (the caller's "no block"
    error then names the file the study names). A block opened in two files is refused in one line
    naming both."""
    found: dict[str, list[Path]] = {name: [] for name in names}
    for p in files(index):
        if not p.exists():
            continue
        text = read_text(p, what="FINDINGS file")
        for name, where in found.items():
            if opens(name).search(text):
                where.append(p)
    for name, where in found.items():
        if len(where) > 1:
            raise BadFileError(f"block {name}: opened in {where[0]} and {where[1]}; a block lives in one file")
    return {name: where[0] if where else Path(index) for name, where in found.items()}


def block_file(index: str | Path, name: str) -> Path:
    """The file of ``index``'s findings that holds block ``name`` (``holders``)."""
    return holders(index, [name])[name]


def by_file(index: str | Path, blocks: dict[str, str]) -> dict[Path, dict[str, str]]:
    """``blocks`` (name -> body) grouped by the file of ``index``'s findings that holds each (``holders``)."""
    out: dict[Path, dict[str, str]] = {}
    for name, path in holders(index, blocks).items():
        out.setdefault(path, {})[name] = blocks[name]
    return out


def block_text(index: str | Path, name: str) -> str:
    """The body of block ``name`` in the file of ``index``'s findings that holds it ("" when none does)."""
    path = block_file(index, name)
    if not path.exists():
        return ""
    text = read_text(path, what="FINDINGS file")
    m = opens(name).search(text)
    end = text.find(f"<!-- /findings:{name} -->", m.end()) if m else -1
    return text[m.end() + 1:end] if end >= 0 else ""


def read_all(index: str | Path = INDEX) -> str:
    """The index and its pages, in ``files`` order, as one text (each file's text, one blank line apart)."""
    return "\n".join(read_text(p, what="FINDINGS file") for p in files(index))
