"""Sweep specs: parsing and checking a spec (``load_spec``, ``spec_from_dict``), expanding it
into runs (``expand``: conditions x grid, each config resolved and validated, run ids and
condition labels) and planning what a (re)run does with each run directory (``plan_run``).

The spec format, run ids and the resume rules are described in ``timlab.experiments.sweeps.runner``,
which runs the sweep and re-exports these names.
"""

from __future__ import annotations

import itertools
import json
import re
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from timlab.config import Config, ConfigError, load_run_config, resolve, short_hash, validate
from timlab.errors import TimlabError
from timlab.files import read_text
from timlab.machine import ISAS
from timlab.rundir import DONE_STATES, RunDir
from timlab.yaml_io import load_yaml

SPEC_KEYS = ("base", "conditions", "grid", "workers", "executor", "isa")
MAX_RUNS = 10_000
"""Most runs one sweep may expand to (each is resolved and validated before anything runs)."""
BASE_KEYS = ("preset", "config", "set")
CONDITION_KEYS = ("name", "set")
EXECUTORS = ("local", "ray")
SEED_KEY = "run.seed"
IGNORED_CONFIG_KEYS = ("run.progress", "run.tensorboard")
"""Keys that may differ between a run's config.yaml and the spec without making it a different run."""


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
    isa: str = "native"
    """The CPU instruction set every run must compute with (``timlab.machine.ISAS``): ``avx2``
    keeps a sweep that spans machines from mixing instruction sets."""
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
    n_runs = max(1, len(conditions)) * math.prod(len(v) for v in grid.values())
    if n_runs > MAX_RUNS:
        raise SweepError(f"{where}: {n_runs} runs (conditions x grid); at most {MAX_RUNS} per sweep: split it")
    workers = d.get("workers")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise SweepError(f"{where}: workers must be an integer >= 1, got {workers!r}")
    executor = d.get("executor", "local")
    if executor not in EXECUTORS:
        raise SweepError(f"{where}: unknown executor {executor!r}; valid choices: {', '.join(EXECUTORS)}")
    isa = d.get("isa", "native")
    if isa not in ISAS:
        raise SweepError(f"{where}: isa {isa!r}; valid choices: {', '.join(ISAS)}")
    if isa != "native" and executor != "local":
        raise SweepError(f"{where}: isa {isa} needs the local executor (remote workers do not inherit this "
                         "process's environment)")
    preset = base.get("preset")
    return SweepSpec(preset=preset, config=config, set=_check_flat(base.get("set"), f"{where}: base.set"),
                     conditions=tuple(conditions), grid=grid, workers=workers, executor=executor, isa=isa,
                     source=source)


def load_spec(path: str | Path) -> SweepSpec:
    """Read and structurally validate a sweep spec YAML file."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"sweep spec not found: {p}")
    d = load_yaml(read_text(p, what="sweep spec"), str(p), SweepError) or {}
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


def expand(spec: SweepSpec) -> list[RunSpec]:
    """Conditions x grid -> runs, each config resolved and validated (SweepError on the first bad one)."""
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
            run_id = "__".join([condition, *seed, short_hash(overrides, 6)])
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
        except (ConfigError, ValueError) as e:
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
