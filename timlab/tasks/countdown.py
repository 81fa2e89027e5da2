"""``countdown``: combine some of the given numbers with + - * (and optionally /) to hit a target.

Prompt ``cd:<n1>,<n2>,...>target=``, e.g. ``cd:3,7,25,50>75=`` -> ``50+25`` (or ``3*25``, ...).
There are ``min_numbers``..``max_numbers`` numbers in ``[1, max_value]``. The reference answer is
made first: a random expression tree over a random subset of 2 or more of the numbers, kept if
its value lies in ``[1, max_target]`` and no intermediate value is negative; it is printed with
only the parentheses precedence needs. So every prompt has a solution, and reference answers are
3..``max_answer_chars`` characters (3..20 with the defaults).

Unlike the TinyZero version, a solution need not use every number: each number may be used at
most once (as a multiset: a number given twice may be used twice).

The completion is checked by ``evaluate_expression``, a small recursive-descent parser (never
``eval``): digits, ``+ - * /``, parentheses and spaces only; no unary minus; every literal must be
an unused given number written without leading zeros; division only when enabled and exact; at
most ``MAX_EXPR_CHARS`` characters and ``MAX_PAREN_DEPTH`` nested parentheses.

Reward: 1 if the completion is a valid expression whose value is the target, else 0. Dense
reward: 1 if correct; ``0.5 * max(0, 1 - |value - target| / target)`` for a valid expression
with the wrong value; 0 for an invalid one.
"""

from __future__ import annotations

import operator
import random
import re
import string
from collections import Counter
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Sequence

from timlab.errors import UsageError
from timlab.tasks.base import TASKS, Example, Task, unique_chars

MAX_EXPR_CHARS = 256  # longer completions are rejected before parsing
MAX_PAREN_DEPTH = 16  # bounds the parser's recursion
MAX_TRIES = 1000  # rejection-sampling attempts for a target in [1, max_target]
_PROMPT_RE = re.compile(r"cd:(\d+(?:,\d+)*)>(\d+)=")
_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2, None: 3}  # None: a bare number


class _Node(NamedTuple):
    text: str
    value: int
    op: str | None  # the top-level operator, None for a number


def _combine(a: _Node, op: str, b: _Node) -> _Node:
    """``a op b`` with the parentheses needed for left-to-right precedence parsing."""
    p = _PRECEDENCE[op]
    left = f"({a.text})" if _PRECEDENCE[a.op] < p else a.text
    right_bare = _PRECEDENCE[b.op] > p or (b.op == op and op in "+*")
    right = b.text if right_bare else f"({b.text})"
    return _Node(f"{left}{op}{right}", _APPLY[op](a.value, b.value), op)


def random_expression(rng: random.Random, numbers: Sequence[int], *, division: bool) -> _Node:
    """A random expression using each of ``numbers`` once; intermediate values stay >= 0."""
    pool = [_Node(str(n), n, None) for n in numbers]
    while len(pool) > 1:
        a = pool.pop(rng.randrange(len(pool)))
        b = pool.pop(rng.randrange(len(pool)))
        ops = ["+", "-", "*"]
        if division and b.value != 0 and a.value % b.value == 0:
            ops.append("/")
        op = rng.choice(ops)
        if op == "-" and a.value < b.value:
            a, b = b, a
        pool.append(_combine(a, op, b))
    return pool[0]


class _Invalid(Exception):
    pass


class _Parser:
    """expr := term (('+'|'-') term)* ; term := factor (('*'|'/') factor)* ;
    factor := NUMBER | '(' expr ')'"""

    def __init__(self, text: str, numbers: Sequence[int], *, division: bool, max_depth: int):
        self.tokens = re.findall(r"\d+|[()+\-*/]", text)
        self.pos = 0
        self.available = Counter(numbers)
        self.division = division
        self.max_depth = max_depth

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise _Invalid("unexpected end")
        self.pos += 1
        return tok

    def expr(self, depth: int) -> int:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.take()
            value = _APPLY[op](value, self.term(depth))
        return value

    def term(self, depth: int) -> int:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            op, rhs = self.take(), self.factor(depth)
            if op == "/" and (not self.division or rhs == 0 or value % rhs != 0):
                raise _Invalid("division disabled or not exact")
            value = _APPLY[op](value, rhs)
        return value

    def factor(self, depth: int) -> int:
        tok = self.take()
        if tok == "(":
            if depth >= self.max_depth:
                raise _Invalid("too deep")
            value = self.expr(depth + 1)
            if self.take() != ")":
                raise _Invalid("missing )")
            return value
        if not tok.isdigit() or tok != str(int(tok)):
            raise _Invalid(f"bad number {tok!r}")
        n = int(tok)
        if self.available[n] == 0:
            raise _Invalid(f"{n} is not given or already used")
        self.available[n] -= 1
        return n


def evaluate_expression(text: str, numbers: Sequence[int], *, division: bool = False,
                        max_chars: int = MAX_EXPR_CHARS,
                        max_depth: int = MAX_PAREN_DEPTH) -> int | None:
    """The value of ``text`` if it is a valid countdown expression over ``numbers``, else None."""
    if len(text) > max_chars or set(text) - set("0123456789+-*/() "):
        return None
    parser = _Parser(text, numbers, division=division, max_depth=max_depth)
    try:
        value = parser.expr(0)
    except _Invalid:
        return None
    return value if parser.peek() is None else None


def parse_prompt(prompt: str) -> tuple[list[int], int]:
    """``"cd:3,7,25>75="`` -> ``([3, 7, 25], 75)``."""
    m = _PROMPT_RE.fullmatch(prompt)
    if m is None:
        raise UsageError(f"not a countdown prompt: {prompt!r} (expected 'cd:3,7,25>75=')")
    return [int(x) for x in m.group(1).split(",")], int(m.group(2))


@TASKS.register("countdown")
@dataclass(frozen=True)
class CountdownTask(Task):
    """``cd:3,7,25,50>75=`` -> ``50+25``."""

    min_numbers: int = 3
    """Fewest numbers in a prompt."""
    max_numbers: int = 5
    """Most numbers in a prompt."""
    max_value: int = 99
    """Numbers are drawn uniformly from [1, max_value]."""
    max_target: int = 999
    """Targets lie in [1, max_target]."""
    division: bool = False
    """Allow exact integer division."""

    name: ClassVar[str] = "countdown"

    def __post_init__(self) -> None:
        if not 2 <= self.min_numbers <= self.max_numbers <= 6:
            raise UsageError(f"countdown: need 2 <= min_numbers <= max_numbers <= 6, got "
                             f"{self.min_numbers}, {self.max_numbers}")
        if self.max_value < 1 or self.max_target < 1:
            raise UsageError("countdown: max_value and max_target must be >= 1")

    @property
    def alphabet(self) -> str:
        return unique_chars("cd:,>=", string.digits, "+-*()", "/" if self.division else "")

    @property
    def max_prompt_chars(self) -> int:
        n, d = self.max_numbers, len(str(self.max_value))
        return len("cd:>=") + n * d + (n - 1) + len(str(self.max_target))

    @property
    def max_answer_chars(self) -> int:
        # n numbers, n - 1 operators, a pair of parentheses at most per non-root operator
        n, d = self.max_numbers, len(str(self.max_value))
        return n * d + (n - 1) + 2 * (n - 2)

    def sample_one(self, rng: random.Random) -> Example:
        k = rng.randint(self.min_numbers, self.max_numbers)
        numbers = [rng.randint(1, self.max_value) for _ in range(k)]
        for _ in range(MAX_TRIES):
            used = rng.sample(numbers, rng.randint(2, k))
            node = random_expression(rng, used, division=self.division)
            if 1 <= node.value <= self.max_target:
                prompt = f"cd:{','.join(map(str, numbers))}>{node.value}="
                return Example(prompt=prompt, answer=node.text)
        raise RuntimeError(f"countdown: no target in [1, {self.max_target}] after {MAX_TRIES} "
                           "tries; raise max_target or lower max_value")

    def reward(self, example: Example, completion: str, *, dense: bool = False) -> float:
        numbers, target = parse_prompt(example.prompt)
        value = evaluate_expression(completion, numbers, division=self.division)
        if value is None:
            return 0.0
        if value == target:
            return 1.0
        return 0.5 * max(0.0, 1.0 - abs(value - target) / target) if dense else 0.0
