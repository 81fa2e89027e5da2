"""One writer of synthetic study sweeps for the analysis tests: run directories as the trainer
leaves them (metrics.parquet cut at the run's last step, status.json through ``RunDir``) under the
sweep's index.parquet, whose states the analyses read live from each status.json."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pandas as pd

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
