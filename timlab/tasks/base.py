"""The task interface, the ``TASKS`` registry, seeded train/val splits and the shared dense reward.

A task samples ``Example(prompt, answer)`` pairs from an explicit ``random.Random`` and scores a
completion (the decoded response, EOS not included) against an example. Rewards are
deterministic: exact match (or verification, for countdown) gives 0/1; ``dense=True`` gives
partial credit in [0, 1], defined per task.

Every task's answers have variable length, so response length means something; a task reports
``alphabet`` (every character of its prompts and answers, for the char tokenizer),
``max_prompt_chars`` and ``max_answer_chars`` (bounds, for sizing generation).

Two hooks for tasks read from a file (``dataset``): ``encode_prompt`` turns an example into the
prompt's token ids (the synthetic tasks encode the prompt as written; ``dataset`` renders it in the
model's chat template), and ``examples`` returns a fixed list that ``make_splits`` partitions
instead of drawing. ``needs_model_path`` marks a task the char-level warm start cannot serve.
"""

from __future__ import annotations

import abc
import dataclasses
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from timlab.errors import UsageError
from timlab.registry import Registry

if TYPE_CHECKING:
    from timlab.config import Config
    from timlab.tokenizer import Tokenizer

TASKS: Registry[type["Task"]] = Registry("task")


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str  # one reference answer (countdown accepts others)


class Task(abc.ABC):
    """Base class; concrete tasks are frozen dataclasses whose fields are their options."""

    name: ClassVar[str]
    needs_model_path: ClassVar[bool] = False
    """True: RL must start from a model folder of the user's (model.path), not the char warm start."""

    @property
    @abc.abstractmethod
    def alphabet(self) -> str:
        """Every character that can appear in a prompt or an answer (sorted, unique)."""

    @property
    @abc.abstractmethod
    def max_prompt_chars(self) -> int: ...

    @property
    @abc.abstractmethod
    def max_answer_chars(self) -> int: ...

    @abc.abstractmethod
    def sample_one(self, rng: random.Random) -> Example: ...

    @abc.abstractmethod
    def reward(self, example: Example, completion: str, *, dense: bool = False) -> float: ...

    def demonstration(self, example: Example, rng: random.Random) -> str:
        """The completion the SFT warm start is trained to write for ``example`` (EOS not
        included). The reference answer by default; a task may write worked solutions for some
        examples, drawing from ``rng`` (the default draws nothing)."""
        return example.answer

    def gold_completion(self, example: Example) -> str:
        """The completion ``val/gold_logprob`` scores (EOS not included): the reference answer by
        default; a task whose answers are worked out returns the worked form."""
        return example.answer

    def encode_prompt(self, tok: "Tokenizer", example: Example) -> list[int]:
        """The token ids the policy is prompted with: the prompt as written, by default."""
        return tok.encode(example.prompt)

    def examples(self) -> list[Example] | None:
        """A task backed by a fixed list of examples returns it (``make_splits`` partitions it);
        a generator of examples returns None (the default)."""
        return None

    def sample(self, rng: random.Random, n: int) -> list[Example]:
        """``n`` examples drawn from ``rng`` only: the same seed gives the same examples."""
        return [self.sample_one(rng) for _ in range(n)]


def positional_match(completion: str, answer: str) -> float:
    """Fraction of aligned positions that agree, over the longer of the two strings.

    Characters are compared left-aligned, position by position; a missing or an extra character
    counts as a miss, so a wrong length is penalized. E.g. answer ``abcd``: ``abxd`` -> 3/4,
    ``abc`` -> 3/4, ``abcde`` -> 4/5, ``""`` -> 0.
    """
    longest = max(len(completion), len(answer))
    if longest == 0:
        return 1.0
    return sum(c == a for c, a in zip(completion, answer)) / longest


def unique_chars(*parts: str) -> str:
    return "".join(sorted(set("".join(parts))))


def get_task(name: str, **kwargs: Any) -> Task:
    """Build a registered task, e.g. ``get_task("reverse", min_len=4, max_len=30)``."""
    cls = TASKS.get(name)
    valid = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    for key in kwargs:
        if key not in valid:
            raise TypeError(f"task {name!r} has no option {key!r}; valid options: "
                            f"{', '.join(valid) or '(none)'}")
    return cls(**kwargs)


def build_task(cfg: Config) -> Task:
    """The configured task (``task.name`` with ``task.kwargs``); bad options become one-line
    errors naming task.kwargs."""
    try:
        return get_task(cfg.task.name, **cfg.task.kwargs)
    except TypeError as e:
        raise UsageError(f"task.kwargs: {e}") from None


def make_splits(task: Task, *, seed: int, n_train: int, n_val: int
                ) -> tuple[list[Example], list[Example]]:
    """Seeded train/val examples with no prompt repeated inside or across the two lists.

    Validation is drawn first, so it does not change with ``n_train``; the training draw does
    change with ``n_val`` (it follows in the same seeded stream), so the SFT warm start, whose
    examples come from the training draw, depends on ``n_val`` too. A task with a fixed list
    (``Task.examples``) is shuffled with ``seed`` and cut: the first ``n_val`` examples validate,
    the next ``n_train`` at most train (so ``n_train`` is a cap there, and ``n_val`` must leave one).
    """
    pool = task.examples()
    if pool is not None:
        if not 1 <= n_val < len(pool):
            raise UsageError(f"task {task.name!r} has {len(pool)} distinct prompts; n_val={n_val} must be "
                             f"between 1 and {len(pool) - 1} to leave some for training")
        order = list(range(len(pool)))
        random.Random(seed).shuffle(order)
        return [pool[i] for i in order[n_val : n_val + n_train]], [pool[i] for i in order[:n_val]]
    rng = random.Random(seed)
    val = _draw_unique(task, rng, n_val, taken=set())
    train = _draw_unique(task, rng, n_train, taken={ex.prompt for ex in val})
    return train, val


def _draw_unique(task: Task, rng: random.Random, n: int, *, taken: set[str]) -> list[Example]:
    out: list[Example] = []
    max_draws = 20 * n + 1000
    for _ in range(max_draws):
        if len(out) == n:
            break
        ex = task.sample_one(rng)
        if ex.prompt not in taken:
            taken.add(ex.prompt)
            out.append(ex)
    if len(out) < n:
        raise UsageError(f"task {task.name!r} gave only {len(out)} distinct new prompts in "
                         f"{max_draws} draws (wanted {n}); widen its options or ask for fewer")
    return out
