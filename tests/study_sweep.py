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
