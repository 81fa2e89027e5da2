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


def scratchpad(a: int, b: int) -> str:
    """The column-by-column working for ``a + b``, without the final answer: ``:7502,4813,``."""
    da, db = str(a)[::-1], str(b)[::-1]
    units, carry = [], 0
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        units.append(f"{x}{y}{carry}{s % 10}{UNIT_END}")
        carry = s // 10
    return SCRATCH_MARK + "".join(units)


def final_answer(completion: str) -> str | None:
    """The text after the last ``>``, or None when there is none."""
    head, mark, tail = completion.rpartition(ANSWER_MARK)
    return tail if mark else None


def used_scratchpad(completion: str) -> bool:
    return completion.startswith(SCRATCH_MARK)


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

    name: ClassVar[str] = "scratch_add"

    def __post_init__(self) -> None:
        check_digit_range("scratch_add", self.min_digits, self.max_digits, MAX_DIGITS)
        if not 0.0 <= self.scratch_frac <= 1.0:
            raise UsageError(f"scratch_add: scratch_frac must be in [0, 1], got {self.scratch_frac}")

    @property
    def alphabet(self) -> str:
        return unique_chars("+=", ANSWER_MARK, SCRATCH_MARK, UNIT_END, string.digits)

    @property
    def max_prompt_chars(self) -> int:
        return 2 + 2 * self.max_digits

    @property
    def max_answer_chars(self) -> int:
        return 1 + 5 * self.max_digits + 1 + (self.max_digits + 1)

    def sample_one(self, rng: random.Random) -> Example:
        a = _random_number(rng, rng.randint(self.min_digits, self.max_digits))
        b = _random_number(rng, rng.randint(self.min_digits, self.max_digits))
        return Example(prompt=f"{a}+{b}=", answer=str(a + b))

    def demonstration(self, example: Example, rng: random.Random) -> str:
        if rng.random() < self.scratch_frac:
            a, b = (int(x) for x in example.prompt[:-1].split("+"))
            return scratchpad(a, b) + ANSWER_MARK + example.answer
        return ANSWER_MARK + example.answer

    def reward(self, example: Example, completion: str, *, dense: bool = False) -> float:
        answer = final_answer(completion)
        if answer is None:
            return 0.0
        if dense:
            return positional_match(answer, example.answer)
        return float(answer == example.answer)
