"""A study's runs as a sweep directory holds them: each run's index row and metrics (``runs``),
the arm a condition belongs to (``arm``), which runs count (``sweep_states``, ``collect``) and
the one line an analysis prints instead of any number while runs are missing
(``incomplete_line``: no interim analysis), and ``PlannedRun``, one run a study's sweep spec
registers (``engine.planned_runs`` makes them; ``blocks`` places them on machines).

A run counts once it has finished at the study's last step or diverged (a diverged run is a
fall, never excluded for its outcome; its endpoints are over the evaluations it reached). Run
states are read live from each run's status.json (``sweeps.index.read_index``), so a sweep still
running shows where its runs are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from timlab.experiments.sweeps.index import INDEX_FILE, read_index
from timlab.rundir import DIVERGED, FINISHED, GUARD_FAILED, read_metrics

SEED_SUFFIX = r"_s\d+$"
"""A condition named ``<arm>_s<seed>`` (one condition per seed) belongs to ``<arm>``."""


@dataclass(frozen=True)
class PlannedRun:
    """One run the sweep spec registers."""

    run_id: str
    """Its directory name in the sweep."""
    name: str
    """How lines name it: the spec's condition, with ``_s<seed>`` when seeds come from the grid."""
    arm: str
    """The arm it belongs to."""
    group: str = ""
    """Its group in a grouped study (``Study.groups``); empty otherwise."""
    block: str = ""
    """The machine block its seed runs in (``Study.blocks``); empty without blocks."""


def arm(condition: str) -> str:
    """The arm of a condition: its name without a trailing ``_s<seed>`` (one condition per seed)."""
    return re.sub(SEED_SUFFIX, "", condition)


def runs(sweep: str | Path) -> list[tuple[pd.Series, pd.DataFrame]]:
    """(index row, metrics) of every run of a sweep that has metrics."""
    out = []
    for _, row in read_index(sweep).iterrows():
        d = Path(row["run_dir"])
        d = d if d.is_absolute() else Path(sweep) / row["run_id"]
        m = read_metrics(d)
        if m is not None:
            out.append((row, m))
    return out


def seed_ranges(seeds) -> str:
    """[0, 1, 2, 5] -> '0-2, 5' (sorted)."""
    s, parts = sorted(seeds), []
    for x in s:
        if parts and x == parts[-1][1] + 1:
            parts[-1][1] = x
        else:
            parts.append([x, x])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in parts)


def grouped_seeds(conditions: list[str], label=None) -> str:
    """Conditions named ``<group>_s<seed>`` as ``<group> seeds 0-2, 7, <other> seed 3`` in
    first-seen order; ``label(condition)`` names a condition's group (default: ``arm``); a
    condition without a seed suffix is listed by its label alone."""
    by: dict[str, list[int]] = {}
    for c in conditions:
        m = re.fullmatch(r".+_s(\d+)", c)
        by.setdefault((label or arm)(c), []).extend([int(m.group(1))] if m else [])
    return ", ".join(f"{g} seed{'s' if len(s) > 1 else ''} {seed_ranges(s)}" if s else g for g, s in by.items())


def incomplete_line(want: list[str], done: set[str], steps: int, label=None) -> str:
    """The one line a pre-registered analysis prints instead of any number while runs of ``want``
    are not in ``done`` (no interim analysis); missing runs grouped by ``grouped_seeds``."""
    missing = [c for c in want if c not in done]
    return (f"INCOMPLETE: {len(want) - len(missing)} of {len(want)} runs finished at step {steps} "
            f"(missing: {grouped_seeds(missing, label)}); no endpoint is computed before the study is complete "
            f"(no interim analysis).")


def sweep_states(sweep: str | Path, steps: int, is_control) -> tuple[list[str], set[str]]:
    """(the control conditions the zero-mismatch guard stopped, sorted; the conditions finished at
    ``steps`` or diverged) of a sweep, states and steps read live from each run's status.json; both
    empty when the sweep has no index yet. ``is_control(condition)`` picks the control runs."""
    if not (Path(sweep) / INDEX_FILE).exists():
        return [], set()
    idx = read_index(sweep)
    rows = list(zip(idx["spec_condition"], idx["state"], idx["last_step"]))
    tripped = sorted(c for c, s, _ in rows if is_control(c) and s == GUARD_FAILED)
    return tripped, {c for c, s, n in rows if (s == FINISHED and n == steps) or s == DIVERGED}


def collect(sweep: str | Path, design: dict, *, key=arm, endpoints) -> dict[str, list[dict]]:
    """Per group (``key(spec_condition)``, default: the arm), the endpoints
    (``endpoints(metrics, design["start"], diverged=...)``) and the ``condition`` of each run that
    counts (``design["steps"]``: the study's last step): every finished run at its last step, and
    every diverged run."""
    per: dict[str, list[dict]] = {}
    if not (Path(sweep) / INDEX_FILE).exists():
        return per  # not started (or not committed yet)
    for row, m in runs(sweep):
        if (row["state"] == FINISHED and int(m["step"].max()) == design["steps"]) or row["state"] == DIVERGED:
            per.setdefault(key(row["spec_condition"]), []).append(
                {"condition": row["spec_condition"],
                 **endpoints(m, design["start"], diverged=row["state"] == DIVERGED)})
    return per
