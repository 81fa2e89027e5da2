"""``addition``: multi-digit addition with operands of variable digit counts.

Prompt ``add:<a>+<b>=``, e.g. ``add:4071+93=`` -> ``4164``. The digit counts of ``a`` and ``b``
are drawn independently and uniformly from ``[min_digits, max_digits]`` (no leading zeros), so
answers are ``min_digits``..``max_digits + 1`` characters: 2..15 by default, up to 40 at most.

Reward: 1 if the completion is exactly the decimal sum (no sign, spaces or leading zeros), else
0. Dense reward: ``positional_match`` against the sum (left-aligned, wrong length penalized).
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import ClassVar

from timlab.errors import UsageError
from timlab.tasks.base import TASKS, Example, Task, positional_match, unique_chars

MAX_DIGITS = 39  # keeps answers at most 40 characters


def _random_number(rng: random.Random, digits: int) -> int:
    if digits == 1:
        return rng.randint(0, 9)
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def check_digit_range(task: str, min_digits: int, max_digits: int, most: int) -> None:
    """One-line error unless 1 <= min_digits <= max_digits <= most (a digit task's operand sizes)."""
    if not 1 <= min_digits <= max_digits <= most:
        raise UsageError(f"{task}: need 1 <= min_digits <= max_digits <= {most}, got "
                         f"min_digits={min_digits}, max_digits={max_digits}")


@TASKS.register("addition")
@dataclass(frozen=True)
class AdditionTask(Task):
    """``add:4071+93=`` -> ``4164``."""

    min_digits: int = 2
    """Fewest digits in an operand."""
    max_digits: int = 14
    """Most digits in an operand (at most 39, so answers stay within 40 characters)."""

    name: ClassVar[str] = "addition"

    def __post_init__(self) -> None:
        check_digit_range("addition", self.min_digits, self.max_digits, MAX_DIGITS)

    @property
    def alphabet(self) -> str:
        return unique_chars("add:+=", string.digits)

    @property
    def max_prompt_chars(self) -> int:
        return len("add:+=") + 2 * self.max_digits

    @property
    def max_answer_chars(self) -> int:
        return self.max_digits + 1

    def sample_one(self, rng: random.Random) -> Example:
        a = _random_number(rng, rng.randint(self.min_digits, self.max_digits))
        b = _random_number(rng, rng.randint(self.min_digits, self.max_digits))
        return Example(prompt=f"add:{a}+{b}=", answer=str(a + b))

    def reward(self, example: Example, completion: str, *, dense: bool = False) -> float:
        if dense:
            return positional_match(completion, example.answer)
        return float(completion == example.answer)
