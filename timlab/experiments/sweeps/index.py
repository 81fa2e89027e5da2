"""The sweep index: one row per run (ids, condition, state, summary, flattened config) in
``DIR/index.parquet``, written atomically as runs finish, read back with live run states
(``read_index``) and filtered by a SQL predicate through DuckDB (``filter_index``,
``query_index``); ``where_sql`` lets only a predicate over the index's columns through.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pandas as pd

from timlab.errors import BadFileError, UsageError, one_line
from timlab.experiments.studies.collapse import SUMMARY_KEYS, run_summary
from timlab.experiments.sweeps.spec import RunSpec
from timlab.files import atomic_write_with
from timlab.rundir import RunDir

INDEX_FILE = "index.parquet"
DEMO_RUNS = "runs"
"""The sweep folder inside a demo's folder (``timlab demo --out DIR`` writes DIR/runs)."""


def find_sweep_dir(path: str | Path) -> Path:
    """``path`` when it holds the index; ``path/runs`` when only that does (a demo's folder), so
    that ``timlab runs DEMO_OUT`` and ``timlab report DEMO_OUT`` find the demo's sweep."""
    path = Path(path)
    if not (path / INDEX_FILE).exists() and (path / DEMO_RUNS / INDEX_FILE).exists():
        return path / DEMO_RUNS
    return path


def _index_row(run: RunSpec, out_dir: Path) -> dict:
    summary = run_summary(out_dir / run.run_id)
    return {
        "run_id": run.run_id,
        "condition": run.condition,
        "spec_condition": run.spec_condition,
        "run_dir": run.run_id,
        "overrides": json.dumps(run.overrides, sort_keys=True, default=str),
        **{k: summary[k] for k in SUMMARY_KEYS},
        **run.config.to_flat_dict(),
    }


def _index_frame(rows: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    for col in df.columns:  # parquet needs one type per column
        if df[col].dtype == object:
            types = {type(v) for v in df[col] if v is not None and not (isinstance(v, float) and math.isnan(v))}
            if len(types) > 1 or (types and not types <= {str, bool}):
                df[col] = df[col].map(lambda v: v if isinstance(v, str) else json.dumps(v, default=str))
    return df


def _write_index(out_dir: Path, rows: list[dict]) -> pd.DataFrame:
    df = _index_frame(rows)
    # atomic, through a temporary file of this write's own: readers never see a half-written index
    atomic_write_with(out_dir / INDEX_FILE, lambda tmp: df.to_parquet(tmp, index=False))
    return df


def read_index(sweep_dir: str | Path) -> pd.DataFrame:
    """The sweep's index.parquet: one row per run (ids, condition, status, summary, flattened config).

    ``state`` and ``last_step`` are read live from each run's status.json, so a sweep that is
    running, or was killed, shows where its runs are rather than where they were at the last
    index write."""
    p = Path(sweep_dir) / INDEX_FILE
    if not p.exists():
        raise FileNotFoundError(f"{sweep_dir}: no {INDEX_FILE} (not a sweep directory; run `timlab sweep` first)")
    try:
        df = pd.read_parquet(p)
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise BadFileError(f"{p}: unreadable ({one_line(e, with_type=True)[:200]}); rerun the sweep to rewrite it") from None
    if "run_dir" in df.columns and "state" in df.columns:
        for i, d in enumerate(df["run_dir"]):
            status = RunDir(Path(sweep_dir) / str(d)).read_status()
            if status.get("state"):
                df.loc[i, "state"] = status["state"]
            step, old = status.get("step"), df["last_step"].iloc[i] if "last_step" in df.columns else None
            if isinstance(step, int) and old is not None:
                df.loc[i, "last_step"] = step if pd.isna(old) else max(step, old)
    return df


WHERE_KEYWORDS = ("AND", "OR", "NOT", "IS", "NULL", "TRUE", "FALSE", "IN", "BETWEEN", "LIKE", "ILIKE")
"""The words a ``--where`` condition may use besides column names: a predicate, never a statement."""
_WHERE_TOKEN = re.compile(r"""\s+|'(?:[^']|'')*'|"(?:[^"]|"")*"|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?"""
                          r"|<>|!=|<=|>=|==|[=<>(),+\-*/%]|[A-Za-z_][A-Za-z0-9_]*")


def where_sql(where: str, columns: list[str]) -> str:
    """A ``--where`` condition as DuckDB SQL over the index's columns, or a one-line UsageError.

    Only a predicate passes: column names (bare, dotted like ``mismatch.magnitude``, or
    double-quoted), numbers, '...' strings, comparisons, arithmetic, parentheses and
    ``WHERE_KEYWORDS``. Anything else (``;``, comments, function calls such as
    ``read_text(...)``, SELECT / COPY) is refused before DuckDB sees the text."""
    names = sorted(columns, key=len, reverse=True)
    out, i = [], 0
    while i < len(where):
        col = next((c for c in names if where.startswith(c, i) and not re.match(r"[\w./]", where[i + len(c):i + len(c) + 1])
                    and not (i and re.match(r"[\w.]", where[i - 1]))), None)
        if col is not None:
            out.append('"' + col.replace('"', '""') + '"')
            i += len(col)
            continue
        m = _WHERE_TOKEN.match(where, i)
        if m is None:
            raise UsageError(f"--where {where!r}: unexpected {where[i]!r} at character {i + 1}; a condition may use "
                             f"columns, numbers, 'strings', comparisons, + - * / %, parentheses and "
                             f"{', '.join(WHERE_KEYWORDS)}")
        tok = m.group()
        i = m.end()
        if tok[0] == '"':
            name = tok[1:-1].replace('""', '"')
            if name not in columns:
                raise UsageError(f"--where: unknown column {name!r}; valid columns: {', '.join(columns)}")
        elif tok[0].isalpha() or tok[0] == "_":
            if tok.upper() not in WHERE_KEYWORDS:
                raise UsageError(f"--where: unknown column {tok!r} (nor one of {', '.join(WHERE_KEYWORDS)}); "
                                 f"valid columns: {', '.join(columns)}")
        if not tok.isspace():
            out.append(tok)
    return " ".join(out)  # tokens apart: "--" or "/*" become two operators, never a comment


def filter_index(df: pd.DataFrame, where: str) -> pd.DataFrame:
    """Rows of an index matching a SQL condition (DuckDB; pandas.query when DuckDB is absent).

    Column names with dots or slashes may be written bare (``mismatch.magnitude > 0.5``) or
    double-quoted (``"val/accuracy" > 0.3``); ``where_sql`` lets only a predicate through.
    """
    sql = where_sql(where, [str(c) for c in df.columns])
    try:
        import duckdb
    except ImportError:
        expr = re.sub(r'"([^"]+)"', r"`\1`", sql)
        expr = re.sub(r"(?<![<>!=])=(?!=)", "==", expr).replace("<>", "!=")
        try:
            return df.query(expr).reset_index(drop=True)
        except Exception as e:
            raise UsageError(f"--where {where!r}: {one_line(e, with_type=True)}") from None
    con = duckdb.connect()
    try:
        con.register("runs", df)
        return con.execute(f"SELECT * FROM runs WHERE {sql}").df()
    except duckdb.Error as e:
        columns = f"; columns: {', '.join(df.columns)}" if isinstance(e, duckdb.BinderException) else ""
        raise UsageError(f"--where {where!r}: {str(e).splitlines()[0]}{columns}") from None
    finally:
        con.close()


LIST_COLUMNS = ("run_id", "condition", "state", "last_step", "peak_accuracy", "final_accuracy",
                "collapsed", "steps_to_collapse", "k3_kl_mean")


def default_columns(df: pd.DataFrame) -> list[str]:
    """What ``timlab runs`` shows by default: ids, status, the key summaries, and every config
    key whose value differs between runs (the swept keys)."""
    base = [c for c in LIST_COLUMNS if c in df.columns]
    config_cols = [c for c in df.columns if "." in c and c not in base and df[c].astype(str).nunique() > 1]
    return base[:4] + config_cols + base[4:]


RUNS_WIDTH = 120
"""``timlab runs`` wraps its table at this many characters (``--wide``: one line a run)."""
RULE_COLUMNS = ("collapsed", "steps_to_collapse")
"""Index columns whose values depend on the collapse rule: shown with the rule in the header."""


def compact_runs(df: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """The default ``timlab runs`` table with the columns that add no information left out, and
    a note for each: ``condition`` where every run_id starts with it, and ``state`` or
    ``last_step`` where every run has the same (``--wide`` shows them)."""
    dropped, notes = [], []
    if {"run_id", "condition"} <= set(df.columns) and all(
            str(r).startswith(f"{c}__") for r, c in zip(df["run_id"], df["condition"])):
        dropped.append("condition")
        notes.append("condition: the run_id before '__'")
    for col in ("state", "last_step"):
        if col in df.columns and len(df) > 1 and df[col].astype(str).nunique() == 1:
            dropped.append(col)
            value = df[col].iloc[0]
            notes.append(f"{col} {int(value) if isinstance(value, float) and value.is_integer() else value} in every run")
    return df.drop(columns=dropped), notes


def format_runs(df: pd.DataFrame, rule: str, *, wide: bool = False, width: int = RUNS_WIDTH) -> str:
    """The ``timlab runs`` table: the collapse columns headed with the rule that judged them
    (``collapsed[peak]``); wrapped at ``width`` characters with the run_id repeated at the left
    of each block, unless ``wide`` (one line a run, however long)."""
    shown = df.rename(columns={c: f"{c}[{rule}]" for c in RULE_COLUMNS})
    fmt = dict(float_format=lambda v: f"{v:.4g}", na_rep="-")
    if wide:
        return shown.to_string(index=False, **fmt)
    if "run_id" in shown.columns and len(shown.columns) > 1:
        shown = shown.set_index("run_id")
        shown.index = [str(v) for v in shown.index]  # left-aligned
        return shown.to_string(line_width=width, **fmt)
    return shown.to_string(index=False, line_width=width, **fmt)


def rejudge(index: pd.DataFrame, sweep_dir: str | Path, **rule) -> pd.DataFrame:
    """The index with ``collapsed`` and ``steps_to_collapse`` recomputed from each run's metrics
    under another collapse rule (``rule`` as ``collapse.run_summary`` takes it, e.g.
    ``rule="plateau"``); the sweep's own files are not changed."""
    out = index.copy()
    summaries = [run_summary(Path(sweep_dir) / str(d), **rule) for d in out["run_dir"]]
    out["collapsed"] = [bool(s["collapsed"]) for s in summaries]
    out["steps_to_collapse"] = [s["steps_to_collapse"] for s in summaries]
    return out


def query_index(sweep_dir: str | Path, *, where: str | None = None, columns: list[str] | None = None,
                sort: str | None = None, descending: bool = False, rule: dict | None = None) -> pd.DataFrame:
    """The index of a sweep, filtered (SQL ``where``), with chosen columns, sorted. ``rule``:
    judge collapses with these ``run_summary`` options (e.g. ``{"rule": "plateau"}``) instead of
    the verdicts stored in the index. A demo's folder stands for its sweep (``find_sweep_dir``)."""
    sweep_dir = find_sweep_dir(sweep_dir)
    df = read_index(sweep_dir)
    if rule:
        df = rejudge(df, sweep_dir, **rule)
    cols = list(columns) if columns else default_columns(df)
    unknown = [c for c in cols + ([sort] if sort else []) if c not in df.columns]
    if unknown:
        raise UsageError(f"unknown column {unknown[0]!r}; valid choices: {', '.join(df.columns)}")
    if where:
        df = filter_index(df, where)
    if sort:
        df = df.sort_values(sort, ascending=not descending, kind="stable")
    return df[cols].reset_index(drop=True)

