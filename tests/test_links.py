"""Every relative Markdown link of README.md and docs/**/*.md resolves: the file it names exists, and
its ``#anchor`` is the slug of a heading of that file as GitHub makes it (lower case; every character
but letters, digits, ``_``, ``-`` and spaces dropped; spaces to ``-``; the second heading with the
same slug gets ``-1``, the third ``-2``). Headings inside fenced code blocks are not headings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md"] + sorted((REPO / "docs").rglob("*.md"))

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
"""An inline link or image ``[text](target "title")``; its text may hold one level of brackets."""
INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it (before the -1, -2 of duplicates)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def _prose(text: str) -> list[str]:
    """The lines of ``text`` outside fenced code blocks."""
    out, fence = [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if m and (fence is None or m.group(1) == fence):
            fence = None if fence else m.group(1)
            continue
        if fence is None:
            out.append(line)
    return out


def anchors(path: Path) -> set[str]:
    """The anchors of ``path``'s headings, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text(encoding="utf-8")):
        if m := HEADING.match(line):
            s = slug(m.group(2))
            n = seen.get(s, 0)
            out.add(s if n == 0 else f"{s}-{n}")
            seen[s] = n + 1
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of each relative link of ``path`` (outside code blocks and inline code)."""
    out = []
    fence = None
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = FENCE.match(line)
        if m and (fence is None or m.group(1) == fence):
            fence = None if fence else m.group(1)
            continue
        if fence:
            continue
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
                out.append((i, target))
    return out


def broken(path: Path, root: Path = REPO) -> list[str]:
    """``path``'s relative links that do not resolve, as "file:line: target (why)", paths from ``root``."""
    bad = []
    for line, target in links(path):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        where = f"{path.relative_to(root)}:{line}: {target}"
        if not dest.exists():
            bad.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{where} (no heading with that anchor in {dest.relative_to(root)})")
    return bad


def test_slug_follows_githubs_rule():
    assert slug("Gradient diagnostics") == "gradient-diagnostics"
    assert slug("New remedies at head_perturb 1 (issue 26; PRE-REGISTERED 2026-11-23, before the runs)") == \
        "new-remedies-at-head_perturb-1-issue-26-pre-registered-2026-11-23-before-the-runs"
    assert slug("Study E3c: does E3b's T * k3 fit predict the cost at T ~ 300?") == \
        "study-e3c-does-e3bs-t--k3-fit-predict-the-cost-at-t--300"
    assert slug("The MoE surge testbed (`--preset surge_moe`)") == "the-moe-surge-testbed---preset-surge_moe"
    assert slug("See [claims](claims.md)") == "see-claims"


def test_anchors_number_duplicates_and_skip_code(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# A\n\n## Notes\n\n```\n# not a heading\n```\n\n## Notes\n\n### Notes\n")
    assert anchors(page) == {"a", "notes", "notes-1", "notes-2"}


def test_broken_links_are_found(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## Part two\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md) [ok](a.md#part-two) [ok](#here) [x](a.md#part-three) [x](c.md) "
                    "[web](https://example.org/#nothing) `[code](c.md)`\n\n## Here\n\n```\n[x](d.md)\n```\n")
    assert broken(page, tmp_path) == ["b.md:1: a.md#part-three (no heading with that anchor in a.md)",
                                      "b.md:1: c.md (no such file)"]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path):
    assert broken(path) == []
