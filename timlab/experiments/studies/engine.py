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
6. the descriptive tables, the fits (``fits``), the verdicts that combine several comparisons of
   one arm (a ``Verdict``: its first case whose tests all pass) and the outcomes that combine rule
   verdicts and fit tests of the whole study, per scale and then across scales (an ``Outcome``:
   per scale its first case whose conditions all hold), and the paragraphs that print the
   analysis' numbers in sentences, in the study's ``order``.

A ``repeats`` check (runs that must repeat another sweep's runs of the same name over their first
steps, bit for bit but for timings) is reported under the validity line; it does not void.

Arms are the sweep's conditions without a trailing ``_s<seed>`` (one condition per seed), or the
conditions themselves when seeds come from a ``run.seed`` grid, or the group ``arm`` of the
study's ``arm_pattern``; arms keep the spec's order.

A grouped study (``Study.groups``; the group ``group`` of ``arm_pattern``, e.g. a verbosity level)
runs steps 4-6 per group: each group has its own control and validity line (a void group is left
out, the others analysed), each family compares a group's arms with that group's reference (Holm
within the group), the tables list each group's rows in turn, and its fits (``length``,
``threshold``) take the (group, arm) cells of the valid groups.
"""

from __future__ import annotations

import math
import re
import string
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd

from timlab.experiments.studies.stats import (bootstrap_ci, bootstrap_ratio_ci, clopper_pearson, compare_family,
                                              permutation_floor, t_ci)
from timlab.experiments.studies.blocks import SEED, block_dirs, block_of, check_freezes, study_states
from timlab.experiments.studies.endpoints import SCALES, guard, rows, window_stat
from timlab.experiments.studies.fits import arm_cost, bootstrap_fit, fit_power, off_fit, power_law_section
from timlab.experiments.studies.registration import (FORMATTED, MARGIN_TESTS, Study, StudyError,
                                                     first_case)
from timlab.experiments.studies.sweep_runs import (PlannedRun, arm as seedless, grouped_seeds, incomplete_line, runs,
                                                   seed_ranges)
from timlab.experiments.studies.text import ci_text, clip, fmt, mean_cells, p_text, t_cells
from timlab.rundir import DIVERGED, FINISHED, GUARD_FAILED, read_metrics
from timlab.rundir.metrics_log import first_difference


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
    tests: dict = field(default_factory=dict)
    """{(fit name, test name): True/False/None (no decision)} of the ``length_exponent`` fits' tests."""
    states: dict = field(default_factory=dict)
    """{(family, endpoint, arm): the rule's verdict as ``registration.RULE_STATES`` names it}, keyed as ``verdicts``."""
    outcomes: dict = field(default_factory=dict)
    """{(outcome, scale): its text} of the study's ``outcomes``; scale "" the combined outcome."""


def arm_of(study: Study, condition: str) -> str:
    """The arm a sweep condition belongs to (see the module docstring)."""
    if not study.arm_pattern:
        return seedless(condition)
    m = re.fullmatch(study.arm_pattern, condition)
    if m is None:
        raise StudyError(f"{study.source}: arm_pattern: condition {condition!r} does not match {study.arm_pattern!r}")
    return m.group("arm")


def group_of(study: Study, condition: str) -> str:
    """The group a sweep condition belongs to in a grouped study (the group ``group`` of its
    ``arm_pattern``); empty in an ungrouped one."""
    return re.fullmatch(study.arm_pattern, condition).group("group") if study.groups else ""


def planned_runs(study: Study) -> list[PlannedRun]:
    """The runs the study's sweep spec expands to, in spec order (every config resolved); the
    control and every arm a family names must be arms of the sweep."""
    from timlab.experiments.sweeps.spec import expand, spec_from_dict

    spec = spec_from_dict(study.sweep, root=study.sweep_root, source=study.sweep_source)
    seeded = SEED in spec.grid
    expanded = expand(spec)
    for r in (r for r in expanded if r.config.run.steps != study.steps):  # a run must be able to count
        raise StudyError(f"{study.source}: steps: {study.steps}, but run {r.run_id} of the sweep stops at run.steps "
                         f"{r.config.run.steps}; every run must train the study's steps")
    planned = [PlannedRun(r.run_id, f"{r.spec_condition}_s{r.overrides[SEED]}" if seeded else r.spec_condition,
                          arm_of(study, r.spec_condition), group_of(study, r.spec_condition)) for r in expanded]
    if study.blocks:
        planned = [replace(p, block=block_of(study, p.name)) for p in planned]
        for b in (b for b in study.blocks if not any(p.block == b.name for p in planned)):
            seeds = sorted({int(p.name.rsplit("_s", 1)[1]) for p in planned})
            raise StudyError(f"{study.source}: blocks: block {b.name} holds none of the sweep's seeds (its seeds: "
                             f"{seed_ranges(b.seeds)}; the sweep's: {seed_ranges(seeds)}); each block needs runs")
    arms = list(dict.fromkeys(p.arm for p in planned))
    named = [("control", study.control)] + [("validity: controls", a) for a in study.validity.controls]
    named += [(f"families: {f.name}", a) for f in study.families
              for a in (f.against, *f.arms, *(x for c in f.comparisons for x in c[:2]))]
    named += [(f"rules: {r.name}: margin_of", r.margin_of) for r in study.rules if r.margin_of]
    named += [(f"fits: {f.name}: arm", f.arm) for f in study.fits if f.kind == "length_exponent"]
    for where, a in named:
        if a not in arms:
            raise StudyError(f"{study.source}: {where}: {a!r} is not an arm of the sweep; arms: {', '.join(arms)}")
    groups = list(dict.fromkeys(p.group for p in planned if study.groups))
    for g in groups:
        if not any(p.group == g and p.arm == study.control for p in planned):
            raise StudyError(f"{study.source}: control: {study.groups} {g} has no {study.control!r} runs (each group "
                             f"needs its own control)")
    for f in (f for f in study.fits if f.kind == "length_exponent"):
        for g in (g for g in f.groups if g not in groups):
            raise StudyError(f"{study.source}: fits: {f.name}: groups: {g!r} is not a {study.groups} of the study; "
                             f"{study.groups}s: {', '.join(groups)}")
    _check_outcomes(study, planned)
    return planned


def _check_outcomes(study: Study, planned: list[PlannedRun]) -> None:
    """Each outcome's family conditions name a group of the sweep and a comparison its family makes
    there (``comparisons``, in the groups that hold both of its arms), on every scale."""
    arms = {}
    for p in planned:
        arms.setdefault(p.group, {}).setdefault(p.arm)
    fams = {f.name: f for f in study.families}
    for o in study.outcomes:
        for scale, values in o.scales or (("", ()),):
            where = f"{study.source}: outcomes: {o.name}" + (f" (scale {scale})" if scale else "")
            for c in (c for case in o.resolved(values) for x in case.when for c in x.parts() if c.family):
                if c.group not in arms:
                    raise StudyError(f"{where}: group: {c.group!r} is not a {study.groups} of the study; "
                                     f"{study.groups}s: {', '.join(arms)}")
                there = arms[c.group]
                names = [n for n, a, b, _ in comparisons(fams[c.family], list(there)) if a in there and b in there]
                if c.arm not in names:
                    raise StudyError(f"{where}: arm: family {c.family} makes no comparison {c.arm!r}"
                                     + (f" in {study.groups} {c.group}" if c.group else "")
                                     + f"; valid choices: {', '.join(names) or 'none'}")


def run_record(study: Study, m: pd.DataFrame, *, diverged: bool) -> dict:
    """One run's registered endpoints and its validity facts."""
    from timlab.experiments.studies.signals import run_signals

    rec = {}
    for e in study.endpoints:  # in order: a difference reads endpoints listed before it
        if e.stat == "log":
            with np.errstate(divide="ignore"):
                rec[e.name] = float(np.log(rec[e.of[0]]))  # a k3 of exactly 0 is -inf: no ratio
        elif e.stat == "difference":
            rec[e.name] = rec[e.of[0]] - rec[e.of[1]]
        elif e.stat == "plus":
            rec[e.name] = rec[e.of[0]] + rec[e.of[1]]
        else:
            rec[e.name] = window_stat(m, e.metric, e.stat, e.window, n=e.n, rule=e.rule, diverged=diverged,
                                      reach=e.reach, lag=e.lag, min_points=e.min_points)
            if e.scale:  # e.g. the log-odds of the run's level: arms are then compared on that scale
                rec[e.name] = SCALES[e.scale](rec[e.name])
    for f in (f for f in study.fits if f.kind == "signals"):
        rec.update(run_signals(m, f, rec[f.endpoint]))
    ev = m.sort_values("step")
    ev = ev[ev["val/accuracy"].notna()] if "val/accuracy" in ev.columns else ev.iloc[:0]
    gold = "val/gold_logprob" in ev.columns
    rec["_valid"] = {"guard": guard(m), "rows": rows(m),
                     "start": (int(ev["step"].iloc[0]) if len(ev) else -1,
                               float(ev["val/accuracy"].iloc[0]) if len(ev) else math.nan,
                               float(ev["val/gold_logprob"].iloc[0]) if len(ev) and gold else math.nan)}
    return rec


def _validity(study: Study, per: dict[str, list[dict]], group: str = "") -> tuple[bool, str]:
    """The registered checks over one group's runs (``per``: {arm: records}); in a grouped study a
    void group is left out, in an ungrouped one the study is void."""
    v = study.validity
    ctrl = [r for a in v.controls or (study.control,) for r in per[a]]
    parts, ok = [], True
    if v.control_exact:
        held = all(r["_valid"]["guard"] for r in ctrl)
        ok &= held and all(r["_valid"]["rows"] == study.steps for r in ctrl)
        where = f"at each of the {study.steps} steps of all {len(ctrl)} control runs" if v.controls else "every step"
        parts.append(f"control guard (k3 exactly 0, every token bitwise equal, {where}) {'held' if held else 'BROKEN'}")
    if v.min_start_accuracy is not None:
        low = min(r["_valid"]["start"][1] for r in ctrl)
        ok &= low >= v.min_start_accuracy
        parts.append(f"control step-0 accuracy {low:.3f} (bar {v.min_start_accuracy:g})")
    if v.same_start:  # one start per machine block (each block's machine makes its own)
        blocks: dict[str, list] = {}
        for r in (r for rs in per.values() for r in rs):
            blocks.setdefault(r["_valid"]["block"], []).append(r["_valid"]["start"])
        for b, found in blocks.items():
            starts, s0 = set(found), found[0]
            learned = v.start_bar is None or s0[1] >= v.start_bar
            ok &= len(starts) == 1 and s0[0] == 0 and learned
            runs_ = f"{len(found)} runs of block {b}" if b else v.runs or f"{len(found)} runs"
            parts.append(f"step-0 evaluation the same in all {runs_} (accuracy {s0[1]:.3f}, gold log-prob "
                         f"{s0[2]:.3f})" + ("" if learned else f", below the bar {v.start_bar:g}") if len(starts) == 1
                         else f"step-0 evaluation DIFFERS between {runs_ if b else v.runs or 'runs'} "
                              f"({len(starts)} distinct)")
    if not parts:
        return True, ""  # no check registered: no line
    void = "VOID (left out of every table and fit)" if study.groups else "VOID (re-run, do not analyse)"
    return ok, f"{v.title.replace('{group}', group)}: {'; '.join(parts)}: {'VALID' if ok else void}."


def _repeats(study: Study, dirs: dict[str, Path], planned: list[PlannedRun], root: Path) -> list[str]:
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
           if (d := first_difference(cut(read_metrics(dirs[p.block] / p.run_id)), cut(theirs[p.name]))) is not None}
    return [f"Steps 0-{r.last_step} against {r.sweep}'s runs of the same name: {len(shared) - len(bad)} of {len(shared)} "
            f"identical in every logged value but timings" + ("." if not bad else
            "; differ: " + "; ".join(f"{c} ({d})" for c, d in bad.items()) + ".")]


def _margin_verdict(rule, c, cost: float | None, fill) -> tuple[bool | None, str]:
    """A margin rule's verdict (``within`` / ``under``): the difference's bootstrap interval
    against M = ``rule.margin`` x ``cost`` (the cost of ``rule.margin_of``); None without a margin
    (no such arm here, or it costs nothing: a margin <= 0 would hold nothing)."""
    if cost is None:
        return None, f"no margin ({rule.margin_of} has no runs here)"
    if not cost > 0:
        return None, f"no margin ({rule.margin_of} costs {cost:+.4f}, not above 0)"
    m = rule.margin * cost
    lo, hi = c.diff_ci
    holds = lo <= 0 <= hi and -m <= lo and hi <= m if rule.test == "within" else lo > -m
    return holds, fill(rule.holds if holds else rule.fails).replace("{margin}", f"{m:.4f}")


def _verdict(rule, c, n_family: int, sizes: tuple[int, int], holm: bool, required: bool = True,
             names: dict | None = None, bound: float | None = None,
             cost: float | None = None) -> tuple[bool | None, str, str]:
    """A rule's verdict on one comparison: (holds, text, state); holds None when no p could pass
    ``alpha`` (or a margin rule has no margin); state one of ``registration.RULE_STATES`` (what an
    outcome reads: "opposite" where the mirror effect gave ``rule.opposite``). ``required``: the
    comparison that ``rule.requires`` reads held its rule; ``names``: what ``{arm}`` and
    ``{against}`` in the texts become; ``bound``: the comparison's ratio bar (a ``ratio_bound``
    rule); ``cost``: the cost of the margin rule's ``margin_of`` arm in this group (None: it has no
    runs here)."""
    fill = lambda t: t.replace("{cost}", c.cost_bound()).replace("{arm}", (names or {}).get("arm", "")).replace(  # noqa: E731
        "{against}", (names or {}).get("against", "")).replace("{bound}", f"{bound:.2f}" if bound is not None else "")
    if rule.test in MARGIN_TESTS:  # no p is read: the permutation floor does not apply
        holds, text = _margin_verdict(rule, c, cost, fill)
        if holds and rule.requires and not required:
            return False, fill(rule.unmet or rule.fails), "fails"
        return holds, text, "not testable" if holds is None else "holds" if holds else "fails"
    floor = (c.floor if c.floor is not None else permutation_floor(*sizes)) * (n_family if holm else 1)
    if floor > rule.alpha or (floor == rule.alpha and rule.interval):  # p < alpha, or p <= alpha on the p alone
        return None, f"not testable here (smallest attainable p {min(floor, 1.0):.3f})", "not testable"
    if rule.interval:
        below, above = c.below(rule.alpha), c.above(rule.alpha)
    else:  # the p alone, at most alpha, by the sign of the difference
        below, above = (c.p_holm <= rule.alpha and c.diff < 0), (c.p_holm <= rule.alpha and c.diff > 0)
    holds, mirror = (below, above) if rule.test == "below" else (above, below)
    if rule.ratio_bound:  # the whole interval of the log ratio beyond the bar, on the ratio scale
        holds = holds and (math.exp(c.diff_ci[1]) < bound if rule.test == "below" else math.exp(c.diff_ci[0]) > bound)
    if holds and rule.requires and not required:
        return False, fill(rule.unmet or rule.fails), "fails"
    if holds:
        return True, fill(rule.holds), "holds"
    opposite = bool(rule.opposite and mirror)
    return False, fill(rule.opposite if opposite else rule.fails), "opposite" if opposite else "fails"


ALIGN = {"endpoint": "---", "comparison": "---", "verdict": "---"}
"""A family table's column alignment (the others right-aligned; ``verdict:RULE`` as ``verdict``)."""


def _align(fam, column: str) -> str:
    """One column's alignment cells: a comparison whose names fill several columns (" | ") has one each."""
    if column == "comparison":
        return "---|" * (1 + fam.spans())
    return "---|" if fam.align == "left" else f"{ALIGN.get(column.split(':')[0], '---:')}|"


def comparisons(fam, arms: list[str]) -> list[tuple[str, str, str, str]]:
    """A family's comparisons as (name, arm, reference, rule): its explicit ``comparisons``, else
    each of its arms against ``against``. The name is the arm, or "arm - reference" when the
    reference is not the family's (the key of ``StudyResult.verdicts``)."""
    pairs = fam.comparisons or [(a, fam.against, "") for a in (fam.arms or [x for x in arms if x != fam.against])]
    return [(a if b == fam.against else f"{a} - {b}", a, b, r) for a, b, r in pairs]


def _cell(kind: str, c, a: str, b: str, key: str, study: Study, fam, col: dict, verdict: str) -> str:
    if ":" in kind and kind.split(":")[0] in FORMATTED:  # one number alone in its own format spec (diff:+.3f)
        cell, spec = kind.split(":", 1)
        return format(getattr(c, cell), spec)
    if kind == "endpoint":
        return study.label(key)
    if kind == "comparison":
        return fam.label.format(arm=fam.shown(a), against=fam.shown(b))
    if kind == "show":
        return fam.zero if col[a][fam.show].mean() == 0 else fmt(float(col[a][fam.show].mean()))
    if kind == "show_t":
        m, lo, hi = t_ci(col[a][fam.show]) if np.isfinite(col[a][fam.show]).all() else (math.nan,) * 3
        lo, hi = clip((lo, hi), study.bounds(fam.show))
        return f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]"
    if kind == "geo":  # the values are logs: their mean and bootstrap interval back on the ratio scale
        x = col[a][key]
        lo, hi = bootstrap_ci(x) if np.isfinite(x).all() else (-math.inf, -math.inf)
        return f"{fmt(float(np.exp(x.mean())))} [{fmt(math.exp(lo))}, {fmt(math.exp(hi))}]"
    if kind == "ratio_exp":
        return f"{math.exp(c.diff):.3f} [{math.exp(c.diff_ci[0]):.3f}, {math.exp(c.diff_ci[1]):.3f}]"
    if kind == "mean":
        return f"{c.mean:+.4f} {ci_text(clip(c.t_ci, study.bounds(key)))} {ci_text(c.boot_ci)}"
    if kind == "diff":
        return f"{c.diff:+.4f} {ci_text(c.diff_ci)}"
    if kind == "diff_fmt":
        return f"{fmt(c.diff)} [{fmt(c.diff_ci[0])}, {fmt(c.diff_ci[1])}]"
    if kind == "ratio":
        try:
            lo, hi = bootstrap_ratio_ci(col[a][key], col[b][key])
        except ValueError:
            return f"- (a resample of {b} has mean 0)"
        return f"{fmt(float(col[a][key].mean()) / float(col[b][key].mean()))} [{fmt(lo)}, {fmt(hi)}]"
    if kind == "p":
        return p_text(c.p)
    if kind == "p_holm":
        return p_text(c.p_holm)
    return verdict.get(kind, "") if isinstance(verdict, dict) else verdict


def _key(group: str, name: str):
    """A comparison's key in ``StudyResult.verdicts``: its name, or (group, name) in a grouped study."""
    return (group, name) if group else name


def _family(study: Study, fam, cols: dict, verdicts: dict, cmps: dict, states: dict | None = None) -> list[str]:
    """One family's table(s), each group's rows in turn (``cols``: {group: {arm: {endpoint: values}}},
    one group "" in an ungrouped study); ``verdicts``, ``states`` (``StudyResult``'s) and ``cmps``
    ({(family, endpoint, name): Comparison}, the name ``_key``) are filled. Holm runs within each group."""
    rules = {r.name: r for r in study.rules}
    states = {} if states is None else states
    pairs = comparisons(fam, list(next(iter(cols.values()), {})))
    judged = bool(fam.rule or fam.endpoint_rules or any(r for *_, r in pairs))
    columns = fam.columns or ("comparison", *(["show"] if fam.show else []), "mean", "diff", "p", "p_holm",
                              *(["verdict"] if judged else []))
    ref = fam.against
    headers = fam.headers or ("arm", *([study.label(fam.show)] if fam.show else []), "mean [95% t] [95% bootstrap]",
                              f"excess over {ref} [95% bootstrap]", "permutation p",
                              "Holm p" if fam.correction == "holm" else "p",
                              *([fam.rule or "verdict"] if judged else []))
    grouped = [study.groups] if study.groups else []
    head = ["| " + " | ".join([*grouped, *headers]) + " |",
            "|" + "---:|" * len(grouped) + "".join(_align(fam, c) for c in columns)]
    bold = lambda text: [f"**{text}**{fam.note}", ""] if fam.heading else []  # noqa: E731
    out = [*bold(fam.title), *head] if fam.title else []
    for key in fam.endpoints:
        if not fam.title:
            out += [*bold(study.label(key)), *head]
        for g, col in cols.items():  # a comparison of arms this group does not have is not made in it
            pairs = [p for p in comparisons(fam, list(col)) if p[1] in col and p[2] in col]
            out += _family_rows(study, fam, key, g, col, pairs, rules, columns, verdicts, cmps, states) if pairs else []
        if not fam.title:
            out.append("")
    if not fam.table:  # computed for the paragraphs and verdicts only
        return []
    return out + ([""] if fam.title else [])


def _family_rows(study: Study, fam, key: str, g: str, col: dict, pairs: list, rules: dict, columns: tuple,
                 verdicts: dict, cmps: dict, states: dict) -> list[str]:
    """One endpoint's rows of one group: the reference row, then each comparison with its verdict."""
    ref, lead, out = fam.against, f"| {g} " if g else "", []
    vals = {n: col[a][key] for n, a, _, _ in pairs}
    refs = {n: col[b][key] for n, _, b, _ in pairs}
    strata = {n: (col[a][BLOCK], col[b][BLOCK]) for n, a, b, _ in pairs} if BLOCK in col[ref] else None
    if fam.correction == "holm":
        cmp = compare_family(vals, refs, strata)
    else:
        cmp = {n: compare_family({n: vals[n]}, {n: refs[n]}, strata and {n: strata[n]})[n] for n in vals}
    bounds = {(a, b): x for (a, b, _), x in zip(fam.comparisons, fam.bounds)}

    def cost(r) -> float | None:
        """The cost of a margin rule's ``margin_of`` arm in this group (None: it has no runs here)."""
        return arm_cost(col[study.control][key], col[r.margin_of][key]) if r.margin_of in col else None

    def reference(ref: str) -> str:
        cells = {"comparison": fam.reference_label.format(against=fam.shown(ref), arm=fam.shown(ref)),
                 "endpoint": study.label(key), "mean": mean_cells(col[ref][key], study.bounds(key)),
                 "show": _cell("show", None, ref, ref, key, study, fam, col, "") if fam.show else "-",
                 **{k: _cell(k, None, ref, ref, key, study, fam, col, "") for k in ("geo", "show_t") if k in columns}}
        return lead + "| " + " | ".join(cells.get(c, "-") for c in columns) + " |"

    shown = set()
    if fam.reference_row and not fam.each_reference:
        out.append(reference(ref))
    for n, a, b, r in pairs:
        if fam.each_reference and b not in shown:  # each reference's row before its first comparison
            shown.add(b)
            out.append(reference(b))
        cmps[fam.name, key, _key(g, n)] = c = cmp[n]
        text: dict = {}
        size = (len(pairs), (len(vals[n]), len(refs[n])), fam.correction == "holm")
        for column in (x for x in columns if x.startswith("verdict:")):
            r_col = rules[column[8:]]
            text[column] = _verdict(r_col, c, *size, bound=bounds.get((a, b)), cost=cost(r_col))[1]
        rule = rules.get(fam.rule_for(key, r))
        if rule:
            required = not rule.requires or verdicts.get((fam.name, key, _key(g, b))) is True
            holds, text["verdict"], state = _verdict(rule, c, *size, required, {"arm": a, "against": b},
                                                     bounds.get((a, b)), cost(rule))
            verdicts[fam.name, key, _key(g, n)] = holds
            states[fam.name, key, _key(g, n)] = state
        out.append(lead + "| " + " | ".join(_cell(k, c, a, b, key, study, fam, col, text) for k in columns) + " |")
    return out


def _ranged(x, ranges, otherwise: str) -> str:
    """Where the 95% bootstrap interval of ``x`` lies: the first (text, low, high) holding it."""
    lo, hi = bootstrap_ci(x)
    return next((t for t, a, b in ranges if (a is None or a <= lo) and (b is None or hi <= b)), otherwise)


def _column(c, a: str, col: dict, control: str, label=str, bounds=lambda name: None) -> str:
    """One cell of a descriptive table (``registration.Column``); ``label(endpoint)`` names an
    endpoint (``nonzero``), ``bounds(endpoint)`` the range its t-intervals are clipped to."""
    if c.control is not None and a == control:
        return c.control
    x = col[a][c.endpoints[0]]
    f = (lambda v: format(v, c.format)) if c.format else fmt  # noqa: E731
    if c.show == "count":
        k = int((x != 0).sum())
        lo, hi = clopper_pearson(k, x.size)
        return f"{k}/{x.size} [{lo:.2f}, {hi:.2f}]" if c.ci else f"{k}/{x.size}"
    if c.show == "n":
        return str(int(np.isfinite(x).sum()))
    if c.show == "values":
        return f"{', '.join(fmt(v, c.digits) for v in x)} ({fmt(float(x.mean()))})"
    if c.show == "nonzero":
        means = {e: col[a][e][np.isfinite(col[a][e])] for e in c.endpoints}
        return ", ".join(f"{label(e)} {fmt(float(v.mean()), c.digits)}" for e, v in means.items()
                         if v.size and v.mean() > 0) or "-"
    if c.show == "mean" and c.partial:  # the mean over the runs with a value, saying how many have one
        have = x[np.isfinite(x)]
        return f(float(have.mean()) if have.size else math.nan) + \
            (c.partial.format(k=have.size, n=x.size) if have.size < x.size else "")
    if c.show in ("change", "pair"):
        return f"{f(float(x.mean()))} {'->' if c.show == 'change' else '/'} {f(float(col[a][c.endpoints[1]].mean()))}"
    if c.show == "t":
        return t_cells(x, c.digits, bounds(c.endpoints[0]))
    if c.show == "t_boot":
        mu, lo, hi = t_ci(x)
        lo, hi = clip((lo, hi), bounds(c.endpoints[0]))
        blo, bhi = bootstrap_ci(x)
        return f"{fmt(mu)} [{fmt(lo)}, {fmt(hi)}] [{fmt(blo)}, {fmt(bhi)}]"
    if c.show == "boot":
        lo, hi = bootstrap_ci(x)
        return f"{fmt(float(x.mean()))} [{fmt(lo)}, {fmt(hi)}]"
    if c.show == "mean":
        return f(float(x.mean()))
    if c.show == "scaled":
        return f(float(x.mean()) * float(col[control][c.by].mean()) ** c.power)
    if c.show == "seeds":
        return ", ".join(f"s{i}: {format(v, c.format or 'g')}" for i, v in enumerate(x) if math.isfinite(v)) or "-"
    return _ranged(x, c.ranges, c.otherwise)


def _table(study: Study, t, cols: dict) -> list[str]:
    """A descriptive table: one row per arm, each group's arms in turn (``cols`` as ``_family``'s)."""
    align = {"count": "---:", "change": "---", "pair": "---", "range": "---", "seeds": "---", "values": "---",
             "nonzero": "---"}
    cell = (lambda c: "---") if t.align == "left" else (lambda c: align.get(c.show, "---:"))  # noqa: E731
    grouped = f"| {study.groups} " if study.groups else ""
    names = dict(t.names)
    out = [f"**{t.title}**{t.note}", ""] if t.title else []
    out += [grouped + f"| {t.arm_header} | " + " | ".join(c.header for c in t.columns) + " |",
            "|---:" * bool(study.groups) + "|---|" + "".join(f"{cell(c)}|" for c in t.columns)]
    out += [(f"| {g} " if g else "") + f"| {names.get(a, a)} | "
            + " | ".join(_column(c, a, col, study.control, study.label, study.bounds) for c in t.columns) + " |"
            for g, col in cols.items() for a in col]
    return out + [""] + ([t.after, ""] if t.after else [])


def _growth(study: Study, f, col: dict, cmps: dict) -> list[str]:
    """A ``growth`` fit: per comparison of its family (a growing dose against its time-averaged
    constant dose), "yes" when the growing arm's ``endpoint`` is lower (``Comparison.below``) or it
    falls in at least ``min_falls`` runs and the constant arm in none; "no" when the difference's
    interval lies inside +-``margin``; else "undecided". The two arms' mean ``k3`` and their ratio
    say whether the doses matched (UNMATCHED beyond a factor ``unmatched``)."""
    fam = next(x for x in study.families if x.name == f.family)
    out = ["| " + " | ".join(f.headers) + " |", "|---|---:|---|---|---|---|"]
    for n, a, b, _ in comparisons(fam, list(col)):
        c = cmps[fam.name, f.endpoint, n]
        slope = c.below()
        falls = int((col[a][f.fall] != 0).sum()) >= f.min_falls and int((col[b][f.fall] != 0).sum()) == 0
        within = -f.margin <= c.diff_ci[0] and c.diff_ci[1] <= f.margin
        ka, kb = float(col[a][f.k3].mean()), float(col[b][f.k3].mean())
        ratio = ka / kb
        matched = 1 / f.unmatched <= ratio <= f.unmatched
        verdict = "yes" if slope or falls else "no" if within else "undecided"
        yes = lambda x: "yes" if x else "no"  # noqa: E731
        out.append(f"| {fam.shown(a)} | {fmt(ka)}, {fmt(kb)} ({ratio:.2f}{'' if matched else ', UNMATCHED'}) | "
                   f"{yes(slope)} | {yes(falls)} | {yes(within)} | **{verdict}** |")
    return out + [""]


def _fits(study: Study, cols: dict, verdicts: dict, root: Path, cmps: dict, kinds: tuple[str, ...],
          tests: dict) -> list[str]:
    """The fits of the ``kinds`` given, in the file's order; ``tests`` is filled (``StudyResult.tests``)."""
    if study.groups:
        return _group_fits(study, cols, root, kinds, tests)
    from timlab.experiments.studies.signals import signals_section

    col = cols.get("", {})
    arms = list(col)
    out = []
    for f in (f for f in study.fits if f.kind in kinds):
        if f.kind == "place":
            out += _place(study, f, col, arms, root)
            continue
        if f.kind == "growth":
            out += _growth(study, f, col, cmps)
            continue
        if f.kind == "signals":
            out += signals_section(col, f)
            continue
        on = {a: bool(verdicts.get((fam.name, f.endpoint, a))) for fam in study.families for a in arms
              if (fam.name, f.endpoint, a) in verdicts}
        name = f.name or study.label(f.endpoint)
        treated = [a for a in arms if a != study.control]
        sub = {a: {"k3": col[a][f.k3], f.endpoint: col[a][f.endpoint]} for a in arms}
        out += power_law_section(sub, study.control, treated, f.arms, f.endpoint, name, f.loss, f.what or f"{f.loss:g}",
                                 f.k3_ref, {a: on.get(a, False) for a in treated}, f.dose_label)
    return out


def _cells(study: Study, cols: dict) -> tuple[dict, list]:
    """A grouped study's columns keyed by (group, arm), and its treated (group, arm) cells in order."""
    col = {(g, a): v for g, c in cols.items() for a, v in c.items()}
    return col, [(g, a) for g, c in cols.items() for a in c if a != study.control]


def _fitted_study(f, root: Path) -> tuple[Study, list[str], dict | None]:
    """The grouped study a ``predict`` fit names: (it, its validity lines or the one line saying it
    is void or not complete, its valid groups' columns or None when it is void or not complete)."""
    from timlab.experiments.studies.registration import load_study

    other = load_study(f.study)
    planned, dirs = planned_runs(other), block_dirs(other, None, root)
    states = study_states(planned, dirs) or {}
    tripped = sorted(p.name for p in planned if p.arm == other.control and states.get(p.run_id, ("",))[0] == GUARD_FAILED)
    if tripped:
        return other, [f"The fit's study {other.name} is void: the zero-mismatch guard stopped {', '.join(tripped)}; "
                       f"no prediction is tested.", ""], None
    done = [p for p in planned if states.get(p.run_id, ("", 0))[0] == DIVERGED
            or states.get(p.run_id, ("", 0)) == (FINISHED, other.steps)]
    if len(done) < len(planned):
        return other, [f"The fit's study {other.name} is not complete ({len(done)} of {len(planned)} runs finished at "
                       f"step {other.steps}): no prediction is tested (no interim analysis).", ""], None
    lines, cols = [], {}
    for g, per in _records(other, dirs, planned, states).items():
        valid, line = _validity(other, per, g)
        lines.append("The fit's " + line[0].lower() + line[1:])
        if valid:
            cols[g] = _columns(other, per)
    return other, lines, cols


def _predict(study: Study, f, cols: dict, root: Path) -> list[str]:
    """A ``predict`` fit: another grouped study's length fit tested on this study's treated cells
    (``fits.prediction_section``), then the free length fit over both studies' cells (descriptive)."""
    from timlab.experiments.studies.fits import length_section, prediction_section

    other, lines, ocols = _fitted_study(f, root)
    if ocols is None:
        return lines
    if set(ocols) & set(cols):
        raise StudyError(f"{study.source}: fits: predict: the test's {study.groups}s must be {study.groups}s "
                         f"{other.name} did not see (both have {', '.join(sorted(set(ocols) & set(cols)))})")
    colf, fit_treated = _cells(other, ocols)
    col, treated = _cells(study, cols)
    if not treated:
        return lines + ["", f"No valid test {study.groups}: no test.", ""]
    keys = dict(control=study.control, k3=f.k3, length=f.length, rho=f.rho, min_cells=f.min_cells,
                min_groups=f.min_groups)
    out = lines + [""] + prediction_section(colf, fit_treated, col, treated, f.endpoint, groups=study.groups, **keys)
    keys.pop("rho")
    return out + length_section({**colf, **col}, fit_treated + treated, f.endpoint, f.name or study.label(f.endpoint),
                                k3_ref=f.k3_ref, at=f.at, rho=f.rho, unbounded=f.unbounded, groups=study.groups,
                                **keys)


def predictions(study: Study, root: str | Path | None = None) -> str:
    """The predictions of each ``predict`` fit with a table (``at_T``), written before the test's
    runs from the fitted study alone (``fits.predictions_table``)."""
    from timlab.experiments.studies.fits import predictions_table

    root = Path(root) if root is not None else Path(".")
    out = []
    for f in (f for f in study.fits if f.kind == "predict" and f.at_T):
        other, lines, ocols = _fitted_study(f, root)
        if ocols is None:
            out += lines[:1]
            continue
        col, treated = _cells(other, ocols)
        out += predictions_table(col, treated, f.endpoint, T=f.at_T, k3_at=f.at_k3, control=other.control, k3=f.k3,
                                 length=f.length, rho=f.rho, min_cells=f.min_cells, min_groups=f.min_groups,
                                 unbounded=f.unbounded)
    return "\n".join(out)


def _group_fits(study: Study, cols: dict, root: Path, kinds: tuple[str, ...], tests: dict) -> list[str]:
    """The fits of a grouped study over its valid groups' treated (group, arm) cells (``fits``);
    ``tests`` is filled with each ``length_exponent`` test's decision."""
    from timlab.experiments.studies.fits import exponent_section, length_section, threshold_section

    col, treated = _cells(study, cols)
    out = []
    for f in (f for f in study.fits if f.kind in kinds):
        if f.kind == "length_exponent":
            used = [g for g in cols if g in (f.groups or cols)]  # the fit's groups, else every valid one
            lines, decided = exponent_section(col, used, f.endpoint, f.name, control=study.control, arm=f.arm,
                                              length=f.length, tests=f.tests, max_undefined=f.max_undefined,
                                              group_name=study.groups)
            out += lines
            tests.update({(f.name, t): v for t, v in decided.items()})
        elif f.kind == "predict":
            out += _predict(study, f, cols, root)
        elif f.kind == "length":
            out += length_section(col, treated, f.endpoint, f.name or study.label(f.endpoint), control=study.control,
                                  k3=f.k3, length=f.length, k3_ref=f.k3_ref, at=f.at, rho=f.rho, min_cells=f.min_cells,
                                  min_groups=f.min_groups, unbounded=f.unbounded, groups=study.groups)
        else:
            tokens = dict(f.tokens)
            missing = [g for g in cols if g not in tokens]
            if missing:
                raise StudyError(f"{study.source}: fits: threshold: tokens: no T for {study.groups} "
                                 f"{', '.join(missing)}; given for {', '.join(tokens)}")
            out += threshold_section(col, treated, tokens, k3=f.k3, fall=f.endpoint, k3_star=f.k3_star,
                                     t_star=f.t_star, exponent=f.exponent, title=f.title, note=f.note,
                                     groups=study.groups)
    return out


def _place(study: Study, f, col: dict, arms: list[str], root: Path) -> list[str]:
    """A ``place`` fit (descriptive, no test): each treated arm's excess slope over this study's
    control against another study's power law at the arm's realized k3 (``fits.off_fit``), once
    that study is complete and valid."""
    from timlab.experiments.studies.registration import load_study

    other = load_study(f.study)
    who = f"the {other.name} study"
    planned, dirs = planned_runs(other), block_dirs(other, None, root)
    states = study_states(planned, dirs) or {}
    done = [p for p in planned if states.get(p.run_id, ("", 0))[0] == DIVERGED
            or states.get(p.run_id, ("", 0)) == (FINISHED, other.steps)]
    if len(done) < len(planned):
        return [f"{f.title}{who} is not complete ({len(done)} of {len(planned)} runs), so it has no fit; nothing is "
                f"placed.", ""]
    per = _records(other, dirs, planned, states).get("", {})
    if other.groups or not _validity(other, per)[0]:
        return [f"{f.title}{who} is void (its validity checks), so it has no fit; nothing is placed.", ""]
    ocol = _columns(other, per)
    out = []
    for key, name in zip(f.endpoints, f.names):
        name = name or study.label(key)
        hp = {a: {"k3": ocol[a][f.k3], key: ocol[a][key]} for a in ocol if a.startswith(f.arms)}
        ctrl = ocol[other.control][key]
        ex = np.array([(hp[a][key].mean() - ctrl.mean()) / 100 for a in sorted(hp)])
        if fit_power(np.array([hp[a]["k3"].mean() for a in sorted(hp)]), ex) is None:
            out.append(f"{f.title}{name}: {who} fitted no power law (fewer than 3 {f.dose_label} arms with a negative "
                       f"mean excess); nothing is placed.")
            continue
        fits, _ = bootstrap_fit(hp, ctrl, key)
        out.append(f"{f.title}{name}, each arm's excess over this study's control (per step) minus {who}'s fit at the "
                   f"arm's realized k3, with its 95% interval:")
        for a in (x for x in arms if x != study.control):
            d, lo, hi = off_fit(fits, col[a][f.k3], col[a][key], control=col[study.control][key])
            where = (f"costs what {f.dose_label} costs at the same k3" if lo <= 0 <= hi else
                     f"costs more than {f.dose_label} at the same k3" if hi < 0 else
                     f"costs less than {f.dose_label} at the same k3")
            out.append(f"- {a}: realized k3 {fmt(float(col[a][f.k3].mean()))}, {d:+.2e} [{lo:+.2e}, {hi:+.2e}]: {where}.")
    return out + [""]


def _decisions(study: Study, cmps: dict, arms: list[str], decisions: dict) -> list[str]:
    """Each ``Verdict``'s line per arm of its family; ``decisions`` is filled."""
    tests = {"below": lambda c, a: c.below(a), "above": lambda c, a: c.above(a),
             "not below": lambda c, a: not c.below(a), "not above": lambda c, a: not c.above(a)}
    out = []
    for v in study.verdicts:
        fam = next(f for f in study.families if f.name == v.family)
        for a, *_ in comparisons(fam, arms):
            c = {key: cmps[fam.name, key, a] for key in fam.endpoints}
            text = first_case(v.cases, lambda when: all(tests[t](c[when[0]], v.alpha) for t in when[1]), v.otherwise)
            decisions[v.name, a] = text
            out.append(v.line.format(arm=a, verdict=text, **c))
        out.append("")
    return out


def _outcomes(study: Study, states: dict, tests: dict, outcomes: dict) -> list[str]:
    """Each ``Outcome``: per scale, the first case whose conditions all hold (a family's rule
    verdict read from ``states``, "not testable" where the comparison was not made, e.g. in a void
    group; a fit's test from ``tests``: yes, no, undecided), with every part the cases read and its
    value; then the scales' outcomes combined. ``outcomes`` is filled (``StudyResult.outcomes``)."""
    def value(c) -> str:
        if c.fit:
            return {True: "yes", False: "no"}.get(tests.get((c.fit, c.test)), "undecided")
        return states.get((c.family, c.endpoint, _key(c.group, c.arm)), "not testable")

    out = []
    for o in study.outcomes:
        per, lines = {}, []
        for scale, values in o.scales or (("", ()),):
            cases = o.resolved(values)
            per[scale] = first_case(cases, lambda cond: any(value(c) in c.states for c in cond.parts()), o.otherwise)
            read = {c.named(study.groups or "group"): value(c) for case in cases for x in case.when for c in x.parts()}
            parts = "; ".join(f"{name}: {v}" for name, v in read.items())
            lines.append(f"- {scale}: **{per[scale]}** ({parts})" if scale else
                         f"Verdict {o.name}: **{per[scale]}** ({parts}).")
            outcomes[o.name, scale] = per[scale]
        if not o.scales:
            out += lines + [""]
            continue
        found = list(per.values())
        combined = found[0] if len(set(found)) == 1 else o.mixed.replace("{each}", ", ".join(
            f"{x} on {scale}" for scale, x in per.items()))
        outcomes[o.name, ""] = combined
        each = "; ".join(f"{scale}: {x}" for scale, x in per.items())
        out += [f"Verdict {o.name}, on each scale (the parts it read, each with its value):", "", *lines, "",
                f"Verdict {o.name}: **{combined}** ({each}).", ""]
    return out


def _paragraphs(study: Study, cmps: dict, cols: dict) -> list[str]:
    """Each of ``study.paragraphs`` with its numbers: ``{FAMILY[ENDPOINT][COMPARISON].FIELD}`` a
    comparison's field, ``{runs[ENDPOINT].FIELD}`` the endpoint's min, max, mean or n over every run
    that has a value (``registration.PARAGRAPH_FIELDS``)."""
    from types import SimpleNamespace

    from timlab.experiments.studies.registration import PARAGRAPH_FIELDS

    if not study.paragraphs:
        return []
    fams: dict = {}
    for (f, key, name), c in cmps.items():
        fams.setdefault(f, {}).setdefault(key, {})[name] = c
    col = cols.get("", {})
    runs = {}
    for e in study.endpoints:
        x = np.concatenate([col[a][e.name] for a in col])
        x = x[np.isfinite(x)]
        runs[e.name] = SimpleNamespace(min=float(x.min()) if x.size else math.nan, max=float(x.max()) if x.size else
                                       math.nan, mean=float(x.mean()) if x.size else math.nan, n=int(x.size))
    out = []
    for i, text in enumerate(study.paragraphs):
        for _, f, _, _ in string.Formatter().parse(text):
            m = PARAGRAPH_FIELDS.fullmatch(f or "")
            if m and m.group("name") is not None and m.group("name") not in fams[m.group("family")][m.group("endpoint")]:
                raise StudyError(f"{study.source}: paragraphs[{i}]: {{{f}}}: no comparison {m.group('name')!r} in "
                                 f"family {m.group('family')}; valid choices: "
                                 f"{', '.join(fams[m.group('family')][m.group('endpoint')])}")
        out += [text.format(runs=runs, **fams), ""]
    return out


def _within_blocks(study: Study, cols: dict) -> list[str]:
    """A blocked study's descriptive table: each family comparison's difference in means within
    each block, beside the pooled one, so a reader sees whether the machines agree (no test)."""
    if not study.blocks:
        return []
    col = cols.get("", {})
    blocks = list(enumerate(study.blocks))
    sizes = {b.name: int((col[study.control][BLOCK] == i).sum()) for i, b in blocks} if col else {}
    out = ["**Within each machine block** (descriptive: the difference of means, arm minus reference, "
           "in each block's seeds alone; the tests above relabel within blocks)", "",
           "| comparison | endpoint | " + " | ".join(f"block {b.name} ({sizes.get(b.name, 0)} seeds)" for _, b in blocks)
           + " | all seeds |", "|---|---|" + "---:|" * (len(blocks) + 1)]
    for fam in study.families:
        for key in fam.endpoints:
            for n, a, b, _ in comparisons(fam, list(col)):
                if a not in col or b not in col:
                    continue
                x, y = col[a], col[b]
                cells = [f"{x[key][x[BLOCK] == i].mean() - y[key][y[BLOCK] == i].mean():+.4f}" for i, _ in blocks]
                out.append(f"| {fam.shown(a)} - {fam.shown(b)} | {study.label(key)} | " + " | ".join(cells)
                           + f" | {x[key].mean() - y[key].mean():+.4f} |")
    return out + [""]


def _records(study: Study, dirs: dict[str, Path], planned: list[PlannedRun],
             states: dict) -> dict[str, dict[str, list[dict]]]:
    """{group: {arm: each of its runs' ``run_record``}} in spec order (every run finished or
    diverged; each read from its block's directory, ``dirs``); one group "" in an ungrouped study.
    In a blocked study each record also holds ``BLOCK``, its block's position in ``Study.blocks``."""
    per: dict[str, dict[str, list[dict]]] = {}
    for p in planned:
        per.setdefault(p.group, {}).setdefault(p.arm, [])
    order = {b.name: float(i) for i, b in enumerate(study.blocks)}
    for p in planned:
        d = dirs[p.block] / p.run_id
        m = read_metrics(d)
        if m is None:
            raise StudyError(f"{d}: finished but has no metrics.parquet")
        rec = run_record(study, m, diverged=states[p.run_id][0] == DIVERGED)
        rec["_valid"]["block"] = p.block
        per[p.group][p.arm].append({**rec, BLOCK: order[p.block]} if study.blocks else rec)
    return per


BLOCK = "_block"
"""A blocked study's column of each run's block (``_records``): the strata of its permutation tests."""


def _columns(study: Study, per: dict[str, list[dict]]) -> dict[str, dict[str, np.ndarray]]:
    """{arm: {endpoint: its values over the arm's runs}} (and ``BLOCK`` in a blocked study)."""
    return {a: {k: np.array([r[k] for r in rs], float) for k in rs[0] if k != "_valid"} for a, rs in per.items()}


def endpoint_values(study: Study, out: str | Path | None = None, *,
                    root: str | Path | None = None) -> dict[str, dict[str, dict[str, np.ndarray]]]:
    """{group: {arm: {endpoint: its values over the arm's runs, in spec order}}} of a complete
    sweep: the registered endpoints exactly as ``analyze`` computes them, for a descriptive table
    beside the registered analysis (a ``StudyError`` while runs are missing)."""
    root = Path(root) if root is not None else Path(".")
    dirs = block_dirs(study, out, root)
    planned = planned_runs(study)
    states = study_states(planned, dirs) or {}
    done = _done(study, planned, states)
    if len(done) < len(planned):
        raise StudyError(_incomplete_line(study, planned, done))
    return {g: _columns(study, per) for g, per in _records(study, dirs, planned, states).items()}


def analyze(study: Study, out: str | Path | None = None, *, root: str | Path | None = None) -> StudyResult:
    """The registered analysis of ``study`` over its sweep directory (see the module docstring).
    ``root``: the folder ``out`` and the other sweeps the study names are relative to (default:
    the working directory)."""
    root = Path(root) if root is not None else Path(".")
    dirs = block_dirs(study, out, root)
    planned = planned_runs(study)
    arms = list(dict.fromkeys(p.arm for p in planned))
    states = study_states(planned, dirs)
    freeze = check_freezes(study, dirs, states)
    states = states or {}
    tripped = sorted(p.name for p in planned if p.arm == study.control and states.get(p.run_id, ("",))[0] == GUARD_FAILED)
    if tripped:
        return StudyResult(f"VOID: the zero-mismatch guard stopped {', '.join(tripped)} (every control step keeps k3 "
                           f"exactly 0 and every token bitwise equal); the study is re-run, not analysed.", "void", freeze)
    done = _done(study, planned, states)
    if len(done) < len(planned):
        return StudyResult(_incomplete_line(study, planned, done), "incomplete", freeze)
    checks, cols = [], {}
    for g, per in _records(study, dirs, planned, states).items():
        valid, line = _validity(study, per, g)
        if not valid and not study.groups:
            return StudyResult(line, "void", freeze)
        checks += [line] if line else []
        if valid:  # a void group is left out of every table and fit
            cols[g] = _columns(study, per)
    verdicts, cmps, decisions, tests, states, outcomes = {}, {}, {}, {}, {}, {}
    fams = {f.name: f for f in study.families}
    tables = {t.name: t for t in study.tables if t.name}
    kinds = {"families": lambda: [x for f in study.families if f.name not in study.order
                                  for x in _family(study, f, cols, verdicts, cmps, states)],
             "tables": lambda: [x for t in study.tables if t.name not in study.order or not t.name
                                for x in _table(study, t, cols)],
             "fits": lambda: _fits(study, cols, verdicts, root, cmps,
                                   tuple(f.kind for f in study.fits if f.kind not in study.order), tests),
             "verdicts": lambda: _decisions(study, cmps, arms, decisions) + _outcomes(study, states, tests, outcomes),
             "paragraphs": lambda: _paragraphs(study, cmps, cols)}
    head = [*checks, *_repeats(study, dirs, planned, root)]
    lines = [*head, ""] if head else []
    for part in study.order:
        lines += kinds[part]() if part in kinds else _family(study, fams[part], cols, verdicts, cmps, states) \
            if part in fams else _table(study, tables[part], cols) if part in tables else \
            _fits(study, cols, verdicts, root, cmps, (part,), tests)
    lines += _within_blocks(study, cols)
    for note in study.notes:
        lines += [note, ""]
    if study.amendments:
        lines += ["", "Amendments after the first run: " + "; ".join(f"{a.date}: {a.reason}" for a in study.amendments)]
    text = "\n".join(lines).rstrip("\n")
    return StudyResult(text + ("\n" if study.blank_end else ""), "complete", freeze, verdicts, decisions, tests, states,
                       outcomes)


def _done(study: Study, planned: list[PlannedRun], states: dict[str, tuple[str, int]]) -> set[str]:
    """The names of the planned runs that count: finished at the study's last step, or diverged."""
    return {p.name for p in planned if states.get(p.run_id, ("", 0))[0] == DIVERGED
            or states.get(p.run_id, ("", 0)) == (FINISHED, study.steps)}


def _incomplete_line(study: Study, planned: list[PlannedRun], done: set[str]) -> str:
    group_by = {p.name: seedless(p.name) if study.groups else p.arm for p in planned}
    return incomplete_line([p.name for p in planned], done, study.steps, label=group_by.get)


def incomplete(study: Study, out: str | Path | None = None, *, root: str | Path | None = None,
               dirs: dict[str, Path] | None = None) -> str | None:
    """The INCOMPLETE line ``analyze`` prints while a run of the study's sweep has neither finished
    at ``steps`` nor diverged (step 3 of the module docstring), or None once every run has. Reads
    the runs' states only, never their metrics; ``out`` and ``root`` as in ``analyze``, or ``dirs``
    ({block: its directory}, as ``block_dirs`` gives). For an analysis of the study's runs that must
    wait for the whole study (``early_warning.second_test``)."""
    root = Path(root) if root is not None else Path(".")
    planned = planned_runs(study)
    done = _done(study, planned, study_states(planned, dirs or block_dirs(study, out, root)) or {})
    return None if len(done) == len(planned) else _incomplete_line(study, planned, done)


def progress(study: Study, out: str | Path | None = None) -> dict[str, tuple[int, int]]:
    """{block ("" without blocks): (its runs that count, its planned runs)}, from the runs' states
    only (a safe view of a study in progress: no metric is read)."""
    planned = planned_runs(study)
    done = _done(study, planned, study_states(planned, block_dirs(study, out)) or {})
    out_ = {}
    for p in planned:
        n, m = out_.get(p.block, (0, 0))
        out_[p.block] = (n + (p.name in done), m + 1)
    return out_


def missing_runs(study: Study, out: str | Path | None = None) -> str:
    """The runs not yet finished, grouped (for ``timlab study check``)."""
    planned = planned_runs(study)
    done = _done(study, planned, study_states(planned, block_dirs(study, out)) or {})
    left = [p.name for p in planned if p.name not in done]
    return grouped_seeds(left) if left else "none"


def figure(study: Study, path: str | Path, out: str | Path | None = None, *, trajectories: bool = False) -> Path:
    """Each family endpoint's arm-minus-reference difference with its 95% bootstrap interval, one
    panel per endpoint, one row per family; only for a complete, valid study (its refusal otherwise). A grouped study
    with a ``length_exponent`` fit gets ``figures.exponent_figure``, one with a ``predict`` fit
    ``prediction_figure`` (``_prediction_figure``), any other grouped study its length fit's figure
    (``_group_figure``). ``trajectories``: instead, each arm's course over training
    (``trajectory_figure``), for any complete study."""
    from matplotlib.figure import Figure

    if trajectories:
        return _trajectory_figure(study, path, out)
    if study.groups and any(f.kind == "length_exponent" for f in study.fits):
        from timlab.experiments.studies.figures import exponent_figure

        return exponent_figure(study, valid_columns(study, out), path)
    if study.groups and any(f.kind == "predict" for f in study.fits):
        return _prediction_figure(study, path, out)
    if study.groups:
        return _group_figure(study, path, out)
    res = analyze(study, out)
    if res.status != "complete":
        raise StudyError(f"{study.source}: no figure: {res.text}")
    dirs, planned = block_dirs(study, out), planned_runs(study)
    per = _records(study, dirs, planned, study_states(planned, dirs) or {})[""]
    # one row per family, one column per endpoint of it (a study of one family: one row)
    rows, cols = len(study.families), max(len(f.endpoints) for f in study.families)
    fig = Figure(figsize=(4.5 * cols, 3.8 * rows))
    for r, fam in enumerate(study.families):
        for c, key in enumerate(fam.endpoints):
            _difference_panel(fig.add_subplot(rows, cols, r * cols + c + 1), study, res, per, fam, key,
                              title=len(study.families) > 1)
    fig.suptitle(f"{study.name}: each arm against its reference (red: the family's rule holds)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))  # room for the title
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path


def _difference_panel(ax, study: Study, res: StudyResult, per: dict, fam, key: str, *, title: bool) -> None:
    """One panel of ``figure``: each comparison of family ``fam`` on endpoint ``key``, the
    difference of means with its 95% bootstrap interval; red where the family's rule holds.
    ``title``: name the family above the endpoint (a study of several families)."""
    import textwrap

    from timlab.experiments.studies.stats import bootstrap_diff_ci

    pairs = comparisons(fam, list(per))
    members = [n for n, *_ in pairs]
    for j, (n, a, b, _) in enumerate(pairs):
        ref = np.array([r[key] for r in per[b]], float)
        x = np.array([r[key] for r in per[a]], float)
        diff = float(x.mean() - ref.mean())
        lo, hi = bootstrap_diff_ci(x, ref)
        held = res.verdicts.get((fam.name, key, n))
        ax.errorbar([j], [diff], yerr=[[diff - lo], [hi - diff]], fmt="o", capsize=3,
                    color="C3" if held else "C0", label=None)
    ax.axhline(0, color="0.5", lw=0.8)
    ax.set_xticks(range(len(members)), members, rotation=30, ha="right", fontsize=8)
    head = textwrap.fill((f"{fam.name}: " if title else "") + study.label(key), 60)
    ax.set_title(f"{head}\n" + (f"rule: {fam.rule}" if fam.rule else "descriptive"), fontsize=8)
    ax.set_ylabel(f"arm minus {fam.against}, 95% bootstrap", fontsize=8)


def valid_columns(study: Study, out: str | Path | None = None) -> dict[str, dict[str, dict[str, np.ndarray]]]:
    """{group: {arm: {endpoint: per-run values}}} of a complete study's valid groups (one group ""
    in an ungrouped study), for its figures; a study that is not complete and valid is refused with
    the analysis' line."""
    res = analyze(study, out)
    if res.status != "complete":
        raise StudyError(f"{study.source}: no figure: {res.text}")
    dirs, planned = block_dirs(study, out), planned_runs(study)
    per = _records(study, dirs, planned, study_states(planned, dirs) or {})
    return {g: _columns(study, rs) for g, rs in per.items() if _validity(study, rs, g)[0]}


def _trajectory_figure(study: Study, path: str | Path, out: str | Path | None = None) -> Path:
    """``trajectory_figure.trajectory_figure`` of a complete study's runs, by arm (by group and arm
    in a grouped study)."""
    from timlab.experiments.studies.trajectory_figure import trajectory_figure

    res = analyze(study, out)
    if res.status != "complete":
        raise StudyError(f"{study.source}: no figure: {res.text}")
    dirs = block_dirs(study, out)
    runs: dict[tuple[str, str], list[pd.DataFrame]] = {}
    for p in planned_runs(study):
        runs.setdefault((p.group, p.arm), []).append(read_metrics(dirs[p.block] / p.run_id))
    return trajectory_figure(study, runs, path)


def _prediction_figure(study: Study, path: str | Path, out: str | Path | None = None) -> Path:
    """A grouped study with ``predict`` fits: ``prediction_figure.prediction_figure`` of its valid
    groups and, per fit, the fitted study's; only when both studies are complete and valid."""
    from timlab.experiments.studies.prediction_figure import prediction_figure

    col, treated = _cells(study, valid_columns(study, out))
    if not treated:
        raise StudyError(f"{study.source}: no figure: no valid test {study.groups} (its validity line)")
    fitted = []
    for f in (f for f in study.fits if f.kind == "predict"):
        other, lines, ocols = _fitted_study(f, Path("."))
        if ocols is None:
            raise StudyError(f"{study.source}: no figure: {lines[0]}")
        fitted.append((f, other.name, *_cells(other, ocols)))
    return prediction_figure(study, col, treated, fitted, path)


def _group_figure(study: Study, path: str | Path, out: str | Path | None = None) -> Path:
    """A grouped study's figure, from its first ``length`` fit: each treated (group, arm) cell's
    excess of the fitted endpoint over its group's control, with its 95% bootstrap interval,
    against the realized k3 and each dose T^rho * k3 (T: the group control's mean ``length``);
    under the dose that holds, the groups fall on one curve. Only for a complete, valid study."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    from timlab.experiments.studies.stats import bootstrap_diff_ci
    from timlab.experiments.studies.fits import dose_name

    fit = next((f for f in study.fits if f.kind == "length"), None)
    if fit is None:
        raise StudyError(f"{study.source}: no figure: a grouped study's figure plots its length fit, and it has none "
                         f"(fits: kind length)")
    cols = valid_columns(study, out)
    arms = list(dict.fromkeys(a for c in cols.values() for a in c if a != study.control))
    marks, key, ctrl = "osD^v", fit.endpoint, study.control
    fig = Figure(figsize=(4.7 * (1 + len(fit.rho)), 4))
    axes = [fig.add_subplot(1, 1 + len(fit.rho), i + 1) for i in range(1 + len(fit.rho))]
    for i, (g, col) in enumerate(cols.items()):
        T = float(col[ctrl][fit.length].mean())
        for j, a in enumerate(x for x in arms if x in col):
            ex = float(col[a][key].mean() - col[ctrl][key].mean())
            lo, hi = bootstrap_diff_ci(col[a][key], col[ctrl][key])
            k = float(col[a][fit.k3].mean())
            for ax, x in zip(axes, (k, *(T ** r * k for r in fit.rho))):
                ax.errorbar([x], [ex], yerr=[[ex - lo], [hi - ex]], fmt=marks[j % 5], color=f"C{i}", ms=5, capsize=2,
                            label=f"{study.groups} {g} (T {T:.0f})" if j == 0 else None)
    for ax, xl in zip(axes, ("realized k3", *(dose_name(r) for r in fit.rho))):
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels overlap within a decade
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set(xlabel=xl, ylabel=f"{study.label(key)}\nminus the {study.groups}'s {ctrl}")
    axes[0].legend(fontsize=7, loc="lower left")
    axes[1].set_title("markers: " + ", ".join(f"{marks[j % 5]} {a}" for j, a in enumerate(arms)), fontsize=8)
    fig.suptitle(f"{study.name}: cost of each ({study.groups}, arm) cell, mean over seeds with 95% bootstrap interval",
                 fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path
