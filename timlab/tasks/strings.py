"""String tasks: ``copy``, ``reverse`` and ``sort`` a random string of variable length.

Prompts are ``<prefix>:<string>=``, e.g. ``rev:a3k9=`` -> ``9k3a``. The string has a length drawn
uniformly from ``[min_len, max_len]`` and characters drawn uniformly (with replacement) from
``charset``, so answers are exactly ``min_len``..``max_len`` characters long.

Reward: 1 if the completion equals the answer exactly, else 0. Dense reward:
``positional_match`` (aligned matching characters over the longer length).
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import ClassVar

from timlab.errors import UsageError
from timlab.tasks.base import TASKS, Example, Task, positional_match, unique_chars

DEFAULT_CHARSET = string.digits + string.ascii_lowercase


@dataclass(frozen=True)
class _StringTask(Task):
    min_len: int = 4
    """Shortest input (= answer) string."""
    max_len: int = 24
    """Longest input (= answer) string."""
    charset: str = DEFAULT_CHARSET
    """Characters the input string is drawn from."""

    prefix: ClassVar[str]

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise UsageError(f"{self.name}: need 1 <= min_len <= max_len, "
                             f"got min_len={self.min_len}, max_len={self.max_len}")
        if not self.charset or set(self.charset) & set("<>="):
            raise UsageError(f"{self.name}: charset must be non-empty and avoid '<', '>', '='")

    def transform(self, s: str) -> str:
        raise NotImplementedError

    @property
    def alphabet(self) -> str:
        return unique_chars(self.prefix, ":=", self.charset)

    @property
    def max_prompt_chars(self) -> int:
        return len(self.prefix) + 2 + self.max_len

    @property
    def max_answer_chars(self) -> int:
        return self.max_len

    def sample_one(self, rng: random.Random) -> Example:
        n = rng.randint(self.min_len, self.max_len)
        s = "".join(rng.choice(self.charset) for _ in range(n))
        return Example(prompt=f"{self.prefix}:{s}=", answer=self.transform(s))

    def reward(self, example: Example, completion: str, *, dense: bool = False) -> float:
        if dense:
            return positional_match(completion, example.answer)
        return float(completion == example.answer)


@TASKS.register("copy")
@dataclass(frozen=True)
class CopyTask(_StringTask):
    """``copy:a3k9=`` -> ``a3k9``."""

    name: ClassVar[str] = "copy"
    prefix: ClassVar[str] = "copy"

    def transform(self, s: str) -> str:
        return s


@TASKS.register("reverse")
@dataclass(frozen=True)
class ReverseTask(_StringTask):
    """``rev:a3k9=`` -> ``9k3a``."""

    name: ClassVar[str] = "reverse"
    prefix: ClassVar[str] = "rev"

    def transform(self, s: str) -> str:
        return s[::-1]


@TASKS.register("sort")
@dataclass(frozen=True)
class SortTask(_StringTask):
    """``sort:a3k9=`` -> ``39ak`` (by code point: digits before letters)."""

    name: ClassVar[str] = "sort"
    prefix: ClassVar[str] = "sort"

    def transform(self, s: str) -> str:
        return "".join(sorted(s))
