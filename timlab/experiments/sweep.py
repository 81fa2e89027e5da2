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
config (``config.resolve`` + ``trainer.run.validate``: unknown keys and names, bad values). An
existing run directory whose config.yaml differs from the spec's config is an error too.

Resuming. Rerunning a sweep on the same ``DIR`` skips runs whose status.json says finished,
diverged or guard_failed (outcomes, not failures); a run left running or failed with a
checkpoint is continued with ``train(..., resume=True)`` (bitwise equal to an uninterrupted
run); a partial run without a checkpoint is deleted and restarted.

Failures. A run that raises (other than a divergence, which is a collapse) is marked failed in
its status.json and the index, with its message; the other runs go on. Warm-start models are
pretrained once per distinct model/task config before the runs start, so parallel runs never
race to build the same cache entry.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import signal
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pandas as pd
import yaml

from timlab.config import Config, ConfigError, load_run_config, resolve
from timlab.errors import TimlabError, UsageError
from timlab.files import read_text
from timlab.experiments.collapse import SUMMARY_KEYS, run_summary
from timlab.trainer.rundir import DONE_STATES, FAILED, RunDir, RunDirBusyError

SPEC_KEYS = ("base", "conditions", "grid", "workers", "executor")
BASE_KEYS = ("preset", "config", "set")
CONDITION_KEYS = ("name", "set")
EXECUTORS = ("local", "ray")
SEED_KEY = "run.seed"
IGNORED_CONFIG_KEYS = ("run.progress", "run.tensorboard")
"""Keys that may differ between a run's config.yaml and the spec without making it a different run."""
INDEX_FILE = "index.parquet"

Progress = Callable[[str, int, int, dict], None]


class SweepError(TimlabError, ValueError):
    """A bad sweep spec or sweep directory; the message is one line."""


# ------------------------------------------------------------------------------- the spec
@dataclass(frozen=True)
class Condition:
    name: str
    set: dict = field(default_factory=dict)
    """Flat overrides, e.g. {"mismatch.magnitude": 2.0}."""


@dataclass(frozen=True)
class SweepSpec:
    preset: str | None = None
    config: str | None = None
    """Base config file (absolute, or relative to the working directory)."""
    set: dict = field(default_factory=dict)
    conditions: tuple[Condition, ...] = ()
    grid: dict = field(default_factory=dict)
    """Flat key -> non-empty list of values."""
    workers: int | None = None
    executor: str = "local"
    source: str = "<dict>"
    """Where the spec came from (for error messages)."""


@dataclass(frozen=True)
class RunSpec:
    run_id: str
    condition: str
    """Group label: the named condition plus its non-seed grid values."""
    overrides: dict
    """Flat overrides on top of preset and config file: base.set, condition.set and grid values."""
    config: Config
    spec_condition: str = "base"
    """The spec's named condition (``base`` when the spec has none)."""


def _check_keys(d: Any, allowed: tuple, where: str) -> dict:
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise SweepError(f"{where}: expected a mapping, got {type(d).__name__}")
    unknown = [k for k in d if k not in allowed]
    if unknown:
        raise SweepError(f"{where}: unknown key {unknown[0]!r}; valid choices: {', '.join(allowed)}")
    return d


def _check_flat(d: Any, where: str) -> dict:
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise SweepError(f"{where}: expected a mapping of section.key: value, got {type(d).__name__}")
    for k in d:
        if not isinstance(k, str) or "." not in k:
            raise SweepError(f"{where}: key {k!r} is not of the form section.key (e.g. optim.lr)")
    return dict(d)


def spec_from_dict(d: dict, *, root: str | Path = ".", source: str = "<dict>") -> SweepSpec:
    """Validate the structure of a spec mapping (configs are checked by ``expand``)."""
    where = source
    d = _check_keys(d, SPEC_KEYS, where)
    base = _check_keys(d.get("base"), BASE_KEYS, f"{where}: base")
    config = base.get("config")
    if config is not None:
        p = Path(config)
        config = str(p if p.is_absolute() else Path(root) / p)
        if not Path(config).exists():
            raise SweepError(f"{where}: base.config file not found: {config}")
    conds_raw = d.get("conditions")
    if conds_raw is not None and not isinstance(conds_raw, list):
        raise SweepError(f"{where}: conditions must be a list of {{name, set}} mappings")
    if conds_raw is not None and not conds_raw:
        raise SweepError(f"{where}: conditions is an empty list (leave it out for a single base condition)")
    conditions: list[Condition] = []
    for i, c in enumerate(conds_raw or []):
        c = _check_keys(c, CONDITION_KEYS, f"{where}: conditions[{i}]")
        name = c.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", name):
            raise SweepError(f"{where}: conditions[{i}]: name must be a string of letters, digits, _ . + - (got {name!r})")
        if any(name == o.name for o in conditions):
            raise SweepError(f"{where}: duplicate condition name {name!r}")
        conditions.append(Condition(name, _check_flat(c.get("set"), f"{where}: condition {name}: set")))
    grid = _check_flat(d.get("grid"), f"{where}: grid")
    for k, v in grid.items():
        if not isinstance(v, list):
            raise SweepError(f"{where}: grid {k}: expected a list of values, got {v!r}")
        if not v:
            raise SweepError(f"{where}: grid {k}: empty list of values (no runs)")
        if len({json.dumps(x, sort_keys=True, default=str) for x in v}) != len(v):
            raise SweepError(f"{where}: grid {k}: duplicate values in {v!r}")
        for c in conditions:
            if k in c.set:
                raise SweepError(f"{where}: {k} is set by both the grid and condition {c.name!r}")
    workers = d.get("workers")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise SweepError(f"{where}: workers must be an integer >= 1, got {workers!r}")
    executor = d.get("executor", "local")
    if executor not in EXECUTORS:
        raise SweepError(f"{where}: unknown executor {executor!r}; valid choices: {', '.join(EXECUTORS)}")
    preset = base.get("preset")
    return SweepSpec(preset=preset, config=config, set=_check_flat(base.get("set"), f"{where}: base.set"),
                     conditions=tuple(conditions), grid=grid, workers=workers, executor=executor, source=source)


def load_spec(path: str | Path) -> SweepSpec:
    """Read and structurally validate a sweep spec YAML file."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"sweep spec not found: {p}")
    try:
        d = yaml.safe_load(read_text(p, what="sweep spec")) or {}
    except yaml.YAMLError as e:
        raise SweepError(f"{p}: invalid YAML ({str(e).splitlines()[0]})") from None
    return spec_from_dict(d, root=p.parent, source=str(p))


# ------------------------------------------------------------------------------- expansion
def _nest(flat: dict, where: str) -> dict:
    """{"task.kwargs.max_len": 8} -> {"task": {"kwargs": {"max_len": 8}}}."""
    out: dict = {}
    for key, value in flat.items():
        parts = key.split(".")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise SweepError(f"{where}: {key} conflicts with another override of {p}")
        if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
            node[parts[-1]] = {**node[parts[-1]], **value}
        else:
            node[parts[-1]] = value
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        s = str(v).lower()
    elif isinstance(v, float):
        s = f"{v:g}"
    elif isinstance(v, (int, str)):
        s = str(v)
    else:
        s = json.dumps(v, sort_keys=True)
    return re.sub(r"[^A-Za-z0-9_.+-]+", "-", s).strip("-") or "x"


def _short_names(keys: list[str]) -> dict[str, str]:
    """Grid key -> label prefix: the last component, or the whole key where that is ambiguous."""
    last = [k.split(".")[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else k.replace(".", "-")) for k, s in zip(keys, last)}


def _hash(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:6]


def expand(spec: SweepSpec) -> list[RunSpec]:
    """Conditions x grid -> runs, each config resolved and validated (SweepError on the first bad one)."""
    from timlab.trainer.run import validate

    conditions = spec.conditions or (Condition("base", {}),)
    keys = list(spec.grid)
    short = _short_names(keys)
    runs: list[RunSpec] = []
    for cond in conditions:
        for values in itertools.product(*(spec.grid[k] for k in keys)):
            point = dict(zip(keys, values))
            overrides = {**spec.set, **cond.set, **point}
            label_parts = [cond.name] if spec.conditions or not point else []
            label_parts += [f"{short[k]}{_fmt(v)}" for k, v in point.items() if k != SEED_KEY]
            condition = "__".join(label_parts) or "base"
            seed = [f"seed{_fmt(point[SEED_KEY])}"] if SEED_KEY in point else []
            run_id = "__".join([condition, *seed, _hash(overrides)])
            where = f"{spec.source}: run {run_id}"
            try:
                cfg = resolve(spec.config, spec.preset, _nest(overrides, where))
                validate(cfg)
            except (ConfigError, ValueError) as e:
                msg = str(e).splitlines()[0].replace("--set: ", "")
                raise SweepError(f"{where}: {msg}") from None
            runs.append(RunSpec(run_id, condition, overrides, cfg, cond.name))
    if not runs:
        raise SweepError(f"{spec.source}: the spec expands to no runs")
    return runs


# ------------------------------------------------------------------------------- planning
def plan_run(run: RunSpec, run_dir: Path) -> str:
    """What a (re)run does with this run: fresh, skip, resume (from its newest usable checkpoint,
    or from step 0 when it has none) or restart (no config.yaml: timlab's files are cleared,
    any others are left alone).

    Raises SweepError when the directory holds a run of a different config.
    """
    rd = RunDir(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise SweepError(f"{run_dir} is a file, not a run directory; use another --out or move it")
    if not run_dir.exists() or not any(run_dir.iterdir()):
        return "fresh"
    if rd.config.exists():
        try:
            old = load_run_config(run_dir).to_flat_dict()
        except (ConfigError, ValueError, yaml.YAMLError) as e:
            raise SweepError(f"{run_dir}: unreadable config.yaml ({str(e).splitlines()[0]})") from None
        new = run.config.to_flat_dict()
        diff = [k for k in sorted(set(old) | set(new)) if k not in IGNORED_CONFIG_KEYS and old.get(k) != new.get(k)]
        if diff:
            k = diff[0]
            raise SweepError(f"{run_dir} holds a run with a different config ({k}: {old.get(k)!r} there, "
                             f"{new.get(k)!r} in the spec); use another --out or delete that run")
    if rd.state() in DONE_STATES:
        return "skip"
    return "resume" if rd.config.exists() else "restart"


# ------------------------------------------------------------------------------- workers
_EVENTS = None  # the worker's progress queue (set by _worker_init)


def _die_with_parent(parent: int) -> None:
    """End this worker when the sweep's process dies, even by kill -9: the kernel sends SIGKILL
    on the parent's exit (Linux prctl PR_SET_PDEATHSIG), and a thread polls the parent pid where
    that is not available (a re-parented worker sees another ppid)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="timlab-parent-watch", daemon=True).start()


def _worker_init(events=None, parent: int | None = None) -> None:
    """Runs once in each worker process: die with the sweep, one thread (tiny models), the
    progress queue."""
    global _EVENTS
    if parent is not None:
        _die_with_parent(parent)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    _EVENTS = events


def _emit(key: str):
    if _EVENTS is None:
        return None
    keys = ("train/reward_mean", "val/accuracy", "rollout_corr/k3_kl")

    def cb(phase: str, i: int, n: int, metrics: dict) -> None:
        small = {k: float(metrics[k]) for k in keys if k in metrics}
        try:
            _EVENTS.put_nowait((key, phase, int(i), int(n), small))
        except Exception:  # progress is best effort; never fail a run over it
            pass

    return cb


def _warm_job(cfg: Config) -> dict:
    """Build (or reuse) the cached SFT warm start of a config."""
    _worker_init(_EVENTS)
    from timlab.trainer.pretrain import ensure_warm_start, warm_start_dir

    cb = _emit(warm_start_dir(cfg).name)
    res = ensure_warm_start(cfg, progress=(lambda s, n, m: cb("pretrain", s, n, m)) if cb else None)
    return {"path": str(res.path), "cached": bool(res.cached)}


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _run_job(run_id: str, cfg: Config, run_dir: str, mode: str) -> dict:
    """Train one run in a worker; never raises for a run that fails (returns its state)."""
    _worker_init(_EVENTS)
    from timlab.trainer.run import NonFiniteError, ZeroMismatchViolation, train

    rd = RunDir(run_dir)
    try:
        if mode == "restart":
            with rd:
                rd.clear()  # only what timlab wrote; anything else in the folder stays
        train(cfg, rd.path, resume=mode == "resume", progress=_emit(run_id))
        return {"state": "finished", "message": ""}
    except (NonFiniteError, ZeroMismatchViolation) as e:  # an outcome (collapse / broken exactness)
        return {"state": rd.read_status().get("state", "diverged"), "message": _one_line(e)}
    except RunDirBusyError as e:  # another process owns the run: leave its status alone
        return {"state": FAILED, "message": _one_line(e)}
    except Exception as e:
        msg = _one_line(e)
        status = rd.read_status()
        if status.get("state") != FAILED:  # raised before the trainer could record it
            try:
                with rd:
                    rd.write_status(FAILED, step=status.get("step", 0), total_steps=cfg.run.steps, message=msg)
            except (TimlabError, OSError):
                pass  # the message still reaches the index
        return {"state": FAILED, "message": msg}


class _LocalExecutor:
    """A spawn-context process pool (kept across phases: workers import torch once); ``map``
    yields (key, result or exception) as calls finish, forwarding progress events meanwhile."""

    def __init__(self, workers: int, on_event):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.on_event = on_event
        self.events = ctx.Queue() if on_event is not None else None
        self.pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init,
                                        initargs=(self.events, os.getpid()))

    def _drain(self) -> None:
        while self.events is not None:
            try:
                ev = self.events.get_nowait()
            except Exception:  # queue.Empty
                return
            self.on_event(*ev)

    def map(self, calls: list[tuple[str, Callable, tuple]]) -> Iterator[tuple[str, Any]]:
        futures = {self.pool.submit(fn, *args): key for key, fn, args in calls}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            self._drain()
            for f in done:
                exc = f.exception()
                yield futures[f], (exc if exc is not None else f.result())
        self._drain()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.events is not None:
            self.events.close()
            self.events.join_thread()


def _require_ray():
    try:
        import ray
    except ImportError:
        raise SweepError("executor 'ray' needs the ray package: pip install 'timlab[ray]'") from None
    return ray


class _RayExecutor:
    """Ray tasks of one CPU each; per-step progress is not forwarded."""

    def __init__(self, workers: int, on_event):
        self.ray = _require_ray()
        if not self.ray.is_initialized():
            self.ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)

    def map(self, calls: list[tuple[str, Callable, tuple]]) -> Iterator[tuple[str, Any]]:
        ray = self.ray
        refs = {ray.remote(num_cpus=1)(fn).remote(*args): key for key, fn, args in calls}
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1)
            key = refs.pop(done[0])
            try:
                yield key, ray.get(done[0])
            except Exception as e:  # a task that died (the run functions themselves never raise)
                yield key, e

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------- the index
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
    tmp = out_dir / (INDEX_FILE + ".tmp")
    df.to_parquet(tmp, index=False)
    os.replace(tmp, out_dir / INDEX_FILE)  # atomic: readers never see a half-written index
    return df


def read_index(sweep_dir: str | Path) -> pd.DataFrame:
    """The sweep's index.parquet: one row per run (ids, condition, status, summary, flattened config).

    ``state`` and ``last_step`` are read live from each run's status.json, so a sweep that is
    running, or was killed, shows where its runs are rather than where they were at the last
    index write."""
    p = Path(sweep_dir) / INDEX_FILE
    if not p.exists():
        raise FileNotFoundError(f"{sweep_dir}: no {INDEX_FILE} (not a sweep directory; run `timlab sweep` first)")
    df = pd.read_parquet(p)
    if "run_dir" in df.columns and "state" in df.columns:
        for i, d in enumerate(df["run_dir"]):
            status = RunDir(Path(sweep_dir) / str(d)).read_status()
            if status.get("state"):
                df.loc[i, "state"] = status["state"]
            step, old = status.get("step"), df["last_step"].iloc[i] if "last_step" in df.columns else None
            if isinstance(step, int) and old is not None:
                df.loc[i, "last_step"] = step if pd.isna(old) else max(step, old)
    return df


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
    runs = expand(spec)
    out = Path(out_dir)
    plan = {r.run_id: plan_run(r, out / r.run_id) for r in runs}
    if executor == "ray":
        _require_ray()
    # ---- everything is checked; from here on directories get written
    out.mkdir(parents=True, exist_ok=True)
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

    def finish(run_id: str, state: str, message: str) -> None:
        nonlocal done
        done += 1
        if state == "failed":
            failed[run_id] = message
        rows[run_id] = _index_row(by_id[run_id], out)
        if state == "failed" and rows[run_id]["state"] != "failed":  # e.g. the worker died
            rows[run_id].update(state="failed", message=message)
        _write_index(out, list(rows.values()))
        if progress:
            progress("sweep", done, len(runs), {"run_id": run_id, "state": state, "message": message,
                                                "mode": plan[run_id]})

    if not todo:
        return _result(rows, plan, [], failed)
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
                    finish(r.run_id, "failed", f"warm start failed: {_one_line(res)}")
            else:
                ready.update(r.run_id for r in warm[key])
        # 2. the runs, in spec order
        calls = [(r.run_id, _run_job, (r.run_id, r.config, str(out / r.run_id), plan[r.run_id]))
                 for r in todo if r.run_id in ready]
        for run_id, res in pool.map(calls):
            if isinstance(res, BaseException):  # the worker process itself died
                finish(run_id, "failed", f"worker died: {_one_line(res)}")
            else:
                finish(run_id, res["state"], res["message"])
    finally:
        pool.close()
    return _result(rows, plan, [r.run_id for r in todo], failed)


def _result(rows: dict, plan: dict, executed: list, failed: dict) -> pd.DataFrame:
    df = _index_frame(list(rows.values()))
    df.attrs.update(plan=plan, executed=executed, failed=failed)
    return df


# ------------------------------------------------------------------------------- querying
def _quote_columns(where: str, columns: list[str]) -> str:
    """Double-quote column names with dots or slashes (``mismatch.magnitude > 0.5``) outside
    string literals and already-quoted names, so SQL does not read them as table.column."""
    special = sorted((c for c in columns if re.search(r"[^A-Za-z0-9_]", c)), key=len, reverse=True)
    if not special:
        return where
    pat = re.compile(r"(?<![\w.\"/])(" + "|".join(map(re.escape, special)) + r")(?![\w\"/])")
    parts = re.split(r"('(?:[^']|'')*'|\"(?:[^\"]|\"\")*\")", where)
    return "".join(p if i % 2 else pat.sub(lambda m: f'"{m.group(1)}"', p) for i, p in enumerate(parts))


def filter_index(df: pd.DataFrame, where: str) -> pd.DataFrame:
    """Rows of an index matching a SQL condition (DuckDB; pandas.query when DuckDB is absent).

    Column names with dots or slashes may be written bare (``mismatch.magnitude > 0.5``) or
    double-quoted (``"val/accuracy" > 0.3``).
    """
    sql = _quote_columns(where, list(df.columns))
    try:
        import duckdb
    except ImportError:
        expr = re.sub(r'"([^"]+)"', r"`\1`", sql)
        expr = re.sub(r"(?<![<>!=])=(?!=)", "==", expr).replace("<>", "!=")
        try:
            return df.query(expr).reset_index(drop=True)
        except Exception as e:
            raise UsageError(f"--where {where!r}: {_one_line(e)}") from None
    con = duckdb.connect()
    try:
        con.register("runs", df)
        return con.execute(f"SELECT * FROM runs WHERE {sql}").df()
    except duckdb.Error as e:
        raise UsageError(f"--where {where!r}: {str(e).splitlines()[0]}") from None
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


def query_index(sweep_dir: str | Path, *, where: str | None = None, columns: list[str] | None = None,
                sort: str | None = None, descending: bool = False) -> pd.DataFrame:
    """The index of a sweep, filtered (SQL ``where``), with chosen columns, sorted."""
    df = read_index(sweep_dir)
    cols = list(columns) if columns else default_columns(df)
    unknown = [c for c in cols + ([sort] if sort else []) if c not in df.columns]
    if unknown:
        raise UsageError(f"unknown column {unknown[0]!r}; valid choices: {', '.join(df.columns)}")
    if where:
        df = filter_index(df, where)
    if sort:
        df = df.sort_values(sort, ascending=not descending, kind="stable")
    return df[cols].reset_index(drop=True)


__all__ = ["SweepSpec", "Condition", "RunSpec", "SweepError", "load_spec", "spec_from_dict", "expand", "plan_run",
           "run_sweep", "read_index", "query_index", "filter_index", "default_columns", "INDEX_FILE"]
