"""P3 (E2) checked against the seeds that did not fall: E2's fall signals at step 20 in every run of
the arm whose seeds fell.

    python bench/e2_fall_signals.py [sweeps/e2] [--condition stale_4_lr2e-4] [--step 20]

E2's Q3 (``scripts/e2_tables.py``) reports, for each early fall at step F, each signal's trailing
mean at F over its mean over steps 1-5 (``e2_tables.vs_start``). That says the signals stood high
at the falls, not that they rose *because* of them: this prints the same ratio at the same step
for every seed of the condition, fallen or not. Descriptive; FINDINGS quotes it under P3 (E2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # run from a checkout, no install

import e2_tables as E2  # noqa: E402
from erosion_tables import runs  # noqa: E402
from timlab.experiments.collapse import judge  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", nargs="?", default=str(ROOT / "sweeps" / "e2"))
    ap.add_argument("--condition", default="stale_4_lr2e-4")
    ap.add_argument("--step", type=int, default=20)
    a = ap.parse_args()
    names = list(E2.SIGNALS)
    print(f"{a.condition}: each signal's {E2.TRAIL}-step trailing mean at step {a.step} over its mean over steps "
          f"{E2.START[0]}-{E2.START[1]}\n")
    print("| seed | fell (plateau rule) | " + " | ".join(names) + " |")
    print("|---:|---|" + "---:|" * len(names))
    for row, m in sorted(runs(a.sweep), key=lambda x: x[0]["spec_condition"]):
        arm, lr, seed = E2.parse(row["spec_condition"])
        if f"{arm}_{lr}" != a.condition:
            continue
        train = m[m["step"] >= 1].set_index("step")
        fall = judge(m.sort_values("step"), rule="plateau", diverged=row["state"] == "diverged")
        ratios = [E2.vs_start(train[col].dropna(), a.step) for col, _ in E2.SIGNALS.values()]
        print(f"| {seed} | {'at step ' + str(fall) if fall is not None else 'no'} | "
              + " | ".join(f"{x:.2f}x" for x in ratios) + " |")


if __name__ == "__main__":
    main()
