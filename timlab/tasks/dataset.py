"""``dataset``: prompts and reference answers from a local JSONL, Parquet or CSV file.

``task.name=dataset`` with ``task.kwargs``: ``path`` (empty: the bundled 50 arithmetic word
problems, ``timlab/data/word_problems.jsonl``), ``prompt_key`` / ``answer_key`` (the columns),
``verifier`` (a name in ``timlab.tasks.verifiers.VERIFIERS``; ``pattern`` for ``regex``),
``system_prompt`` and ``format_reward``. Rows whose prompt repeats an earlier row's are dropped,
so prompts are distinct; ``make_splits`` shuffles the rows with ``task.split_seed`` and cuts off
``task.n_val`` for validation (``task.n_train`` caps the rest).

Prompts: ``encode_prompt`` renders ``[system, user]`` messages (no system message when
``system_prompt`` is empty) with the model folder's chat template through ``transformers``, or,
when the folder has none, the system prompt and the prompt joined by a blank line
(``timlab.tokenizer.PLAIN_CHAT_SEP``). The model folder is the user's (``model.path``): the
char-level warm start is not built for this task.

Reward: 1 if the verifier accepts the completion; else ``format_reward`` (default 0) if the
verifier found an answer in its format (a number, a ``\\boxed{}``, a pattern match), else 0. Dense
reward: as above, with partial credit ``positional_match`` of the extracted answer's normalized
text against the canonical reference where that is higher. Rewards stay in [0, 1].
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from timlab.errors import BadFileError, UsageError
from timlab.registry import UnknownNameError
from timlab.tasks.base import TASKS, Example, Task, positional_match, unique_chars
from timlab.tasks.verifiers import VERIFIERS, Verifier, build_verifier, normalize

if TYPE_CHECKING:
    from timlab.tokenizer import Tokenizer

BUNDLED = Path(__file__).resolve().parents[1] / "data" / "word_problems.jsonl"
"""The default file: 50 arithmetic word problems written by scripts/make_word_problems.py."""

FORMATS = (".csv", ".jsonl", ".parquet")


@TASKS.register("dataset")
@dataclass(frozen=True)
class DatasetTask(Task):
    """Prompt/answer rows of a local file, scored by a named verifier."""

    path: str = ""
    """JSONL, Parquet or CSV file (by its suffix); empty: the bundled word problems."""
    prompt_key: str = "question"
    """Column (JSON key) holding the prompt."""
    answer_key: str = "answer"
    """Column (JSON key) holding the reference answer."""
    verifier: str = "last_number"
    """How a completion is checked: exact, last_number, boxed or regex."""
    pattern: str = ""
    """The regular expression of the ``regex`` verifier (its first group, or the whole match, is the answer)."""
    system_prompt: str = ""
    """System message put before each prompt (empty: none)."""
    format_reward: float = 0.0
    """Reward in [0, 1) for a wrong answer given in the verifier's format (0: plain 0/1 reward)."""

    name: ClassVar[str] = "dataset"
    needs_model_path: ClassVar[bool] = True

    def __post_init__(self) -> None:
        for key in ("path", "prompt_key", "answer_key", "verifier", "pattern", "system_prompt"):
            value = getattr(self, key)
            if not isinstance(value, str):  # e.g. YAML read `system_prompt: Answer: 42` as a mapping
                raise UsageError(f"task.kwargs.{key} must be text, got a {type(value).__name__} "
                                 f"({value!r}); quote it in YAML")
        if not (isinstance(self.format_reward, (int, float)) and 0 <= self.format_reward < 1):
            raise UsageError(f"task.kwargs.format_reward must be a number in [0, 1), got {self.format_reward!r}")
        try:
            check = build_verifier(self.verifier, pattern=self.pattern)
        except UnknownNameError:
            raise UsageError(f"unknown task.kwargs.verifier {self.verifier!r}; valid choices: "
                             f"{', '.join(VERIFIERS.names())}") from None
        path = Path(self.path) if self.path else BUNDLED
        examples = read_examples(path, prompt_key=self.prompt_key, answer_key=self.answer_key, verifier=check)
        object.__setattr__(self, "_check", check)
        object.__setattr__(self, "_examples", examples)

    # ------------------------------------------------------------------------ the Task protocol
    @property
    def alphabet(self) -> str:
        from timlab.tokenizer import PLAIN_CHAT_SEP

        return unique_chars(self.system_prompt, PLAIN_CHAT_SEP, *(e.prompt + e.answer for e in self._examples))

    @property
    def max_prompt_chars(self) -> int:
        from timlab.tokenizer import PLAIN_CHAT_SEP

        extra = len(self.system_prompt) + len(PLAIN_CHAT_SEP) if self.system_prompt else 0
        return extra + max(len(e.prompt) for e in self._examples)

    @property
    def max_answer_chars(self) -> int:
        return max(len(e.answer) for e in self._examples)

    def examples(self) -> list[Example]:
        return list(self._examples)

    def sample_one(self, rng: random.Random) -> Example:
        return self._examples[rng.randrange(len(self._examples))]

    def messages(self, example: Example) -> list[dict[str, str]]:
        """The chat the model is prompted with: the system prompt (if any), then the user's prompt."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": example.prompt}]

    def encode_prompt(self, tok: "Tokenizer", example: Example) -> list[int]:
        return tok.encode(tok.render_chat(self.messages(example)))

    def reward(self, example: Example, completion: str, *, dense: bool = False) -> float:
        check: Verifier = self._check
        given = check.extract(completion)
        if given is None:
            return 0.0
        reference = check.reference(example.answer)
        if check.matches(given, reference):
            return 1.0
        partial = positional_match(normalize(given), reference) if dense else 0.0
        return max(float(self.format_reward), partial)


def read_examples(path: Path, *, prompt_key: str, answer_key: str, verifier: Verifier) -> list[Example]:
    """The file's (prompt, answer) rows as Examples, first occurrence of each prompt kept. One-line
    errors name the file and the row or field: a missing or unreadable file, an unknown suffix, a
    missing column, an empty or non-text prompt or answer, an answer the verifier cannot read."""
    if not path.is_file():
        raise UsageError(f"task.kwargs.path {str(path)!r}: no such file")
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise UsageError(f"task.kwargs.path {str(path)!r}: unknown file type {suffix or '(none)'!r}; "
                         f"valid choices: {', '.join(FORMATS)}")
    rows = _read_jsonl(path) if suffix == ".jsonl" else _read_table(path, suffix)
    if not rows:
        raise BadFileError(f"{path}: no rows")
    columns = {k for _, row in rows for k in row}
    for key, field in ((prompt_key, "prompt_key"), (answer_key, "answer_key")):
        if key not in columns:
            raise BadFileError(f"{path}: no column {key!r} (task.kwargs.{field}); columns: "
                               f"{', '.join(sorted(map(str, columns)))}")
    seen: set[str] = set()
    out = []
    for where, row in rows:
        prompt = _text(row.get(prompt_key), path, where, prompt_key, "prompt_key")
        answer = _text(row.get(answer_key), path, where, answer_key, "answer_key")
        try:
            verifier.reference(answer)
        except UsageError as e:
            raise BadFileError(f"{path}: {where}: {e}") from None
        if prompt not in seen:
            seen.add(prompt)
            out.append(Example(prompt=prompt, answer=answer))
    return out


def _read_jsonl(path: Path) -> list[tuple[str, dict]]:
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise BadFileError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise BadFileError(f"{path}: line {n}: invalid JSON ({e})") from None
        if not isinstance(row, dict):
            raise BadFileError(f"{path}: line {n}: expected a JSON object, got a {type(row).__name__}")
        rows.append((f"line {n}", row))
    return rows


def _read_table(path: Path, suffix: str) -> list[tuple[str, dict]]:
    import pandas as pd

    try:
        if suffix == ".csv":  # every cell as written: no NaN for empty cells, no number parsing
            df = pd.read_csv(path, dtype=str, keep_default_na=False)
        else:
            df = pd.read_parquet(path)
    except Exception as e:  # pandas / pyarrow raise many types for a malformed file; keep it one line
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise BadFileError(f"{path}: cannot be read as {suffix[1:].upper()} ({first})") from None
    first_row = 2 if suffix == ".csv" else 1  # the CSV header is line 1
    return [(f"row {i + first_row}", row) for i, row in enumerate(df.to_dict(orient="records"))]


def _text(value: Any, path: Path, where: str, key: str, field: str) -> str:
    """A cell as text: strings as they are, numbers printed; empty, missing or other types raise."""
    if hasattr(value, "item") and type(value).__module__ == "numpy" and getattr(value, "ndim", 1) == 0:
        value = value.item()  # a numpy scalar from Parquet
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise BadFileError(f"{path}: {where}: {key!r} (task.kwargs.{field}) is missing")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise BadFileError(f"{path}: {where}: {key!r} (task.kwargs.{field}) is a {type(value).__name__}, not text")
    if not value.strip():
        raise BadFileError(f"{path}: {where}: {key!r} (task.kwargs.{field}) is empty")
    return value
