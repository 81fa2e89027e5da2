"""The recompute driver of a predictor study: re-run the start of committed runs, bit for bit, for
statistics their runs did not log.

Used by ``timlab --isa avx2 study recompute FILE`` (``timlab.cli``) for a ``kind: predictor`` study
file (``timlab.experiments.studies.predictor``). For each run of ``rerun_list`` not yet in the
recompute table, in one process:

1. its start (its config's ``model.path``, where the study registers it): the first time a start
   is needed and its folder is missing, its registered ``build``
   command lines run in this process; its model.safetensors must have the registered SHA-256;
2. the run: ``timlab train`` of the committed run's own config.yaml with ``run.steps`` set to
   ``rerun.last_step`` (a run's first N steps do not depend on ``run.steps``), in a scratch folder
   beside the table;
3. the repeat check: every column the committed run logged must equal the re-run's over steps 0
   to ``last_step`` bit for bit, wall-clock timings left out
   (``timlab.rundir.metrics_log.first_difference``); a value of the re-run's own last evaluation
   where the committed run made none is not compared. The result (``ok`` or where it first
   differs) is recorded, never raised: the analysis leaves a cell that does not repeat out;
4. its per-step candidate values (steps 0 to ``last_step``) are appended to the table, which is
   rewritten atomically (a scratch file renamed into place), and the scratch folder is removed.

So a kill loses at most the run in flight, and the same command resumes. Progress lines name each
run, its repeat check and its CPU time, never a candidate's value (the registration is blind until
the analysis).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import time
from pathlib import Path
from typing import Callable

import pandas as pd

from timlab.experiments.studies.predictor import PredictorStudy, SourceRun, StudyError, read_table, rerun_list

SCRATCH = ".recompute"
"""The scratch folder (beside the table) that holds the run in flight."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def ensure_start(st: PredictorStudy, path: str, *, run_command: Callable[[list[str]], int] | None = None,
                 say: Callable[[str], None] = print) -> None:
    """Rebuild the start ``path`` by its registered commands when its folder is missing, then check
    its SHA-256 (a one-line ``StudyError`` when it differs or cannot be built)."""
    start = next(s for s in st.starts if s.path == path)
    weights = Path(path) / "model.safetensors"
    if not weights.exists():
        if not start.build:
            raise StudyError(f"start {path} not found and the study registers no command that rebuilds it; "
                             "link or copy it there (SHA-256 of model.safetensors " f"{start.sha256[:8]}...)")
        if run_command is None:  # the CLI passes its own entry point (nothing below the CLI imports it)
            raise StudyError(f"start {path} not found; rebuild it with: " + "; ".join(f"timlab {x}" for x in start.build))
        for line in start.build:
            say(f"building start {path}: timlab {line}")
            t0 = time.process_time()
            rc = run_command(shlex.split(line))
            if rc != 0:
                raise StudyError(f"start {path}: `timlab {line}` exited with {rc}")
            say(f"  {time.process_time() - t0:.0f} CPU-s")
    got = sha256_file(weights)
    if got != start.sha256:
        raise StudyError(f"start {path}: model.safetensors SHA-256 {got[:12]}... is not the registered "
                         f"{start.sha256[:12]}...; its runs cannot repeat")


def rerun(st: PredictorStudy, r: SourceRun, scratch: Path, *, train=None) -> tuple[pd.DataFrame, str]:
    """Re-run steps 0 to ``st.last_step`` of ``r`` in ``scratch``; (its rows for the table, the repeat check)."""
    from timlab.config import resolve
    from timlab.metrics.harm import HARM_CANDIDATES
    from timlab.rundir import read_metrics
    from timlab.rundir.metrics_log import first_difference

    if train is None:
        from timlab.trainer.run import train
    if scratch.exists():
        shutil.rmtree(scratch)  # a run killed in flight starts over
    n = st.last_step
    cfg = resolve(r.path / "config.yaml", None, [f"run.steps={n}", f"run.checkpoint_every={n}", "run.keep_checkpoints=1",
                                                 "run.progress=false", "run.tensorboard=false"])
    train(cfg, scratch)
    new = read_metrics(scratch)
    old = read_metrics(r.path)
    old = old[old["step"] <= n].reset_index(drop=True)
    new = new[new["step"] <= n].reset_index(drop=True)
    check = new.copy()
    if len(old) == len(new) and len(old):
        last = old["step"] == n  # the re-run's own last evaluation, where the committed run made none
        for col in [c for c in old.columns if c in check.columns]:
            if old[col].dtype.kind == "f":
                check.loc[last & old[col].isna(), col] = float("nan")
    diff = first_difference(old, check)
    metrics = sorted({*HARM_CANDIDATES, *(c.metric for c in st.candidates)} & set(new.columns))
    rows = new[["step", *metrics]].copy()
    rows.insert(0, "run", r.run)
    rows.insert(0, "source", r.source)
    rows["repeat"] = "ok" if diff is None else diff
    return rows, ("ok" if diff is None else diff)


def _append(table: Path, rows: pd.DataFrame) -> None:
    old = read_table(table)
    out = rows if old is None else pd.concat([old, rows], ignore_index=True)
    table.parent.mkdir(parents=True, exist_ok=True)
    tmp = table.with_name(f".{table.name}.{os.getpid()}.tmp")
    out.to_parquet(tmp, index=False)
    os.replace(tmp, table)


def recompute(st: PredictorStudy, *, say: Callable[[str], None] = print, train=None,
              run_command: Callable[[list[str]], int] | None = None, limit: int | None = None) -> dict:
    """Re-run every planned run not yet in the table (at most ``limit`` of them); returns counts."""
    from timlab.machine import PIN_ENV

    if not st.frozen or st.frozen != st.hash:
        raise StudyError(f"study {st.name}: recompute needs a frozen registration (frozen: {st.hash} in the file, "
                         "committed before any re-run)" if not st.frozen else
                         f"study {st.name}: the registration changed after it was frozen "
                         f"(frozen {st.frozen[:12]}, now {st.hash[:12]})")
    if st.isa == "avx2" and not all(os.environ.get(k) == v for k, v in PIN_ENV.items()):
        raise StudyError(f"study {st.name}: its runs were made pinned to AVX2; run `timlab --isa avx2 study recompute ...`")
    table = Path(st.table)
    planned = rerun_list(st)
    have = read_table(table)
    done = set() if have is None else set(have["run"])
    todo = [r for r in planned if r.run not in done]
    say(f"study {st.name}: {len(planned)} re-runs of steps 0-{st.last_step}, {len(planned) - len(todo)} already in "
        f"{table}, {len(todo)} to run")
    from timlab.yaml_io import load_yaml

    registered = {s.path for s in st.starts}
    ready: set[str] = set()
    counts = {"ran": 0, "repeat": 0, "differ": 0}
    t_all = time.process_time()
    for i, r in enumerate(todo[:limit] if limit is not None else todo, 1):
        cfg = load_yaml((r.path / "config.yaml").read_text(encoding="utf-8"), str(r.path / "config.yaml"), StudyError)
        start = str((cfg.get("model") or {}).get("path") or "")
        if start in registered and start not in ready:
            ensure_start(st, start, run_command=run_command, say=say)
            ready.add(start)
        t0 = time.process_time()
        rows, check = rerun(st, r, table.parent / SCRATCH / r.run, train=train)
        _append(table, rows)
        shutil.rmtree(table.parent / SCRATCH / r.run, ignore_errors=True)
        counts["ran"] += 1
        counts["repeat" if check == "ok" else "differ"] += 1
        say(f"[{len(planned) - len(todo) + i}/{len(planned)}] {r.source} {r.run}: "
            f"{'repeats bit for bit' if check == 'ok' else 'DIFFERS: ' + check}; {time.process_time() - t0:.1f} CPU-s")
    shutil.rmtree(table.parent / SCRATCH, ignore_errors=True)
    say(f"study {st.name}: {counts['ran']} re-runs in {time.process_time() - t_all:.0f} CPU-s ({counts['repeat']} repeat, "
        f"{counts['differ']} differ); {len(planned) - len(todo) + counts['ran']} of {len(planned)} in {table}")
    return counts
