"""Tables of the MoE surge testbed and its study (docs/FINDINGS.md, "MoE study"), from sweeps' run directories.

    python scripts/moe_tables.py learn sweeps/surge_moe_learn   # the zero-mismatch learning check, per seed
    python scripts/moe_tables.py arms sweeps/moe_pilot          # per arm: realized k3, routing flips, accuracy, cost
    python scripts/moe_tables.py study sweeps/moe               # the pre-registered analysis (rules 1-7)
    python scripts/moe_tables.py layers sweeps/moe              # per arm and sparse layer: flip fraction

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

``study``: the analysis pre-registered in FINDINGS ("MoE study"), run only when every condition of
the study's spec (``--spec``, default docs/examples/moe.yaml; one condition ``<arm>_s<seed>`` per
run) has finished at step 500 or diverged; before that it prints one ``INCOMPLETE`` line naming the
missing runs (no interim analysis), and a control run stopped by the zero-mismatch guard voids the
study at once. Rule 1 (validity): every control step keeps k3 exactly 0 and every token bitwise
equal, and every run's step-0 evaluation (accuracy and gold log-prob) is the same. Per run: the
mechanism over steps 1-500 (k3, flip rates, mean |r| at flipped and unflipped positions) and the
erosion study's endpoints (``study.endpoints.run_endpoints``: mean accuracy and gold log-prob and
their OLS slopes per 100 steps over the evaluations at steps 50-500, plateau-rule falls, step-500
values). Per arm: means with 95% t- and seed-bootstrap intervals; rule 2 places the k3 interval
against the MoE and dense ranges. Each outcome endpoint is one Holm family (``stats.compare_family``:
bootstrap interval of the difference, exact permutation p over all 12,870 relabelings of 8 vs 8) of
every mismatch arm minus control (rules 3-4: erodes, or "costs at most" the interval's lower end)
and every replay arm (``<arm>_replay``) minus its no-replay arm (rule 5: recovers, claimed only
where the no-replay arm erodes on that endpoint). k3 and the flip rate compare each replay arm with
its no-replay arm the same way (Holm over the pairs), with the ratio of means and its bootstrap
interval (``stats.bootstrap_ratio_ci``). Rule 6 places each arm's excess slope against the erosion
study's k3 fit (``study.fits.off_fit``) once that study is complete.

``layers``: per arm, each sparse layer's flip fraction (``router_flip_frac_by_layer`` in
distributions.jsonl, which committed sweeps leave out, so it runs where the sweep ran).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timlab.experiments.study.endpoints import run_endpoints as erosion_run_endpoints  # noqa: E402
from timlab.experiments.study.fits import bootstrap_fit, fit_power, off_fit  # noqa: E402
from timlab.experiments.study.sweep_runs import arm, collect, incomplete_line, runs, sweep_states  # noqa: E402
from timlab.experiments.study.text import comparison_cells, fmt, mean_cells  # noqa: E402
from timlab.experiments.stats import (N_BOOT, bootstrap_ci, bootstrap_ratio_ci, clopper_pearson,  # noqa: E402
                                      compare_family, t_ci)
from timlab.experiments.sweep import INDEX_FILE, load_spec  # noqa: E402
from timlab.rundir.metrics_log import without_timings  # noqa: E402

CONTROL = ERO_CONTROL = "control"
"""The zero-mismatch arm's condition name in the MoE specs (and the erosion study's)."""
HEAD = "head_"
"""Prefix of the erosion study's head_perturb arms (its k3 fit's arms)."""
ERO_STUDY = {"arms": 11, "seeds": 8, "steps": 500, "start": 50, "min_start_accuracy": 0.95}
"""The erosion study's design (docs/examples/studies/erosion.yaml), for rule 6."""
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


# ------------------------------------------------------------------------------ the study
SPEC = ROOT / "docs" / "examples" / "moe.yaml"
"""The registered study's spec: its conditions (``<arm>_s<seed>``) are the runs the analysis waits for."""
STUDY = {"steps": 500, "start": 50}
"""The registered design besides the spec's runs: steps per run and the first step of the outcome window."""
EROSION_SWEEP = ROOT / "sweeps" / "erosion"
"""The erosion study, whose k3 fit rule 6 places the MoE arms against."""
REPLAY = "_replay"
"""Suffix of a router-replay arm; its no-replay arm is the name without it."""
MOE_RANGE = (1.5e-3, 1e-1)
"""Realized k3 that real MoE stacks log (VeXact's Qwen3-30B-A3B runs): rule 2's range."""
DENSE_RANGE = (6e-4, 1.5e-3)
"""Realized k3 that real dense bf16 stacks log."""
OUTCOMES = (("acc_level", "mean accuracy"), ("acc_slope", "accuracy slope per 100 steps"),
            ("gold_level", "mean gold log-prob"), ("gold_slope", "gold log-prob slope per 100 steps"))
"""The four outcome endpoints (key, label); each is one Holm family of erosion and recovery comparisons."""
MECHANISM = (("k3", "realized k3"), ("flip", "router flip frac (pairs)"))
"""The mechanism endpoints compared replay vs no replay (key, label); one Holm family each."""


def study_endpoints(m: pd.DataFrame, start: int = STUDY["start"], *, diverged: bool = False) -> dict:
    """One run's endpoints: the erosion study's (``study.endpoints.run_endpoints``: levels and slopes
    over the evaluations at steps >= ``start``, guard, falls, final values, k3 over the first and last
    20 steps), with the mechanism over every RL step (k3, flip rates, mean |r| at flipped and
    unflipped positions; steps 1-500 as registered, not the outcome window) and the step-0
    evaluation (rule 1)."""
    out = erosion_run_endpoints(m, start, diverged=diverged)
    m = m.sort_values("step")
    t = m[m["step"] >= 1]  # step 0 is the evaluation of the start alone (no rollout)
    ev = m[m["val/accuracy"].notna()]
    flip = t["mismatch/router_flip_frac"]
    out.update({
        "k3": float(t["rollout_corr/k3_kl"].mean()), "flip": float(flip.mean()),
        "flip_any": float(t["mismatch/router_flip_frac_any_layer"].mean()),
        "r_flipped": float(t["mismatch/abs_diff_mean_router_flipped"].mean()),
        "r_unflipped": float(t["mismatch/abs_diff_mean_router_unflipped"].mean()),
        "flip_first": float(flip.iloc[:20].mean()), "flip_last": float(flip.iloc[-20:].mean()),
        "start_step": int(ev["step"].iloc[0]),
        "start_gold": float(ev["val/gold_logprob"].iloc[0]) if "val/gold_logprob" in ev else math.nan,
    })
    return out


def study(sweep: str, *, spec: str | Path = SPEC, design: dict = STUDY, erosion: str | Path = EROSION_SWEEP) -> str:
    """The pre-registered analysis of the MoE study sweep as markdown (rules 1-7 of FINDINGS' "MoE study")."""
    want = [c.name for c in load_spec(spec).conditions]
    tripped, done = sweep_states(sweep, design["steps"], lambda c: arm(c) == CONTROL)
    if tripped:
        return (f"VOID: the zero-mismatch guard stopped {', '.join(tripped)} (rule 1: every control step keeps k3 "
                f"exactly 0 and every token bitwise equal); the study is re-run, not analysed.")
    if any(c not in done for c in want):  # no run's metrics are read before the study is complete
        return _incomplete(want, done, design)
    per = collect(sweep, design, endpoints=study_endpoints)
    ero = collect(str(erosion), ERO_STUDY, endpoints=erosion_run_endpoints) if (Path(erosion) / INDEX_FILE).exists() else {}
    return analyse(per, want, design=design, erosion=ero)


def _incomplete(want: list[str], done: set[str], design: dict) -> str:
    return incomplete_line(want, done, design["steps"])


def analyse(per: dict[str, list[dict]], want: list[str], *, design: dict = STUDY,
            erosion: dict[str, list[dict]] | None = None) -> str:
    """The analysis of per-arm run endpoints (``collect`` with ``study_endpoints``) against the
    spec's conditions ``want``; ``erosion``: the erosion study's per-arm endpoints for rule 6."""
    done = {r["condition"] for v in per.values() for r in v}
    if any(c not in done for c in want):
        return _incomplete(want, done, design)
    order = list(dict.fromkeys(arm(c) for c in want))  # arms in spec order
    per = {a: [r for r in per[a] if r["condition"] in want] for a in order}
    ctrl = per[CONTROL]
    starts = {(r["start_step"], r["start_acc"], r["start_gold"]) for v in per.values() for r in v}
    guard = all(r["guard"] and r["rows"] == design["steps"] for r in ctrl)
    valid = guard and len(starts) == 1 and next(iter(starts))[0] == 0
    s0 = next(iter(starts))
    out = [f"Validity (rule 1): control guard (k3 exactly 0, every token bitwise equal, every step) "
           f"{'held' if guard else 'BROKEN'}; step-0 evaluation "
           + (f"the same in all {len(want)} runs (accuracy {s0[1]:.3f}, gold log-prob {s0[2]:.3f})"
              if len(starts) == 1 else f"DIFFERS between runs ({len(starts)} distinct)")
           + f": {'VALID' if valid else 'VOID (re-run, do not analyse)'}.", ""]
    if not valid:
        return out[0]
    col = {a: {k: np.array([r[k] for r in per[a]], float) for k in per[a][0] if k != "condition"} for a in order}
    mis = [a for a in order if a != CONTROL]
    pairs = {a: a[: -len(REPLAY)] for a in mis if a.endswith(REPLAY) and a[: -len(REPLAY)] in mis}  # replay -> no replay
    out += _mechanism(col, mis, design) + _replay(col, pairs, design)
    erodes: dict[tuple[str, str], bool] = {}
    for key, label in OUTCOMES:
        out += _outcome(col, mis, pairs, key, f"{label}, evaluations at steps {design['start']}-{design['steps']}", erodes)
    out += _secondary(per, order, design) + _cross_study(col, mis, erosion) + [
        "Per-layer flip fractions (secondary) are in each run's distributions.jsonl, which sweeps do not commit: "
        "`python scripts/moe_tables.py layers SWEEP` on the machine that ran it."]
    return "\n".join(out)


def _k3_range(lo: float, hi: float) -> str:
    """Rule 2: where an arm's seed-bootstrap k3 interval [lo, hi] lies."""
    if MOE_RANGE[0] <= lo and hi <= MOE_RANGE[1]:
        return "in the MoE range"
    if DENSE_RANGE[0] <= lo and hi <= DENSE_RANGE[1]:
        return "in the dense range"
    if hi < DENSE_RANGE[0]:
        return "below the dense range"
    return "not inside either range"


def _mechanism(col: dict, mis: list[str], design: dict) -> list[str]:
    out = [f"**Mechanism** (means over steps 1-{design['steps']}, then over seeds; rule 2: in the MoE range if the k3 bootstrap "
           f"interval lies inside [{MOE_RANGE[0]:g}, {MOE_RANGE[1]:g}], dense range [{DENSE_RANGE[0]:g}, {DENSE_RANGE[1]:g}])", "",
           "| arm | realized k3 [95% t] [95% bootstrap] | rule 2 | router flip frac (pairs) [95% bootstrap] | "
           "positions with a flip | mean \\|r\\| flipped / unflipped |", "|---|---:|---|---:|---:|---|"]
    for a in (CONTROL, *mis):
        c = col[a]
        mu, lo, hi = t_ci(c["k3"])
        blo, bhi = bootstrap_ci(c["k3"])
        flo, fhi = bootstrap_ci(c["flip"])
        out.append(f"| {a} | {fmt(mu)} [{fmt(lo)}, {fmt(hi)}] [{fmt(blo)}, {fmt(bhi)}] | "
                   f"{'-' if a == CONTROL else _k3_range(blo, bhi)} | {fmt(float(c['flip'].mean()))} [{fmt(flo)}, {fmt(fhi)}] | "
                   f"{fmt(float(c['flip_any'].mean()))} | {fmt(float(c['r_flipped'].mean()))} / "
                   f"{fmt(float(c['r_unflipped'].mean()))} |")
    return out + [""]


def _replay(col: dict, pairs: dict[str, str], design: dict) -> list[str]:
    """Rule 5's mechanism half: each replay arm against its no-replay arm on k3 and flip rate (Holm
    over the pairs, per endpoint), with the ratio of means."""
    if not pairs:
        return []
    out = [f"**Router replay against no replay** (mechanism, means over steps 1-{design['steps']}; Holm over the "
           f"{len(pairs)} pairs per endpoint; rule 5)", "",
           "| endpoint | replay arm / no-replay arm | ratio of means [95% bootstrap] | difference [95% bootstrap] | "
           "permutation p | Holm p | verdict |", "|---|---|---:|---:|---:|---:|---|"]
    for key, label in MECHANISM:
        cmp = compare_family({a: col[a][key] for a in pairs}, {a: col[b][key] for a, b in pairs.items()})
        for a, b in pairs.items():
            r = cmp[a]
            den = float(col[b][key].mean())
            try:
                rlo, rhi = bootstrap_ratio_ci(col[a][key], col[b][key])
                ratio = f"{fmt(float(col[a][key].mean()) / den)} [{fmt(rlo)}, {fmt(rhi)}]"
            except ValueError:
                ratio = "- (a resample of the no-replay arm has mean 0)"
            if key == "k3":
                verdict = "**removes the flip-driven mismatch**" if r.below() else "not shown"
            else:
                verdict = "lower" if r.below() else "higher" if r.above() else "not separable"
            out.append(f"| {label} | {a} / {b} | {ratio} | {fmt(r.diff)} [{fmt(r.diff_ci[0])}, {fmt(r.diff_ci[1])}] | "
                       f"{r.p:.4f} | {r.p_holm:.4f} | {verdict} |")
    return out + [""]


def _outcome(col: dict, mis: list[str], pairs: dict[str, str], key: str, label: str,
             erodes: dict[tuple[str, str], bool]) -> list[str]:
    """One outcome endpoint: every mismatch arm minus control (erosion, rules 3-4) and every replay arm
    minus its no-replay arm (recovery, rule 5), one Holm family."""
    comps = {f"{a} - {CONTROL}": (a, CONTROL) for a in mis} | {f"{a} - {b}": (a, b) for a, b in pairs.items()}
    cmp = compare_family({n: col[a][key] for n, (a, _) in comps.items()}, {n: col[b][key] for n, (_, b) in comps.items()})
    out = [f"**{label}** (Holm over the {len(comps)} comparisons)", "",
           "| comparison | first arm's mean [95% t] [95% bootstrap] | difference [95% bootstrap] | permutation p | "
           "Holm p | verdict |", "|---|---:|---:|---:|---:|---|",
           f"| {CONTROL} (reference) | {mean_cells(col[CONTROL][key])} | - | - | - | - |"]
    for n, (a, b) in comps.items():
        r = cmp[n]
        if b == CONTROL:
            erodes[a, key] = r.below()
            verdict = "**erodes**" if r.below() else f"no detectable erosion (costs {r.cost_bound()})"
        elif r.above():
            verdict = "**recovers**" if erodes[b, key] else f"higher, not claimed ({b} does not erode)"
        else:
            verdict = f"lower than {b}" if r.below() else "no detectable recovery"
        out.append(f"| {n} | {comparison_cells(r)} | {verdict} |")
    return out + [""]


def _secondary(per: dict, order: list[str], design: dict) -> list[str]:
    out = ["**Secondary**", "", f"| arm | falls (plateau rule) [95% Clopper-Pearson] | k3 first 20 -> last 20 steps | "
           f"flip frac first 20 -> last 20 steps | accuracy at step {design['steps']} [95% t] | "
           f"gold log-prob at step {design['steps']} [95% t] |", "|---|---:|---|---|---:|---:|"]
    for a in order:
        rs = per[a]
        k = sum(r["fell"] for r in rs)
        clo, chi = clopper_pearson(k, len(rs))
        fa, fg = t_ci([r["final_acc"] for r in rs]), t_ci([r["final_gold"] for r in rs])
        mean = lambda key: fmt(float(np.mean([r[key] for r in rs])))  # noqa: E731
        out.append(f"| {a} | {k}/{len(rs)} [{clo:.2f}, {chi:.2f}] | {mean('k3_first')} -> {mean('k3_last')} | "
                   f"{mean('flip_first')} -> {mean('flip_last')} | {fa[0]:.3f} [{fa[1]:.3f}, {fa[2]:.3f}] | "
                   f"{fg[0]:.3f} [{fg[1]:.3f}, {fg[2]:.3f}] |")
    return out + [""]


def _cross_study(col: dict, mis: list[str], erosion: dict[str, list[dict]] | None, *, n: int = N_BOOT) -> list[str]:
    """Rule 6 (descriptive, no test): each MoE arm's excess slope against the erosion study's k3 fit
    at its realized k3 (``study.fits.off_fit`` over ``n`` fit resamples, with the MoE control's
    seeds as its reference)."""
    head = "Cross-study (rule 6, descriptive): "
    want = ERO_STUDY["arms"] * ERO_STUDY["seeds"]
    done = sum(len(v) for v in (erosion or {}).values())
    if erosion is None or done < want or ERO_CONTROL not in erosion:
        return [head + f"the erosion study is not complete ({done} of {want} runs), so it has no fit; nothing is placed.", ""]
    ec = erosion[ERO_CONTROL]
    if not all(r["guard"] and r["rows"] == ERO_STUDY["steps"] and r["start_acc"] >= ERO_STUDY["min_start_accuracy"]
               for r in ec):
        return [head + "the erosion study is void (its rule 1), so it has no fit; nothing is placed.", ""]
    hp = {a: {k: np.array([r[k] for r in v], float) for k in ("k3", "acc_slope", "gold_slope")}
          for a, v in erosion.items() if a.startswith(HEAD)}
    out = []
    for key in ("acc_slope", "gold_slope"):
        name = dict(OUTCOMES)[key].split(" per")[0]
        ctrl = np.array([r[key] for r in ec], float)
        ex = np.array([(hp[a][key].mean() - ctrl.mean()) / 100 for a in sorted(hp)])
        if fit_power(np.array([hp[a]["k3"].mean() for a in sorted(hp)]), ex) is None:
            out.append(head + f"{name}: the erosion study fitted no power law (fewer than 3 head_perturb arms with a "
                       f"negative mean excess); nothing is placed.")
            continue
        fits, _ = bootstrap_fit(hp, ctrl, key, n=n)
        out.append(head + f"{name}, each arm's excess over the MoE control (per step) minus the erosion fit at the "
                   f"arm's realized k3, with its 95% interval:")
        for a in mis:
            d, lo, hi = off_fit(fits, col[a]["k3"], col[a][key], control=col[CONTROL][key])
            where = ("costs what a head perturbation of the same k3 costs" if lo <= 0 <= hi else
                     "costs more than a head perturbation of the same k3" if hi < 0 else
                     "costs less than a head perturbation of the same k3")
            out.append(f"- {a}: realized k3 {fmt(float(col[a]['k3'].mean()))}, {d:+.2e} [{lo:+.2e}, {hi:+.2e}]: {where}.")
    return out + [""]


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", choices=("learn", "arms", "study", "layers"))
    ap.add_argument("sweep")
    ap.add_argument("--spec", default=str(SPEC), help=f"the study's spec (study only; default {SPEC.relative_to(ROOT)})")
    a = ap.parse_args(argv)
    print({"learn": learn, "arms": arms, "layers": layers,
           "study": lambda s: study(s, spec=a.spec)}[a.table](a.sweep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
