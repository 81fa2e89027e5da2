"""Answer verifiers for free-form text: the ``VERIFIERS`` registry the ``dataset`` task picks from.

A verifier turns a completion into the answer it gives (``extract``; None when the completion
gives none in the expected format) and a reference answer into its canonical form
(``reference``; a one-line error when the reference has no answer of that form), then says
whether the two agree (``matches``). Registered:

- ``exact``: the whole completion equals the reference after ``normalize`` (Unicode NFKC,
  casefold, whitespace runs collapsed to one space, ends stripped, one trailing period dropped).
- ``last_number``: the last number in the completion equals the last number in the reference,
  as decimals (``1,000`` = ``1000``, ``3.50`` = ``3.5``, ``-2`` = ``-2.0``).
- ``boxed``: the content of the last ``\\boxed{...}`` (nested braces allowed) equals the
  reference's (its own last ``\\boxed{}`` if it has one, else the whole reference): normalized
  text, or equal numbers when both are numbers.
- ``regex``: the last match of a user pattern (its first group if it has groups, else the whole
  match) equals the normalized reference. The pattern runs in the ``regex`` package's engine (the
  same syntax as Python's ``re``; a dependency of timlab) under a time limit of
  ``REGEX_TIMEOUT_S`` per completion: a pattern that backtracks catastrophically (``(a|aa)+b``
  takes seconds on 30 characters, doubling with each more) stops scoring with a one-line error
  naming it, instead of stalling training. Python's ``re`` has no such limit, and no length cap
  would do: such patterns blow up on a few dozen characters. A completion the limit stops is an
  error, never a reward of 0, so a run's rewards never depend on the machine's speed. Compiling is
  bounded too: a pattern whose counted repeats unroll to more than ``REGEX_MAX_SIZE`` atoms
  (``regex_size``) is refused before the engine unrolls it.

Pure string code: imports nothing of timlab but the registry and the errors.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import ClassVar

from timlab.errors import UsageError
from timlab.registry import Registry

VERIFIERS: Registry[type["Verifier"]] = Registry("verifier")

NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
"""A decimal number: optional minus, digits with optional thousands commas, optional fraction."""

BOXED = "\\boxed{"

REGEX_TIMEOUT_S = 0.5
"""Seconds one completion's ``regex`` verifier match may take (ordinary patterns: microseconds)."""
REGEX_MAX_SIZE = 100_000
"""The most atoms a ``regex`` verifier pattern may expand to with each counted repeat ``{m,n}``
unrolled (``regex_size``): the regex engine unrolls them when it compiles, about 400 bytes an atom
(``a{100000}``: 40 MB), and the time limit covers matching only. ``((((a{100}){100}){100}){100})``
would be 10^8 (3.4 GB, then a MemoryError); ordinary patterns are a few hundred."""

_COUNTED = re.compile(r"\{(\d*)(,?)(\d*)\}")
"""A counted repeat: ``{m}``, ``{m,}``, ``{,n}`` or ``{m,n}``."""


def regex_size(pattern: str) -> int:
    """How many atoms (characters, escapes, classes) ``pattern`` holds with every counted repeat
    unrolled to its largest finite bound (``{m,}``: m), nested repeats multiplied, alternatives
    added; ``*``, ``+`` and ``?`` are loops and add nothing. An upper bound, not the engine's exact
    count (a ``{`` in a comment counts too); it stops counting past ``REGEX_MAX_SIZE``."""
    cap = REGEX_MAX_SIZE + 1
    frames = [[0, 0]]  # per open group: [size of its finished items, size of its last item]
    i, n = 0, len(pattern)

    def atom(size: int) -> None:
        f = frames[-1]
        f[0], f[1] = min(cap, f[0] + f[1]), size

    while i < n:
        c = pattern[i]
        if c == "\\":
            j = i + 2
            if pattern[i + 1:i + 2] in ("p", "P", "N", "x", "u", "U") and pattern[j:j + 1] == "{":  # \p{L}, \N{...}
                j = pattern.find("}", j) + 1 or n
            atom(1)
            i = j
        elif c == "[":
            j = i + 1 + (pattern[i + 1:i + 2] == "^")
            j += pattern[j:j + 1] == "]"  # a ] first is a literal
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            atom(1)
            i = j + 1
        elif c == "(":
            frames.append([0, 0])
            i += 1
        elif c == ")" and len(frames) > 1:
            total, last = frames.pop()
            atom(min(cap, total + last))
            i += 1
        elif c == "|":
            atom(0)
            i += 1
        elif (m := _COUNTED.match(pattern, i)) and (m.group(1) or m.group(3)):
            bound = int(m.group(3) or m.group(1)) if (m.group(3) or not m.group(2)) else int(m.group(1))
            frames[-1][1] = min(cap, frames[-1][1] * max(bound, 1))
            i = m.end()
        elif c in "*+?":
            i += 1
        else:
            atom(1)
            i += 1
    while len(frames) > 1:  # an unclosed group: the compiler refuses it anyway
        total, last = frames.pop()
        atom(min(cap, total + last))
    return min(cap, sum(frames[0]))


def normalize(text: str) -> str:
    """NFKC, casefold, whitespace runs -> one space, ends stripped, one trailing period dropped."""
    text = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    return text[:-1].rstrip() if text.endswith(".") else text


def parse_number(text: str) -> Decimal | None:
    """``"1,000"`` -> ``Decimal(1000)``; None unless ``text`` is exactly one number (spaces aside)."""
    text = text.strip()
    if not NUMBER_RE.fullmatch(text):
        return None
    try:
        return Decimal(text.replace(",", ""))
    except InvalidOperation:  # pragma: no cover (the pattern admits only valid decimals)
        return None


def last_number(text: str) -> str | None:
    """The last number in ``text`` as written (``"so 1,250 apples."`` -> ``"1,250"``), or None."""
    found = NUMBER_RE.findall(text)
    return found[-1] if found else None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text``, braces balanced, or None (also when
    that box is never closed). ``"\\boxed{\\frac{1}{2}}"`` -> ``"\\frac{1}{2}"``."""
    start = text.rfind(BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(BOXED)
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


class Verifier:
    """Base: ``extract`` the completion's answer, canonicalize the ``reference``, compare."""

    name: ClassVar[str]

    def extract(self, completion: str) -> str | None:
        """The answer ``completion`` gives, or None when it gives none in this verifier's format."""
        raise NotImplementedError

    def reference(self, answer: str) -> str:
        """The canonical form of a reference answer; UsageError when it has none of this form."""
        return normalize(answer)

    def matches(self, given: str, reference: str) -> bool:
        """Whether an extracted answer agrees with a canonical reference."""
        return normalize(given) == reference

    def __call__(self, completion: str, answer: str) -> bool:
        given = self.extract(completion)
        return given is not None and self.matches(given, self.reference(answer))


@VERIFIERS.register("exact")
@dataclass(frozen=True)
class ExactVerifier(Verifier):
    name: ClassVar[str] = "exact"

    def extract(self, completion: str) -> str | None:
        return completion if completion.strip() else None


@VERIFIERS.register("last_number")
@dataclass(frozen=True)
class LastNumberVerifier(Verifier):
    name: ClassVar[str] = "last_number"

    def extract(self, completion: str) -> str | None:
        return last_number(completion)

    def reference(self, answer: str) -> str:
        found = last_number(answer)
        if found is None:
            raise UsageError(f"reference answer {answer[:40]!r} has no number for verifier 'last_number'")
        return str(parse_number(found))

    def matches(self, given: str, reference: str) -> bool:
        return parse_number(given) == Decimal(reference)


@VERIFIERS.register("boxed")
@dataclass(frozen=True)
class BoxedVerifier(Verifier):
    name: ClassVar[str] = "boxed"

    def extract(self, completion: str) -> str | None:
        return last_boxed(completion)

    def reference(self, answer: str) -> str:
        boxed = last_boxed(answer)
        return normalize(answer if boxed is None else boxed)

    def matches(self, given: str, reference: str) -> bool:
        a, b = parse_number(given), parse_number(reference)
        return a == b if a is not None and b is not None else normalize(given) == reference


@VERIFIERS.register("regex")
@dataclass(frozen=True)
class RegexVerifier(Verifier):
    pattern: str = ""
    """Python regular expression; its first group (or the whole match) is the answer."""

    name: ClassVar[str] = "regex"

    def __post_init__(self) -> None:
        if not self.pattern:
            raise UsageError("verifier 'regex' needs task.kwargs.pattern (a Python regular expression)")
        try:
            import regex
        except ImportError:  # pragma: no cover (a dependency of timlab)
            raise UsageError("verifier 'regex' needs the 'regex' package, which bounds a match's time: "
                             "pip install regex") from None
        size = regex_size(self.pattern)
        if size > REGEX_MAX_SIZE:  # refused before the compiler unrolls it
            raise UsageError(f"task.kwargs.pattern {self.pattern!r} repeats too much: with its counted repeats "
                             f"{{m,n}} unrolled it holds over {REGEX_MAX_SIZE:,} atoms (the limit; compiling it "
                             "would take that many times 400 bytes); use * or + for long runs")
        try:
            compiled = regex.compile(self.pattern, flags=regex.VERSION0)  # VERSION0: Python re's semantics
        except regex.error as e:
            raise UsageError(f"task.kwargs.pattern {self.pattern!r} is not a valid regular expression ({e})") from None
        object.__setattr__(self, "_compiled", compiled)

    def extract(self, completion: str) -> str | None:
        last = None
        try:
            for last in self._compiled.finditer(completion, timeout=REGEX_TIMEOUT_S):  # type: ignore[attr-defined]
                pass
        except TimeoutError:
            raise UsageError(f"task.kwargs.pattern {self.pattern!r} took over {REGEX_TIMEOUT_S} s on a completion of "
                             f"{len(completion)} characters (catastrophic backtracking: nested or overlapping "
                             "repeats such as (a+)+ or (a|aa)+); make each repeat match one way") from None
        if last is None:
            return None
        return last.group(1) if self._compiled.groups else last.group(0)  # type: ignore[attr-defined]


def build_verifier(name: str, *, pattern: str = "") -> Verifier:
    """A registered verifier by name; ``pattern`` is for ``regex`` only (an error elsewhere)."""
    cls = VERIFIERS.get(name)
    if cls is RegexVerifier:
        return RegexVerifier(pattern)
    if pattern:
        raise UsageError(f"task.kwargs.pattern is only used by verifier 'regex', not {name!r}")
    return cls()


__all__ = ["VERIFIERS", "Verifier", "build_verifier", "normalize", "parse_number", "last_number", "last_boxed"]
