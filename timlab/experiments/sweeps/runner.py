"""Sweeps: a YAML spec expanded into runs, executed in parallel worker processes, resumable,
with every run's config and summary in one table, ``DIR/index.parquet``.

Spec format (every key optional; unknown keys are errors)::

    base:                        # applied to every run
      preset: smoke              # a timlab preset (config.PRESETS)
      config: base.yaml          # a config file, relative to the spec file
      set: {optim.lr: 3e-4}      # flat "section.key" overrides
    conditions:                  # named conditions, each a flat set of overrides
      - {name: control, set: {mismatch.injector: none}}
      - {name: head_2, set: {mismatch.injector: head_perturb, mismatch.magnitude: 2.0}}
    grid:                        # cartesian grid of flat keys, crossed with the conditions
      run.seed: [0, 1, 2]
    workers: 2                   # parallel runs (default: the number of cores)
    executor: local              # local (process pool) or ray
    isa: avx2                    # optional: refuse to run unless the process computes with AVX2 bits

Overrides apply in the order defaults < preset < config file < base.set < condition.set <
grid. A key may not be set by both a condition and the grid. Conditions may be left out (one
implicit condition, ``base``); a grid with no conditions crosses the base config alone.

Runs and ids. ``run.seed`` is the replicate axis; every other grid key defines conditions. A
run's ``condition`` (the label the collapse tables and the report group by) is the condition's
name followed by its non-seed grid values, e.g. ``head_2__magnitude2``; its ``run_id`` appends
``seed<k>`` and a 6-character hash of the run's overrides: ``head_2__magnitude2__seed0__3fa2c1``.
Each run lives in ``DIR/<run_id>/`` (a normal ``timlab train`` run directory).

Checked before anything runs (one-line ``SweepError``): unknown spec keys, a grid key with an
empty list, duplicate condition names or grid values, no runs at all, and every resolved
config (``config.resolve`` + ``config.validate``: unknown keys and names, bad values). An
existing run directory whose config.yaml differs from the spec's config is an error too.

Resuming. Rerunning a sweep on the same ``DIR`` skips runs whose status.json says finished,
diverged or guard_failed (outcomes, not failures); a run left running or failed with a
checkpoint is continued with ``train(..., resume=True)`` (bitwise equal to an uninterrupted
run); a partial run without a checkpoint is deleted and restarted.

Instruction sets. The first sweep that runs anything in ``DIR`` records the bits it computes
with (``machine.bits()``: ``avx2``, ``avx2-intel``, or the CPU capability such as ``AVX512``; and
``machine.fingerprint()``) in ``DIR/sweep_isa.json``; a later sweep into ``DIR`` that would compute
other bits is refused (one line naming both), as a second writer is, so one folder never holds
runs of two instruction sets.

Failures. A run that raises (other than a divergence, which is a collapse) is marked failed in
its status.json and the index, with its message; the other runs go on. Warm-start models are
pretrained once per distinct model/task config before the runs start, so parallel runs never
race to build the same cache entry.

Where the code lives: the spec, its expansion into runs and the resume plan in
``timlab.experiments.sweeps.spec``; the worker jobs and the local / ray executors in
``timlab.experiments.sweeps.workers``; the index and its SQL queries in
``timlab.experiments.sweeps.index``. This module runs a sweep and re-exports their public names.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pandas as pd

from timlab.errors import one_line
from timlab.files import atomic_write_text, held_folder_lock
from timlab.machine import bits as machine_bits, computes_as, describe as describe_machine
from timlab.experiments.sweeps.index import (  # noqa: F401  (the public names are re-exported: __all__)
    INDEX_FILE, _index_frame, _index_row, _write_index, default_columns, filter_index, query_index, read_index)
from timlab.experiments.sweeps.spec import (  # noqa: F401  (the public names are re-exported: __all__)
    EXECUTORS, Condition, RunSpec, SweepError, SweepSpec, expand, load_spec, plan_run, spec_from_dict)
from timlab.experiments.sweeps.workers import _LocalExecutor, _RayExecutor, _require_ray, _run_job, _warm_job
from timlab.progress import Progress

INDEX_EVERY_S = 2.0
"""The index is rewritten as runs finish at most this often (and when the sweep ends): once per
run would make a sweep of n runs write n tables of up to n rows."""
LOCK_FILE = "sweep.lock"
"""Held by the sweep writing a directory: a second sweep into it is refused (it would mark the
first one's runs failed and overwrite its index)."""
ISA_FILE = "sweep_isa.json"
"""The instruction set a sweep directory's runs compute with (``machine.bits()``), written by the
first sweep that runs anything in it: a sweep that would compute other bits is refused."""


def _check_isa(out: Path) -> None:
    """Refuse (one line) a sweep into ``out`` that computes other bits than its runs so far; record
    them on the first sweep. Called under the sweep's lock. A record names ``machine.bits()`` and,
    since the pin learned about Intel's MKL, ``machine.fingerprint()``; both must match (an older
    record without a fingerprint is checked by its name alone)."""
    here = machine_bits()
    described = describe_machine()
    record = out / ISA_FILE
    if not record.exists():
        atomic_write_text(record, json.dumps({"isa": here, **described}, indent=1) + "\n")
        return
    try:
        saved = json.loads(record.read_text(encoding="utf-8"))
        recorded, recorded_fp = saved["isa"], saved.get("fingerprint")
        if not isinstance(recorded, str) or not isinstance(recorded_fp, (str, type(None))):
            raise TypeError("isa is not text")
    except (OSError, ValueError, KeyError, TypeError):
        raise SweepError(f"{record} is unreadable; it names the instruction set of the runs in {out}: restore it, "
                         "or choose a new --out") from None
    if recorded != here:
        how = {"avx2": "continue it as `timlab --isa avx2 sweep ...` on a machine whose CPU is not Intel's",
               "avx2-intel": "continue it as `timlab --isa avx2 sweep ...` on an Intel machine"}.get(
            recorded, f"continue it on a machine that computes with {recorded}, unpinned")
        raise SweepError(f"sweep directory {out} holds runs computed with {recorded} ({ISA_FILE}), but this process "
                         f"computes with {here}: one folder never mixes instruction sets; {how}, or choose a new --out")
    if recorded_fp is not None and recorded_fp != described["fingerprint"]:
        raise SweepError(f"sweep directory {out} holds runs whose machine has fingerprint {recorded_fp} ({ISA_FILE}), "
                         f"but this process computes {described['fingerprint']} ({here}, torch {described['torch']}): "
                         "the same operations round differently here; continue it where `python -c 'from timlab "
                         f"import machine; print(machine.fingerprint())'` prints {recorded_fp}, or choose a new --out")


# ------------------------------------------------------------------------------- the sweep
def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def run_sweep(spec_or_path: SweepSpec | str | Path | dict, out_dir: str | Path, *, workers: int | None = None,
              executor: str | None = None, progress: Progress | None = None) -> pd.DataFrame:
    """Run (or continue) a sweep into ``out_dir``; return its index.

    ``progress(phase, i, n, info)`` gets ``("sweep", runs_done, runs_total, {run_id, state,
    message, mode})`` after each run and ``("train:<run_id>", step, steps, metrics)`` /
    ``("pretrain:<name>", ...)`` per step (local executor). The returned frame's ``attrs`` hold
    ``plan`` ({run_id: fresh|resume|restart|skip}), ``executed`` and ``failed`` ({run_id: message}).
    """
    if isinstance(spec_or_path, SweepSpec):
        spec = spec_or_path
    elif isinstance(spec_or_path, dict):
        spec = spec_from_dict(spec_or_path)
    else:
        spec = load_spec(spec_or_path)
    executor = executor or spec.executor
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise SweepError(f"--workers must be an integer >= 1, got {workers!r}")
    if executor not in EXECUTORS:
        raise SweepError(f"unknown executor {executor!r}; valid choices: {', '.join(EXECUTORS)}")
    if not computes_as(spec.isa):
        here = describe_machine()
        if here["pinned_avx2"]:  # pinned, and torch still cannot dispatch AVX2: no pin can help here
            raise SweepError(f"{spec.source}: isa {spec.isa}, but this CPU computes with {here['cpu_capability']} "
                             "even pinned: the spec's bits need an x86 CPU with AVX2")
        raise SweepError(f"{spec.source}: isa {spec.isa}, but this process computes with "
                         f"{here['cpu_capability']}: run it as `timlab --isa {spec.isa} sweep ...`")
    runs = expand(spec)
    out = Path(out_dir)
    plan = {r.run_id: plan_run(r, out / r.run_id) for r in runs}
    if executor == "ray":
        _require_ray()
    # ---- everything is checked; from here on directories get written
    out.mkdir(parents=True, exist_ok=True)
    busy = lambda holder: SweepError(f"sweep directory {out} is in use by process {holder} (another timlab sweep); "  # noqa: E731
                                     "wait for it or stop it")
    with held_folder_lock(out, LOCK_FILE, busy=busy):
        rows = {r.run_id: _index_row(r, out) for r in runs}
        _write_index(out, list(rows.values()))

        todo = [r for r in runs if plan[r.run_id] != "skip"]
        n_workers = max(1, min(workers or spec.workers or _cpu_count(), len(todo) or 1))
        on_event = (lambda key, phase, i, n, m: progress(f"{phase}:{key}", i, n, {"run_id": key, **m})) if progress else None
        done = len(runs) - len(todo)
        if progress:
            progress("sweep", done, len(runs), {})
        failed: dict[str, str] = {}
        by_id = {r.run_id: r for r in runs}

        written = [time.monotonic()]

        def finish(run_id: str, state: str, message: str) -> None:
            nonlocal done
            done += 1
            if state == "failed":
                failed[run_id] = message
            rows[run_id] = _index_row(by_id[run_id], out)
            if state == "failed" and rows[run_id]["state"] != "failed":  # e.g. the worker died
                rows[run_id].update(state="failed", message=message)
            if time.monotonic() - written[0] >= INDEX_EVERY_S:
                _write_index(out, list(rows.values()))
                written[0] = time.monotonic()
            if progress:
                progress("sweep", done, len(runs), {"run_id": run_id, "state": state, "message": message,
                                                    "mode": plan[run_id]})

        if not todo:
            return _result(rows, plan, [], failed)
        _check_isa(out)
        pool = (_RayExecutor if executor == "ray" else _LocalExecutor)(n_workers, on_event)
        try:
            # 1. warm starts, one per distinct model/task config, so parallel runs never race to build one
            from timlab.trainer.pretrain import warm_start_dir

            warm: dict[str, list[RunSpec]] = {}
            for r in todo:
                if not r.config.model.path:
                    warm.setdefault(str(warm_start_dir(r.config)), []).append(r)
            ready = {r.run_id for r in todo if r.config.model.path}
            for key, res in pool.map([(k, _warm_job, (rs[0].config,)) for k, rs in warm.items()]):
                if isinstance(res, BaseException):
                    for r in warm[key]:
                        finish(r.run_id, "failed", f"warm start failed: {one_line(res, with_type=True)}")
                else:
                    ready.update(r.run_id for r in warm[key])
            # 2. the runs, in spec order
            calls = [(r.run_id, _run_job, (r.run_id, r.config, str(out / r.run_id), plan[r.run_id]))
                     for r in todo if r.run_id in ready]
            for run_id, res in pool.map(calls):
                if isinstance(res, BaseException):  # the worker process itself died
                    finish(run_id, "failed", f"worker died: {one_line(res, with_type=True)}")
                else:
                    finish(run_id, res["state"], res["message"])
        except BaseException:  # Ctrl-C, SIGTERM: the queued runs must not start
            pool.interrupt()
            raise
        finally:
            pool.close()
            _write_index(out, list(rows.values()))  # the runs finished since the last write
        return _result(rows, plan, [r.run_id for r in todo], failed)


def _result(rows: dict, plan: dict, executed: list, failed: dict) -> pd.DataFrame:
    df = _index_frame(list(rows.values()))
    df.attrs.update(plan=plan, executed=executed, failed=failed)
    return df


__all__ = ["SweepSpec", "Condition", "RunSpec", "SweepError", "load_spec", "spec_from_dict", "expand", "plan_run",
           "run_sweep", "read_index", "query_index", "filter_index", "default_columns", "INDEX_FILE", "ISA_FILE"]
