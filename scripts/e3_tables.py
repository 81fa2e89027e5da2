"""Tables of Study E3, length at fixed difficulty (docs/FINDINGS.md, "Study E3"), from its sweeps,
besides the pre-registered analyses of E3, E3b, E3c and E3d, which are study files analysed by the
package (``timlab.experiments.study``)::

    timlab study analyze docs/examples/studies/e3.yaml    # E3 (e3b.yaml: E3b; e3c.yaml: E3c; e3d.yaml: E3d)

    python scripts/e3_tables.py starts sweeps/e3_starts
    python scripts/e3_tables.py followup sweeps/e3_starts_rl
    python scripts/e3_tables.py figure sweeps/e3 --out docs/img/e3_length.png

``starts``: the calibration of E3's learned starts (docs/examples/e3_starts.yaml): per condition
(verbosity level, SFT step count), the greedy accuracy and gold log-prob at the step-0 evaluation
(the SFT's own) and after 10 and 20 zero-mismatch RL steps, the step-0 gold log-prob per answer
token (over the level's mean worked answer + EOS), the share of GRPO groups kept (not all-equal:
0 means RL makes no update) and the mean sampled response length over steps 1-20.

``followup``: the run directories of a folder (the RL runs made after the calibration, from
chosen SFT lengths; FINDINGS gives their commands): each evaluation's greedy accuracy and gold
log-prob, and the share of GRPO groups kept.

``figure``: each treated (level, arm) cell's accuracy cost against k3, T * k3 and T^2 * k3.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timlab.experiments.stats import bootstrap_diff_ci  # noqa: E402
from timlab.experiments.study.endpoints import run_endpoints  # noqa: E402
from timlab.experiments.study.sweep_runs import collect, incomplete_line, runs, sweep_states  # noqa: E402
from timlab.experiments.sweep import load_spec  # noqa: E402
from timlab.rundir import read_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

ANSWER_TOKENS = {0: 22, 1: 61, 2: 149, 3: 302}
"""Mean worked answer per verbosity level at 1-4-digit sums, in tokens (bench/verbosity.py, bench/RESULTS.md)."""


def starts(sweep: str) -> str:
    rows = []
    for row, m in runs(sweep):
        level, sft = map(int, re.fullmatch(r"v(\d)_sft(\d+)", row["spec_condition"]).groups())
        ev = m[["step", "val/accuracy", "val/gold_logprob"]].dropna().set_index("step")
        train = m[m["step"] > 0]
        rows.append((level, sft, ev, float(train["train/groups_kept_frac"].mean()),
                     float(train["train/response_length_mean"].mean())))
    lines = ["| level | SFT steps | accuracy at RL steps 0, 10, 20 | gold log-prob at 0, 10, 20 | "
             "step 0 per answer token | groups kept, steps 1-20 | sampled length |",
             "|---:|---:|---|---|---:|---:|---:|"]
    for level, sft, ev, kept, length in sorted(rows, key=lambda r: (r[0], r[1])):
        acc = ", ".join(f"{v:.3f}" for v in ev["val/accuracy"])
        gold = ", ".join(f"{v:.3g}" for v in ev["val/gold_logprob"])
        per_token = ev["val/gold_logprob"].iloc[0] / (ANSWER_TOKENS[level] + 1)
        lines.append(f"| {level} | {sft} | {acc} | {gold} | {per_token:.1e} | {kept:.2f} | {length:.1f} |")
    return "\n".join(lines)


def followup(folder: str) -> str:
    lines = ["| run | accuracy at each evaluation (step: value) | gold log-prob at each evaluation | groups kept |",
             "|---|---|---|---:|"]
    for d in sorted(p for p in Path(folder).iterdir() if (p / "metrics.parquet").exists()):
        m = read_metrics(d)
        ev = m[["step", "val/accuracy", "val/gold_logprob"]].dropna()
        acc = ", ".join(f"{int(s)}: {a:.3f}" for s, a in zip(ev["step"], ev["val/accuracy"]))
        gold = ", ".join(f"{g:.3g}" for g in ev["val/gold_logprob"])
        kept = float(m.loc[m["step"] > 0, "train/groups_kept_frac"].mean())
        lines.append(f"| {d.name} | {acc} | {gold} | {kept:.2f} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ the figure
SPEC = ROOT / "docs" / "examples" / "e3.yaml"
"""The study's spec: its conditions (``v<L>_<arm>_s<seed>``) are the runs the figure waits for."""
STUDY = {"steps": 150, "start": 50}
"""The registered design besides the spec's runs: steps per run and the first step of the outcome window."""
CONTROL = "control"
"""The zero-mismatch arm's name in the spec's conditions."""


def cell(condition: str) -> tuple[int, str]:
    """``v2_head_0.49_s3`` -> (2, 'head_0.49'): the (level, arm) of a condition."""
    m = re.fullmatch(r"v(\d+)_(.+)_s\d+", condition)
    if m is None:
        raise ValueError(f"condition {condition!r}: expected v<level>_<arm>_s<seed>")
    return int(m.group(1)), m.group(2)


def study_endpoints(m: pd.DataFrame, start: int = STUDY["start"], *, diverged: bool = False) -> dict:
    """One run's endpoints: the erosion study's over the evaluations at steps >= ``start``, the mean
    sampled response length over the training steps >= ``start``, and the step-0 evaluation."""
    out = run_endpoints(m, start, diverged=diverged)
    m = m.sort_values("step")
    ev = m[m["val/accuracy"].notna()]
    out.update({"length": float(m.loc[m["step"] >= start, "train/response_length_mean"].mean()),
                "start_step": int(ev["step"].iloc[0]), "start_gold": float(ev["val/gold_logprob"].iloc[0])})
    return out


def _refusal(sweep: str, want: list[str], design: dict) -> str | None:
    """The line printed instead of any number (a control stopped by the guard: VOID; runs
    missing: INCOMPLETE), or None when the study is complete. Reads run states only, no metrics."""
    tripped, done = sweep_states(sweep, design["steps"], lambda c: cell(c)[1] == CONTROL)
    if tripped:
        return (f"VOID: the zero-mismatch guard stopped {', '.join(tripped)} (every control step keeps k3 "
                f"exactly 0 and every token bitwise equal); the study is re-run, not analysed.")
    return _incomplete(want, done, design) if any(c not in done for c in want) else None


def _incomplete(want: list[str], done: set[str], design: dict) -> str:
    return incomplete_line(want, done, design["steps"], label=lambda c: "v{} {}".format(*cell(c)))


def _in_spec(per: dict, want: list[str]) -> tuple[list, dict]:
    """The spec's (level, arm) cells in spec order, and each cell's runs that the spec names."""
    cells = list(dict.fromkeys(cell(c) for c in want))
    return cells, {k: [r for r in per[k] if r["condition"] in want] for k in cells}


def _columns(per: dict, cells: list) -> dict:
    """{(level, arm): {endpoint: per-seed array}} of the cells' run endpoints."""
    return {k: {e: np.array([r[e] for r in per[k]], float) for e in per[k][0] if e != "condition"} for k in cells}


def figure(sweep: str, out: str | Path, *, spec: str | Path = SPEC, design: dict = STUDY) -> Path:
    """Each treated (level, arm) cell's excess mean accuracy over its level's control, with its 95%
    bootstrap interval, against realized k3, T * k3 and T^2 * k3 (T: the level's control mean
    response length): under the shape that holds, the levels fall on one curve. Only for a
    complete sweep (the study's own refusal otherwise)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    want = [c.name for c in load_spec(spec).conditions]
    refusal = _refusal(sweep, want, design)
    if refusal:
        raise SystemExit(refusal)
    per = collect(sweep, design, key=cell, endpoints=study_endpoints)
    cells, per = _in_spec(per, want)
    col = _columns(per, cells)
    levels = sorted({lv for lv, _ in cells})
    arms = list(dict.fromkeys(a for _, a in cells if a != CONTROL))
    fig = Figure(figsize=(14, 4))
    axes = [fig.add_subplot(1, 3, i + 1) for i in range(3)]
    for lv in levels:
        T = float(col[lv, CONTROL]["length"].mean())
        for j, a in enumerate(arms):
            c = col[lv, a]
            ex = float(c["acc_level"].mean() - col[lv, CONTROL]["acc_level"].mean())
            lo, hi = bootstrap_diff_ci(c["acc_level"], col[lv, CONTROL]["acc_level"])
            k = float(c["k3"].mean())
            for ax, x in zip(axes, (k, T * k, T * T * k)):
                ax.errorbar([x], [ex], yerr=[[ex - lo], [hi - ex]], fmt="osD^v"[j % 5], color=f"C{lv}", ms=5, capsize=2,
                            label=f"level {lv} (T {T:.0f})" if j == 0 else None)
    for ax, xl in zip(axes, ("realized k3", "T * k3", "T^2 * k3")):
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels overlap within a decade
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set(xlabel=xl, ylabel="mean accuracy minus the level's control")
    axes[0].legend(fontsize=7, loc="lower left")
    axes[1].set_title("markers: " + ", ".join(f"{'osD^v'[j % 5]} {a}" for j, a in enumerate(arms)), fontsize=8)
    fig.suptitle(f"{sweep}: accuracy cost of each (level, arm) cell, steps {design['start']}-{design['steps']}, "
                 f"mean over seeds with 95% bootstrap interval", fontsize=9)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=100)
    return out


TABLES = {"starts": starts, "followup": followup}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("table", choices=[*TABLES, "figure"])
    p.add_argument("sweep", help="the sweep (starts, figure) or the folder of run directories (followup)")
    p.add_argument("--spec", help=f"figure: the study's spec (default {SPEC.relative_to(ROOT)})")
    p.add_argument("--out", help="the figure's file (figure only)")
    a = p.parse_args(argv)
    np.seterr(all="ignore")
    if a.table == "figure":
        if not a.out:
            p.error("figure needs --out FILE.png")
        print(f"wrote {figure(a.sweep, a.out, spec=a.spec or SPEC)}")
        return 0
    print(TABLES[a.table](a.sweep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
