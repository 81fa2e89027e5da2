"""``scratch_add``: addition answered either tersely or by working it out, column by column.

The task where reasoning pays, built so RL can discover it: prompt ``<a>+<b>=``, and a
completion in one of two forms, both ending in ``>`` followed by the sum:

- terse: ``>132`` (the sum written at once, most significant digit first; hard for a small
  model, because every digit depends on the carries of all the columns to its right);
- scratchpad: ``:7502,4813,>132`` for 47+85, one 5-character unit per column from the least
  significant: the two digits (0 where an operand has run out), the carry in, the sum digit and
  a comma; then ``>`` and the sum. Each unit needs only the previous unit and two digit
  look-ups, so a small model gets it right far more often, at about 5x the length (21 vs 4.4
  tokens on the surge preset's 1-4-digit sums).

``verbosity`` (0-3) makes the worked answer longer without making the sum harder: from level 1
the working first copies the operands, zero-padded to the column count (47+85 -> ``:47+85=``,
5+998 -> ``:005+998=``), and each column unit repeats its four digits
cyclically to ``4 + VERBOSITY_PADDING[level]`` characters before the comma (level 1, 47+85:
``:47+85=75027502750275,48134813481348,>132``). The padding is a copy of what the unit already
says, so it adds length, not difficulty; only the final answer is rewarded, as at level 0, which
is today's form exactly. Mean answer length (tokens, EOS included) at 1-4-digit sums:
about 22, 61, 149 and 302 at levels 0-3 (bench/RESULTS.md).

``restate`` (0-676) lengthens the worked answer another way, one a small model can learn at
T ~ 1,000 (level 3's padding, which the 150k-parameter preset model could not): before the
scratchpad the completion restates the prompt's operands ``restate`` times, each copy under a
two-letter countdown label (base 26, ``aa`` = 0), from ``restate - 1`` down to ``aa``. For 47+85
at ``restate=3``: ``ac47+85=ab47+85=aa47+85=:7502,4813,>132``. Every restated token is a copy of
the entry before it (or of the prompt) except the label, which counts down, so each one follows
from the last ~10 tokens; the last entry reads like the prompt, and what follows it is level 0's
worked answer exactly. The decisions (sum digits and carries) are level 0's at every ``restate``:
length without difficulty and without more decisions. Mean answer length (tokens, EOS included)
at 1-4-digit sums: 21.9 + 9.0 x ``restate`` (30.9 at 1, 301 at 31, 1,005 at 109; bench/RESULTS.md).
The letters join the alphabet (so the vocabulary) at any ``restate`` > 0, the same at every length.
``restate_at=after`` writes the same restatement after the final answer instead, behind a ``;``:
``:7502,4813,>132;ac47+85=ab47+85=aa47+85=``. There it follows every decision and the reward
(which reads the answer up to the ``;``), so it cannot move one: the same filler, placed where its
mismatch reaches training only through the filler tokens' own gradient. The ``;`` joins the
alphabet only in that form.

The SFT warm start (``demonstration``) writes the scratchpad for a ``scratch_frac`` share of
examples and the terse form for the rest, so with a small ``scratch_frac`` the starting policy
mostly answers tersely, and greedy decoding does (the first token ``>`` outweighs ``:``). Only the final answer is
rewarded: 1 if the text after the last ``>`` is exactly the decimal sum, else 0; dense reward is
``positional_match`` on that text. The scratchpad is never checked, as with chain-of-thought in
reasoning models. RL that learns to work it out raises accuracy and makes answers longer (2.4x
over ~40 updates on the surge preset): a response-length surge.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import ClassVar

from timlab.errors import UsageError
from timlab.tasks.arithmetic import _random_number, check_digit_range
from timlab.tasks.base import TASKS, Example, Task, positional_match, unique_chars

ANSWER_MARK = ">"
SCRATCH_MARK = ":"
UNIT_END = ","
MAX_DIGITS = 20
OPERANDS_END = "="
ANSWER_END = ";"
"""Ends the final answer when the restatement follows it (``restate_at=after``)."""
RESTATE_AT = ("before", "after")
"""Where ``restate`` puts the restated operands: before the worked answer, or after the final answer."""

COUNTDOWN_LETTERS = string.ascii_lowercase
"""The restatement labels' digits (base 26, most significant first): two letters count 0-675."""
MAX_RESTATE = len(COUNTDOWN_LETTERS) ** 2

VERBOSITY_PADDING = (0, 10, 38, 87)
"""Characters each column unit repeats of its own digits, per verbosity level (index). Chosen so
the mean worked answer at 1-4-digit sums is ~20, 60, 150 and 300 tokens."""


def scratchpad(a: int, b: int, verbosity: int = 0) -> str:
    """The column-by-column working for ``a + b``, without the final answer: ``:7502,4813,``
    (verbosity 0); from level 1 the zero-padded operands first and each unit padded (see above)."""
    da, db = str(a)[::-1], str(b)[::-1]
    cols = max(len(da), len(db))
    pad = VERBOSITY_PADDING[verbosity]
    units, carry = [], 0
    for i in range(cols):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        digits = f"{x}{y}{carry}{s % 10}"
        units.append((digits * (2 + pad // 4))[: 4 + pad] + UNIT_END)
        carry = s // 10
    copy = f"{str(a).zfill(cols)}+{str(b).zfill(cols)}{OPERANDS_END}" if verbosity else ""
    return SCRATCH_MARK + copy + "".join(units)


def countdown_label(i: int) -> str:
    """The restatement label of count ``i`` (0 <= i < 676): two letters, base 26. 0 -> ``aa``, 27 -> ``bb``."""
    return COUNTDOWN_LETTERS[i // len(COUNTDOWN_LETTERS)] + COUNTDOWN_LETTERS[i % len(COUNTDOWN_LETTERS)]


def restatement(a: int, b: int, restate: int) -> str:
    """``restate`` copies of the operands, labelled from ``restate - 1`` down to 0:
    ``restatement(47, 85, 2) == "ab47+85=aa47+85="`` ("" at 0)."""
    operands = f"{a}+{b}{OPERANDS_END}"
    return "".join(countdown_label(i) + operands for i in range(restate - 1, -1, -1))


def final_answer(completion: str) -> str | None:
    """The text after the last ``>`` up to a ``;`` (``restate_at=after``), or None when there is no ``>``."""
    head, mark, tail = completion.rpartition(ANSWER_MARK)
    return tail.partition(ANSWER_END)[0] if mark else None


def used_scratchpad(completion: str) -> bool:
    """True when the completion works the sum out (a ``:`` before its first ``>``), restated or not."""
    return SCRATCH_MARK in completion.partition(ANSWER_MARK)[0]


@TASKS.register("scratch_add")
@dataclass(frozen=True)
class ScratchAddTask(Task):
    """``47+85=`` -> ``>132`` or ``:7502,4813,>132``."""

    min_digits: int = 1
    """Fewest digits in an operand."""
    max_digits: int = 5
    """Most digits in an operand (sets the scratchpad's length: about 6 characters per digit)."""
    scratch_frac: float = 0.1
    """Share of SFT demonstrations written with the scratchpad (the rest are terse)."""
    verbosity: int = 0
    """Length of the worked answer at the same difficulty: 0 (today's form) to 3 (VERBOSITY_PADDING)."""
    restate: int = 0
    """Copies of the operands, under a two-letter countdown, before the worked answer (0-676; 0 = none):
    adds ~9 tokens each at fixed difficulty and fixed decisions (the module docstring). Needs verbosity 0."""
    restate_at: str = "before"
    """Where the restated operands go: before (the worked answer) or after (the final answer, behind a ``;``)."""

    name: ClassVar[str] = "scratch_add"

    def __post_init__(self) -> None:
        check_digit_range("scratch_add", self.min_digits, self.max_digits, MAX_DIGITS)
        if not 0.0 <= self.scratch_frac <= 1.0:
            raise UsageError(f"scratch_add: scratch_frac must be in [0, 1], got {self.scratch_frac}")
        if type(self.verbosity) is not int or self.verbosity not in range(len(VERBOSITY_PADDING)):
            raise UsageError(f"scratch_add: verbosity must be one of {', '.join(map(str, range(len(VERBOSITY_PADDING))))}, "
                             f"got {self.verbosity!r}")
        if type(self.restate) is not int or not 0 <= self.restate <= MAX_RESTATE:
            raise UsageError(f"scratch_add: restate must be an integer from 0 to {MAX_RESTATE}, got {self.restate!r}")
        if self.restate and self.verbosity:
            raise UsageError(f"scratch_add: restate ({self.restate}) and verbosity ({self.verbosity}) both lengthen "
                             "the worked answer; set one of them (the other to 0)")
        if self.restate_at not in RESTATE_AT:
            raise UsageError(f"scratch_add: restate_at must be one of {', '.join(RESTATE_AT)}, got {self.restate_at!r}")

    @property
    def alphabet(self) -> str:
        letters = COUNTDOWN_LETTERS if self.restate else ""
        end = ANSWER_END if self.restate and self.restate_at == "after" else ""
        return unique_chars("+=", ANSWER_MARK, SCRATCH_MARK, UNIT_END, string.digits, letters, end)

    @property
    def max_prompt_chars(self) -> int:
        return 2 + 2 * self.max_digits

    @property
    def max_answer_chars(self) -> int:
        copy = 2 * self.max_digits + 2 if self.verbosity else 0
        unit = 5 + VERBOSITY_PADDING[self.verbosity]
        restated = self.restate * (2 + self.max_prompt_chars) + (self.restate_at == "after" and self.restate > 0)
        return restated + 1 + copy + unit * self.max_digits + 1 + (self.max_digits + 1)

    def sample_one(self, rng: random.Random) -> Example:
        a = _random_number(rng, rng.randint(self.min_digits, self.max_digits))
        b = _random_number(rng, rng.randint(self.min_digits, self.max_digits))
        return Example(prompt=f"{a}+{b}=", answer=str(a + b))

    def demonstration(self, example: Example, rng: random.Random) -> str:
        if rng.random() < self.scratch_frac:
            return self.gold_completion(example)
        return ANSWER_MARK + example.answer

    def gold_completion(self, example: Example) -> str:
        """The worked form (the one RL learns to write)."""
        a, b = (int(x) for x in example.prompt[:-1].split("+"))
        worked = scratchpad(a, b, self.verbosity) + ANSWER_MARK + example.answer
        if self.restate_at == "after" and self.restate:
            return worked + ANSWER_END + restatement(a, b, self.restate)
        return restatement(a, b, self.restate) + worked

    def reward(self, example: Example, completion: str, *, dense: bool = False) -> float:
        answer = final_answer(completion)
        if answer is None:
            return 0.0
        if dense:
            return positional_match(answer, example.answer)
        return float(answer == example.answer)
