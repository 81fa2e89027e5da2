"""E3d's healing analysis applied to the erosion study (E1), descriptively: does E1's cost heal?

    python bench/erosion_late_window.py [sweeps/erosion]

E1 registered levels over steps 50-500, not healing; E3d registered healing (its early window,
steps 50-150, against its late one, 400-500). This takes E3d's per-run endpoints from its study file
(docs/examples/studies/e3d.yaml: accuracy level per window, its change from early to late, realized
k3 per window), computes them over the committed erosion runs (``studies.engine.run_record``) and
compares each arm with the control (``compare_family``: exact permutation p, bootstrap intervals;
Holm over the 10 arms). Not a registered test of E1: FINDINGS quotes it to say in words what
"heals" can and cannot mean there.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, no install

from timlab.experiments.studies.stats import compare_family  # noqa: E402
from timlab.experiments.studies.registration import load_study  # noqa: E402
from timlab.experiments.studies.engine import run_record  # noqa: E402
from timlab.experiments.studies.sweep_runs import arm, runs  # noqa: E402
from timlab.experiments.studies.text import comparison_cells, fmt  # noqa: E402
from timlab.rundir import DIVERGED, FINISHED  # noqa: E402

E3D = load_study(ROOT / "docs" / "examples" / "studies" / "e3d.yaml")
KEYS = ("acc_early", "acc_late", "acc_change", "k3_early", "k3_late")


def main(sweep: str = str(ROOT / "sweeps" / "erosion")) -> None:
    per: dict[str, list[dict]] = {}
    for row, m in runs(sweep):
        if row["state"] == DIVERGED or (row["state"] == FINISHED and int(m["step"].max()) == E3D.steps):
            per.setdefault(arm(row["spec_condition"]), []).append(run_record(E3D, m, diverged=row["state"] == DIVERGED))
    col = {a: {k: [r[k] for r in rows] for k in KEYS} for a, rows in per.items()}
    arms = [a for a in sorted(per) if a != "control"]
    (e0, e1), (l0, l1) = E3D.endpoint("acc_early").window, E3D.endpoint("acc_late").window
    print(f"{sweep}: {sum(len(v) for v in per.values())} runs; early = steps {e0}-{e1}, late = steps {l0}-{l1}\n")
    print("| arm | k3 early -> late | accuracy early | accuracy late |")
    print("|---|---|---:|---:|")
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    for a in ["control", *arms]:
        c = col[a]
        print(f"| {a} | {fmt(mean(c['k3_early']))} -> {fmt(mean(c['k3_late']))} | {mean(c['acc_early']):.4f} | "
              f"{mean(c['acc_late']):.4f} |")
    for key, label in (("acc_late", f"accuracy level, steps {l0}-{l1}"),
                       ("acc_change", "accuracy change from early to late")):
        cmp = compare_family({a: col[a][key] for a in arms}, {a: col["control"][key] for a in arms})
        print(f"\n**{label}**, arm minus control\n")
        print("| arm | arm mean [95% t] [95% bootstrap] | excess over control [95% bootstrap] | permutation p | Holm p |")
        print("|---|---:|---:|---:|---:|")
        for a in arms:
            print(f"| {a} | {comparison_cells(cmp[a])} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
