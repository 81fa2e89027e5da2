"""Offline mismatch analysis of per-sequence token log-probs dumped by any RL stack.

``analyze_file(path)`` reads a Parquet or JSONL file with one row per sequence (the schema is
``SCHEMA`` below and docs/analyze.md), checks every row, and computes on the valid ones what
timlab's trainer logs live: ``all_metrics`` (verl's ``rollout_corr/*`` plus ``mismatch/*``), the
same per step when rows carry ``step``, and the breakdowns of ``timlab.metrics`` (histogram of
r = log pi - log mu, |r| by position, by trainer probability, by response length). When rows
carry ``step`` and ``tokens``, it feeds the steps in order of ``step`` to the trainer's
``PersistenceTracker`` (``timlab.metrics.persistence``) for ``mismatch/persistence_*``, per step and
as the mean over the steps; otherwise ``persistence`` says why there are none. With
``out_html`` it writes a self-contained HTML report (PNGs as base64 data URIs).

Bad input never yields silent numbers. A problem that concerns the whole file (missing file, empty
file, a required column absent from every row, unreadable Parquet) raises ``AnalyzeError`` with a
one-line message. A problem confined to rows (ragged arrays, NaN/inf or a non-number at a valid
position, a positive log-prob, a bad mask, a truncated or invalid JSONL line) puts the row in
``errors`` as ``{"row", "column", "problem"}`` and the remaining rows are analyzed; only when no
row is valid does it raise, quoting the first problem. ``row`` is the 0-based index of the record
(JSONL: of the non-blank line; the line number is in the problem text).

The converters of what TRL and verl hold in memory into rows, ``from_trl_inputs`` and
``from_verl_batch``, live next to the plug-ins in ``timlab.integrations.logs`` (imported here
too); ``write_rows`` writes rows as Parquet or JSONL by extension.

Not from a paper: metric definitions are ``timlab.metrics`` (docs/metrics.md).
"""

from __future__ import annotations

import html
import json
import math
from array import array
from itertools import chain
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from timlab.errors import TimlabError, UsageError
from timlab.files import atomic_write_text
from timlab.integrations.logs import from_trl_inputs, from_verl_batch  # re-exported: analyze's inputs
from timlab.metrics import (
                            advantage_metrics_from_sums,
                            advantage_sums,
                            breakdown_sums,
                            breakdowns_from_sums,
                            format_length_scaling,
                            group_metric_sums,
                            length_scaling_from_sums,
                            length_scaling_sums,
                            merge_length_scaling_sums,
                            merge_advantage_sums,
                            merge_breakdown_sums,
                            merge_metric_sums,
                            metric_sums,
                            metrics_from_group_sums,
                            metrics_from_sums,
                            )
from timlab.metrics.persistence import MIN_SHARED, PERSISTENCE_KEYS, PersistenceTracker

REQUIRED = ("trainer_logprobs", "rollout_logprobs")
OPTIONAL = ("id", "step", "prompt", "response", "tokens", "mask", "reward", "advantage")
SCHEMA = ("one row per sequence: trainer_logprobs: list[float], rollout_logprobs: list[float] (same length, "
          "the response tokens); optional id, step: int, prompt: str, response: str, tokens: list[int], "
          "mask: list[0/1] (default all 1), reward: float, advantage: float")
"""The input schema in one line (error messages quote it)."""

POSITIVE_LOGP_TOL = 1e-3
"""A log-prob above this at a valid position is an error (log-probs are <= 0; a positive value
usually means probabilities or negative log-probs were stored)."""

MAGNITUDE_LIMIT = 1e100
"""A log-prob below -MAGNITUDE_LIMIT at a valid position, or a reward beyond +-MAGNITUDE_LIMIT, is
an error: finite but absurd values (near 1e308) would overflow the file's sums, so its means
would print as inf. Under the limit every sum analyze forms stays finite: sums of |r| or of
rewards up to ~1e208 values, the length scaling's squares (r^2 <= 4e200, and the square of a
row's sum_t r) for files of up to ~1e50 tokens. A float32 engine's -3.4e38 "impossible token"
value passes."""

STEP_MISSING = "step is missing or null (other rows have one)"

POSITION_BUCKETS = 8
STEP_COLUMNS = ("rollout_corr/k3_kl", "rollout_corr/log_ppl_abs_diff", "mismatch/abs_diff_mean",
                "mismatch/max_abs_diff", "mismatch/frac_bitwise_equal", "mismatch/probs_diff_mean")
"""Metrics shown per step in the text summary and plotted against step in the report."""

CHUNK_CELLS = 1 << 16
"""Valid rows are turned into tensors and folded into the running metrics in chunks of at most
about this many (row x position) cells, so memory holds one chunk, not the file (plus 8 bytes per
valid token: the |r| values the exact 99th percentile needs)."""

PARQUET_BATCH_ROWS = 1024

PARQUET_EXT = (".parquet", ".pq")
JSONL_EXT = (".jsonl", ".ndjson", ".json")


class AnalyzeError(TimlabError, ValueError):
    """The file cannot be analyzed at all; the message is one line naming the file and the cause."""


# ------------------------------------------------------------------------------ reading
def _format(path: Path) -> str:
    ext = path.suffix.lower()
    if ext in PARQUET_EXT:
        return "parquet"
    if ext in JSONL_EXT:
        return "jsonl"
    with path.open("rb") as f:  # unknown extension: sniff the Parquet magic
        return "parquet" if f.read(4) == b"PAR1" else "jsonl"


def _error(row: int, column: str | None, problem: str) -> dict:
    return {"row": row, "column": column, "problem": problem}


def _jsonl_rows(path: Path) -> Iterator[tuple[dict | None, dict | None]]:
    """``(record, None)`` per usable non-blank line, ``(None, error)`` per unusable one, in file
    order, reading one line at a time (universal newlines, like ``Path.read_text``)."""
    failed = None  # (row, lineno, JSONDecodeError): whether it was the last line is known at the next one
    row, ends_with_newline = 0, True
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                ends_with_newline = line.endswith("\n")
                if not line.strip():
                    continue
                if failed is not None:
                    r, n, e = failed
                    yield None, _error(r, None, f"line {n}: invalid JSON: {e.msg} at character {e.colno}")
                    failed = None
                try:
                    obj = json.loads(line[:-1] if ends_with_newline else line)
                except json.JSONDecodeError as e:
                    failed = (row, lineno, e)
                else:
                    if isinstance(obj, dict):
                        yield obj, None
                    else:
                        yield None, _error(row, None, f"line {lineno}: expected a JSON object, got {type(obj).__name__}")
                row += 1
    except UnicodeDecodeError:
        raise AnalyzeError(f"{path}: not UTF-8 text, so not JSONL (a Parquet file needs a .parquet name)") from None
    if failed is not None:
        r, n, e = failed
        problem = (f"line {n}: truncated JSON on the last line (file cut off while being written?): {e.msg}"
                   if not ends_with_newline else f"line {n}: invalid JSON: {e.msg} at character {e.colno}")
        yield None, _error(r, None, problem)


def _parquet_rows(path: Path) -> Iterator[tuple[dict | None, dict | None]]:
    """``(record, None)`` per row, read ``PARQUET_BATCH_ROWS`` rows at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for rec in batch.to_pylist():
                yield rec, None
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:  # the last: a column name that is not UTF-8
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise AnalyzeError(f"{path}: not a readable Parquet file ({msg})") from None


def iter_records(path: str | Path) -> tuple[Iterator[tuple[dict | None, dict | None]], str]:
    """``(rows, format)``: an iterator over the file's rows in order, each ``(record, None)`` or,
    for an unusable JSONL line, ``(None, error)``; unchecked. Holds one line (JSONL) or one batch
    of rows (Parquet) at a time.

    Raises ``AnalyzeError`` for a missing or empty file; an unreadable one raises while iterating.
    """
    path = Path(path)
    if path.is_dir():
        raise AnalyzeError(f"{path} is a folder, not a Parquet or JSONL file of per-sequence log-probs; a run folder is "
                           "read with --alarm RULE (`timlab analyze RUN_DIR --alarm grad_norm_change`: its metrics.parquet)")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise AnalyzeError(f"{path}: empty file (expected {SCHEMA})")
    fmt = _format(path)
    return (_jsonl_rows(path) if fmt == "jsonl" else _parquet_rows(path)), fmt


def read_records(path: str | Path) -> tuple[list[dict | None], list[dict], str]:
    """``(records, errors, format)``: the raw rows of a Parquet/JSONL file, unchecked, all in
    memory (``iter_records`` streams them).

    Raises ``AnalyzeError`` for a missing, empty or unreadable file.
    """
    rows, fmt = iter_records(path)
    records, errors = [], []
    for rec, err in rows:
        records.append(rec)
        if err is not None:
            errors.append(err)
    if not records:
        raise AnalyzeError(f"{path}: no rows (expected {SCHEMA})")
    return records, errors, fmt


# ------------------------------------------------------------------------------ checking
@dataclass
class _Seq:
    """One valid row, as floats."""

    row: int
    train: list[float]
    rollout: list[float]
    mask: list[bool]
    step: int | None
    reward: float | None
    advantage: float | None = None
    tokens: list[int] | None = None


def _numbers(value: Any, column: str) -> tuple[list[float] | None, str | None]:
    """A list of floats (null -> NaN), or the problem with ``value``."""
    if value is None:
        return None, f"{column} is null"
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()  # numpy arrays from a caller's rows
    if not isinstance(value, (list, tuple)):
        return None, f"{column} must be a list of numbers, got {type(value).__name__}"
    out = []
    for j, x in enumerate(value):
        if x is None:
            out.append(math.nan)
        elif isinstance(x, bool) or not isinstance(x, (int, float)):
            return None, f"{column}[{j}] = {x!r} is not a number"
        else:
            out.append(float(x))
    return out, None


def _mask(value: Any, n: int) -> tuple[list[bool] | None, str | None]:
    if value is None:
        return [True] * n, None
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        return None, f"mask must be a list of 0/1, got {type(value).__name__}"
    if len(value) != n:
        return None, f"mask has {len(value)} values, trainer_logprobs {n}"
    bad = next((j for j, x in enumerate(value) if x not in (0, 1)), None)  # True/False pass (== 1/0)
    if bad is not None:
        return None, f"mask[{bad}] = {value[bad]!r}; mask values must be 0 or 1"
    return [bool(x) for x in value], None


def _first_bad_logp(values: list[float], mask: list[bool], column: str) -> str | None:
    for j, (v, m) in enumerate(zip(values, mask)):
        if not m:
            continue  # padding may hold anything
        if not math.isfinite(v):
            return f"{column}[{j}] = {v} at a valid position (mask=1); log-probs must be finite"
        if v > POSITIVE_LOGP_TOL:
            return (f"{column}[{j}] = {v:.4g} > 0; log-probs must be <= 0 "
                    "(probabilities or negative log-probs stored?)")
        if v < -MAGNITUDE_LIMIT:
            return (f"{column}[{j}] = {v:.4g} is below -{MAGNITUDE_LIMIT:g}; its sums would overflow float64 "
                    "(a padding value? set mask to 0 there)")
    return None


def check_row(row: int, rec: dict, *, has_step: bool) -> tuple[_Seq | None, list[dict]]:
    """Validate one record; return the sequence (None if invalid) and its problems."""
    errs: list[dict] = []
    cols = {}
    for col in REQUIRED:
        if col not in rec:
            errs.append(_error(row, col, f"missing column {col}"))
            continue
        vals, problem = _numbers(rec[col], col)
        if problem:
            errs.append(_error(row, col, problem))
        else:
            cols[col] = vals
    if len(cols) < len(REQUIRED):
        return None, errs
    train, rollout = cols["trainer_logprobs"], cols["rollout_logprobs"]
    if len(train) != len(rollout):
        return None, [_error(row, "rollout_logprobs",
                             f"ragged: trainer_logprobs has {len(train)} values, rollout_logprobs {len(rollout)}")]
    if not train:
        return None, [_error(row, "trainer_logprobs", "no response tokens (empty lists)")]
    mask, problem = _mask(rec.get("mask"), len(train))
    if problem:
        return None, [_error(row, "mask", problem)]
    if not any(mask):
        errs.append(_error(row, "mask", "mask is all 0 (no valid tokens)"))
    for col, vals in (("trainer_logprobs", train), ("rollout_logprobs", rollout)):
        problem = _first_bad_logp(vals, mask, col)
        if problem:
            errs.append(_error(row, col, problem))
    tokens = rec.get("tokens")
    if tokens is not None:
        tokens = tokens.tolist() if hasattr(tokens, "tolist") else tokens
        if not isinstance(tokens, (list, tuple)) or any(isinstance(t, bool) or not isinstance(t, int) for t in tokens):
            errs.append(_error(row, "tokens", "tokens must be a list of integer token ids"))
        elif len(tokens) != len(train):
            errs.append(_error(row, "tokens", f"tokens has {len(tokens)} values, trainer_logprobs {len(train)}"))
        elif tokens and min(tokens) < 0:
            bad = next((j for j, (t, m) in enumerate(zip(tokens, mask)) if m and t < 0), None)
            if bad is not None:  # padding may hold -100 or the like; a valid token needs a vocabulary id
                errs.append(_error(row, "tokens", f"tokens[{bad}] = {tokens[bad]} at a valid position (mask=1); "
                                                  "token ids must be >= 0"))
    step = rec.get("step")
    if has_step:
        if step is None:
            errs.append(_error(row, "step", STEP_MISSING))
        elif isinstance(step, bool) or not isinstance(step, (int, float)) or not float(step).is_integer():
            errs.append(_error(row, "step", f"step = {step!r} is not an integer"))
    reward = rec.get("reward")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                               or not math.isfinite(reward)):
        errs.append(_error(row, "reward", f"reward = {reward!r} is not a finite number"))
    elif reward is not None and abs(reward) > MAGNITUDE_LIMIT:
        errs.append(_error(row, "reward", f"reward = {reward:.4g} is beyond +-{MAGNITUDE_LIMIT:g}; "
                                          "the mean reward would overflow float64"))
    advantage = rec.get("advantage")
    if advantage is not None and (isinstance(advantage, bool) or not isinstance(advantage, (int, float))
                                  or not math.isfinite(advantage) or abs(advantage) > MAGNITUDE_LIMIT):
        errs.append(_error(row, "advantage", f"advantage = {advantage!r} is not a finite number "
                                             f"within +-{MAGNITUDE_LIMIT:g}"))
    if errs:
        return None, errs
    return _Seq(row, train, rollout, mask, int(step) if has_step else None,
                None if reward is None else float(reward), None if advantage is None else float(advantage),
                tokens if tokens is None or isinstance(tokens, list) else list(tokens)), []


# ------------------------------------------------------------------------------ metrics
def _positions(seqs: list[_Seq]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's length (B,), and the (row, column) of every position of every row, (N,) each."""
    lengths = torch.tensor([len(s.train) for s in seqs], dtype=torch.int64)  # (B,)
    rows = torch.repeat_interleave(torch.arange(len(seqs)), lengths)  # (N,)
    cols = torch.arange(int(lengths.sum())) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)  # (N,)
    return lengths, rows, cols


def _pack(seqs: list[_Seq]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) float64 log pi, log mu and bool mask; padding is 0 / False (and so are
    masked-out values). Built from the rows' values in one flat pass, not a tensor per row."""
    lengths, rows, cols = _positions(seqs)
    B, T = len(seqs), int(lengths.max())
    m = torch.tensor([x for s in seqs for x in s.mask], dtype=torch.bool)  # (N,) every row's positions
    zero = torch.zeros((), dtype=torch.float64)
    train = torch.zeros(B, T, dtype=torch.float64)
    rollout = torch.zeros(B, T, dtype=torch.float64)
    mask = torch.zeros(B, T, dtype=torch.bool)
    train[rows, cols] = torch.where(m, torch.tensor([x for s in seqs for x in s.train], dtype=torch.float64), zero)
    rollout[rows, cols] = torch.where(m, torch.tensor([x for s in seqs for x in s.rollout], dtype=torch.float64), zero)
    mask[rows, cols] = m
    return train, rollout, mask


class _Group:
    """Running statistics of the file's valid rows, with the breakdowns, fed chunk by chunk."""

    def __init__(self):
        self.num_sequences = self.num_tokens = self.length_sum = 0
        self.reward_sum, self.num_rewards = 0, 0  # summed in row order, as sum() over the rows would
        self.metrics: dict | None = None
        self.shapes: dict | None = None
        self.scaling: dict | None = None
        self.harm: dict | None = None  # advantage_sums over the rows with an advantage

    def add(self, seqs: list[_Seq], train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> None:
        self.num_sequences += len(seqs)
        self.num_tokens += int(mask.sum())
        self.length_sum += sum(len(s.train) for s in seqs)
        for s in seqs:
            if s.reward is not None:
                self.reward_sum += s.reward
                self.num_rewards += 1
        m = metric_sums(train, rollout, mask)
        self.metrics = m if self.metrics is None else merge_metric_sums(self.metrics, m)
        b = breakdown_sums(train, rollout, mask)
        self.shapes = b if self.shapes is None else merge_breakdown_sums(self.shapes, b)
        ls = length_scaling_sums(train, rollout, mask)
        self.scaling = ls if self.scaling is None else merge_length_scaling_sums(self.scaling, ls)
        rows = [i for i, s in enumerate(seqs) if s.advantage is not None]
        if rows:
            idx = torch.tensor(rows, dtype=torch.int64)  # (B_adv,)
            adv = torch.tensor([seqs[i].advantage for i in rows], dtype=torch.float64)  # (B_adv,)
            h = advantage_sums(train[idx], rollout[idx], mask[idx], adv)
            self.harm = h if self.harm is None else merge_advantage_sums(self.harm, h)

    def summary(self) -> dict:
        return {
            "num_sequences": self.num_sequences,
            "num_tokens": self.num_tokens,
            "response_length_mean": self.length_sum / self.num_sequences,
            "reward_mean": self.reward_sum / self.num_rewards if self.num_rewards else None,
            "metrics": metrics_from_sums(self.metrics),
            "harm": None if self.harm is None else {"num_sequences": int(self.harm["num_seqs"]),
                                                    "metrics": advantage_metrics_from_sums(self.harm)},
        }


_CONCATENATED = ("abs_values", "row_w", "row_tokens")
"""``metric_sums`` keys kept per token or per row, not per step (merged apart from the others)."""


class _Steps:
    """Running statistics of every step at once (the per-step table), fed chunk by chunk.

    A chunk's rows are grouped by step, and the steps with the same number of rows in the chunk
    are stacked into one (G, B, T) batch (``group_metric_sums``), so a chunk costs a few tensor
    operations per distinct rows-per-step count, not per step (20k one-row steps are one batch).
    Each step's statistics equal ``metric_sums`` of its own rows bit for bit; a step whose rows
    span chunks is merged in row order (``merge_metric_sums``, element-wise over steps). Counts
    and rewards are summed row by row, in row order."""

    def __init__(self):
        self.slot: dict[int, int] = {}  # step -> its index in the lists and tensors below
        self.num_sequences: list[int] = []
        self.num_tokens: list[int] = []
        self.length_sum: list[int] = []
        self.reward_sum: list[float] = []
        self.num_rewards: list[int] = []
        self.parts: list[tuple[torch.Tensor, dict]] = []  # per batch: (its steps' slots (G,), group_metric_sums)

    def _slot(self, step: int) -> int:
        k = self.slot.get(step)
        if k is None:
            k = self.slot[step] = len(self.slot)
            for counts in (self.num_sequences, self.num_tokens, self.length_sum, self.num_rewards):
                counts.append(0)
            self.reward_sum.append(0)
        return k

    def add(self, seqs: list[_Seq], train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> None:
        slots = []
        for s in seqs:
            k = self._slot(s.step)
            slots.append(k)
            self.num_sequences[k] += 1
            self.num_tokens[k] += sum(s.mask)
            self.length_sum[k] += len(s.train)
            if s.reward is not None:
                self.reward_sum[k] += s.reward
                self.num_rewards[k] += 1
        slot = torch.tensor(slots, dtype=torch.int64)  # (B,)
        order = torch.argsort(slot, stable=True)  # (B,) rows grouped by step, in row order within a step
        steps, counts = torch.unique_consecutive(slot[order], return_counts=True)  # (S,) each
        start = counts.cumsum(0) - counts  # (S,) each step's first position in order
        for n in counts.unique().tolist():
            pick = counts == n
            rows = order[start[pick][:, None] + torch.arange(n)]  # (G, n) the rows of G steps with n rows
            self.parts.append((steps[pick], group_metric_sums(train[rows], rollout[rows], mask[rows])))

    def summaries(self) -> list[dict]:
        """``[{step, num_sequences, num_tokens, response_length_mean, reward_mean, metrics}]`` by step."""
        G = len(self.slot)
        if not G:
            return []
        state: dict[str, torch.Tensor] = {}
        seen = torch.zeros(G, dtype=torch.bool)
        values, groups = [], []  # |r| of every valid token, and its step's slot
        for slots, sums in self.parts:
            part = {k: v for k, v in sums.items() if k not in _CONCATENATED}
            values.append(sums["abs_values"])
            groups.append(slots.repeat_interleave(sums["num_tokens"].to(torch.int64)))
            if not state:
                state = {k: torch.zeros(G, dtype=v.dtype) for k, v in part.items()}
            again = seen[slots]  # (G_part,) steps that an earlier chunk already had
            if again.any():
                merged = merge_metric_sums({k: state[k][slots] for k in part}, part)
                part = {k: torch.where(again, merged[k], v) for k, v in part.items()}
            for k, v in part.items():
                state[k][slots] = v
            seen[slots] = True
        state["abs_values"] = torch.cat(values)
        metrics = metrics_from_group_sums(state, torch.cat(groups))  # one dict per slot
        return [{"step": step, "num_sequences": self.num_sequences[k], "num_tokens": self.num_tokens[k],
                 "response_length_mean": self.length_sum[k] / self.num_sequences[k],
                 "reward_mean": self.reward_sum[k] / self.num_rewards[k] if self.num_rewards[k] else None,
                 "metrics": metrics[k]} for step, k in sorted(self.slot.items())]


# ------------------------------------------------------------------------------ persistence
MAX_TOKEN_ID = (1 << 24) - 1
"""The largest token id taken as a vocabulary entry (vocabularies in use hold ~256k). Persistence
keeps float64 vectors the size of the vocabulary (max token id + 1), so a larger id makes it
unavailable rather than allocating gigabytes."""

PERSISTENCE_NEEDS_TOKENS = "this file has no `tokens` column: the per-token-id bias needs token ids"
PERSISTENCE_NEEDS_STEPS = "this file has no `step` column: persistence compares the bias of one step with the steps before it"
"""Why analyze has no persistence for a file without token ids or without steps."""


class _Persistence:
    """The input of ``mismatch/persistence_*``: each step's valid tokens (id and r = log pi - log mu),
    split by the parity of their row among the step's rows (file order), kept to the end of the
    file; ``summary`` then feeds the steps, in order of ``step``, to one ``PersistenceTracker``
    (``timlab.metrics.persistence``). Only rows with ``tokens`` take part; 12 bytes per valid
    token of those rows (an int32 id, a float64 r)."""

    def __init__(self):
        self.slot: dict[int, int] = {}  # step -> k: its tokens are in parts[2k] (even rows), parts[2k + 1] (odd)
        self.rows: list[int] = []  # rows with tokens seen so far, per slot
        self.ids: list[array] = []
        self.ratios: list[array] = []
        self.max_id = -1
        self.without_tokens = 0  # valid rows with a step but no tokens

    def add(self, seqs: list[_Seq], train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> None:
        keep = [b for b, s in enumerate(seqs) if s.tokens is not None]
        self.without_tokens += len(seqs) - len(keep)
        if not keep:
            return
        part = []  # per kept row: 2 x its step's slot + the parity of its place among the step's rows
        for b in keep:
            k = self.slot.get(seqs[b].step)
            if k is None:
                k = self.slot[seqs[b].step] = len(self.rows)
                self.rows.append(0)
                self.ids += [array("i"), array("i")]
                self.ratios += [array("d"), array("d")]
            part.append(2 * k + self.rows[k] % 2)
            self.rows[k] += 1
        idx = torch.tensor(keep, dtype=torch.int64)  # (B',)
        _, rows, cols = _positions([seqs[b] for b in keep])
        tokens = torch.zeros(len(keep), mask.shape[1], dtype=torch.int64)  # (B', T)
        tokens[rows, cols] = torch.tensor(list(chain.from_iterable(seqs[b].tokens for b in keep)), dtype=torch.int64)
        valid = mask[idx]  # (B', T)
        ids, r = tokens[valid], (train[idx] - rollout[idx])[valid]  # (N,) each, row-major
        if ids.numel():
            self.max_id = max(self.max_id, int(ids.max()))
        where = torch.tensor(part, dtype=torch.int64)[valid.nonzero()[:, 0]]  # (N,) each token's part
        order = torch.argsort(where, stable=True)  # (N,) tokens grouped by part, row-major within one
        parts, counts = torch.unique_consecutive(where[order], return_counts=True)
        for p, chunk in zip(parts.tolist(), torch.split(order, counts.tolist())):
            self.ids[p].frombytes(ids[chunk].to(torch.int32).numpy().tobytes())  # "i": int32 (ids past 2^24 are refused)
            self.ratios[p].frombytes(r[chunk].numpy().tobytes())

    def summary(self, *, has_step: bool) -> tuple[dict, dict[int, dict[str, float]]]:
        """``(persistence, by_step)``: ``persistence`` is ``{available, reason, vocab_size, num_steps,
        num_defined, rows_without_tokens}``; ``by_step`` maps each step fed to its ``PERSISTENCE_KEYS``
        (empty when unavailable)."""
        info = {"available": False, "reason": None, "vocab_size": None, "num_steps": len(self.slot),
                "num_defined": None, "rows_without_tokens": self.without_tokens}
        if not has_step:
            return {**info, "reason": PERSISTENCE_NEEDS_STEPS}, {}
        if not self.slot:
            return {**info, "reason": PERSISTENCE_NEEDS_TOKENS}, {}
        if self.max_id > MAX_TOKEN_ID:
            return {**info, "reason": f"token id {self.max_id} is beyond {MAX_TOKEN_ID}, too large for a vocabulary"}, {}
        if len(self.slot) == 1:
            (step,) = self.slot
            return {**info, "reason": f"this file has one step (step {step}) with token ids: persistence compares "
                                      "a step's per-token-id bias with the steps before it"}, {}
        vocab_size = self.max_id + 1
        tracker = PersistenceTracker(vocab_size)
        by_step = {}
        for step, k in sorted(self.slot.items()):
            by_step[step] = tracker.update(*self._batch(k))
        info.update(vocab_size=vocab_size, num_defined={
            key: sum(math.isfinite(v[key]) for v in by_step.values()) for key in PERSISTENCE_KEYS})
        if not any(info["num_defined"][key] for key in PERSISTENCE_KEYS[:2]):
            zero = all(x == 0 for a in self.ratios for x in a)
            info["reason"] = ("r = 0 at every valid token (no mismatch), so the bias has no direction to follow" if zero
                              else f"the correlations are undefined at every step: fewer than {MIN_SHARED} token ids "
                                   "recur between steps, or the per-id mean log-ratio is the same for every id")
            return info, {}
        info["available"] = True
        return info, by_step

    def _batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step slot ``k`` as the tracker's (B, T) inputs with B = 2: row 0 holds the tokens of the
        step's even rows, row 1 those of its odd rows (its even/odd split is by row), so its sums
        are the step's; log pi = r and log mu = 0, so its r is the file's."""
        even, odd = 2 * k, 2 * k + 1
        T = max(len(self.ids[even]), len(self.ids[odd]))
        train = torch.zeros(2, T, dtype=torch.float64)  # (2, T)
        tokens = torch.zeros(2, T, dtype=torch.int64)  # (2, T)
        mask = torch.zeros(2, T, dtype=torch.bool)  # (2, T)
        for row, p in enumerate((even, odd)):
            n = len(self.ids[p])
            if n:
                train[row, :n] = torch.frombuffer(self.ratios[p], dtype=torch.float64)
                tokens[row, :n] = torch.frombuffer(self.ids[p], dtype=torch.int32)
            mask[row, :n] = True
        return train, torch.zeros_like(train), mask, tokens


def _add_persistence(result: dict, persistence: _Persistence, *, has_step: bool) -> None:
    """Put ``PERSISTENCE_KEYS`` into ``result``: per step into each ``per_step`` entry's metrics
    (None where undefined, e.g. the first step: the result stays JSON without NaN), and into
    ``metrics`` their mean over the steps where each is defined; only when persistence is available.
    ``result["persistence"]`` says how many steps had a value, or why it is unavailable."""
    info, by_step = persistence.summary(has_step=has_step)
    result["persistence"] = info
    if not info["available"]:
        return
    for s in result["per_step"]:
        values = by_step.get(s["step"], {})
        s["metrics"].update({key: values[key] if math.isfinite(values.get(key, math.nan)) else None
                             for key in PERSISTENCE_KEYS})
    for key in PERSISTENCE_KEYS:
        values = [v[key] for v in by_step.values() if math.isfinite(v[key])]
        result["metrics"][key] = sum(values) / len(values) if values else None


class _Analysis:
    """Checks rows as they arrive and folds the valid ones, ``CHUNK_CELLS`` at a time, into the
    file's and each step's running statistics.

    Whether ``step`` is required is known only at the end (any row with a ``step`` key makes it
    required for all). Rows lacking it before the first row that has one are kept apart: if a
    later row has a step, they become invalid (with the same errors ``check_row`` gives) and their
    statistics are dropped, which is why the chunk is cut where the first step appears.
    """

    def __init__(self, source: str):
        self.source = source
        self.num_rows = 0
        self.any_record = False
        self.columns: set[str] = set()
        self.errors: list[dict] = []
        self.has_step = False
        self.chunk: list[_Seq] = []
        self.chunk_len = 0
        self.total = _Group()
        self.steps = _Steps()
        self.persistence = _Persistence()
        self.stepless_valid = array("q")  # rows valid only if no row has a step
        self.stepless_invalid: dict[int, list[dict]] = {}  # row -> its errors if some row has a step

    def add(self, rec: dict | None, error: dict | None = None) -> None:
        row = self.num_rows
        self.num_rows += 1
        if error is not None:
            self.errors.append(error)
        if rec is None:
            return
        self.any_record = True
        self.columns.update(rec)
        if "step" in rec and not self.has_step:
            self._flush()
            self.has_step = True
            if self.stepless_valid:  # what came before belongs to rows that are invalid now
                self.total = _Group()
        seq, errs = check_row(row, rec, has_step=self.has_step)
        if not self.has_step:
            if seq is not None:
                self.stepless_valid.append(row)
            elif errs:
                self.stepless_invalid[row] = check_row(row, rec, has_step=True)[1]
        self.errors.extend(errs)
        if seq is not None:
            self.chunk.append(seq)
            self.chunk_len = max(self.chunk_len, len(seq.train))
            if len(self.chunk) * self.chunk_len >= CHUNK_CELLS:
                self._flush()

    def _flush(self) -> None:
        if not self.chunk:
            return
        train, rollout, mask = _pack(self.chunk)  # (B, T) each
        self.total.add(self.chunk, train, rollout, mask)
        if self.has_step:
            self.steps.add(self.chunk, train, rollout, mask)
            self.persistence.add(self.chunk, train, rollout, mask)
        self.chunk, self.chunk_len = [], 0

    def _final_errors(self) -> list[dict]:
        errors = self.errors
        if self.has_step and (self.stepless_valid or self.stepless_invalid):
            errors = [e for e in errors if e["row"] not in self.stepless_invalid]
            errors += [e for errs in self.stepless_invalid.values() for e in errs]
            errors += [_error(r, "step", STEP_MISSING) for r in self.stepless_valid]
        return sorted(errors, key=lambda e: e["row"])  # stable: a row's problems keep their order

    def result(self, *, out_html: str | Path | None = None) -> dict:
        self._flush()
        if not self.num_rows:
            raise AnalyzeError(f"{self.source}: no rows (expected {SCHEMA})")
        columns = sorted(self.columns)
        for col in REQUIRED:
            if col not in columns and self.any_record:
                raise AnalyzeError(f"{self.source}: missing column {col!r} (columns: {', '.join(columns) or 'none'}); "
                                   f"expected {SCHEMA}")
        errors = self._final_errors()
        num_valid = self.total.num_sequences
        if not num_valid:
            first = errors[0] if errors else _error(0, None, "no rows")
            where = f"row {first['row']}" + (f", column {first['column']}" if first["column"] else "")
            raise AnalyzeError(f"{self.source}: no valid rows ({self.num_rows} invalid); "
                               f"first problem: {where}: {first['problem']}")
        result = {
            "source": self.source,
            "columns": columns,
            "num_rows": self.num_rows,
            "num_valid": num_valid,
            "num_invalid": self.num_rows - num_valid,
            "errors": errors,
        }
        result.update(self.total.summary())
        T = self.total.shapes["position_counts"].numel()  # the longest valid row
        result.update(breakdowns_from_sums(self.total.shapes, num_position_buckets=min(POSITION_BUCKETS, T)))
        result["length_scaling"] = length_scaling_from_sums(self.total.scaling)
        result["per_step"] = self.steps.summaries()
        _add_persistence(result, self.persistence, has_step=self.has_step)
        result["report"] = None
        if out_html is not None:
            result["report"] = str(write_report(result, out_html))
        return result


def analyze_records(records: list[dict | None], *, read_errors: list[dict] | None = None, source: str = "rows",
                    out_html: str | Path | None = None) -> dict:
    """Check records, compute the metrics on the valid ones; see ``analyze_file``."""
    analysis = _Analysis(source)
    for rec in records:
        analysis.add(rec)  # a None record's problem is in read_errors
    analysis.errors.extend(read_errors or [])
    return analysis.result(out_html=out_html)


def analyze_file(path: str | Path, *, out_html: str | Path | None = None) -> dict:
    """Analyze a Parquet or JSONL file of per-sequence log-probs (schema: ``SCHEMA``).

    Returns a JSON-ready dict: ``metrics`` (``all_metrics`` over every valid token of the file),
    ``per_step`` (a list of ``{step, num_sequences, num_tokens, response_length_mean,
    reward_mean, metrics}``, empty without a ``step`` column), ``histogram``, ``by_position``,
    ``by_prob``, ``by_length`` (``timlab.metrics`` breakdowns), ``length_scaling`` (noise vs bias:
    ``timlab.metrics.length_scaling`` over every valid row), ``persistence`` (``{available,
    reason, vocab_size, num_steps, num_defined, rows_without_tokens}``; when available,
    ``PERSISTENCE_KEYS`` are in ``metrics``, the mean over the steps, and in each step's), ``num_rows`` / ``num_valid`` /
    ``num_invalid``, ``errors`` (``[{row, column, problem}]``), ``num_tokens``,
    ``response_length_mean``, ``reward_mean``, ``columns``, ``format``, ``report`` (the HTML path
    or None). Raises ``AnalyzeError`` (a ``ValueError``) when nothing can be analyzed.

    The file is streamed: rows are read one line (JSONL) or one batch (Parquet) at a time and
    folded into running statistics ``CHUNK_CELLS`` cells at a time, so memory holds one chunk
    plus 8 bytes per valid token, not the file. A file that fits in one chunk gives exactly what
    ``all_metrics`` and the breakdowns give on its padded batch; across chunks, sums are added
    chunk by chunk, so float results can differ from the one-batch value in the last bits (counts,
    max/min, the 99th percentile and histograms are exact).
    """
    rows, fmt = iter_records(path)
    analysis = _Analysis(str(path))
    for rec, err in rows:
        analysis.add(rec, err)
    result = analysis.result(out_html=out_html)
    result["format"] = fmt
    return result


# ------------------------------------------------------------------------------ text summary
def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return "0" if x == 0 else f"{x:.3g}"


def format_analysis(result: dict, *, max_errors: int = 10) -> str:
    """A short human-readable summary of ``analyze_file``'s result."""
    m = result["metrics"]
    lines = [
        f"analyze {result['source']}: {result['num_valid']} of {result['num_rows']} rows valid, "
        f"{result['num_tokens']} tokens, mean length {result['response_length_mean']:.1f}"
        + (f", mean reward {result['reward_mean']:.3g}" if result["reward_mean"] is not None else ""),
        f"  max |r| {_fmt(m['mismatch/max_abs_diff'])}  mean |r| {_fmt(m['mismatch/abs_diff_mean'])}  "
        f"bitwise equal {100 * m['mismatch/frac_bitwise_equal']:.2f}%  k3 {_fmt(m['rollout_corr/k3_kl'])}  "
        f"k3 per response {_fmt(m['mismatch/k3_seq'])}  "
        f"kl {_fmt(m['rollout_corr/kl'])}  |log ppl diff| {_fmt(m['rollout_corr/log_ppl_abs_diff'])}  "
        f"probs diff mean {_fmt(m['mismatch/probs_diff_mean'])}  ESS {_fmt(m['mismatch/ess'])}",
    ]
    lines.append("  " + format_harm(result))
    lines += ["  " + x for x in harm_prediction(result).splitlines()]
    if "length_scaling" in result:
        lines.append("  length scaling: " + format_length_scaling(result["length_scaling"]))
    if "persistence" in result:
        lines.append("  " + format_persistence(result))
    if result["per_step"]:
        columns = step_columns(result)
        short = [c.split("/")[1] for c in columns]
        widths = [max(14, len(c)) for c in short]
        lines.append("  " + f"{'step':>6} {'seqs':>5} {'tokens':>7} " + " ".join(f"{c:>{w}}" for c, w in zip(short, widths)))
        for s in result["per_step"]:
            lines.append("  " + f"{s['step']:>6} {s['num_sequences']:>5} {s['num_tokens']:>7} "
                         + " ".join(f"{_fmt(s['metrics'][c]):>{w}}" for c, w in zip(columns, widths)))
    if result["errors"]:
        lines.append(f"  {result['num_invalid']} invalid row(s) left out:")
        for e in result["errors"][:max_errors]:
            lines.append(f"    row {e['row']}" + (f", column {e['column']}" if e["column"] else "") + f": {e['problem']}")
        if len(result["errors"]) > max_errors:
            lines.append(f"    ... {len(result['errors']) - max_errors} more (all in the JSON / HTML report)")
    if result.get("report"):
        lines.append(f"  report: {result['report']}")
    return "\n".join(lines)


def step_columns(result: dict) -> tuple[str, ...]:
    """The metrics of the per-step table: ``STEP_COLUMNS``, then ``PERSISTENCE_KEYS`` when the
    file's persistence is available."""
    return STEP_COLUMNS + (PERSISTENCE_KEYS if (result.get("persistence") or {}).get("available") else ())


def format_persistence(result: dict) -> str:
    """One line: the file's ``mismatch/persistence_*`` (the mean over the steps where each is
    defined, and how many steps that is), or why persistence is unavailable."""
    info = result["persistence"]
    if not info["available"]:
        return f"persistence: unavailable ({info['reason']})"
    m, n = result["metrics"], info["num_steps"]
    parts = [f"{key.split('_', 1)[1]} {_fmt(m[key])} ({info['num_defined'][key]} of {n} steps)"
             for key in PERSISTENCE_KEYS]
    left_out = info["rows_without_tokens"]
    return ("persistence of the per-token-id bias across steps (mean over the steps where defined; ~1: it keeps "
            "its direction, ~0: redrawn every step): " + ", ".join(parts)
            + f"; vocabulary {info['vocab_size']} (max token id + 1)"
            + (f"; {left_out} row(s) without tokens left out" if left_out else ""))


HARM_NEEDS_ADVANTAGES = ("the advantage-weighted harm statistics (mismatch/adv_diff_mean, mismatch/adv_diff_corr) "
                         "need an 'advantage' column, which this file lacks")
"""What analyze says about the harm statistics of a file without advantages."""


def format_harm(result: dict) -> str:
    """One line: the harm statistics of an ``analyze_*`` result, or why the advantage-weighted ones
    are missing (the file has no ``advantage`` values)."""
    m = result["metrics"]
    size = f"k3 per response {_fmt(m['mismatch/k3_seq'])}, TV mean {_fmt(m['mismatch/tv_mean'])}"
    harm = result.get("harm")
    if harm is None:
        return f"harm: {size}; {HARM_NEEDS_ADVANTAGES}"
    h = harm["metrics"]
    return (f"harm: {size}, mean A*r {_fmt(h['mismatch/adv_diff_mean'])}, "
            f"corr(A, sum r) {_fmt(h['mismatch/adv_diff_corr'])} over {harm['num_sequences']} sequences with an advantage")


def harm_prediction(result: dict) -> str:
    """The answer to "is this mismatch a problem?" (``timlab.experiments.diagnostics.harm_prediction``) for the whole
    file: its k3, mean answer length and ``mismatch/persistence_ema`` where the result carries it; the
    kind where ``--kind`` stated it."""
    from timlab.experiments.diagnostics.harm_prediction import harm_answer

    # result["metrics"] carries mismatch/persistence_ema where the file gave it (``_add_persistence``)
    return harm_answer(result["metrics"], length=result["response_length_mean"], kind=result.get("mismatch_kind"))


# ------------------------------------------------------------------------------ HTML report
HEADLINE = (
    ("mismatch/max_abs_diff", "max |r| over valid tokens"),
    ("mismatch/abs_diff_mean", "mean |r| (dense bf16 vLLM vs FSDP ~0.005)"),
    ("mismatch/abs_diff_p99", "99th percentile of |r|"),
    ("mismatch/frac_bitwise_equal", "share of tokens with log pi == log mu exactly"),
    ("mismatch/frac_tokens_different", "share of tokens with |r| > 1e-6"),
    ("rollout_corr/k3_kl", "mean of exp(r) - r - 1 (dense bf16 ~6e-4)"),
    ("rollout_corr/kl", "mean of log mu - log pi (verl warns at |kl| > 0.1)"),
    ("rollout_corr/log_ppl_abs_diff", "mean over sequences of |mean-token log mu - log pi|"),
    ("mismatch/log_ppl_abs_diff_sum", "same with sums over tokens (Beyond-Precision Eq. 8)"),
    ("mismatch/k3_seq", "k3 summed over each response, the per-response KL estimate (nats)"),
    ("rollout_corr/chi2_token", "mean exp(2r) - 1 (verl warns at > 1)"),
    ("mismatch/probs_diff_mean", "mean |pi - mu| in probability (verl: > 0.01 points to precision)"),
    ("mismatch/tv_mean", "probability mass moved: mean per-token total variation, estimated from the sampled tokens"),
    ("mismatch/ess", "token IS effective sample size, (0, 1] (verl warns below 0.3)"),
)


def _bar_plot(labels: list[str], values: list[float], counts: list[int] | None, *, title: str, ylabel: str,
              logy: bool = False, w: float = 9.0) -> str:
    from timlab.experiments.reports.page import new_figure, png_uri

    fig = new_figure(w, 3.4)
    ax = fig.add_subplot(1, 1, 1)
    x = list(range(len(labels)))
    values = [v if math.isfinite(v) else math.nan for v in values]  # an infinite bar has no height to draw
    ax.bar(x, values, color="#4477aa")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, rotation=45 if len(labels) > 6 else 0, ha="right" if len(labels) > 6 else "center",
                       fontsize=8)
    top = max((v for v in values if v == v), default=0.0)
    if logy and top > 0:
        ax.set_yscale("log")
        ax.set_ylim(0.7, top * 3)
    elif top > 0:
        ax.set_ylim(0, top * 1.15)
    if counts is not None:
        for xi, v, n in zip(x, values, counts):
            if n:
                ax.annotate(f"n={n}", (xi, v), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=7,
                            color="#555")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    return png_uri(fig)


def _edge(x: float) -> str:
    return f"{x:g}"


def _histogram_uri(h: dict) -> str:
    e = h["edges"]
    labels = [f"[{_edge(lo)}, {_edge(hi)})" for lo, hi in zip(e, e[1:])]
    return _bar_plot(labels, [float(c) for c in h["counts"]], h["counts"], logy=True, w=10.0,
                     title=f"r = log pi - log mu over {h['num_tokens']} valid tokens", ylabel="tokens (log scale)")


def _bucket_uri(b: dict, *, title: str, label, key: str = "mean_abs_diff", ylabel: str = "mean |r|") -> str | None:
    keep = [i for i, n in enumerate(b["counts"]) if n]
    if not keep:
        return None
    e = b["edges"]
    return _bar_plot([label(e[i], e[i + 1]) for i in keep], [b[key][i] for i in keep], [b["counts"][i] for i in keep],
                     title=title, ylabel=ylabel)


def _steps_uri(per_step: list[dict]) -> str:
    from matplotlib.ticker import MaxNLocator

    from timlab.experiments.reports.page import new_figure, png_uri

    fig = new_figure(10.0, 5.6)
    steps = [s["step"] for s in per_step]
    for k, key in enumerate(STEP_COLUMNS[:4]):
        ax = fig.add_subplot(2, 2, k + 1)
        ys = [s["metrics"][key] for s in per_step]
        ax.plot(steps, [y if y is not None and math.isfinite(y) else math.nan for y in ys], marker="o", color="#cc6677")
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    return png_uri(fig)


def write_report(result: dict, out_html: str | Path) -> Path:
    """Write the self-contained HTML report of an ``analyze_*`` result; returns the path."""
    import pandas as pd

    from timlab.experiments.reports.page import STYLE, img, table

    out = Path(out_html)
    out.parent.mkdir(parents=True, exist_ok=True)
    m = result["metrics"]
    esc = html.escape
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>timlab analyze: {esc(Path(result['source']).name)}</title>", f"<style>{STYLE}</style></head><body>",
        f"<h1>Training-inference mismatch: {esc(Path(result['source']).name)}</h1>",
        f"<p>{esc(result['source'])}: {result['num_valid']} of {result['num_rows']} rows valid, "
        f"{result['num_tokens']} valid tokens, mean response length {result['response_length_mean']:.1f}"
        + (f", mean reward {result['reward_mean']:.3g}" if result["reward_mean"] is not None else "") + ". "
        "r = log pi (trainer) - log mu (rollout engine) at every valid response token.</p>",
        "<h2>Summary</h2>",
        table(pd.DataFrame({"metric": [k for k, _ in HEADLINE], "value": [m[k] for k, _ in HEADLINE],
                             "meaning": [d for _, d in HEADLINE]}), left=("metric", "meaning")),
        "<details><summary>All metrics</summary>",
        table(pd.DataFrame({"metric": list(m), "value": list(m.values())}), left=("metric",)),
        "</details>",
        "<h2>Harm statistics</h2>",
        f"<p>{esc(format_harm(result).removeprefix('harm: '))}. Definitions: docs/metrics.md, harm section.</p>",
        "<h2>Persistence</h2>",
        f"<p>{esc(format_persistence(result).removeprefix('persistence: '))}. Definitions: docs/metrics.md, "
        "persistence section.</p>",
        "<h2>Histogram of r</h2>",
        '<p class="note">Symmetric log-spaced bins; the middle bin [-1e-06, 1e-06) holds the (near-)equal tokens. '
        "Values beyond +-20 are counted in the outer bins.</p>",
        img(_histogram_uri(result["histogram"]), "histogram of r"),
        "<h2>Where the mismatch lives</h2>",
        img(_bucket_uri(result["by_position"], title="mean |r| by response position",
                         label=lambda lo, hi: f"[{lo}, {hi})"), "mean |r| by position"),
        img(_bucket_uri(result["by_prob"], title="mean |r| by trainer probability exp(log pi)",
                         label=lambda lo, hi: f"[{lo:g}, {hi:g})"), "mean |r| by probability"),
        img(_bucket_uri(result["by_length"], title="mean per-token |r| by response length (valid tokens)",
                         label=lambda lo, hi: f"[{lo:g}, {hi:g})"), "mean |r| by length"),
        img(_bucket_uri(result["by_length"], title="mean |sum_t r| per sequence by response length",
                         label=lambda lo, hi: f"[{lo:g}, {hi:g})", key="mean_abs_sum_diff", ylabel="mean |sum r|"),
             "mean |sum r| by length"),
    ]
    ls = result.get("length_scaling")
    if ls is not None:
        parts += ["<h2>Noise or bias? How the log-ratio grows with length</h2>",
                  f"<p>{esc(format_length_scaling(ls))}. iid per-token noise makes |sum_t r| grow like T^0.5, a "
                  "systematic bias like T^1 (timlab.metrics.scaling).</p>"]
        if ls["lengths"]:
            parts.append(table(pd.DataFrame({"prefix length T": ls["lengths"], "sequences": ls["seqs_at_length"],
                                              "RMS of sum_t r": ls["rms_sum"], "mean of sum_t |r|": ls["mean_abs_sum"]})))
    if result["per_step"]:
        rows = [{"step": s["step"], "sequences": s["num_sequences"], "tokens": s["num_tokens"],
                 "mean length": s["response_length_mean"],
                 **({"mean reward": s["reward_mean"]} if result["reward_mean"] is not None else {}),
                 **{k: s["metrics"][k] for k in step_columns(result)}} for s in result["per_step"]]
        parts += ["<h2>Per step</h2>", img(_steps_uri(result["per_step"]), "metrics per step"),
                  table(pd.DataFrame(rows))]
    if result["errors"]:
        shown = result["errors"][:200]
        parts += [f"<h2>Invalid rows ({result['num_invalid']}, left out)</h2>",
                  table(pd.DataFrame({"row": [e["row"] for e in shown],
                                       "column": [e["column"] or "" for e in shown],
                                       "problem": [e["problem"] for e in shown]}), left=("column", "problem"))]
        if len(result["errors"]) > len(shown):
            parts.append(f'<p class="note">... and {len(result["errors"]) - len(shown)} more in the JSON output.</p>')
    parts += [f'<p class="note">Schema: {esc(SCHEMA)}. Metric definitions: timlab.metrics (verl\'s '
              "rollout_corr/* and timlab's mismatch/*).</p>", "</body></html>"]
    atomic_write_text(out, "\n".join(parts))  # a full disk never leaves half a page over the old report
    return out


# ------------------------------------------------------------------------------ writing
def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.tolist()
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):
        return v.tolist()  # numpy
    return v


def write_rows(rows: list[dict], path: str | Path, *, append: bool = False) -> Path:
    """Write rows in the analyze schema: Parquet (``.parquet``/``.pq``) or JSONL (``.jsonl``/``.ndjson``/``.json``).

    ``append=True`` adds to an existing JSONL file (one file for a whole run, e.g. from a hook
    called every step); Parquet files cannot be appended to. Tensors and numpy arrays become lists.
    """
    path = Path(path)
    ext = path.suffix.lower()
    if ext not in PARQUET_EXT + JSONL_EXT:
        raise UsageError(f"unknown extension {ext or '(none)'!r} of {path}; valid: {', '.join(PARQUET_EXT + JSONL_EXT)}")
    clean = [{k: _jsonable(v) for k, v in row.items()} for row in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    if ext in PARQUET_EXT:
        if append:
            raise UsageError(f"append=True needs a JSONL file; {path} is Parquet")
        import pyarrow as pa
        import pyarrow.parquet as pq

        keys = list(dict.fromkeys(k for row in clean for k in row))  # every row's keys (from_pylist reads row 0's)
        pq.write_table(pa.Table.from_pydict({k: [row.get(k) for row in clean] for k in keys}), path)
        return path
    with path.open("a" if append else "w", encoding="utf-8") as f:
        for row in clean:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path
