"""``timlab demo``: the VeXact experiment at small scale on a CPU, start to finish.

1. pretrain (cached) the ``demo`` preset's tiny model: SFT on string reversal with EOS;
2. sweep: zero mismatch vs injected mismatch at several magnitudes vs remedies, several seeds,
   in parallel worker processes (resumable: rerunning the command skips finished runs);
3. report: one self-contained HTML page with the curves, the dose-response plot and the table.

The injected mismatch is ``head_perturb`` (a fixed random perturbation of the rollout's output
head): a persistent, biased TIM, the kind pilot runs found can collapse a tiny model
(zero-mean fresh noise mostly does not; docs/claims.md). Remedies are applied at the largest magnitude: token
TIS (C = 2), sequence MIS (C = 2), the length-decay LR in automatic mode, a fixed-period
length-decay LR, and a 10x lower constant LR. The zero-mismatch control runs in exact mode,
where the trainer's log-probs equal the rollout's bit for bit every step (the guard checks).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

from timlab.config import PRESETS
from timlab.errors import TimlabError, UsageError
from timlab.files import atomic_write_text, read_text
from timlab.yaml_io import load_yaml

DOSES = (0.5, 1.0, 2.0)
SEEDS = 5
"""Seeds per condition (the full demo; each run is the ``demo`` preset's ``run.steps`` long)."""
QUICK_SEEDS, QUICK_STEPS = 2, 60
"""Seeds per condition and RL steps per run of ``--quick``."""
REMEDY_DOSE = 2.0


def conditions(quick: bool) -> list[dict]:
    lr = PRESETS["demo"]["optim"]["lr"]
    head = lambda m: {"mismatch.injector": "head_perturb", "mismatch.magnitude": m}  # noqa: E731
    hi = head(REMEDY_DOSE)
    out = [{"name": "zero_mismatch", "set": {"mismatch.injector": "none"}}]
    doses = (REMEDY_DOSE,) if quick else DOSES
    out += [{"name": f"head_{m:g}", "set": head(m)} for m in doses]
    out += [{"name": f"head_{REMEDY_DOSE:g}+token_tis", "set": {**hi, "correction.level": "token", "correction.mode": "truncate", "correction.threshold": 2.0}}]
    if not quick:
        out += [
            {"name": f"head_{REMEDY_DOSE:g}+seq_mis", "set": {**hi, "correction.level": "sequence", "correction.mode": "mask", "correction.threshold": 2.0}},
            {"name": f"head_{REMEDY_DOSE:g}+length_decay_auto", "set": {**hi, "scheduler.name": "length_decay", "scheduler.decay_period": 0}},
            {"name": f"head_{REMEDY_DOSE:g}+length_decay_P30", "set": {**hi, "scheduler.name": "length_decay", "scheduler.decay_period": 30}},
        ]
    out += [{"name": f"head_{REMEDY_DOSE:g}+lr_div10", "set": {**hi, "optim.lr": lr / 10}}]
    return out


CPU_SECONDS_PER_STEP = (0.12, 0.25)
"""CPU seconds per RL step of a demo run, evaluations and start-up included: 805 s / 6750 steps
on an idle 2-core AVX-512 machine, 1643 s / 6750 steps on an idle 2-core AVX2 one (the full
demo, warm SFT cache). Load from other jobs can double the wall time."""
SFT_SECONDS = 60
"""The demo preset's SFT warm start on one core (45-60 s), paid once: it is cached."""


def check_settings(*, seeds: int | None = None, steps: int | None = None, workers: int | None = None) -> None:
    """One-line UsageError for a count below 1 (None means: the default)."""
    for name, value in (("seeds", seeds), ("steps", steps), ("workers", workers)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UsageError(f"--{name} must be an integer >= 1, got {value!r}")


def estimate_seconds(*, quick: bool = False, seeds: int | None = None, steps: int | None = None,
                     workers: int | None = None) -> tuple[int, int, float]:
    """(runs, steps per run, [low, high] wall seconds without the SFT warm start) of a demo
    with these settings, from ``CPU_SECONDS_PER_STEP``; workers default to the cores."""
    import os

    check_settings(seeds=seeds, steps=steps, workers=workers)
    spec = demo_spec(quick=quick, seeds=seeds, steps=steps)
    n_runs = len(spec["conditions"]) * len(spec["grid"]["run.seed"])
    n_steps = spec["base"]["set"].get("run.steps", PRESETS["demo"]["run"]["steps"])
    parallel = min(workers or os.cpu_count() or 1, n_runs)
    return n_runs, n_steps, tuple(n_runs * n_steps * c / parallel for c in CPU_SECONDS_PER_STEP)


def demo_spec(*, quick: bool, seeds: int | None = None, steps: int | None = None, workers: int | None = None) -> dict:
    n_seeds = seeds if seeds is not None else (QUICK_SEEDS if quick else SEEDS)
    base_set = {}
    if quick or steps is not None:
        base_set["run.steps"] = steps if steps is not None else QUICK_STEPS
    spec = {
        "base": {"preset": "demo", "set": base_set},
        "conditions": conditions(quick),
        "grid": {"run.seed": list(range(n_seeds))},
    }
    if workers:
        spec["workers"] = workers
    return spec


def check_demo_args(out: Path, spec: dict, *, seeds: int | None, steps: int | None, workers: int | None) -> Path:
    """Refuse bad arguments before the demo writes anything (one line each); return the spec's
    path. ``out/sweep.yaml`` may only be a demo spec timlab wrote (it is replaced)."""
    from timlab.experiments.sweep_spec import expand, spec_from_dict

    check_settings(seeds=seeds, steps=steps, workers=workers)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; choose a folder")
    expand(spec_from_dict(spec))  # every run's config resolves and validates
    spec_path = out / "sweep.yaml"
    if spec_path.exists() or spec_path.is_symlink():
        try:
            old = load_yaml(read_text(spec_path, what="demo spec"), str(spec_path)) if spec_path.is_file() else None
        except TimlabError:
            old = None
        if spec_path.is_symlink() or not (isinstance(old, dict) and isinstance(old.get("base"), dict)
                                          and old["base"].get("preset") == "demo"):
            raise UsageError(f"{spec_path} is not a demo spec timlab wrote; timlab leaves it alone: "
                             "choose another --out or move that file")
    return spec_path


@dataclass
class DemoResult:
    out_dir: Path
    report: Path
    table: "object"  # pandas DataFrame of conditions
    index: "object"


SPEC_FILE = "sweep.yaml"
OUTPUTS = (SPEC_FILE, "runs", "report.html", "conditions.csv")
"""What a demo writes in its folder (``force`` deletes these and nothing else)."""


def _claim_folder(out: Path, spec: dict, *, force: bool) -> None:
    """Refuse a folder that holds a demo with other settings (its runs would mix with this
    one's in one index and report) unless ``force``, which deletes that demo's outputs."""
    import shutil

    spec_path = out / SPEC_FILE
    if not spec_path.is_file():
        return
    old = load_yaml(read_text(spec_path, what="demo spec"), str(spec_path)) or {}
    if {k: v for k, v in old.items() if k != "workers"} == {k: v for k, v in spec.items() if k != "workers"}:
        return  # the same demo: continue it (finished runs are skipped)
    if not force:
        raise UsageError(f"{out} holds a demo with other settings ({_describe(old)}; now {_describe(spec)}); "
                         "choose another --out, or pass --force to delete it and start over")
    for name in OUTPUTS:
        path = out / name
        if path.is_symlink() or path.is_file():
            path.unlink()  # a link is removed, never followed
        elif path.is_dir():
            shutil.rmtree(path)


def _describe(spec: dict) -> str:
    seeds = len(spec.get("grid", {}).get("run.seed", []))
    steps = (spec.get("base", {}).get("set") or {}).get("run.steps", PRESETS["demo"]["run"]["steps"])
    return f"{len(spec.get('conditions', []))} conditions x {seeds} seeds, {steps} steps"


def run_demo(out_dir: str | Path = "demo_out", *, quick: bool = False, seeds: int | None = None, steps: int | None = None,
             workers: int | None = None, force: bool = False, progress: Callable | None = None) -> DemoResult:
    """Pretrain, sweep and report into ``out_dir``. Rerunning with the same settings continues
    (finished runs are skipped); a folder holding a demo with other settings is refused unless
    ``force`` (which deletes that demo's outputs)."""
    from timlab.config import resolve
    from timlab.experiments.collapse import condition_table
    from timlab.experiments.report import build_report
    from timlab.experiments.sweep import run_sweep
    from timlab.trainer.pretrain import pretrain

    out = Path(out_dir)
    spec = demo_spec(quick=quick, seeds=seeds, steps=steps, workers=workers)
    spec_path = check_demo_args(out, spec, seeds=seeds, steps=steps, workers=workers)
    _claim_folder(out, spec, force=force)
    # ---- everything is checked; from here on files get written
    out.mkdir(parents=True, exist_ok=True)
    pretrain(resolve(preset="demo"), progress=(lambda s, n, m: progress("pretrain", s, n, m)) if progress else None)
    atomic_write_text(spec_path, yaml.safe_dump(spec, sort_keys=False))
    index = run_sweep(spec_path, out / "runs", workers=workers, progress=progress)
    report = build_report(out / "runs", out / "report.html")
    table = condition_table(index)
    table.to_csv(out / "conditions.csv")
    return DemoResult(out, Path(report.path), table, index)
