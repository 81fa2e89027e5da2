"""One writer of synthetic study sweeps for the analysis tests: run directories as the trainer
leaves them (metrics.parquet cut at the run's last step, status.json through ``RunDir``) under the
sweep's index.parquet, whose states the analyses read live from each status.json."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pandas as pd

from timlab.findings import block_file
from timlab.rundir import RunDir


def write_sweep(root: Path, names: list[str], metrics: Callable[[str], pd.DataFrame], steps: int, *,
                states: dict | None = None, run_ids: dict | None = None) -> Path:
    """A sweep directory at ``root`` holding the runs ``names`` (``metrics(name)``: the run's full
    table), each finished at ``steps`` unless ``states`` says otherwise (name -> (state, last step));
    ``run_ids``: name -> run directory (default ``<name>__abc123``; a study file's runs need the ids
    their spec expands to)."""
    rows = []
    for name in names:
        state, last = (states or {}).get(name, ("finished", steps))
        rd = RunDir(Path(root) / (run_ids or {}).get(name, f"{name}__abc123"))
        rd.path.mkdir(parents=True)
        m = metrics(name)
        m[m["step"] <= last].to_parquet(rd.metrics_file, index=False)
        rd.write_status(state, step=last, total_steps=steps)
        rows.append({"run_id": rd.path.name, "run_dir": rd.path.name, "spec_condition": name, "condition": name,
                     "state": "running", "last_step": 0})
    pd.DataFrame(rows).to_parquet(Path(root) / "index.parquet", index=False)
    return Path(root)


def planted_run(rng, *, control: bool, steps: int, ev, acc, gold, k3: float, magnitude: float,
                length: float) -> pd.DataFrame:
    """A planted run's metrics table: the evaluations ``acc`` and ``gold`` at steps ``ev``, and per
    training step 1..``steps`` the guard's columns (k3 exactly 0 and every token equal for a
    ``control``; else k3 ``k3`` x lognormal noise, sd 0.3), the magnitude and the response length
    (``length`` + noise sd 0.5); ``rng`` draws k3's noise, then the length's."""
    import numpy as np

    t = np.arange(1, steps + 1)
    train = pd.DataFrame({"step": t, "rollout_corr/k3_kl": 0.0 if control else k3 * np.exp(rng.normal(0, .3, t.size)),
                          "mismatch/frac_bitwise_equal": 1.0 if control else 0.3,
                          "mismatch/magnitude": 0.0 if control else magnitude,
                          "train/response_length_mean": length + rng.normal(0, 0.5, t.size)})
    m = pd.DataFrame({"step": ev, "val/accuracy": acc, "val/gold_logprob": gold}).merge(train, on="step", how="outer")
    return m.sort_values("step")[["step"] + sorted(c for c in m.columns if c != "step")]


def planted_levels(arms: list[str], costs: dict[str, float], seed_sd: float, *, level: float, start: tuple[float, float],
                   k3: float, magnitude: float, steps: int = 150):
    """``metrics(name)`` for a sweep of ``steps``-step runs named ``<arm>_s<seed>``: accuracy ``level``
    (a seed offset of sd ``seed_sd``, evaluation noise sd 3e-3, every 10 steps) minus the arm's
    planted cost from step 20 on; gold log-prob -0.10 minus 5x that; step 0's evaluation ``start``
    (accuracy, gold log-prob) in every run; k3 ``k3`` for every arm but the control."""
    import numpy as np

    def metrics(name: str) -> pd.DataFrame:
        arm, seed = name.rsplit("_s", 1)
        rng = np.random.default_rng([arms.index(arm), int(seed)])
        ev = np.arange(0, steps + 1, 10)
        cost = costs.get(arm, 0.0) * (ev >= 20)
        acc = level + rng.normal(0, seed_sd) + rng.normal(0, 3e-3, ev.size) - cost
        gold = -0.10 + rng.normal(0, 1e-3, ev.size) - 5 * cost
        acc[0], gold[0] = start
        return planted_run(rng, control=arm == "control", steps=steps, ev=ev, acc=acc, gold=gold, k3=k3,
                           magnitude=magnitude, length=23.0)
    return metrics


def analyzed(study, root: Path, metrics: Callable[[str], pd.DataFrame], names: list[str] | None = None):
    """Freeze ``study`` in ``root``, write the runs ``names`` (default: every planned run) from
    ``metrics`` as finished, and return its analysis."""
    from timlab.experiments.studies.engine import analyze, planned_runs

    from timlab.experiments.studies.registration import freeze

    ids = {p.name: p.run_id for p in planned_runs(study)}
    out = Path(root) / study.out
    freeze(study, out)
    write_sweep(out, list(ids) if names is None else names, metrics, study.steps, run_ids=ids)
    return analyze(study, root=root)


def write_blocks(study, root: Path, metrics: Callable[[str], pd.DataFrame], names: list[str] | None = None) -> dict:
    """A blocked study's sweep (``Study.blocks``): each block's directory under ``root`` frozen, and
    the runs ``names`` (default: every planned run) written into their own block's directory as
    finished; returns {block: its directory}."""
    from timlab.experiments.studies.engine import planned_runs
    from timlab.experiments.studies.registration import freeze
    from timlab.experiments.studies.blocks import block_dirs

    planned = planned_runs(study)
    dirs = block_dirs(study, None, root)
    for b, d in dirs.items():
        freeze(study, d)
        mine = [p for p in planned if p.block == b and (names is None or p.name in names)]
        if mine:
            write_sweep(d, [p.name for p in mine], metrics, study.steps, run_ids={p.name: p.run_id for p in mine})
    return dirs


def assert_registered_in_findings(study, heading: str) -> None:
    """The findings page that holds the study's generated block (``timlab.findings.block_file``) has
    the section "# <heading>: ..." (its title, up to the page's first "## " heading), which names the
    study's registration hash and holds the block."""
    text = block_file(study.findings[0], study.findings[1]).read_text()
    assert text.startswith(f"# {heading}:"), text[:80]
    end = text.find("\n## ")
    section = text if end < 0 else text[:end]
    assert study.hash in section
    assert f"<!-- findings:{study.findings[1]} -->" in section