"""``timlab demo``: the VeXact experiment at small scale on a CPU, start to finish.

1. pretrain (cached) the ``demo`` preset's tiny model: SFT on string reversal with EOS;
2. sweep: zero mismatch vs injected mismatch at several magnitudes vs remedies, several seeds,
   in parallel worker processes (resumable: rerunning the command skips finished runs);
3. report: one self-contained HTML page with the curves, the dose-response plot and the tables.

The headline is a set of effects with intervals (``timlab.experiments.studies.effects``), not a count of
collapses: each dose against the zero-mismatch control, each dose against the next lower one
(the dose ordering), each remedy against the untreated largest dose, as differences of late and
final greedy accuracy with bootstrap intervals and exact permutation p. Collapses are counted
only as a secondary column, under the ``plateau`` rule (a fall from the learned level that lasts
two evaluations; never a single evaluation). Runs are bitwise repeatable on one machine, not
across CPU instruction sets (AVX2 vs AVX-512 kernels round differently), so the headline must
hold with margin, not at a threshold.

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


HEADLINE_RULE = "plateau"
"""The collapse rule of the demo's secondary collapse column (``collapse.RULES``)."""


def comparisons(quick: bool) -> list[tuple[str, str]]:
    """The headline's (condition, reference) pairs: each dose vs ``zero_mismatch``, each dose vs the
    next lower one, each remedy vs the untreated dose ``REMEDY_DOSE``."""
    names = [c["name"] for c in conditions(quick)]
    untreated = f"head_{REMEDY_DOSE:g}"
    doses = [n for n in names if n.startswith("head_") and "+" not in n]
    out = [(d, "zero_mismatch") for d in doses]
    out += list(zip(doses[1:], doses[:-1]))
    out += [(n, untreated) for n in names if n.startswith(untreated + "+")]
    return out


def summarize(runs_dir: str | Path, quick: bool) -> tuple["object", "object"]:
    """(effects, conditions) of a demo's sweep folder: ``effects.paired_table`` of ``comparisons``
    on late and final accuracy, and ``collapse.condition_table`` with collapses judged by
    ``HEADLINE_RULE``."""
    from timlab.experiments.studies.collapse import condition_table, run_summary
    from timlab.experiments.studies.effects import paired_table
    from timlab.experiments.sweeps.runner import read_index

    runs_dir = Path(runs_dir)
    index = read_index(runs_dir).reset_index(drop=True)
    judged = index.copy()
    for i, run in enumerate(index["run_dir"]):
        s = run_summary(runs_dir / run, rule=HEADLINE_RULE)
        judged.loc[i, "collapsed"], judged.loc[i, "steps_to_collapse"] = s["collapsed"], s["steps_to_collapse"]
    return paired_table(index, comparisons(quick)), condition_table(judged)


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
on an idle 2-core AVX-512 machine, 1643 s / 6750 steps on an idle 2-core AVX2 one, 1510 s
(user + system) / 6750 on a shared 2-core AVX2 EPYC under load (the full demo, warm SFT cache;
README). Load from other jobs can double the wall time, and add CPU time too (one AVX2 machine
under a load of ~3 measured 1939 s)."""
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
    from timlab.experiments.sweeps.spec import expand, spec_from_dict

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
    effects: "object"  # pandas DataFrame: effects.paired_table of the headline comparisons
    table: "object"  # pandas DataFrame of conditions, collapses under HEADLINE_RULE
    index: "object"
    machine: str
    """``timlab.machine.summary()`` of the process that ran the demo: which published table applies."""


SPEC_FILE = "sweep.yaml"
OUTPUTS = (SPEC_FILE, "runs", "report.html", "conditions.csv", "effects.csv")
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
    from timlab.experiments.reports.report import build_report
    from timlab.experiments.sweeps.runner import run_sweep
    from timlab.machine import REPEATS_NOTE, summary
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
    effects, table = summarize(out / "runs", quick)
    machine = summary()
    report = build_report(out / "runs", out / "report.html", rule=HEADLINE_RULE, effects=effects,
                          note=f"Computed with {machine}: {REPEATS_NOTE}.")
    table.to_csv(out / "conditions.csv")
    effects.to_csv(out / "effects.csv", index=False)
    return DemoResult(out, Path(report.path), effects, table, index, machine)


def conditions_view(table) -> "object":
    """The condition table as the demo prints it (secondary to the effects)."""
    import pandas as pd

    from timlab.experiments.reports.report import mean_pm_std as _pm

    return pd.DataFrame({
        "condition": table["condition"],
        "k3 KL": [f"{x:.3g}" for x in table["k3_kl_mean"]],
        "final accuracy": [_pm(m, s) for m, s in zip(table["final_accuracy_mean"], table["final_accuracy_std"])],
        "late accuracy": [_pm(m, s) for m, s in zip(table["late_accuracy_mean"], table["late_accuracy_std"])],
        f"collapsed ({HEADLINE_RULE} rule)": [
            f"{c}/{n}" + (f" (step {m:g})" if m == m else "")
            for c, n, m in zip(table["n_collapsed"], table["n"], table["median_steps_to_collapse"])],
    })


def format_summary(effects, table) -> str:
    """What ``timlab demo`` prints at the end: the headline effects with their legend, then the
    conditions (collapses counted under ``HEADLINE_RULE``, secondary)."""
    from timlab.experiments.studies.effects import HOLDS_NOTE, effects_view

    return "\n".join([
        "Headline: effects with intervals",
        effects_view(effects).to_string(index=False),
        HOLDS_NOTE,
        "",
        f"Conditions (mean +- std over seeds; collapses under the {HEADLINE_RULE} rule, a secondary reading)",
        conditions_view(table).to_string(index=False),
    ])
