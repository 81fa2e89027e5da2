"""Tables of Study E3, length at fixed difficulty (docs/FINDINGS.md, "Study E3"), from its sweeps,
besides the pre-registered analyses of E3, E3b and E3d, which are study files analysed by the
package (``timlab.experiments.study``)::

    timlab study analyze docs/examples/studies/e3.yaml    # E3 (e3b.yaml: E3b; e3d.yaml: E3d)

    python scripts/e3_tables.py starts sweeps/e3_starts
    python scripts/e3_tables.py followup sweeps/e3_starts_rl
    python scripts/e3_tables.py figure sweeps/e3 --out docs/img/e3_length.png
    python scripts/e3_tables.py predict sweeps/e3c             # E3c: E3b's fit tested at a new length

``starts``: the calibration of E3's learned starts (docs/examples/e3_starts.yaml): per condition
(verbosity level, SFT step count), the greedy accuracy and gold log-prob at the step-0 evaluation
(the SFT's own) and after 10 and 20 zero-mismatch RL steps, the step-0 gold log-prob per answer
token (over the level's mean worked answer + EOS), the share of GRPO groups kept (not all-equal:
0 means RL makes no update) and the mean sampled response length over steps 1-20.

``followup``: the run directories of a folder (the RL runs made after the calibration, from
chosen SFT lengths; FINDINGS gives their commands): each evaluation's greedy accuracy and gold
log-prob, and the share of GRPO groups kept.

``predict``: the out-of-sample test pre-registered in FINDINGS ("Study E3c"), run only when both
its sweep (``--spec``, default docs/examples/e3c.yaml) and the fit's (``--fit``/``--fit-spec``,
default sweeps/e3b) are complete. The fit's cells (its valid levels) are fitted three ways: the
registered free fit (alpha, beta), and one power of T * k3 or of T^2 * k3 (``fit_shape``); each
predicts the accuracy-level loss of every treated cell of the test sweep (a level the fit did not
see) at that cell's realized k3 and its control's T. D = measured loss - predicted, with a 95%
bootstrap interval over 2,000 joint resamples of both studies' seeds: an interval holding 0 is
consistent. "T * k3 holds out of sample" when its prediction is consistent and T^2 * k3's is not
(and the reverse); then the test level's own tables as E3's study file registers them (per level:
validity, realized k3 and length, the erosion families with Holm over the level's arms, falls),
and the free length fit over all levels together (descriptive; ``study.fits.length_section``).

``figure``: each treated (level, arm) cell's accuracy cost against k3, T * k3 and T^2 * k3.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timlab.experiments.study.endpoints import run_endpoints  # noqa: E402
from timlab.experiments.study.fits import (fit_length, fit_shape, fmt_loss, length_cells, length_section,  # noqa: E402
                                           threshold_section)
from timlab.experiments.study.sweep_runs import collect, incomplete_line, runs, sweep_states  # noqa: E402
from timlab.experiments.study.text import comparison_cells, fmt, mean_cells  # noqa: E402
from timlab.experiments.stats import N_BOOT, bootstrap_ci, bootstrap_diff_ci, clopper_pearson, compare_family, least_squares, t_ci  # noqa: E402
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


# ------------------------------------------------------------------------------ the study
SPEC = ROOT / "docs" / "examples" / "e3.yaml"
"""The registered study's spec: its conditions (``v<L>_<arm>_s<seed>``) are the runs the analysis waits for."""
STUDY = {"steps": 150, "start": 50, "min_start_accuracy": 0.95}
"""The registered design besides the spec's runs: steps per run, the first step of the outcome
window, and the validity bar for each level's step-0 accuracy."""
CONTROL = "control"
"""The zero-mismatch arm's name in the spec's conditions."""
ENDPOINTS = (("acc_level", "mean accuracy"), ("acc_slope", "accuracy slope per 100 steps"),
             ("gold_level", "mean gold log-prob"), ("gold_slope", "gold log-prob slope per 100 steps"))
"""The primary endpoints (key, label); each is one Holm family per level (the level's treatment arms)."""
RHO = {"T * k3": 1.0, "T^2 * k3": 2.0}
"""The two hypotheses for rho = beta / alpha."""
UNBOUNDED = 10.0
"""A predicted loss above this prints as "unbounded" (``fits.fmt_loss``)."""
THRESHOLD = {"title": "The threshold fit's test",
             "note": " (k3*(T) = 1e-3 x (T / 465)^-1.85 at each level's mean worked answer; a cell above it should "
                     "fall in at least half its seeds, one below it in fewer)"}
"""How the threshold test's section opens (``fits.threshold_section``, the threshold study's law)."""
FIT_SWEEP = ROOT / "sweeps" / "e3b"
FIT_SPEC = ROOT / "docs" / "examples" / "e3b.yaml"
"""The sweep whose length fit E3c tests out of sample, and its spec."""
TEST_SPEC = ROOT / "docs" / "examples" / "e3c.yaml"
"""E3c's spec: the level the fit did not see (``predict``)."""


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


def _validity(per: dict, cells: list, lv: int, design: dict) -> tuple[bool, str]:
    """Registered validity of one level: its controls' guard held at every step, and every run of the
    level evaluated the same start at step 0, at or above the accuracy bar."""
    guard = all(r["guard"] and r["rows"] == design["steps"] for r in per[lv, CONTROL])
    starts = {(r["start_step"], r["start_acc"], r["start_gold"]) for k in cells if k[0] == lv for r in per[k]}
    s0 = next(iter(starts))
    learned = s0[1] >= design["min_start_accuracy"]
    ok = guard and len(starts) == 1 and s0[0] == 0 and learned
    return ok, (f"Validity, level {lv}: control guard (k3 exactly 0, every token bitwise equal, every step) "
                f"{'held' if guard else 'BROKEN'}; step-0 evaluation "
                + (f"the same in all its runs (accuracy {s0[1]:.3f}, gold log-prob {s0[2]:.3f})" if len(starts) == 1
                   else f"DIFFERS between its runs ({len(starts)} distinct)")
                + ("" if learned or len(starts) > 1 else f", below the bar {design['min_start_accuracy']}")
                + f": {'VALID' if ok else 'VOID (left out of every table and the fit)'}.")


def _mechanism(col: dict, ok: list[int], arms: dict, T: dict, design: dict) -> list[str]:
    out = [f"**Realized mismatch and length** (means over steps {design['start']}-{design['steps']}, then over seeds)", "",
           "| level | arm | realized k3 [95% t] [95% bootstrap] | mean response length | T * k3 | T^2 * k3 |",
           "|---:|---|---:|---:|---:|---:|"]
    for lv in ok:
        for a in (CONTROL, *arms[lv]):
            c = col[lv, a]
            mu, lo, hi = t_ci(c["k3"])
            blo, bhi = bootstrap_ci(c["k3"])
            out.append(f"| {lv} | {a} | {fmt(mu)} [{fmt(lo)}, {fmt(hi)}] [{fmt(blo)}, {fmt(bhi)}] | "
                       f"{float(c['length'].mean()):.1f} | {fmt(T[lv] * mu)} | {fmt(T[lv] ** 2 * mu)} |")
    return out + ["", "T is the level's control mean response length (the fit's T).", ""]


def _outcome(col: dict, ok: list[int], arms: dict, key: str, label: str, erodes: dict) -> list[str]:
    out = [f"**{label}** (per level, Holm over the level's {_arms(max((len(v) for v in arms.values()), default=0))})", "",
           "| level | arm | mean [95% t] [95% bootstrap] | excess over control [95% bootstrap] | permutation p | "
           "Holm p | verdict |", "|---:|---|---:|---:|---:|---:|---|"]
    for lv in ok:
        ctrl = col[lv, CONTROL][key]
        cmp = compare_family({a: col[lv, a][key] for a in arms[lv]}, {a: ctrl for a in arms[lv]})
        out.append(f"| {lv} | {CONTROL} | {mean_cells(ctrl)} | - | - | - | - |")
        for a in arms[lv]:
            r = cmp[a]
            erodes[lv, a, key] = r.below()
            verdict = "**erodes**" if r.below() else f"no detectable erosion (costs {r.cost_bound()})"
            out.append(f"| {lv} | {a} | {comparison_cells(r)} | {verdict} |")
    return out + [""]


def _arms(k: int) -> str:
    return "1 treatment arm: no correction" if k == 1 else f"{k} treatment arms"


def _falls(per: dict, ok: list[int], arms: dict, design: dict) -> list[str]:
    out = ["**Falls and final values**", "", f"| level | arm | falls (plateau rule) [95% Clopper-Pearson] | "
           f"k3 first 20 -> last 20 steps | accuracy at step {design['steps']} [95% t] |", "|---:|---|---:|---|---:|"]
    for lv in ok:
        for a in (CONTROL, *arms[lv]):
            rs = per[lv, a]
            k = sum(r["fell"] for r in rs)
            clo, chi = clopper_pearson(k, len(rs))
            fa = t_ci([r["final_acc"] for r in rs])
            out.append(f"| {lv} | {a} | {k}/{len(rs)} [{clo:.2f}, {chi:.2f}] | "
                       f"{fmt(float(np.mean([r['k3_first'] for r in rs])))} -> "
                       f"{fmt(float(np.mean([r['k3_last'] for r in rs])))} | {fa[0]:.3f} [{fa[1]:.3f}, {fa[2]:.3f}] |")
    return out + [""]


def _elementwise(fn, k, t):
    """``fn(k, t)`` over broadcast arrays with the standard library's ``math`` (the same bits on every
    CPU, unlike numpy's SIMD exp and log): a float for scalar inputs, else an array of their shape."""
    kb, tb = np.broadcast_arrays(np.asarray(k, dtype=float), np.asarray(t, dtype=float))
    out = np.array([fn(a, b) for a, b in zip(kb.ravel().tolist(), tb.ravel().tolist())]).reshape(kb.shape)
    return float(out) if out.ndim == 0 else out


def _predictors(k3, T, ex, level) -> dict:
    """Each hypothesis fitted on the fit's cells, as a function (k3, T) -> predicted loss (None: no fit)."""
    out = {}
    f = fit_length(k3, T, ex, level)
    out["the registered fit (alpha, beta free)"] = None if f is None else (
        lambda k, t, f=f: _elementwise(lambda kk, tt: math.exp(f[0] + f[1] * math.log(kk) + f[2] * math.log(tt)), k, t))
    for h, rho in RHO.items():
        g = fit_shape(k3, T, ex, level, rho)
        out[h] = None if g is None else (lambda k, t, g=g, rho=rho: _elementwise(
            lambda kk, tt: math.exp(g[0] + g[1] * math.log(tt ** rho * kk)), k, t))
    return out


PREDICT_AT = {"T": 300.0, "k3": (1.0e-3, 1.3e-3, 1.6e-3)}
"""Where E3c's registered predictions were tabulated before its runs: level 3's T and the k3 its dose was expected to realize."""


def predictions(fit_sweep: str | Path = FIT_SWEEP, fit_spec: str | Path = FIT_SPEC, *, at: dict = PREDICT_AT,
                design: dict = STUDY, n: int = N_BOOT, seed: int = 0) -> str:
    """E3c's prediction table (FINDINGS, "Study E3c"): each hypothesis fitted on the fit sweep's
    treated cells (``_predictors``), its loss at ``at["T"]`` and each ``at["k3"]``, with a 95%
    interval over ``n`` seed resamples of the fit's cells (as ``_prediction`` draws them)."""
    want = [c.name for c in load_spec(fit_spec).conditions]
    refusal = _refusal(str(fit_sweep), want, design)
    if refusal:
        return f"{refusal} ({_shown(fit_sweep)})"
    cells, per = _in_spec(collect(str(fit_sweep), design, key=cell, endpoints=study_endpoints), want)
    col = _columns(per, cells)
    treated = [k for k in cells if k[1] != CONTROL]
    full = length_cells(col, treated, "acc_level")
    pred = _predictors(*full)
    rng = np.random.default_rng(seed)
    reps = [_predictors(*length_cells(col, treated, "acc_level", rng=rng)) for _ in range(n)]
    label = {"the registered fit (alpha, beta free)": "the registered fit, log loss = a + alpha log k3 + beta log T"}
    for h, rho in RHO.items():
        g = fit_shape(*full, rho)
        label[h] = f"one power of {h} (exponent {g[1]:.2f})" if g else f"one power of {h} (no fit)"
    T = at["T"]
    out = [f"| hypothesis fitted on the {len(treated)} cells | " + " | ".join(f"k3 {k:.1e}" for k in at["k3"]) + " |",
           "|---|" + "---:|" * len(at["k3"])]
    for h, f in pred.items():
        row = []
        for k in at["k3"]:
            v = np.array([r[h](k, T) for r in reps if r[h] is not None])
            row.append("no fit" if f is None else
                       f"{fmt_loss(float(f(k, T)), UNBOUNDED)} [{fmt_loss(float(np.percentile(v, 2.5)), UNBOUNDED)}, "
                       f"{fmt_loss(float(np.percentile(v, 97.5)), UNBOUNDED)}]")
        out.append(f"| {label[h]} | " + " | ".join(row) + " |")
    return "\n".join(out)


def predict(sweep: str, *, spec: str | Path = TEST_SPEC, fit_sweep: str | Path = FIT_SWEEP,
            fit_spec: str | Path = FIT_SPEC, design: dict = STUDY, n: int = N_BOOT, seed: int = 0) -> str:
    """E3c's pre-registered analysis (FINDINGS, "Study E3c"): the length fit of ``fit_sweep`` (E3b)
    predicts the accuracy-level cost of each treated cell of ``sweep`` (a level it did not see) at
    the cell's realized k3 and T; the measured cost is compared with each prediction. Both sweeps
    must be complete (no interim analysis)."""
    want_fit = [c.name for c in load_spec(fit_spec).conditions]
    want = [c.name for c in load_spec(spec).conditions]
    for where, names in ((fit_sweep, want_fit), (sweep, want)):
        refusal = _refusal(str(where), names, design)
        if refusal:
            return f"{refusal} ({_shown(where)})"
    per_fit = collect(str(fit_sweep), design, key=cell, endpoints=study_endpoints)
    per = collect(str(sweep), design, key=cell, endpoints=study_endpoints)
    return out_of_sample(per_fit, want_fit, per, want, design=design, n=n, seed=seed)


def out_of_sample(per_fit: dict, want_fit: list[str], per: dict, want: list[str], *, design: dict = STUDY,
                  n: int = N_BOOT, seed: int = 0) -> str:
    """``predict``'s analysis of per-cell run endpoints (``collect`` with ``key=cell``)."""
    fit_cells, per_fit = _in_spec(per_fit, want_fit)
    cells, per = _in_spec(per, want)
    if {lv for lv, _ in cells} & {lv for lv, _ in fit_cells}:
        raise ValueError("the test's levels must be levels the fit did not see")
    colf, col = _columns(per_fit, fit_cells), _columns(per, cells)
    out, fit_ok, ok = [], [], []
    for lv in sorted({lv for lv, _ in fit_cells}):
        valid, line = _validity(per_fit, fit_cells, lv, design)
        fit_ok += [lv] if valid else []
        out.append("The fit's " + line[0].lower() + line[1:])
    for lv in sorted({lv for lv, _ in cells}):
        valid, line = _validity(per, cells, lv, design)
        ok += [lv] if valid else []
        out.append("The test's " + line[0].lower() + line[1:])
    out.append("")
    if not ok:
        return "\n".join(out + ["No valid test level: no test."])
    arms = {lv: [a for v, a in cells if v == lv and a != CONTROL] for lv in ok}
    T = {lv: float(col[lv, CONTROL]["length"].mean()) for lv in ok}
    out += _mechanism(col, ok, arms, T, design)
    for key, label in ENDPOINTS:
        out += _outcome(col, ok, arms, key, f"{label}, evaluations at steps {design['start']}-{design['steps']}", {})
    out += _falls(per, ok, arms, design)
    fit_treated = [(lv, a) for lv, a in fit_cells if lv in fit_ok and a != CONTROL]
    treated = [(lv, a) for lv in ok for a in arms[lv]]
    out += _prediction(colf, fit_treated, col, treated, n=n, seed=seed)
    both = {**colf, **col}
    out += length_section(both, fit_treated + treated, "acc_level",
                          "mean accuracy over the fit's and the test's levels (descriptive)", n=n, seed=seed)
    return "\n".join(out + threshold_section(col, treated, ANSWER_TOKENS, **THRESHOLD))


def _prediction(colf: dict, fit_treated: list, col: dict, treated: list, *, n: int, seed: int) -> list[str]:
    """The registered test: per treated test cell and hypothesis, the measured accuracy-level loss
    minus the predicted one, D, with a 95% bootstrap interval over joint resamples of both studies'
    seeds; an interval holding 0 is consistent with the hypothesis."""
    k3, T, ex, _ = length_cells(col, treated, "acc_level")
    pred = _predictors(*length_cells(colf, fit_treated, "acc_level"))
    rng = np.random.default_rng(seed)
    D, P = {h: [] for h in pred}, {h: [] for h in pred}
    failed = dict.fromkeys(pred, 0)
    for _ in range(n):
        fr = _predictors(*length_cells(colf, fit_treated, "acc_level", rng=rng))
        kt, Tt, et, _ = length_cells(col, treated, "acc_level", rng=rng)
        for h, f in fr.items():
            if f is None:
                failed[h] += 1
            else:
                P[h].append(f(kt, Tt))
                D[h].append(-et - P[h][-1])
    out = ["**The out-of-sample test** (accuracy-level loss over steps 50-150 predicted from the fit's cells at "
           "each test cell's realized k3 and T; D = measured loss - predicted, 95% bootstrap over joint resamples of "
           "both studies' seeds; D's interval holding 0 = consistent)", "",
           "| level | arm | realized k3 | T | measured loss [95% bootstrap] | hypothesis | predicted loss [95% bootstrap] | "
           "D [95% bootstrap] | verdict |", "|---:|---|---:|---:|---:|---|---:|---:|---|"]
    verdicts: dict[tuple, dict[str, str]] = {}
    for i, (lv, a) in enumerate(treated):
        lo_m, hi_m = (-x for x in reversed(bootstrap_diff_ci(col[lv, a]["acc_level"], col[lv, CONTROL]["acc_level"])))
        for h, f in pred.items():
            if f is None or len(D[h]) < n / 2:
                verdicts.setdefault((lv, a), {})[h] = "no fit"
                out.append(f"| {lv} | {a} | {fmt(k3[i])} | {T[i]:.1f} | {fmt(-ex[i])} [{fmt(lo_m)}, {fmt(hi_m)}] | {h} | "
                           f"no fit ({failed[h]} of {n} resamples failed) | - | no fit |")
                continue
            d = np.array(D[h])[:, i]
            dlo, dhi = (float(np.percentile(d, q)) for q in (2.5, 97.5))
            p_pt = float(f(k3[i], T[i]))
            plo, phi = (float(np.percentile(np.array(P[h])[:, i], q)) for q in (2.5, 97.5))
            v = ("consistent" if dlo <= 0 <= dhi else
                 "under-predicts (the cost is larger)" if dlo > 0 else "over-predicts (the cost is smaller)")
            verdicts.setdefault((lv, a), {})[h] = v
            out.append(f"| {lv} | {a} | {fmt(k3[i])} | {T[i]:.1f} | {fmt(-ex[i])} [{fmt(lo_m)}, {fmt(hi_m)}] | {h} | "
                       f"{fmt(p_pt)} [{fmt(plo)}, {fmt(phi)}] | {-ex[i] - p_pt:+.4f} [{dlo:+.4f}, {dhi:+.4f}] | {v} |")
    out.append("")
    for (lv, a), v in verdicts.items():
        t1, t2 = (v[h] == "consistent" for h in RHO)
        shape = ("**T * k3** holds out of sample" if t1 and not t2 else "**T^2 * k3** holds out of sample" if t2 and not t1
                 else "**neither** shape predicts it" if not (t1 or t2) else "**does not discriminate** (both consistent)")
        free = v["the registered fit (alpha, beta free)"]
        out.append(f"Level {lv}, {a}: {shape}; the registered fit's extrapolation: "
                   f"{'**holds**' if free == 'consistent' else f'**{free}**'}.")
    return out + [""]


def _shown(path: str | Path) -> Path:
    """``path`` relative to the repository when it lies inside it (so committed text does not
    name this machine's folders), else absolute."""
    p = Path(path).resolve()
    return p.relative_to(ROOT) if p.is_relative_to(ROOT) else p


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


TABLES = {"starts": starts, "followup": followup, "predict": predict}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("table", choices=[*TABLES, "figure"])
    p.add_argument("sweep", help="the sweep (starts, study) or the folder of run directories (followup)")
    p.add_argument("--spec", help=f"the study's spec (default {SPEC.relative_to(ROOT)}; "
                                  f"predict: {TEST_SPEC.relative_to(ROOT)})")
    p.add_argument("--fit", default=str(FIT_SWEEP), help=f"predict: the sweep whose fit is tested "
                                                          f"(default {FIT_SWEEP.relative_to(ROOT)})")
    p.add_argument("--fit-spec", default=str(FIT_SPEC), help=f"predict: the fit sweep's spec "
                                                              f"(default {FIT_SPEC.relative_to(ROOT)})")
    p.add_argument("--out", help="the figure's file (figure only)")
    a = p.parse_args(argv)
    np.seterr(all="ignore")
    if a.table == "figure":
        if not a.out:
            p.error("figure needs --out FILE.png")
        print(f"wrote {figure(a.sweep, a.out, spec=a.spec or SPEC)}")
        return 0
    if a.table == "predict":
        print(predict(a.sweep, spec=a.spec or TEST_SPEC, fit_sweep=a.fit, fit_spec=a.fit_spec))
    else:
        print(TABLES[a.table](a.sweep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
