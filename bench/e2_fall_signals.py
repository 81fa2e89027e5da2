"""P3 (E2) checked against the seeds that did not fall: E2's fall signals at step 20 in every run of
the arm whose seeds fell.

    python bench/e2_fall_signals.py [sweeps/e2] [--condition stale_4_lr2e-4] [--step 20]

E2's Q3 (the ``signals`` fit of docs/examples/studies/e2.yaml) reports, for each early fall at step
F, each signal's trailing mean at F over its mean over steps 1-5 (``study.signals.vs_start``). That says the signals stood high
at the falls, not that they rose *because* of them: this prints the same ratio at the same step
for every seed of the condition, fallen or not. Descriptive; FINDINGS quotes it under P3 (E2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # run from a checkout, no install

from erosion_tables import runs  # noqa: E402
from timlab.experiments.studies.collapse import judge  # noqa: E402
from timlab.experiments.studies.registration import load_study  # noqa: E402
from timlab.experiments.studies.signals import series, vs_start  # noqa: E402

FIT = next(f for f in load_study(ROOT / "docs" / "examples" / "studies" / "e2.yaml").fits if f.kind == "signals")
"""E2's registered signals (every arm's: the ramp-only signal is left out)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", nargs="?", default=str(ROOT / "sweeps" / "e2"))
    ap.add_argument("--condition", default="stale_4_lr2e-4")
    ap.add_argument("--step", type=int, default=20)
    a = ap.parse_args()
    signals = [s for s in FIT.signals if not s.arms]
    names = [s.name for s in signals]
    print(f"{a.condition}: each signal's {FIT.trail}-step trailing mean at step {a.step} over its mean over steps "
          f"{FIT.start[0]}-{FIT.start[1]}\n")
    print("| seed | fell (plateau rule) | " + " | ".join(names) + " |")
    print("|---:|---|" + "---:|" * len(names))
    for row, m in sorted(runs(a.sweep), key=lambda x: x[0]["spec_condition"]):
        condition, seed = row["spec_condition"].rsplit("_s", 1)
        if condition != a.condition:
            continue
        fall = judge(m.sort_values("step"), rule="plateau", diverged=row["state"] == "diverged")
        ratios = [vs_start(series(m.sort_values("step"), s), a.step, start=FIT.start, trail=FIT.trail) for s in signals]
        print(f"| {seed} | {'at step ' + str(fall) if fall is not None else 'no'} | "
              + " | ".join(f"{x:.2f}x" for x in ratios) + " |")


if __name__ == "__main__":
    main()
