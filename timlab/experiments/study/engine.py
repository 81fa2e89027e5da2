"""The one analysis every registered study runs: from a study file and its sweep directory to the
markdown block FINDINGS holds, with each verdict the registration's rules give.

``analyze(study)``, in order, each step refusing to go on when it fails:

1. the freeze (``registration.check_freeze``): the registration is the one frozen at the first run,
   or the last recorded amendment's;
2. a control run stopped by the zero-mismatch guard voids the study (VOID, nothing computed);
3. every run of the sweep spec has finished at ``steps`` or diverged; until then one INCOMPLETE
   line names the missing runs and no run's metrics are read (no interim analysis);
4. the validity checks: controls exact at every step, the control's step-0 accuracy bar, identical
   step-0 evaluations; a failure voids the study (the line says which, nothing else is computed);
5. per run, the registered endpoints (``endpoints.window_stat``); per family and endpoint, each arm
   against the reference (``stats.compare_family``: mean with 95% t- and seed-bootstrap intervals,
   difference with its bootstrap interval, exact permutation p, Holm over the family's arms) and
   the rule's verdict; a comparison whose smallest attainable p (the permutation floor, times the
   family size under Holm) is not below the rule's alpha is "not testable here";
6. the descriptive tables, the fits (``fits``), and the verdicts that combine several
   comparisons of one arm (a ``Verdict``: its first case whose tests all pass), in the study's
   ``order``.

A ``repeats`` check (runs that must repeat another sweep's runs of the same name over their first
steps, bit for bit but for timings) is reported under the validity line; it does not void.

Arms are the sweep's conditions without a trailing ``_s<seed>`` (one condition per seed), or the
conditions themselves when seeds come from a ``run.seed`` grid, or the group ``arm`` of the
study's ``arm_pattern``; arms keep the spec's order.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from timlab.experiments.stats import clopper_pearson, compare_family, permutation_floor
from timlab.experiments.study.endpoints import guard, rows, window_stat
from timlab.experiments.study.fits import power_law_section
from timlab.experiments.study.registration import Study, StudyError, check_freeze
from timlab.experiments.study.sweep_runs import arm as seedless, grouped_seeds, incomplete_line, runs
from timlab.experiments.study.text import comparison_cells, fmt, mean_cells, t_cells
from timlab.rundir import DIVERGED, FINISHED, GUARD_FAILED, read_metrics
from timlab.rundir.metrics_log import first_difference

SEED = "run.seed"


@dataclass(frozen=True)
class PlannedRun:
    """One run the sweep spec registers."""

    run_id: str
    """Its directory name in the sweep."""
    name: str
    """How lines name it: the spec's condition, with ``_s<seed>`` when seeds come from the grid."""
    arm: str
    """The arm it belongs to."""


@dataclass
class StudyResult:
    """What ``analyze`` found."""

    text: str
    """The markdown block (or the one VOID / INCOMPLETE line)."""
    status: str
    """``complete``, ``incomplete`` or ``void``."""
    freeze: str
    """The freeze check's line."""
    verdicts: dict = field(default_factory=dict)
    """{(family, endpoint, arm): True/False/None (not testable)} of a complete, valid study."""
    decisions: dict = field(default_factory=dict)
    """{(verdict, arm): the verdict's text} of the study's ``verdicts``."""


def arm_of(study: Study, condition: str) -> str:
    """The arm a sweep condition belongs to (see the module docstring)."""
    if not study.arm_pattern:
        return seedless(condition)
    m = re.fullmatch(study.arm_pattern, condition)
    if m is None:
        raise StudyError(f"{study.source}: arm_pattern: condition {condition!r} does not match {study.arm_pattern!r}")
    return m.group("arm")


def planned_runs(study: Study) -> list[PlannedRun]:
    """The runs the study's sweep spec expands to, in spec order (every config resolved); the
    control and every arm a family names must be arms of the sweep."""
    from timlab.experiments.sweep_spec import expand, spec_from_dict

    spec = spec_from_dict(study.sweep, root=study.sweep_root, source=study.sweep_source)
    seeded = SEED in spec.grid
    planned = [PlannedRun(r.run_id, f"{r.spec_condition}_s{r.overrides[SEED]}" if seeded else r.spec_condition,
                          arm_of(study, r.spec_condition)) for r in expand(spec)]
    arms = list(dict.fromkeys(p.arm for p in planned))
    for where, a in [("control", study.control)] + [(f"families: {f.name}", a) for f in study.families
                                                     for a in (f.against, *f.arms)]:
        if a not in arms:
            raise StudyError(f"{study.source}: {where}: {a!r} is not an arm of the sweep; arms: {', '.join(arms)}")
    return planned


def sweep_dir(study: Study, out: str | Path | None = None) -> Path:
    """The study's sweep directory: ``out``, else the file's ``out``."""
    d = out or study.out
    if not d:
        raise StudyError(f"{study.source}: no sweep directory: set out: in the study file or pass --out")
    return Path(d)


def _states(out: Path) -> dict[str, tuple[str, int]] | None:
    """{run_id: (state, last step)} read live from each run's status.json; None without an index."""
    from timlab.experiments.sweep_index import INDEX_FILE, read_index

    if not (out / INDEX_FILE).exists():
        return None
    idx = read_index(out)
    return {r: (s, int(n) if pd.notna(n) else 0) for r, s, n in zip(idx["run_id"], idx["state"], idx["last_step"])}


def run_record(study: Study, m: pd.DataFrame, *, diverged: bool) -> dict:
    """One run's registered endpoints and its validity facts."""
    rec = {}
    for e in study.endpoints:  # in order: a difference reads endpoints listed before it
        rec[e.name] = rec[e.of[0]] - rec[e.of[1]] if e.stat == "difference" else \
            window_stat(m, e.metric, e.stat, e.window, n=e.n, rule=e.rule, diverged=diverged)
    ev = m.sort_values("step")
    ev = ev[ev["val/accuracy"].notna()] if "val/accuracy" in ev.columns else ev.iloc[:0]
    gold = "val/gold_logprob" in ev.columns
    rec["_valid"] = {"guard": guard(m), "rows": rows(m),
                     "start": (int(ev["step"].iloc[0]) if len(ev) else -1,
                               float(ev["val/accuracy"].iloc[0]) if len(ev) else math.nan,
                               float(ev["val/gold_logprob"].iloc[0]) if len(ev) and gold else math.nan)}
    return rec


def _validity(study: Study, per: dict[str, list[dict]]) -> tuple[bool, str]:
    v, ctrl = study.validity, per[study.control]
    parts, ok = [], True
    if v.control_exact:
        held = all(r["_valid"]["guard"] for r in ctrl)
        ok &= held and all(r["_valid"]["rows"] == study.steps for r in ctrl)
        parts.append(f"control guard (k3 exactly 0, every token bitwise equal, every step) {'held' if held else 'BROKEN'}")
    if v.min_start_accuracy is not None:
        low = min(r["_valid"]["start"][1] for r in ctrl)
        ok &= low >= v.min_start_accuracy
        parts.append(f"control step-0 accuracy {low:.3f} (bar {v.min_start_accuracy:g})")
    if v.same_start:
        starts = {r["_valid"]["start"] for rs in per.values() for r in rs}
        s0 = next(iter(starts))
        learned = v.start_bar is None or s0[1] >= v.start_bar
        ok &= len(starts) == 1 and s0[0] == 0 and learned
        n = sum(len(rs) for rs in per.values())
        parts.append(f"step-0 evaluation the same in all {v.runs or f'{n} runs'} (accuracy {s0[1]:.3f}, gold log-prob "
                     f"{s0[2]:.3f})" + ("" if learned else f", below the bar {v.start_bar:g}") if len(starts) == 1 else
                     f"step-0 evaluation DIFFERS between {v.runs or 'runs'} ({len(starts)} distinct)")
    return ok, f"{v.title}: {'; '.join(parts) or 'no check registered'}: {'VALID' if ok else 'VOID (re-run, do not analyse)'}."


def _repeats(study: Study, out: Path, planned: list[PlannedRun], root: Path) -> list[str]:
    """The ``repeats`` line: how many runs repeat, over steps 0 to its last step, the other sweep's
    run of the same name bit for bit (every logged value but wall-clock timings, in the columns
    both hold); none if the study registers no such check."""
    r = study.repeats
    if r is None:
        return []
    other = root / r.sweep
    theirs = {row["spec_condition"]: m for row, m in runs(other)} if (other / "index.parquet").exists() else {}
    shared = [p for p in planned if p.name in theirs]
    cut = lambda m: m[m["step"] <= r.last_step].reset_index(drop=True)  # noqa: E731
    bad = {p.name: d for p in shared
           if (d := first_difference(cut(read_metrics(out / p.run_id)), cut(theirs[p.name]))) is not None}
    return [f"Steps 0-{r.last_step} against {r.sweep}'s runs of the same name: {len(shared) - len(bad)} of {len(shared)} "
            f"identical in every logged value but timings" + ("." if not bad else
            "; differ: " + "; ".join(f"{c} ({d})" for c, d in bad.items()) + ".")]


def _verdict(rule, c, n_family: int, sizes: tuple[int, int], holm: bool) -> tuple[bool | None, str]:
    floor = permutation_floor(*sizes) * (n_family if holm else 1)
    if floor >= rule.alpha:
        return None, f"not testable here (smallest attainable p {min(floor, 1.0):.3f})"
    holds = c.below(rule.alpha) if rule.test == "below" else c.above(rule.alpha)
    return holds, rule.holds if holds else rule.fails.replace("{cost}", c.cost_bound())


def _family_tables(study: Study, col: dict, arms: list[str], verdicts: dict, cmps: dict) -> list[str]:
    """Each family's tables; ``verdicts`` and ``cmps`` ({(family, endpoint, arm): Comparison}) are filled."""
    out = []
    for fam in study.families:
        rule = {r.name: r for r in study.rules}.get(fam.rule)
        ref = fam.against
        members = list(fam.arms) or [a for a in arms if a != ref]
        for key in fam.endpoints:
            vals = {a: col[a][key] for a in members}
            if fam.correction == "holm":
                cmp = compare_family(vals, {a: col[ref][key] for a in members})
            else:
                cmp = {a: compare_family({a: vals[a]}, {a: col[ref][key]})[a] for a in members}
            show = [study.label(fam.show)] if fam.show else []
            headers = fam.headers or ("arm", *show, "mean [95% t] [95% bootstrap]", f"excess over {ref} [95% bootstrap]",
                                      "permutation p", "Holm p" if fam.correction == "holm" else "p",
                                      *([rule.name] if rule else []))
            out += [f"**{study.label(key)}**{fam.note}", "", "| " + " | ".join(headers) + " |",
                    "|---|" + "---:|" * len(show) + "---:|---:|---:|---:|" + ("---|" if rule else "")]
            shown = lambda a: [("0" if col[a][fam.show].mean() == 0 else fmt(float(col[a][fam.show].mean())))] if show else []  # noqa: E731
            if fam.reference_row:
                out.append(f"| {ref} | " + "".join(f"{s} | " for s in shown(ref)) + f"{mean_cells(col[ref][key])} | - | - | - |"
                           + (" - |" if rule else ""))
            for a in members:
                cmps[fam.name, key, a] = cmp[a]
                text = ""
                if rule:
                    holds, text = _verdict(rule, cmp[a], len(members), (len(vals[a]), len(col[ref][key])),
                                           fam.correction == "holm")
                    verdicts[fam.name, key, a] = holds
                    text = f" {text} |"
                out.append(f"| {a} | " + "".join(f"{s} | " for s in shown(a)) + f"{comparison_cells(cmp[a])} |{text}")
            out.append("")
    return out


def _descriptive(study: Study, col: dict, arms: list[str]) -> list[str]:
    out = []
    align = {"count": "---:", "change": "---", "t": "---:"}
    for t in study.tables:
        out += [f"**{t.title}**{t.note}", "", "| arm | " + " | ".join(c.header for c in t.columns) + " |",
                "|---|" + "".join(f"{align[c.show]}|" for c in t.columns)]
        for a in arms:
            cells = []
            for c in t.columns:
                x = col[a][c.endpoints[0]]
                if c.show == "count":
                    k = int((x != 0).sum())
                    lo, hi = clopper_pearson(k, x.size)
                    cells.append(f"{k}/{x.size} [{lo:.2f}, {hi:.2f}]")
                elif c.show == "change":
                    f = (lambda v: format(v, c.format)) if c.format else fmt  # noqa: E731
                    cells.append(f"{f(float(x.mean()))} -> {f(float(col[a][c.endpoints[1]].mean()))}")
                else:
                    cells.append(t_cells(x, c.digits))
            out.append(f"| {a} | " + " | ".join(cells) + " |")
        out.append("")
    return out


def _fits(study: Study, col: dict, arms: list[str], verdicts: dict) -> list[str]:
    out = []
    for f in study.fits:
        on = {a: bool(verdicts.get((fam.name, f.endpoint, a))) for fam in study.families for a in arms
              if (fam.name, f.endpoint, a) in verdicts}
        name = f.name or study.label(f.endpoint)
        treated = [a for a in arms if a != study.control]
        sub = {a: {"k3": col[a][f.k3], f.endpoint: col[a][f.endpoint]} for a in arms}
        out += power_law_section(sub, study.control, treated, f.arms, f.endpoint, name, f.loss, f.what or f"{f.loss:g}",
                                 f.k3_ref, {a: on.get(a, False) for a in treated}, f.dose_label)
    return out


def _decisions(study: Study, cmps: dict, arms: list[str], decisions: dict) -> list[str]:
    """Each ``Verdict``'s line per arm of its family; ``decisions`` is filled."""
    tests = {"below": lambda c, a: c.below(a), "above": lambda c, a: c.above(a),
             "not below": lambda c, a: not c.below(a), "not above": lambda c, a: not c.above(a)}
    out = []
    for v in study.verdicts:
        fam = next(f for f in study.families if f.name == v.family)
        for a in fam.arms or [x for x in arms if x != fam.against]:
            c = {key: cmps[fam.name, key, a] for key in fam.endpoints}
            text = next((case.then for case in v.cases
                         if all(tests[t](c[key], v.alpha) for key, ts in case.when for t in ts)), v.otherwise)
            decisions[v.name, a] = text
            out.append(v.line.format(arm=a, verdict=text, **c))
        out.append("")
    return out


def analyze(study: Study, out: str | Path | None = None, *, root: str | Path | None = None) -> StudyResult:
    """The registered analysis of ``study`` over its sweep directory (see the module docstring).
    ``root``: the folder ``out`` and the other sweeps the study names are relative to (default:
    the working directory)."""
    root = Path(root) if root is not None else Path(".")
    out = root / sweep_dir(study, out)
    planned = planned_runs(study)
    arms = list(dict.fromkeys(p.arm for p in planned))
    states = _states(out)
    freeze = check_freeze(study, out, has_runs=states is not None)
    states = states or {}
    tripped = sorted(p.name for p in planned if p.arm == study.control and states.get(p.run_id, ("",))[0] == GUARD_FAILED)
    if tripped:
        return StudyResult(f"VOID: the zero-mismatch guard stopped {', '.join(tripped)} (every control step keeps k3 "
                           f"exactly 0 and every token bitwise equal); the study is re-run, not analysed.", "void", freeze)
    done = {p.name for p in planned if states.get(p.run_id, ("", 0))[0] == DIVERGED
            or states.get(p.run_id, ("", 0)) == (FINISHED, study.steps)}
    if len(done) < len(planned):
        arm_by = {p.name: p.arm for p in planned}
        return StudyResult(incomplete_line([p.name for p in planned], done, study.steps, label=arm_by.get), "incomplete",
                           freeze)
    per: dict[str, list[dict]] = {a: [] for a in arms}
    for p in planned:
        m = read_metrics(out / p.run_id)
        if m is None:
            raise StudyError(f"{out / p.run_id}: finished but has no metrics.parquet")
        per[p.arm].append(run_record(study, m, diverged=states[p.run_id][0] == DIVERGED))
    valid, line = _validity(study, per)
    if not valid:
        return StudyResult(line, "void", freeze)
    col = {a: {e.name: np.array([r[e.name] for r in rs], float) for e in study.endpoints} for a, rs in per.items()}
    verdicts, cmps, decisions = {}, {}, {}
    sections = {"families": lambda: _family_tables(study, col, arms, verdicts, cmps),
                "tables": lambda: _descriptive(study, col, arms), "fits": lambda: _fits(study, col, arms, verdicts),
                "verdicts": lambda: _decisions(study, cmps, arms, decisions)}
    lines = [line, *_repeats(study, out, planned, root), ""]
    for part in study.order:
        lines += sections[part]()
    if study.amendments:
        lines += ["", "Amendments after the first run: " + "; ".join(f"{a.date}: {a.reason}" for a in study.amendments)]
    text = "\n".join(lines).rstrip("\n")
    return StudyResult(text + ("\n" if study.blank_end else ""), "complete", freeze, verdicts, decisions)


def missing_runs(study: Study, out: str | Path | None = None) -> str:
    """The runs not yet finished, grouped (for ``timlab study check``)."""
    planned = planned_runs(study)
    states = _states(sweep_dir(study, out)) or {}
    left = [p.name for p in planned if states.get(p.run_id, ("", 0)) != (FINISHED, study.steps)
            and states.get(p.run_id, ("",))[0] != DIVERGED]
    return grouped_seeds(left) if left else "none"


def figure(study: Study, path: str | Path, out: str | Path | None = None) -> Path:
    """Each family endpoint's arm-minus-reference difference with its 95% bootstrap interval, one
    panel per endpoint; only for a complete, valid study (its refusal otherwise)."""
    from matplotlib.figure import Figure

    from timlab.experiments.stats import bootstrap_diff_ci

    res = analyze(study, out)
    if res.status != "complete":
        raise StudyError(f"{study.source}: no figure: {res.text}")
    d = sweep_dir(study, out)
    per: dict[str, list[dict]] = {}
    states = _states(d) or {}
    for p in planned_runs(study):
        per.setdefault(p.arm, []).append(run_record(study, read_metrics(d / p.run_id),
                                                    diverged=states[p.run_id][0] == DIVERGED))
    panels = [(fam, key) for fam in study.families for key in fam.endpoints]
    fig = Figure(figsize=(4.5 * len(panels), 3.6))
    for i, (fam, key) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        ref = np.array([r[key] for r in per[fam.against]], float)
        members = list(fam.arms) or [a for a in per if a != fam.against]
        for j, a in enumerate(members):
            x = np.array([r[key] for r in per[a]], float)
            diff = float(x.mean() - ref.mean())
            lo, hi = bootstrap_diff_ci(x, ref)
            held = res.verdicts.get((fam.name, key, a))
            ax.errorbar([j], [diff], yerr=[[diff - lo], [hi - diff]], fmt="o", capsize=3,
                        color="C3" if held else "C0", label=None)
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set_xticks(range(len(members)), members, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{study.label(key)}\n" + (f"{fam.rule} (red: holds)" if fam.rule else "descriptive"), fontsize=9)
        ax.set_ylabel(f"arm minus {fam.against}, 95% bootstrap")
    fig.suptitle(f"{study.name}: each arm against {study.control}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path
