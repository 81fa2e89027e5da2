"""Tables of the MoE surge testbed and its study (docs/FINDINGS.md, "MoE study"), from sweeps' run directories;
the command is ``python scripts/moe_tables.py``.

``learn``: per run, greedy accuracy (``val/accuracy``) at step 0, its peak and final value, the gain
(final minus step 0), the first evaluation step with accuracy >= 0.95, the mean sampled response
length over the first and last 10 steps, and whether the gain meets the issue's bar (+0.15).

``arms``: per arm (the condition name without a trailing ``_s<seed>``), means over the RL steps of
each run and then over its runs: realized k3 (``rollout_corr/k3_kl``), the share of (position,
sparse layer) pairs whose top-k expert set differs between rollout and trainer
(``mismatch/router_flip_frac``), the share of positions with a flip in any layer, mean |r| of
tokens at flipped and unflipped positions; greedy accuracy and ``val/gold_logprob`` at the first
and last evaluation (per seed); whether every step of the ``control`` arm kept k3 exactly 0 and
every token bitwise equal; whether each ``control_replay`` run equals the ``control`` run of its
seed in every logged value but the timings; the wall-clock cost per RL step (training step time plus its share of
evaluation time; one thread per run, so an upper bound on CPU-seconds per step on a shared machine).

The pre-registered analysis of the MoE study (rules 1-7) is a study file, analysed by the package:
``timlab study analyze docs/examples/studies/moe.yaml`` (``timlab.experiments.studies``).

``layers``: per arm, each sparse layer's flip fraction (``router_flip_frac_by_layer`` in
distributions.jsonl, which committed sweeps leave out, so it runs where the sweep ran).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from timlab.experiments.studies.sweep_runs import arm, runs
from timlab.experiments.studies.text import fmt
from timlab.rundir.metrics_log import without_timings

CONTROL = "control"
"""The zero-mismatch arm's condition name in the MoE specs."""
CONTROL_REPLAY = "control_replay"
"""The control with router replay (the pilot's): it must equal the control in every logged value."""
LEARN_BAR = 0.15
"""Issue 25's bar for "learns like the dense one": greedy accuracy gain of at least this much."""
LEARNED = 0.95
"""Greedy accuracy at which a policy counts as learned (the dense surge policy ends at 0.96-0.99)."""


def learn(sweep: str) -> str:
    lines = ["| seed | accuracy step 0 | peak | final | gain | first step >= 0.95 | response length first / last 10 steps | gain >= 0.15 |",
             "|---:|---:|---:|---:|---:|---:|---|---|"]
    met = 0
    for row, m in runs(sweep):
        ev = m[["step", "val/accuracy"]].dropna().sort_values("step")
        acc = ev["val/accuracy"].to_numpy()
        gain = float(acc[-1] - acc[0])
        met += gain >= LEARN_BAR
        hit = ev.loc[ev["val/accuracy"] >= LEARNED, "step"]
        t = m[m["step"] >= 1].sort_values("step")["train/response_length_mean"]
        lines.append(f"| {int(row['run.seed'])} | {acc[0]:.3f} | {acc.max():.3f} | {acc[-1]:.3f} | {gain:+.3f} | "
                     f"{int(hit.iloc[0]) if len(hit) else '-'} | {t.iloc[:10].mean():.1f} / {t.iloc[-10:].mean():.1f} | "
                     f"{'yes' if gain >= LEARN_BAR else 'no'} |")
    lines.append("")
    lines.append(f"seeds with a gain >= {LEARN_BAR}: {met} of {len(lines) - 3}")
    return "\n".join(lines)


def arms(sweep: str) -> str:
    keys = ("rollout_corr/k3_kl", "mismatch/router_flip_frac", "mismatch/router_flip_frac_any_layer",
            "mismatch/abs_diff_mean_router_flipped", "mismatch/abs_diff_mean_router_unflipped")
    per: dict[str, dict[str, list]] = {}
    guard_ok, step_s, untimed, n_control = True, [], {}, 0
    for row, m in runs(sweep):
        t = m[m["step"] >= 1]  # step 0 is the evaluation of the start alone (no rollout)
        d = per.setdefault(arm(row["spec_condition"]), {k: [] for k in (*keys, "acc", "gold", "step_s")})
        for k in keys:
            d[k].append(float(t[k].mean()))
        ev = m[["step", "val/accuracy", "val/gold_logprob"]].dropna(subset=["val/accuracy"]).sort_values("step")
        d["acc"].append((float(ev["val/accuracy"].iloc[0]), float(ev["val/accuracy"].iloc[-1])))
        d["gold"].append((float(ev["val/gold_logprob"].iloc[0]), float(ev["val/gold_logprob"].iloc[-1])))
        if arm(row["spec_condition"]) == CONTROL:
            n_control += 1
            guard_ok &= bool(len(t) == int(m["step"].max()) and (t["rollout_corr/k3_kl"] == 0).all()
                             and (t["mismatch/frac_bitwise_equal"] == 1).all())
        untimed[row["spec_condition"]] = without_timings(m).reset_index(drop=True)
        s = (float(m["train/step_time_s"].sum()) + float(m["time/eval_s"].sum())) / int(m["step"].max())
        d["step_s"].append(s), step_s.append(s)
    lines = ["| arm | seeds | realized k3 | router flip frac (pairs) | positions with a flip | mean \\|r\\| flipped / unflipped | "
             "accuracy first -> last eval (per seed) | gold log-prob first -> last eval (per seed) | wall s per RL step |",
             "|---|---:|---:|---:|---:|---|---|---|---:|"]
    for c, d in per.items():
        mean = {k: float(np.mean(d[k])) for k in keys}
        acc = ", ".join(f"{a:.3f}->{b:.3f}" for a, b in d["acc"])
        gold = ", ".join(f"{a:.2f}->{b:.2f}" for a, b in d["gold"])
        lines.append(f"| {c} | {len(d['acc'])} | {fmt(mean[keys[0]])} | {fmt(mean[keys[1]])} | {fmt(mean[keys[2]])} | "
                     f"{fmt(mean[keys[3]])} / {fmt(mean[keys[4]])} | {acc} | {gold} | {np.mean(d['step_s']):.2f} |")
    lines.append("")
    guard = ("no control arm in this sweep" if not n_control else "held" if guard_ok else "BROKEN")
    lines.append(f"control guard (k3 exactly 0 and every token bitwise equal at every step): "
                 f"{guard}; wall seconds per RL step (train + eval share), "
                 f"mean over {len(step_s)} runs: {np.mean(step_s):.2f} (range {min(step_s):.2f}-{max(step_s):.2f})")
    for name in sorted(c for c in untimed if arm(c) == CONTROL_REPLAY):
        ctrl = untimed.get(name.replace(CONTROL_REPLAY, CONTROL, 1))
        same = ctrl is not None and ctrl.shape == untimed[name].shape and ctrl.equals(untimed[name])
        lines.append(f"{name} equals {name.replace(CONTROL_REPLAY, CONTROL, 1)} in every logged value but timings: "
                     f"{'yes' if same else 'NO'}")
    return "\n".join(lines)


def layers(sweep: str) -> str:
    """Per arm, the mean over steps and runs of each sparse layer's flip fraction
    (``router_flip_frac_by_layer`` in distributions.jsonl; not committed with a sweep)."""
    per: dict[str, list[dict[int, float]]] = {}
    for row, _ in runs(sweep):
        d = Path(sweep) / str(row["run_dir"])
        f = d / "distributions.jsonl"
        if not f.exists():
            continue
        recs = [json.loads(x).get("router_flip_frac_by_layer") for x in f.read_text().splitlines()]
        recs = [r for r in recs if r]
        if recs:
            keys = sorted({int(k) for r in recs for k in r})
            per.setdefault(arm(row["spec_condition"]), []).append(
                {k: float(np.mean([r.get(str(k), r.get(k, math.nan)) for r in recs])) for k in keys})
    if not per:
        return f"{sweep}: no run has router_flip_frac_by_layer in a distributions.jsonl (not committed with a sweep)"
    keys = sorted({k for v in per.values() for r in v for k in r})
    lines = ["| arm | runs | " + " | ".join(f"layer {k}" for k in keys) + " |", "|---|---:|" + "---:|" * len(keys)]
    for a, v in per.items():
        lines.append(f"| {a} | {len(v)} | " + " | ".join(fmt(float(np.nanmean([r.get(k, math.nan) for r in v])))
                                                   for k in keys) + " |")
    return "\n".join(lines)
