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

Limits, so that a hostile or careless file fails at once with a one-line error naming the file and
the line or row instead of stalling training: a JSONL line holds at most ``MAX_LINE_BYTES`` bytes
(read at most that far, never the whole line), and a prompt or answer (and the system prompt) at
most ``MAX_TEXT_CHARS`` characters (the ``csv`` module's own default cell limit, about 32k
tokens); a file holds at most ``MAX_ROWS`` rows, and a Parquet file's prompt and answer columns
at most ``MAX_PARQUET_CHARS`` characters in all (compressed, dictionary-encoded pages make its size
on disk no bound), read a batch at a time. Text must be valid Unicode (JSON can spell a lone surrogate, ``"\\ud800"``, which no
tokenizer can encode), JSON nested too deeply to parse is refused, a CSV row needs as many fields
as the header (pandas would read a longer row's first fields as an index), and a float32 or
float16 Parquet cell reads as its own shortest decimal (``1.1``, not ``1.100000023841858``).

Reward: 1 if the verifier accepts the completion; else ``format_reward`` (default 0) if the
verifier found an answer in its format (a number, a ``\\boxed{}``, a pattern match), else 0. Dense
reward: as above, with partial credit ``positional_match`` of the extracted answer's normalized
text against the canonical reference where that is higher. Rewards stay in [0, 1].
"""

from __future__ import annotations

import csv
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
MAX_LINE_BYTES = 1 << 20
"""Longest JSONL line read (1 MiB): a longer one is an error naming the line."""
MAX_TEXT_CHARS = 1 << 17
"""Longest prompt, answer or system prompt (131,072 characters; also the csv module's cell limit)."""
MAX_ROWS = 1_000_000
"""Most rows a dataset file may hold (any format; a Parquet file's count is read from its metadata
before any row is)."""
MAX_PARQUET_CHARS = 1 << 28
"""Most characters a Parquet file's prompt and answer columns may decode to in all (268,435,456):
its pages are compressed and its strings dictionary-encoded, so 400 KB on disk can decode to
gigabytes; it is read ``PARQUET_BATCH_ROWS`` rows at a time and counted before a batch becomes
Python text."""
PARQUET_BATCH_ROWS = 256


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
        if len(self.system_prompt) > MAX_TEXT_CHARS:
            raise UsageError(f"task.kwargs.system_prompt has {len(self.system_prompt):,} characters; "
                             f"the limit is {MAX_TEXT_CHARS:,}")
        if (bad := _lone_surrogate(self.system_prompt)) is not None:
            raise UsageError(f"task.kwargs.system_prompt is not valid Unicode text ({bad})")
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
    if suffix == ".parquet":
        rows = _read_parquet(path, (prompt_key, "prompt_key"), (answer_key, "answer_key"))
    else:
        rows = _read_jsonl(path) if suffix == ".jsonl" else _read_csv(path)
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
    with open(path, "rb") as f:
        n = 0
        while line := f.readline(MAX_LINE_BYTES + 1):  # never more than the limit into memory
            n += 1
            if len(line.rstrip(b"\r\n")) > MAX_LINE_BYTES:
                raise BadFileError(f"{path}: line {n}: longer than {MAX_LINE_BYTES:,} bytes (the limit for a JSONL line)")
            if n == 1 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]  # a UTF-8 byte-order mark
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise BadFileError(f"{path}: not UTF-8 text ({e.reason} on line {n}, byte {e.start + 1})") from None
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except ValueError as e:
                raise BadFileError(f"{path}: line {n}: invalid JSON ({e})") from None
            except RecursionError:
                raise BadFileError(f"{path}: line {n}: JSON nested too deeply to read") from None
            if not isinstance(row, dict):
                raise BadFileError(f"{path}: line {n}: expected a JSON object, got a {type(row).__name__}")
            _check_rows(path, len(rows) + 1)
            rows.append((f"line {n}", row))
    return rows


def _read_csv(path: Path) -> list[tuple[str, dict]]:
    """Every cell as written (no number parsing, no NaN); a row with another number of fields than
    the header is an error naming it."""
    rows, reader = [], None
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            reader = csv.reader(f)  # a cell past csv.field_size_limit() (MAX_TEXT_CHARS by default) is an error
            header = next(reader, None)
            if header is None:
                return []
            if len(set(header)) != len(header):
                twice = next(h for h in header if header.count(h) > 1)
                raise BadFileError(f"{path}: the header names column {twice!r} twice")
            for i, cells in enumerate(reader):
                where = f"row {i + 2}"  # the header is row 1
                if not cells:
                    continue  # a blank line
                if len(cells) != len(header):
                    raise BadFileError(f"{path}: {where}: {len(cells)} fields, but the header has {len(header)} "
                                       f"({', '.join(header)}); quote a field that holds a comma")
                _check_rows(path, len(rows) + 1)
                rows.append((where, dict(zip(header, cells))))
    except UnicodeDecodeError as e:
        raise BadFileError(f"{path}: not UTF-8 text ({e.reason})") from None
    except csv.Error as e:
        where = f"line {reader.line_num if reader is not None else 1}"
        if "field larger than field limit" in str(e):
            raise BadFileError(f"{path}: {where}: a cell longer than {MAX_TEXT_CHARS:,} characters (the limit for a "
                               "prompt or answer)") from None
        raise BadFileError(f"{path}: {where}: cannot be read as CSV ({e})") from None
    return rows


def _check_rows(path: Path, n: int, *, counted: bool = True) -> None:
    """``n``: the rows read so far (``counted``: reading stops at the first past the limit) or the
    file's row count from its metadata."""
    if n > MAX_ROWS:
        rows = f"more than {MAX_ROWS:,} rows" if counted else f"{n:,} rows"
        raise BadFileError(f"{path}: {rows}; the limit for a dataset file is {MAX_ROWS:,} rows (take a sample of it)")


def _read_parquet(path: Path, *keys: tuple[str, str]) -> list[tuple[str, dict]]:
    """The rows of a Parquet file, only its columns ``keys`` ((column, task.kwargs field) pairs):
    the row count is checked against ``MAX_ROWS`` from the metadata, then ``PARQUET_BATCH_ROWS``
    rows are read at a time (repeated strings stay dictionary-encoded) and their characters counted
    against ``MAX_PARQUET_CHARS`` before they become Python text. A float32 or float16 cell reads
    as its own shortest decimal (``1.1``, not ``1.100000023841858``)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    def unreadable(e: Exception) -> BadFileError:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return BadFileError(f"{path}: cannot be read as PARQUET ({first})")

    try:
        f = pq.ParquetFile(path)
        schema = f.schema_arrow
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:  # the last: a column name not UTF-8
        raise unreadable(e) from None
    _check_rows(path, f.metadata.num_rows, counted=False)
    columns = [key for key, _ in dict.fromkeys(keys)]
    for key, field in keys:
        if key not in schema.names:
            raise BadFileError(f"{path}: no column {key!r} (task.kwargs.{field}); columns: "
                               f"{', '.join(sorted(map(str, schema.names)))}")
        t = schema.field(key).type
        t = t.value_type if pa.types.is_dictionary(t) else t
        if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t)
                or pa.types.is_floating(t) or pa.types.is_null(t)):
            raise BadFileError(f"{path}: column {key!r} (task.kwargs.{field}) holds {t}, not text")
    texts = [k for k in columns if pa.types.is_string(t := schema.field(k).type) or pa.types.is_large_string(t)
             or pa.types.is_dictionary(t)]
    rows, chars = [], 0
    try:
        f = pq.ParquetFile(path, read_dictionary=texts)  # repeated strings stay one dictionary entry
        for batch in f.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
            cols = {}
            for key in columns:
                col = batch.column(key)
                if pa.types.is_dictionary(col.type):
                    lengths = pc.utf8_length(col.dictionary).take(col.indices) if col.type.value_type != pa.null() else None
                else:
                    lengths = pc.utf8_length(col) if pa.types.is_string(col.type) or pa.types.is_large_string(col.type) else None
                chars += (pc.sum(lengths).as_py() or 0) if lengths is not None else 0
                if chars > MAX_PARQUET_CHARS:
                    raise BadFileError(f"{path}: the columns {', '.join(map(repr, columns))} hold more than "
                                       f"{MAX_PARQUET_CHARS:,} characters by row {len(rows) + batch.num_rows:,} "
                                       "(the limit for a Parquet file's prompts and answers)")
                if pa.types.is_floating(col.type) and col.type.bit_width < 64:  # float32/16: the shortest decimal
                    cols[key] = [None if math.isnan(v) else str(v) for v in col.to_numpy(zero_copy_only=False)
                                 .astype(np.float32 if col.type.bit_width == 32 else np.float16)]
                else:
                    cols[key] = col.to_pylist()
            first = len(rows) + 1
            rows.extend((f"row {first + i}", {k: cols[k][i] for k in columns}) for i in range(batch.num_rows))
    except (pa.ArrowException, OSError) as e:
        raise unreadable(e) from None
    return rows


def _lone_surrogate(text: str) -> str | None:
    """Where ``text`` holds a lone surrogate (which UTF-8 cannot encode), or None."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return f"a lone surrogate {text[e.start]!r} at character {e.start}"


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
    if len(value) > MAX_TEXT_CHARS:
        raise BadFileError(f"{path}: {where}: {key!r} (task.kwargs.{field}) has {len(value):,} characters; "
                           f"the limit is {MAX_TEXT_CHARS:,}")
    if (bad := _lone_surrogate(value)) is not None:
        raise BadFileError(f"{path}: {where}: {key!r} (task.kwargs.{field}) is not valid Unicode text ({bad})")
    return value
