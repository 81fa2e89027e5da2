"""Copy a sweep's finished runs into the repository, as the committed sweeps keep them.

    python scripts/keep_runs.py WORK_SWEEP REPO_SWEEP [--steps N]

A long sweep runs in a working folder (a worktree, so commits do not disturb it) and its runs are
committed as they finish. This copies, for every run of WORK_SWEEP that has finished at its last
step (``--steps``: at that step), diverged, or been stopped by the zero-mismatch guard (a study's
evidence too), what the repository keeps of a run (its config, its
per-step metrics and its status; .gitignore leaves checkpoints and logs out), plus the sweep's own
records (the index, the study freeze, the machine record), into REPO_SWEEP. A run already kept is
copied again only when its status changed. It prints the runs it copied, one per line, and never
deletes anything.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timlab.experiments.study.registration import FREEZE_FILE  # noqa: E402
from timlab.experiments.sweep import INDEX_FILE, ISA_FILE  # noqa: E402
from timlab.rundir import DIVERGED, FINISHED, GUARD_FAILED, RunDir  # noqa: E402

SWEEP_FILES = (INDEX_FILE, FREEZE_FILE, ISA_FILE)
"""A sweep folder's own records that are kept (those it has)."""


def kept_files(run: RunDir) -> list[Path]:
    """What the repository keeps of a run (its config, metrics and status)."""
    return [run.config, run.metrics_file, run.status_file]


def done(run: RunDir, steps: int | None) -> bool:
    """Finished (at ``steps`` when given), diverged, or stopped by the guard."""
    try:
        status = json.loads(run.status_file.read_text())
    except (OSError, ValueError):
        return False
    state = status.get("state")
    return state in (DIVERGED, GUARD_FAILED) or (state == FINISHED and (steps is None or status.get("step") == steps))


def keep(src: Path, dst: Path, steps: int | None = None) -> list[str]:
    """Copy the finished runs of ``src`` (and its records) into ``dst``; the names of the runs copied."""
    if not (src / INDEX_FILE).is_file():
        raise SystemExit(f"keep_runs: {src} is not a sweep folder (no {INDEX_FILE})")
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for d in sorted(p for p in src.iterdir() if p.is_dir()):
        run, there = RunDir(d), RunDir(dst / d.name)
        if not done(run, steps):
            continue
        if there.status_file.is_file() and there.status_file.read_bytes() == run.status_file.read_bytes():
            continue
        there.path.mkdir(exist_ok=True)
        for f in kept_files(run):
            shutil.copyfile(f, there.path / f.name)
        copied.append(d.name)
    for name in SWEEP_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    return copied


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="the working sweep folder")
    ap.add_argument("dst", type=Path, help="the sweep folder in the repository")
    ap.add_argument("--steps", type=int, help="count a finished run only at this step (a study's last step)")
    args = ap.parse_args(argv)
    for name in keep(args.src, args.dst, args.steps):
        print(name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
