"""Study H2's pilot (docs/findings, "Study H2"): its kinds of mismatch and their pilot doses, each
kind's pilot cost and the study doses the registered rule (``timlab.experiments.studies.oos.pilot_doses``)
chose from it (block harm2-pilot). ``python scripts/harm2_sweeps.py`` writes the sweep files from these.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from timlab.experiments.studies.findings_blocks.common import ROOT
from timlab.experiments.studies.oos import pilot_doses

KINDS = {
    "persist": ({"mismatch.injector": "head_perturb"}, (0.3, 0.5, 0.8), True),
    "redraw5": ({"mismatch.injector": "head_perturb", "mismatch.redraw_every": 5}, (0.5, 0.7, 1.0), True),
    "redraw1": ({"mismatch.injector": "head_perturb", "mismatch.redraw_every": 1}, (0.6, 0.8, 1.1), True),
    "noise": ({"mismatch.injector": "logit_noise"}, (0.75, 1.5, 3.0), True),
    "temp": ({"mismatch.injector": "temperature"}, (0.3, 0.6, 1.2), True),
    "kv": ({"mismatch.injector": "kv_cache", "mismatch.dtype": "fp8"}, (6.5, 7.25, 8.0), False),
}
"""kind -> (its mismatch settings, the pilot's doses of mismatch.magnitude, whether the dose rule works
on log dose). kv's magnitude is already a log (the fp8 cache's scale is 2^magnitude)."""

STALE_LAGS = (1, 2)
"""stale's two doses: its lag in steps, an integer, fixed by the registration (not by the pilot)."""

PILOT_SEEDS = (100, 101)
STUDY_SEEDS = tuple(range(8))
TARGETS = (0.02, 0.06)
COST_WINDOW = (50, 150)
PILOT_OUT = "sweeps/harm2_pilot"


def num(x: float) -> str:
    return f"{x:g}"



def run_means(sweep: str | Path, metric: str = "val/accuracy", window=COST_WINDOW) -> dict[str, list[float]]:
    """condition without its seed -> each finished run's mean ``metric`` over ``window``."""
    from timlab.experiments.studies.predictor import _window_mean
    from timlab.rundir import read_metrics

    out: dict[str, list[float]] = {}
    for p in sorted(Path(sweep).iterdir()):
        if (p / "metrics.parquet").is_file():
            m = read_metrics(p)
            out.setdefault(re.sub(r"_s\d+$", "", p.name.split("__")[0]), []).append(_window_mean(m, metric, window))
    return out


def chosen_doses(sweep: str | Path = PILOT_OUT) -> dict[str, tuple]:
    """kind -> (pilot doses, pilot costs, chosen doses) by the registered rule."""
    means = run_means(sweep)
    ctrl = float(np.mean(means["control"]))
    out = {}
    for kind, (_, doses, log) in KINDS.items():
        costs = [ctrl - float(np.mean(means[f"{kind}_{num(d)}"])) for d in doses]
        out[kind] = (doses, costs, pilot_doses(doses, costs, TARGETS, log=log))
    return out


def pilot_table(sweep: str | Path = ROOT / PILOT_OUT) -> str:
    """The pilot's costs and the doses the rule chose, as FINDINGS shows them (block harm2-pilot)."""
    chosen = chosen_doses(sweep)
    lines = ["| kind | pilot doses | pilot cost at each (2 seeds) | study doses (targets 0.02, 0.06) |", "|---|---|---|---|"]
    for kind, (doses, costs, pick) in chosen.items():
        lines.append(f"| {kind} | {', '.join(num(d) for d in doses)} | {', '.join(f'{c:+.4f}' for c in costs)} | "
                     f"{', '.join(num(d) for d in pick)} |")
    lines.append(f"| stale | - | - | {', '.join(str(x) for x in STALE_LAGS)} (registered lags) |")
    return "\n".join(lines)
