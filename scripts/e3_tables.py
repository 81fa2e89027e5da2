"""Tables of Study E3, length at fixed difficulty (docs/FINDINGS.md, "Study E3"), from its sweeps,
besides the pre-registered analyses of E3, E3b, E3c and E3d, which are study files analysed by the
package (``timlab.experiments.studies``)::

    timlab study analyze docs/examples/studies/e3.yaml    # E3 (e3b.yaml: E3b; e3c.yaml: E3c; e3d.yaml: E3d)
    timlab study figure docs/examples/studies/e3.yaml --png docs/img/e3_length.png

    python scripts/e3_tables.py starts sweeps/e3_starts
    python scripts/e3_tables.py followup sweeps/e3_starts_rl

``starts``: the calibration of E3's learned starts (docs/examples/e3_starts.yaml): per condition
(verbosity level, SFT step count), the greedy accuracy and gold log-prob at the step-0 evaluation
(the SFT's own) and after 10 and 20 zero-mismatch RL steps, the step-0 gold log-prob per answer
token (over the level's mean worked answer + EOS), the share of GRPO groups kept (not all-equal:
0 means RL makes no update) and the mean sampled response length over steps 1-20.

``followup``: the run directories of a folder (the RL runs made after the calibration, from
chosen SFT lengths; FINDINGS gives their commands): each evaluation's greedy accuracy and gold
log-prob, and the share of GRPO groups kept.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timlab.experiments.studies.sweep_runs import runs  # noqa: E402
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


TABLES = {"starts": starts, "followup": followup}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("table", choices=list(TABLES))
    p.add_argument("sweep", help="the sweep (starts) or the folder of run directories (followup)")
    a = p.parse_args(argv)
    print(TABLES[a.table](a.sweep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
