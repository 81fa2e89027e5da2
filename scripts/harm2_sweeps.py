"""Study H2's sweep files (docs/FINDINGS.md, "Study H2"): the pilot's, and the study's from the pilot's
costs by the registered dose rule (``timlab.experiments.studies.oos.pilot_doses``).

    python scripts/harm2_sweeps.py pilot            # writes docs/examples/harm2_pilot.yaml
    python scripts/harm2_sweeps.py doses            # prints each kind's pilot costs and chosen doses
    python scripts/harm2_sweeps.py study --write    # writes docs/examples/harm2.yaml from the pilot

Each kind is one arm prefix and the settings of its mismatch; a condition is ``<kind>_<dose>_s<seed>``
with ``run.seed = mismatch.seed = seed``. Pilot seeds (100, 101) are not study seeds (0-7).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timlab.experiments.studies.findings_blocks.harm2 import (KINDS, PILOT_OUT, PILOT_SEEDS, STALE_LAGS,  # noqa: E402
                                                              STUDY_SEEDS, chosen_doses)
from timlab.experiments.studies.findings_blocks.harm2 import num as _num  # noqa: E402

HEADER = """base:
  preset: surge
  set: {model.path: runs/erosion_start, task.n_val: 512, run.steps: 150, run.eval_every: 10, run.checkpoint_every: 50,
        run.progress: false}
isa: avx2
conditions:
"""


def _num(x: float) -> str:
    return f"{x:g}"


def condition(kind: str, dose: float | None, seed: int) -> str:
    if kind == "control":
        name, sets = "control", {"mismatch.injector": "none"}
    elif kind == "stale":
        name, sets = f"stale_{int(dose)}", {"mismatch.injector": "stale", "mismatch.magnitude": int(dose)}
    else:
        name, sets = f"{kind}_{_num(dose)}", {**KINDS[kind][0], "mismatch.magnitude": float(dose)}
    sets = {**sets, "run.seed": seed, "mismatch.seed": seed}
    body = ", ".join(f"{k}: {v}" for k, v in sets.items())
    return f"  - {{name: {name}_s{seed}, set: {{{body}}}}}"


def pilot_yaml() -> str:
    lines = []
    for seed in PILOT_SEEDS:
        lines.append(condition("control", None, seed))
        for kind, (_, doses, _) in KINDS.items():
            lines += [condition(kind, d, seed) for d in doses]
    return HEADER + "\n".join(lines) + "\n"


def study_yaml(chosen: dict[str, tuple]) -> str:
    lines = []
    for seed in STUDY_SEEDS:
        lines.append(condition("control", None, seed))
        for kind in KINDS:
            lines += [condition(kind, d, seed) for d in chosen[kind][2]]
        lines += [condition("stale", lag, seed) for lag in STALE_LAGS]
    return HEADER + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["pilot", "doses", "study"])
    ap.add_argument("--write", action="store_true", help="study: write docs/examples/harm2.yaml")
    a = ap.parse_args(argv)
    if a.what == "pilot":
        (ROOT / "docs/examples/harm2_pilot.yaml").write_text(PILOT_HEAD + pilot_yaml(), encoding="utf-8")
        return 0
    chosen = chosen_doses(ROOT / PILOT_OUT)
    for kind, (doses, costs, pick) in chosen.items():
        print(f"{kind:8s} pilot doses {list(doses)} cost {[round(c, 4) for c in costs]} -> doses {list(pick)}")
    if a.what == "study":
        text = STUDY_HEAD + study_yaml(chosen)
        if a.write:
            (ROOT / "docs/examples/harm2.yaml").write_text(text, encoding="utf-8")
        else:
            print(text)
    return 0


PILOT_HEAD = """# Study H2's PILOT (docs/FINDINGS.md, "Study H2", the pilot rule registered before it ran): each kind at three
# doses, pilot seeds 100 and 101 (not study seeds), 150 steps from the learned surge start runs/erosion_start
# (SHA-256 9a3f7b27...b4db4). A kind's pilot cost at a dose = the mean over the 2 pilot controls minus the mean over
# its 2 runs of each run's mean greedy accuracy over the evaluations at steps 50-150; the doses of the study are
# then chosen by `python scripts/harm2_sweeps.py doses` (the rule: timlab.experiments.studies.oos.pilot_doses).
# Written by `python scripts/harm2_sweeps.py pilot`.
#   timlab --isa avx2 sweep docs/examples/harm2_pilot.yaml --out sweeps/harm2_pilot --workers 2
"""

STUDY_HEAD = """# Study H2 (docs/FINDINGS.md, "Study H2", pre-registered; the study file: docs/examples/studies/harm2_runs.yaml):
# 7 kinds x 2 doses and a control, 8 seeds each, 150 steps from the learned surge start runs/erosion_start.
# The doses of six kinds come from the pilot (sweeps/harm2_pilot) by the registered rule; stale's are its lags 1
# and 2. Written by `python scripts/harm2_sweeps.py study --write`.
"""


if __name__ == "__main__":
    raise SystemExit(main())
