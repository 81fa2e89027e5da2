"""Power of Study H1 (docs/FINDINGS.md, "Study H1"), from the erosion study's seed variance.

    OMP_NUM_THREADS=1 python bench/h1_power.py [--sweep sweeps/erosion] [--sims 200] [--json OUT]
    OMP_NUM_THREADS=1 python bench/h1_power.py --blocks 3,5 [--shift 1.0]   # Amendment 1's test

H1 compares 8 seeds of a mismatch arm with 8 seeds of the control, and a TIS arm with its non-TIS
arm, on three endpoints over 2,000 steps. No 2,000-step run exists before H1, so the seed-to-seed
spread of each endpoint is taken from its closest analogue in the committed erosion sweep (E1: the
same learned start, protocol and evaluations, 500 steps):

- late accuracy level (H1: mean of the evaluations at steps 1500-2000, 21 of them) <- E1's level
  over steps 50-500 (19 evaluations);
- late accuracy slope (H1: steps 1500-2000, per 100 steps) <- E1's slope over steps 50-500;
- gold log-prob drift (H1: late level minus the level over steps 50-500) <- E1's level over steps
  300-500 minus its level over steps 50-250.

The reference's spread is E1's control's; a mismatch arm's is that of the E1 head_perturb arm
nearest its realized k3, rounded up (``ANALOGUE``: hold 3e-3 <- k3 4.1e-3, hold 1e-2 <- 0.013,
grow, whose target runs 1.3e-2 -> 3e-2 over the late window, <- 0.034); a TIS arm is assumed to
spread as its non-TIS arm. The power of the registered test (the exact two-sided permutation test
of ``timlab.experiments.studies.stats``: 12,870 relabelings for 8 vs 8) is simulated with normal seeds for
a grid of planted effects in units of the difference's standard error, at the larger and the
smaller spread ratio the table needs (``RATIOS``; the worse curve is used), at alpha 0.05 / 3
(Holm's first step over a family of 3, the arm eroding alone; and the TIS pairs, Bonferroni over
the 3 profiles) and 0.05 (Holm's last step). The minimum detectable effect (MDE) is the smallest planted
effect with power >= 0.8 (interpolated on the grid), for 8 seeds and, to state what cutting seeds
would cost, for 6 and 4. Spreads over 2,000 steps may exceed those over 500 (seeds have longer to
drift apart), so these are projections.

``--blocks 3,5`` (Amendment 1: seeds 0-2 on AMD machines, 3-7 on Intel ones) compares, for 8 vs 8,
the minimum detectable effect of the registered test with that of the test the amendment uses,
which relabels within the blocks only (5,040 relabelings), with the seeds of the second block
shifted by ``--shift`` reference standard deviations in both arms (a machine effect; 0 by default).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timlab.experiments.studies.stats import permutation_floor, permutation_test  # noqa: E402
from timlab.experiments.studies.endpoints import window_stat  # noqa: E402
from timlab.experiments.studies.sweep_runs import arm, runs  # noqa: E402
from timlab.files import write_json  # noqa: E402

ANALOGUE = {"hold_3e-3": "head_0.49", "hold_1e-2": "head_0.78", "grow": "head_1.1"}
"""H1's mismatch arm -> the E1 arm whose seed spread stands for it (module docstring)."""
ENDPOINTS = ("acc_late", "acc_slope", "gold_drift")
ALPHAS = (0.05 / 3, 0.05)
POWER = 0.8
SEEDS = (8, 6, 4)
RATIOS = (1.0, 10.0)
"""Spread ratios (arm / reference) the power curves are simulated at; H1's pairs lie in between."""
GRID = np.arange(1.5, 5.01, 0.25)
"""Planted effects, in standard errors of the difference."""


def endpoints(m) -> dict[str, float]:
    """E1's analogue of each H1 endpoint for one run (module docstring)."""
    return {
        "acc_late": window_stat(m, "val/accuracy", "level", (50, 500)),
        "acc_slope": window_stat(m, "val/accuracy", "slope", (50, 500)),
        "gold_drift": (window_stat(m, "val/gold_logprob", "level", (300, 500))
                       - window_stat(m, "val/gold_logprob", "level", (50, 250))),
    }


def spreads(sweep: str) -> dict[str, dict[str, float]]:
    """{endpoint: {E1 arm: seed sd}} for the control and the analogues."""
    per: dict[str, list[dict]] = {}
    for row, m in runs(sweep):
        per.setdefault(arm(row["spec_condition"]), []).append(endpoints(m))
    return {e: {a: float(np.std([r[e] for r in per[a]], ddof=1)) for a in ("control", *ANALOGUE.values())}
            for e in ENDPOINTS}


def power_curve(n: int, ratio: float, sims: int, seed: int = 0, blocks: tuple[int, ...] | None = None,
                shift: float = 0.0, stratified: bool = False) -> dict[float, np.ndarray]:
    """{alpha: power at each GRID effect} of n seeds at N(-g * se, ratio) against n at N(0, 1);
    with ``blocks`` (seeds per block, summing to n) the seeds of block k are shifted by k * ``shift``
    in both arms, and ``stratified`` relabels within blocks only."""
    rng = np.random.default_rng(seed)
    se = math.sqrt((1 + ratio**2) / n)
    labels = np.repeat(np.arange(len(blocks)), blocks) if blocks else np.zeros(n, int)
    strata = (labels, labels) if stratified else None
    ps = np.array([[permutation_test(rng.normal(-g * se, ratio, n) + shift * labels,
                                     rng.normal(0.0, 1.0, n) + shift * labels, strata=strata).p for _ in range(sims)]
                   for g in GRID])  # (grid, sims)
    return {alpha: (ps < alpha).mean(axis=1) for alpha in ALPHAS}


def blocked_mde(blocks: tuple[int, ...], shift: float, sims: int) -> dict[tuple[str, float], float]:
    """{(test, alpha): MDE in standard errors} of ``sum(blocks)`` vs as many seeds, the registered
    test and the within-block one, the worse of the RATIOS curves."""
    n = sum(blocks)
    out = {}
    for name, stratified in (("registered (12,870 relabelings)", False), ("within blocks", True)):
        curves = [power_curve(n, r, sims, blocks=blocks, shift=shift, stratified=stratified) for r in RATIOS]
        for alpha in ALPHAS:
            out[name, alpha] = max(mde_in_se(c[alpha]) for c in curves)
    return out


def mde_in_se(curve: np.ndarray) -> float:
    """The smallest effect (in standard errors) with power >= POWER, interpolated; inf beyond the grid."""
    ok = np.flatnonzero(curve >= POWER)
    if ok.size == 0:
        return math.inf
    i = int(ok[0])
    if i == 0:
        return float(GRID[0])
    f = (POWER - curve[i - 1]) / (curve[i] - curve[i - 1])
    return float(GRID[i - 1] + f * (GRID[i] - GRID[i - 1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", default="sweeps/erosion")
    ap.add_argument("--sims", type=int, default=200, help="simulated experiments per planted effect")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--blocks", help="seeds per machine block, e.g. 3,5: the registered test against the "
                                     "within-block one (8 vs 8 only)")
    ap.add_argument("--shift", type=float, default=0.0,
                    help="with --blocks: the second block's seeds shifted by this many reference sds, both arms")
    args = ap.parse_args()
    if args.blocks:
        blocks = tuple(int(x) for x in args.blocks.split(","))
        res = blocked_mde(blocks, args.shift, args.sims)
        print(f"{sum(blocks)} vs {sum(blocks)} in blocks of {args.blocks} seeds, block shift {args.shift:g} sd; MDE in "
              f"standard errors of the difference (power {POWER}):")
        for (name, alpha), v in res.items():
            print(f"  {name}, alpha {alpha:.4f}: {v:.2f}")
        if args.json:
            write_json(args.json, {f"{n}|{a:.4f}": v for (n, a), v in res.items()})
        return 0
    sp = spreads(args.sweep)
    k = {}  # (n, alpha) -> MDE in standard errors (the worse of the RATIOS curves)
    for n in SEEDS:
        curves = [power_curve(n, r, args.sims) for r in RATIOS]
        for alpha in ALPHAS:
            k[n, alpha] = max(mde_in_se(c[alpha]) if permutation_floor(n, n) < alpha else math.inf for c in curves)
    print("MDE in standard errors of the difference (power 0.8): " + "; ".join(
        f"{n} vs {n}, alpha {alpha:.4f}: {v:.2f}" for (n, alpha), v in k.items()))
    print("\n| H1 arm (E1 analogue) | endpoint | seed sd: control / arm | n | MDE vs control, alpha 0.0167 | "
          "vs control, alpha 0.05 | TIS vs non-TIS, alpha 0.0167 |")
    print("|---|---|---|---:|---:|---:|---:|")
    rows = []
    for a, e1 in ANALOGUE.items():
        for e in ENDPOINTS:
            sc, sa = sp[e]["control"], sp[e][e1]
            for n in SEEDS:
                se_c, se_t = math.sqrt((sc**2 + sa**2) / n), math.sqrt(2 * sa**2 / n)
                row = {"arm": a, "analogue": e1, "endpoint": e, "sd_control": sc, "sd_arm": sa, "n": n,
                       "mde_control_0.0167": k[n, ALPHAS[0]] * se_c, "mde_control_0.05": k[n, ALPHAS[1]] * se_c,
                       "mde_tis_0.0167": k[n, ALPHAS[0]] * se_t}
                rows.append(row)
                cells = " | ".join("untestable" if not math.isfinite(row[c]) else f"{row[c]:.4f}"
                                   for c in ("mde_control_0.0167", "mde_control_0.05", "mde_tis_0.0167"))
                print(f"| {a} ({e1}) | {e} | {sc:.4f} / {sa:.4f} | {n} | {cells} |", flush=True)
    if args.json:
        write_json(args.json, {"spreads": sp, "mde_in_se": {f"{n}|{a:.4f}": v for (n, a), v in k.items()}, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
