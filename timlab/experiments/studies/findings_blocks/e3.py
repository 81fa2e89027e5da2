"""Study E3's sweep tables (docs/findings/e3.md): the calibration of its learned starts and the RL
runs after it, from their run directories; the command is ``python scripts/e3_tables.py``.

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

import re
from pathlib import Path

from timlab.experiments.studies.sweep_runs import runs
from timlab.rundir import read_metrics

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
