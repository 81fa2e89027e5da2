"""The pre-registered analysis of Study E2, growing mismatch (docs/FINDINGS.md, "Study E2"), from its sweep.

    python scripts/e2_tables.py study sweeps/e2

The study is docs/examples/e2.yaml: 5 mismatch arms (``control``, ``stale_2``, ``stale_4``, the
head_perturb geometric ``ramp`` and its time-averaged constant dose ``const``) x 3 LR arms
(``lr2e-4``, ``lr1e-4``, ``ld``: length decay from 2e-4) x 8 seeds x 400 steps, one condition per
run named ``<arm>_<lr>_s<seed>``. A run counts once it has finished at step 400 or diverged
(a fall, never excluded; ``study.sweep_runs.collect``). Until every run of the spec counts, the
output is one INCOMPLETE line naming the missing runs and nothing is computed (no interim analysis).

Per run (``run_record``), over the evaluations at steps 60-400 and over the late window 200-400:
mean ``val/accuracy`` and ``val/gold_logprob`` and their OLS slopes per 100 steps
(``study.endpoints.run_endpoints``); the realized k3 (mean ``rollout_corr/k3_kl`` over steps 60-400,
and over 1-400); the trend of log k3 (OLS slope per 100 steps over steps 1-400, the steps with
k3 > 0); the fall step under the plateau rule (``collapse.judge(rule="plateau")``); for each signal
the step it rises (``rise_step``) and, for a fall, its value at the fall against the start's.

The analysis (each number as registered; choices the text left open are in FINDINGS, "Analysis
fixed before the data (2026-11-25)"):
- Validity: all 24 control runs keep k3 exactly 0 and every token bitwise equal at every step, and
  score >= 0.95 at step 0; otherwise VOID and nothing else is computed.
- Primary endpoints (a)-(d): per condition the mean over seeds with 95% t- and seed-bootstrap
  intervals; against its LR arm's control the excess with a bootstrap interval, the exact
  permutation p (8 vs 8: all 12,870 relabelings) and Holm over the 12 treatment conditions per
  endpoint (``stats.compare_family``); a condition erodes when ``Comparison.below()``.
- Q1: per LR arm, ramp against constant on the late window (both slopes, both levels; Holm over
  the 3 LR arms per endpoint), plateau-rule falls per condition with Clopper-Pearson intervals and
  their steps, the ramp/constant realized-k3 ratio (flagged unmatched beyond 2x) and the decision.
- Q2: per mismatch arm, the geometric-mean k3 ratio of lr 1e-4 and of length decay to lr 2e-4
  (``compare_family`` on log k3: the difference of mean logs is the log ratio), Holm over 8.
- Q3: the falls at F > 80: per signal the falls warned with a Clopper-Pearson interval, the lead
  times, the false-alarm rate among the runs of the same conditions that did not fall, and whether
  the signal warns usefully; the falls at F <= 80 listed as early falls.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timlab.experiments.collapse import judge  # noqa: E402
from timlab.experiments.stats import bootstrap_ci, clopper_pearson, compare_family, line_fit, t_ci  # noqa: E402
from timlab.experiments.study.endpoints import run_endpoints  # noqa: E402
from timlab.experiments.study.sweep_runs import collect as collect_runs, seed_ranges  # noqa: E402
from timlab.experiments.study.text import comparison_cells, fmt, mean_cells  # noqa: E402
from timlab.experiments.sweep_spec import load_spec  # noqa: E402

SPEC = ROOT / "docs" / "examples" / "e2.yaml"
"""The registered sweep: the runs the analysis waits for."""
CONTROL, RAMP, CONST = "control", "ramp", "const"
ARMS = (CONTROL, "stale_2", "stale_4", RAMP, CONST)
"""The mismatch arms, as the run names spell them."""
LRS = ("lr2e-4", "lr1e-4", "ld")
"""The LR arms, as the run names spell them (``ld``: length decay); the first is the reference of Q2."""
LR_LABEL = {"lr2e-4": "lr 2e-4", "lr1e-4": "lr 1e-4", "ld": "length decay"}
LR_RATIO = {"lr1e-4": 0.5, "ld": 0.46875}
"""Each lower LR arm's mean LR over the 400 steps over 2e-4 (length decay: (1 + 1/2 + 1/4 + 1/8) / 4);
Q2's "more than the LR's square" bar is its square (0.25 and 0.22)."""
DESIGN = {"seeds": 8, "steps": 400, "start": 60, "late": 200, "min_start_accuracy": 0.95}
"""Seeds per condition, steps per run, first step of the primary window and of the late window,
and the validity bar for the controls' step-0 accuracy."""
KEYS = ("acc_level", "acc_slope", "gold_level", "gold_slope")
"""The per-run endpoints, in the registration's order (a)-(d)."""
LABEL = {"acc_level": "mean accuracy", "acc_slope": "accuracy slope per 100 steps",
         "gold_level": "mean gold log-prob", "gold_slope": "gold log-prob slope per 100 steps"}
SIGNALS = {"k3": ("rollout_corr/k3_kl", 1.5), "log-ppl abs diff": ("rollout_corr/log_ppl_abs_diff", 1.5),
           "grad norm": ("train/grad_norm", 1.5), "response length": ("train/response_length_mean", 1.2)}
"""Q3's signals: name -> (metric, the factor over its reference that makes a rise)."""
SCHEDULED = "k3 / magnitude^2"
"""k3 against the ramp's scheduled value (``mismatch/magnitude`` squared): a signal of the ramp arms only."""
REFERENCE = (21, 60)
"""A signal's reference is its median over these steps (inclusive)."""
TRAIL = 10
"""A rise is judged on the trailing mean of this many steps ..."""
RISE_AFTER = 60
"""... at the first step after this one."""
EARLY = 80
"""Falls at F <= this leave no room for a reference and a rise: early falls."""
START = (1, 5)
"""An early fall's signals are read against their mean over these steps."""
EQUIV = 0.02
"""Q1 "no": the late accuracy slope difference's interval within +-this, per 100 steps."""
GROWTH_FALLS = 3
"""Q1 "yes" by falls: the ramp falls in at least this many seeds and the constant arm in none."""
UNMATCHED = 2.0
"""Ramp and constant realized k3 (steps 1-400) further apart than this factor: flagged unmatched."""
MIN_FALLS = 3
"""With fewer falls at F > EARLY, they are listed one by one and no rate is computed."""
NAME = re.compile(rf"(?P<arm>{'|'.join(ARMS)})_(?P<lr>{'|'.join(LRS)})_s(?P<seed>\d+)")


# ------------------------------------------------------------------------------ one run
def rise_step(s: pd.Series, factor: float) -> int | None:
    """The first step t > RISE_AFTER at which the TRAIL-step trailing mean of ``s`` (indexed by
    step, one row per step) exceeds ``factor`` x its median over REFERENCE; None if it never does."""
    ref = s[(s.index >= REFERENCE[0]) & (s.index <= REFERENCE[1])].median()
    if not math.isfinite(ref):
        return None
    trail = s.rolling(TRAIL).mean()
    hit = trail[(trail.index > RISE_AFTER) & (trail > factor * ref)]
    return int(hit.index[0]) if len(hit) else None


def vs_start(s: pd.Series, step: int) -> float:
    """The TRAIL-step trailing mean of ``s`` at ``step`` (its last steps up to it) over its mean over START."""
    start = float(s[(s.index >= START[0]) & (s.index <= START[1])].mean())
    at = float(s[s.index <= step].iloc[-TRAIL:].mean())
    return at / start if start > 0 else math.nan


def run_record(m: pd.DataFrame, *, diverged: bool = False) -> dict:
    """One run's numbers for every question (see the module docstring)."""
    m = m.sort_values("step")
    win = run_endpoints(m, DESIGN["start"], diverged=diverged)
    late = run_endpoints(m, DESIGN["late"], diverged=diverged)
    train = m[m["step"] >= 1].set_index("step")
    k3 = train["rollout_corr/k3_kl"]
    pos = k3[k3 > 0]  # a stale run's first steps have k3 exactly 0 (the weights have not moved yet): no log
    sig = {n: train[col].dropna() for n, (col, _) in SIGNALS.items() if col in train.columns}
    factor = {n: f for n, (_, f) in SIGNALS.items()}
    if "mismatch/magnitude" in train.columns and (train["mismatch/magnitude"] > 0).all():
        sig[SCHEDULED], factor[SCHEDULED] = (k3 / train["mismatch/magnitude"] ** 2).dropna(), SIGNALS["k3"][1]
    fall = judge(m, rule="plateau", diverged=diverged)
    return {**{k: win[k] for k in KEYS}, **{f"late_{k}": late[k] for k in KEYS},
            "k3": win["k3"], "k3_all": float(k3.mean()),
            "k3_trend": line_fit(pos.index, [math.log(v) for v in pos])[0] * 100 if len(pos) >= 2 else math.nan,
            "guard": win["guard"], "rows": win["rows"], "start_acc": win["start_acc"], "fall": fall,
            "rise": {n: rise_step(s, factor[n]) for n, s in sig.items()},
            "vs_start": {n: vs_start(s, fall) for n, s in sig.items()} if fall is not None else {}}


# ------------------------------------------------------------------------------ the runs
def parse(name: str) -> tuple[str, str, int]:
    """(mismatch arm, LR arm, seed) of a run name ``<arm>_<lr>_s<seed>``."""
    m = NAME.fullmatch(name)
    if m is None:
        raise ValueError(f"{name!r} is not an E2 run name <arm>_<lr>_s<seed> (arms {', '.join(ARMS)}; "
                         f"LR arms {', '.join(LRS)})")
    return m["arm"], m["lr"], int(m["seed"])


def expected(spec: str | Path = SPEC) -> list[str]:
    """The run names of the spec, checked to be the registered grid (arms x LR arms x seeds)."""
    names = [c.name for c in load_spec(spec).conditions]
    grid = {f"{a}_{lr}_s{s}" for a in ARMS for lr in LRS for s in range(DESIGN["seeds"])}
    if len(names) != len(grid) or set(names) != grid:
        raise ValueError(f"{spec}: its conditions are not the registered {len(ARMS)} arms x {len(LRS)} LR arms x "
                         f"{DESIGN['seeds']} seeds named <arm>_<lr>_s<seed>")
    return names


def collect(sweep: str) -> dict[str, dict]:
    """Run name -> ``run_record`` of every run that counts (``study.sweep_runs.collect``'s rule)."""
    per = collect_runs(sweep, DESIGN, key=lambda c: c,
                    endpoints=lambda m, start, diverged: run_record(m, diverged=diverged))
    twice = [n for n, r in per.items() if len(r) > 1]
    if twice:
        raise ValueError(f"{sweep}: more than one run of {', '.join(twice)}")
    return {n: r[0] for n, r in per.items()}


def incomplete(done: int, want: int, missing: list[str]) -> str:
    """The one line printed instead of any number while runs are missing (no interim analysis)."""
    by: dict[str, list[int]] = {}
    for n in missing:
        a, lr, s = parse(n)
        by.setdefault(f"{a}_{lr}", []).append(s)
    groups: dict[tuple, list[str]] = {}
    for c, s in by.items():
        groups.setdefault(tuple(sorted(s)), []).append(c)
    n_cond = len(ARMS) * len(LRS)
    parts = [f"{'seed' if len(s) == 1 else 'seeds'} {seed_ranges(s)} of {f'all {n_cond} conditions' if len(cs) == n_cond else ', '.join(cs)}"
             for s, cs in groups.items()]
    return (f"INCOMPLETE: {done} of {want} runs finished at step {DESIGN['steps']} (missing: {'; '.join(parts)}); "
            f"no endpoint is computed before the study is complete (no interim analysis).")


def conditions() -> list[str]:
    return [f"{a}_{lr}" for lr in LRS for a in ARMS]


def per_condition(runs: dict[str, dict]) -> dict[str, list[dict]]:
    """Condition ``<arm>_<lr>`` -> its runs' records in seed order (every run must be there)."""
    return {c: [runs[f"{c}_s{s}"] for s in range(DESIGN["seeds"])] for c in conditions()}


def values(recs: list[dict], key: str) -> np.ndarray:
    return np.array([r[key] for r in recs], float)  # (seeds,)


def family(groups: dict[str, np.ndarray], refs: dict[str, np.ndarray]) -> tuple[dict, list[str]]:
    """``compare_family`` over the members whose values are all finite, and the names of the
    others (a run that diverged before a window has no value there); they stay out of the Holm family."""
    ok = [a for a in groups if np.isfinite(groups[a]).all() and np.isfinite(refs[a]).all()]
    cmp = compare_family({a: groups[a] for a in ok}, {a: refs[a] for a in ok}) if ok else {}
    return cmp, [a for a in groups if a not in ok]


# ------------------------------------------------------------------------------ the questions
def validity(per: dict[str, list[dict]]) -> tuple[bool, str]:
    """Decision rule 1 over the 24 control runs: (valid, the line that says so)."""
    ctrl = [r for lr in LRS for r in per[f"{CONTROL}_{lr}"]]
    guard = all(r["guard"] and r["rows"] == DESIGN["steps"] for r in ctrl)
    start = min(r["start_acc"] for r in ctrl)
    valid = guard and start >= DESIGN["min_start_accuracy"]
    return valid, (f"Validity: control guard (k3 exactly 0, every token bitwise equal, at each of the "
                   f"{DESIGN['steps']} steps of all {len(ctrl)} control runs) {'held' if guard else 'BROKEN'}; "
                   f"control step-0 accuracy {start:.3f} (bar {DESIGN['min_start_accuracy']}): "
                   f"{'VALID' if valid else 'VOID (re-run, do not analyse)'}.")


def primary(per: dict[str, list[dict]]) -> dict[str, tuple[dict, list[str]]]:
    """Endpoint -> (condition -> Comparison against its LR arm's control, Holm over the 12
    treatment conditions; conditions left out for a missing value)."""
    treat = [(a, lr) for lr in LRS for a in ARMS[1:]]
    return {k: family({f"{a}_{lr}": values(per[f"{a}_{lr}"], k) for a, lr in treat},
                      {f"{a}_{lr}": values(per[f"{CONTROL}_{lr}"], k) for a, lr in treat}) for k in KEYS}


def late(per: dict[str, list[dict]]) -> dict[str, tuple[dict, list[str]]]:
    """Late-window endpoint -> (LR arm -> Comparison of the ramp against the constant arm, Holm over the 3 LR arms)."""
    return {k: family({lr: values(per[f"{RAMP}_{lr}"], f"late_{k}") for lr in LRS},
                      {lr: values(per[f"{CONST}_{lr}"], f"late_{k}") for lr in LRS}) for k in KEYS}


def falls(per: dict[str, list[dict]]) -> dict[str, dict]:
    """Condition -> its plateau-rule falls: count k of n, Clopper-Pearson interval, {seed: fall step}."""
    out = {}
    for c, recs in per.items():
        steps = {s: r["fall"] for s, r in enumerate(recs) if r["fall"] is not None}
        out[c] = {"k": len(steps), "n": len(recs), "ci": clopper_pearson(len(steps), len(recs)), "steps": steps}
    return out


def growth(per: dict[str, list[dict]], lat: dict, fl: dict) -> dict[str, dict]:
    """Decision rule 3 per LR arm (Q1), on the late accuracy slope and the falls."""
    cmp, _ = lat["acc_slope"]
    out = {}
    for lr in LRS:
        c = cmp.get(lr)
        slope_yes = bool(c is not None and c.below())
        fall_yes = fl[f"{RAMP}_{lr}"]["k"] >= GROWTH_FALLS and fl[f"{CONST}_{lr}"]["k"] == 0
        within = bool(c is not None and -EQUIV <= c.diff_ci[0] and c.diff_ci[1] <= EQUIV)
        k3 = {a: float(values(per[f"{a}_{lr}"], "k3_all").mean()) for a in (RAMP, CONST)}
        k3r = k3[RAMP] / k3[CONST]
        out[lr] = {"slope": slope_yes, "falls": fall_yes, "within": within, "k3": k3, "k3_ratio": k3r,
                   "matched": 1 / UNMATCHED <= k3r <= UNMATCHED,
                   "verdict": "yes" if slope_yes or fall_yes else "no" if within else "undecided"}
    return out


def shrink(per: dict[str, list[dict]]) -> tuple[dict, list[str]]:
    """Q2: (mismatch arm, LR arm) -> Comparison of log k3 (steps 60-400) against the arm at
    lr 2e-4, Holm over the 8; exp of its difference and interval is the geometric-mean ratio."""
    with np.errstate(divide="ignore"):
        logk = {c: np.log(values(recs, "k3")) for c, recs in per.items()}
    pairs = [(a, lr) for a in ARMS[1:] for lr in LRS[1:]]
    cmp, dropped = family({p: logk[f"{p[0]}_{p[1]}"] for p in pairs}, {p: logk[f"{p[0]}_{LRS[0]}"] for p in pairs})
    return cmp, dropped


def signals(per: dict[str, list[dict]]) -> dict:
    """Q3: the falls at F > EARLY and the early ones, and per signal its warnings, lead times and
    false alarms (see the module docstring)."""
    fallen = [(c, s, r) for c, recs in per.items() for s, r in enumerate(recs) if r["fall"] is not None]
    later = [x for x in fallen if x[2]["fall"] > EARLY]
    early = [x for x in fallen if x[2]["fall"] <= EARLY]
    conds = sorted({c for c, _, _ in later})
    stayed = [(c, r) for c in conds for r in per[c] if r["fall"] is None]
    rows = {}
    for name in (*SIGNALS, SCHEDULED):
        only = (lambda c: c.startswith(RAMP + "_")) if name == SCHEDULED else (lambda c: True)
        fl = [(c, s, r) for c, s, r in later if only(c)]
        ok = [(c, r) for c, r in stayed if only(c)]
        leads = [r["fall"] - r["rise"][name] for _, _, r in fl if r["rise"].get(name) is not None]
        warned = sum(x > 0 for x in leads)
        alarms = sum(r["rise"].get(name) is not None for _, r in ok)
        wci = clopper_pearson(warned, len(fl)) if fl else (math.nan, math.nan)
        aci = clopper_pearson(alarms, len(ok)) if ok else (math.nan, math.nan)
        rows[name] = {"falls": len(fl), "warned": warned, "warned_ci": wci, "leads": sorted(leads),
                      "stayed": len(ok), "alarms": alarms, "alarms_ci": aci,
                      "useful": bool(fl and ok and warned > len(fl) / 2 and aci[1] < wci[0])}
    return {"late": later, "early": early, "conditions": conds, "rows": rows}


# ------------------------------------------------------------------------------ markdown
def _left_out(dropped: list[str]) -> list[str]:
    return [f"Left out of this family (a run without a value: it diverged before the window): "
            f"{', '.join(map(str, dropped))}.", ""] if dropped else [""]


def _primary_md(per, prim) -> list[str]:
    out = []
    for k in KEYS:
        cmp, dropped = prim[k]
        out += [f"**{LABEL[k]}, steps {DESIGN['start']}-{DESIGN['steps']}**", "",
                "| condition | realized k3 | mean [95% t] [95% bootstrap] | excess over its LR arm's control "
                "[95% bootstrap] | permutation p | Holm p | erodes |", "|---|---:|---:|---:|---:|---:|---|"]
        for c in conditions():
            k3 = fmt(float(values(per[c], "k3").mean()))
            if c in cmp:
                r = cmp[c]
                erodes = "**yes**" if r.below() else f"no (costs {r.cost_bound()})"
                out.append(f"| {c} | {k3} | {comparison_cells(r)} | {erodes} |")
            else:
                out.append(f"| {c} | {k3} | {mean_cells(values(per[c], k))} | - | - | - | - |")
        out += _left_out(dropped)
    return out


def _q1_md(per, lat, fl, gr) -> list[str]:
    out = [f"**Q1: the ramp against the constant arm, late window (steps {DESIGN['late']}-{DESIGN['steps']}); "
           f"Holm over the {len(LRS)} LR arms per endpoint**", "",
           "| endpoint | LR arm | ramp mean [95% t] [95% bootstrap] | ramp minus constant [95% bootstrap] | "
           "permutation p | Holm p | ramp lower |", "|---|---|---:|---:|---:|---:|---|"]
    for k in KEYS:
        cmp, dropped = lat[k]
        for lr in LRS:
            if lr in cmp:
                r = cmp[lr]
                out.append(f"| {LABEL[k]} | {LR_LABEL[lr]} | {comparison_cells(r)} | {'**yes**' if r.below() else 'no'} |")
            else:
                out.append(f"| {LABEL[k]} | {LR_LABEL[lr]} | left out (a run without a value) | - | - | - | - |")
    out += ["", "| condition | falls (plateau rule) [95% Clopper-Pearson] | fall steps (seed: step) |", "|---|---:|---|"]
    for c in conditions():
        f = fl[c]
        steps = ", ".join(f"s{s}: {t}" for s, t in f["steps"].items()) or "-"
        out.append(f"| {c} | {f['k']}/{f['n']} [{f['ci'][0]:.2f}, {f['ci'][1]:.2f}] | {steps} |")
    out += ["", "| LR arm | realized k3 steps 1-400: ramp, constant (ratio) | late accuracy slope: ramp lower | "
            f"ramp falls >= {GROWTH_FALLS}, constant none | late-slope difference within +-{EQUIV} | "
            "growth matters (Q1) |", "|---|---:|---|---|---|---|"]
    for lr in LRS:
        g = gr[lr]
        out.append(f"| {LR_LABEL[lr]} | {fmt(g['k3'][RAMP])}, {fmt(g['k3'][CONST])} ({g['k3_ratio']:.2f}"
                   f"{'' if g['matched'] else ', UNMATCHED'}) | "
                   f"{'yes' if g['slope'] else 'no'} | {'yes' if g['falls'] else 'no'} | "
                   f"{'yes' if g['within'] else 'no'} | **{g['verdict']}** |")
    return out + [""]


def _q2_md(per, cmp, dropped) -> list[str]:
    out = [f"**Q2: does a lower LR shrink the realized k3 (steps {DESIGN['start']}-{DESIGN['steps']})? Ratio of "
           f"geometric means to lr 2e-4; permutation p of log k3, Holm over {len(ARMS[1:]) * len(LRS[1:])}**", "",
           "| mismatch arm | LR arm | geometric-mean k3 [95% bootstrap] | log-k3 trend per 100 steps, steps 1-400 "
           "[95% t] | ratio to lr 2e-4 [95% bootstrap] | permutation p | Holm p | shrinks (Q2) | below the LR's "
           "square |", "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for a in ARMS[1:]:
        for lr in LRS:
            with np.errstate(divide="ignore"):
                logk = np.log(values(per[f"{a}_{lr}"], "k3"))
            g = bootstrap_ci(logk) if np.isfinite(logk).all() else (-math.inf, -math.inf)
            tr = values(per[f"{a}_{lr}"], "k3_trend")
            tm, tlo, thi = t_ci(tr) if np.isfinite(tr).all() else (math.nan,) * 3
            row = (f"| {a} | {LR_LABEL[lr]} | {fmt(float(np.exp(logk.mean())))} [{fmt(math.exp(g[0]))}, "
                   f"{fmt(math.exp(g[1]))}] | {tm:+.3f} [{tlo:+.3f}, {thi:+.3f}] | ")
            r = cmp.get((a, lr))
            if lr == LRS[0] or r is None:
                out.append(row + ("- | - | - | - | - |" if lr == LRS[0] else "left out (a run without k3) | - | - | - | - |"))
                continue
            bar = LR_RATIO[lr] ** 2
            lo, hi = math.exp(r.diff_ci[0]), math.exp(r.diff_ci[1])
            out.append(row + f"{math.exp(r.diff):.3f} [{lo:.3f}, {hi:.3f}] | {r.p:.4f} | {r.p_holm:.4f} | "
                             f"{'**yes**' if r.below() else 'no'} | {'**yes**' if r.below() and hi < bar else 'no'} "
                             f"(bar {bar:.2f}) |")
    return out + _left_out([f"{a} {LR_LABEL[lr]}" for a, lr in dropped])


def _q3_md(sg) -> list[str]:
    names = (*SIGNALS, SCHEDULED)
    out = [f"**Q3: signals before falls.** Falls at F > {EARLY}: {len(sg['late'])}; early falls (F <= {EARLY}): "
           f"{len(sg['early'])}. A signal rises at the first step t > {RISE_AFTER} whose {TRAIL}-step trailing mean "
           f"exceeds 1.5x its median over steps {REFERENCE[0]}-{REFERENCE[1]} (1.2x for response length); lead = F - t.", ""]
    if len(sg["late"]) < MIN_FALLS:
        out.append(f"Fewer than {MIN_FALLS} falls at F > {EARLY}: listed one by one, no rate computed." if sg["late"]
                   else f"No fall at F > {EARLY}: no lead time to measure.")
        if sg["late"]:
            out += ["", "| condition | seed | F | " + " | ".join(f"{n}: rise (lead)" for n in names) + " |",
                    "|---|---:|---:|" + "---|" * len(names)]
            for c, s, r in sg["late"]:
                cells = [("-" if r["rise"].get(n) is None else f"{r['rise'][n]} ({r['fall'] - r['rise'][n]:+d})")
                         if n != SCHEDULED or c.startswith(RAMP + "_") else "n/a" for n in names]
                out.append(f"| {c} | {s} | {r['fall']} | " + " | ".join(cells) + " |")
    else:
        out += [f"Conditions with a fall at F > {EARLY}: {', '.join(sg['conditions'])} (false alarms are counted among "
                f"their runs that did not fall; {SCHEDULED}: ramp arms only).", "",
                "| signal | falls warned (lead > 0) [95% Clopper-Pearson] | lead times where it rose: median (range) | "
                "false alarms [95% Clopper-Pearson] | warns usefully |", "|---|---:|---:|---:|---|"]
        for n in names:
            r = sg["rows"][n]
            if not r["falls"]:
                out.append(f"| {n} | no fall in its arms | - | - | - |")
                continue
            lead = (f"{float(np.median(r['leads'])):+.0f} ({r['leads'][0]:+d} to {r['leads'][-1]:+d})"
                    if r["leads"] else "never rose")
            alarms = (f"{r['alarms']}/{r['stayed']} [{r['alarms_ci'][0]:.2f}, {r['alarms_ci'][1]:.2f}]" if r["stayed"]
                      else "no run stayed up")
            out.append(f"| {n} | {r['warned']}/{r['falls']} [{r['warned_ci'][0]:.2f}, {r['warned_ci'][1]:.2f}] | {lead} | "
                       f"{alarms} | {'**yes**' if r['useful'] else 'no'} |")
    if sg["early"]:
        out += ["", f"Early falls (F <= {EARLY}), each signal's {TRAIL}-step trailing mean at F over its mean over steps "
                f"{START[0]}-{START[1]}:", "",
                "| condition | seed | F | " + " | ".join(names) + " |", "|---|---:|---:|" + "---:|" * len(names)]
        for c, s, r in sg["early"]:
            cells = [_g(r["vs_start"].get(n, math.nan)) if n != SCHEDULED or c.startswith(RAMP + "_") else "n/a"
                     for n in names]
            out.append(f"| {c} | {s} | {r['fall']} | " + " | ".join(cells) + " |")
    return out


def _g(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.2f}x"


def analyse(runs: dict[str, dict], names: list[str]) -> str:
    """The pre-registered analysis of the runs' records (``collect``) as markdown, or the
    INCOMPLETE line while any of ``names`` (``expected``) is missing."""
    missing = [n for n in names if n not in runs]
    if missing:
        return incomplete(len(names) - len(missing), len(names), missing)
    per = per_condition(runs)
    valid, line = validity(per)
    if not valid:
        return line
    lat, fl = late(per), falls(per)
    q2, dropped = shrink(per)
    out = [line, ""] + _primary_md(per, primary(per)) + _q1_md(per, lat, fl, growth(per, lat, fl)) \
        + _q2_md(per, q2, dropped) + _q3_md(signals(per))
    return "\n".join(out).rstrip("\n")


def study(sweep: str, spec: str | Path = SPEC) -> str:
    """The pre-registered analysis of the E2 sweep as markdown (see the module docstring)."""
    return analyse(collect(sweep), expected(spec))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", choices=("study",))
    ap.add_argument("sweep")
    ap.add_argument("--spec", default=str(SPEC), help="the sweep spec whose runs the analysis waits for")
    a = ap.parse_args(argv)
    print(study(a.sweep, a.spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
