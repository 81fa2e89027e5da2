"""The parsers of one entry of a study file's sections (an endpoint, a family, a verdict, an
outcome's condition, a paragraph, a fit's kind-specific keys, an amendment) and the checks of
single values they share (``_keys``, ``_choice``, ``_number``, a bounded format spec, ...): each
returns a ``schema`` dataclass or value, or raises a one-line ``StudyError`` naming the field.
``sections`` calls them, one section at a time.
"""

from __future__ import annotations

import datetime
import math
import re
import string
from typing import Any

from timlab.experiments.studies.endpoints import SCALED_STATS, SCALES, STATS
from timlab.experiments.studies.schema import (ALIGNS, CASE_TESTS, CELLS, COMPARISON_FIELDS, CORRECTIONS, DERIVED,
                                               FORMATTED, INTERVAL_TESTS, MAX_FORMAT_WIDTH, NAME, PARAGRAPH_FIELDS,
                                               PLACEHOLDER, RULE_STATES, RUN_FIELDS, TEST_STATES, Amendment, Case,
                                               Condition, Endpoint, ExponentTest, Family, Fit, Outcome, Signal,
                                               StudyError, Verdict)

def bounded_spec(spec: str, where: str) -> str:
    """A format spec a study file gives, checked before anything is formatted with it: no nested
    field, and no width or precision above ``MAX_FORMAT_WIDTH``."""
    if "{" in spec or "}" in spec:
        raise StudyError(f"{where}: format spec {spec!r}: a nested {{field}} is not allowed")
    for n in re.findall(r"\d+", spec):
        if len(n) > 6 or int(n) > MAX_FORMAT_WIDTH:
            raise StudyError(f"{where}: format spec {spec!r}: width or precision {n[:12]}"
                             f"{'...' if len(n) > 12 else ''} is above the limit of {MAX_FORMAT_WIDTH}")
    return spec


def bounded_fields(text: str, where: str) -> str:
    """A format string a study file gives (a label, a verdict's line, a paragraph), each of its
    fields' specs checked by ``bounded_spec`` before it is ever formatted."""
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as e:
        raise StudyError(f"{where}: not a format string ({e})") from None
    for _, f, spec, _ in parsed:
        if f is not None and spec:
            bounded_spec(spec, where)
    return text


def _keys(d: Any, allowed: tuple, required: tuple, where: str) -> dict:
    if not isinstance(d, dict):
        raise StudyError(f"{where}: expected a mapping, got {type(d).__name__}")
    for k in d:
        if k not in allowed:
            raise StudyError(f"{where}: unknown key {k!r}; valid choices: {', '.join(allowed)}")
    for k in required:
        if k not in d:
            raise StudyError(f"{where}: missing key {k!r}")
    return d


def _unique(names: list, where: str, what: str = "named") -> None:
    """Refuse a name given twice (a later entry would silently replace the first)."""
    twice = [n for n in names if names.count(n) > 1]
    if twice:
        raise StudyError(f"{where}: two {what} {twice[0]!r}; each needs its own name")


def _choice(v: Any, choices: tuple, where: str) -> str:
    if v not in choices:
        raise StudyError(f"{where}: {v!r}; valid choices: {', '.join(choices)}")
    return v


def _names(v: Any, known: list[str], where: str) -> tuple[str, ...]:
    v = [v] if isinstance(v, str) else v
    if not isinstance(v, list) or not v:
        raise StudyError(f"{where}: expected a name or a non-empty list of names")
    for x in v:
        _choice(x, tuple(known), where)
    return tuple(v)


def _int_at_least(v: Any, low: int, what: str) -> int:
    """``v``, an integer (not a bool) >= ``low``; else a one-line StudyError naming ``what``."""
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise StudyError(f"{what} must be an integer >= {low}, got {v!r}")
    return v


def _number(v: Any, where: str, *, positive: bool = True) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        raise StudyError(f"{where}: expected a {'positive ' if positive else ''}number, got {v!r}")
    return float(v)


def _window(v: Any, where: str) -> tuple[int | None, int | None]:
    if v is None:
        return (None, None)
    if not (isinstance(v, list) and len(v) == 2 and all(x is None or (isinstance(x, int) and not isinstance(x, bool)
                                                                     and x >= 0) for x in v)):
        raise StudyError(f"{where}: expected [first step, last step] (integers >= 0, or null), got {v!r}")
    if None not in v and v[0] > v[1]:
        raise StudyError(f"{where}: first step {v[0]} after last step {v[1]}")
    return (v[0], v[1])



def _endpoint(d: Any, where: str, earlier: list[str]) -> Endpoint:
    d = _keys(d, ("name", "metric", "stat", "window", "n", "rule", "label", "of", "reach", "lag", "min_points",
                  "scale"), ("name", "stat"), where)
    if not isinstance(d["name"], str) or not NAME.fullmatch(d["name"]):
        raise StudyError(f"{where}: name must be a letter followed by letters, digits or _ (got {d['name']!r})")
    n = _int_at_least(d.get("n", 20), 1, f"{where}: n")
    for key, low in (("lag", 0), ("min_points", 2)):
        _int_at_least(d.get(key, low), low, f"{where}: {key}")
    stat = _choice(d["stat"], STATS + tuple(DERIVED), f"{where}: stat")
    of: tuple[str, ...] = ()
    if stat in DERIVED:
        of = _names(d.get("of"), earlier, f"{where}: of (endpoints listed before it)")
        if len(of) != DERIVED[stat]:
            raise StudyError(f"{where}: of: {stat} takes " + (f"two endpoints [a, b] (a {'-' if stat == 'difference' else '+'} b)"
                             if DERIVED[stat] == 2 else "one endpoint") + f", got {list(of)}")
    elif "metric" not in d:
        raise StudyError(f"{where}: missing key 'metric'")
    reach = None if d.get("reach") is None else _number(d["reach"], f"{where}: reach", positive=False)
    scale = _choice(d["scale"], tuple(SCALES), f"{where}: scale") if "scale" in d else ""
    if scale and stat not in SCALED_STATS:
        raise StudyError(f"{where}: scale: {scale} applies to a level of the metric ({', '.join(SCALED_STATS)}), "
                         f"not to stat {stat}")
    return Endpoint(d["name"], str(d.get("metric", "")), stat, _window(d.get("window"), f"{where}: window"), n,
                    _choice(d.get("rule", "plateau"), ("plateau", "peak"), f"{where}: rule"), str(d.get("label", "")),
                    of, reach, d.get("lag", 0), d.get("min_points", 2), scale)


def _verdict(d: Any, where: str, families: list[Family]) -> Verdict:
    d = _keys(d, ("name", "family", "cases", "otherwise", "line", "alpha"), ("name", "family", "cases", "otherwise", "line"),
              where)
    fam = {f.name: f for f in families}[_choice(d["family"], tuple(f.name for f in families), f"{where}: family")]
    cases = []
    for i, c in enumerate(d["cases"] if isinstance(d["cases"], list) and d["cases"] else [None]):
        cw = f"{where}: cases[{i}]"
        c = _keys(c, ("when", "then"), ("when", "then"), cw)
        if not isinstance(c["when"], dict) or not c["when"]:
            raise StudyError(f"{cw}: when: expected a mapping of endpoint: test (or a list of tests)")
        when = tuple((_choice(e, fam.endpoints, f"{cw}: when: endpoint of family {fam.name}"),
                      tuple(_choice(t, CASE_TESTS, f"{cw}: when: {e}") for t in (v if isinstance(v, list) else [v])))
                     for e, v in c["when"].items())
        cases.append(Case(when, str(c["then"])))
    line = bounded_fields(str(d["line"]), f"{where}: line")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(line) if f is not None]
    except ValueError as e:
        raise StudyError(f"{where}: line: not a format string ({e})") from None
    for f in fields:
        m = re.fullmatch(r"(\w+)(?:\.(\w+)(?:\[[01]\])?)?", f)
        ok = m is not None and (m.group(1) in ("arm", "verdict") and not m.group(2)
                                or m.group(1) in fam.endpoints and m.group(2) in COMPARISON_FIELDS)
        if not ok:
            raise StudyError(f"{where}: line: field {{{f}}}; valid choices: {{arm}}, {{verdict}}, or an endpoint of "
                             f"family {fam.name} ({', '.join(fam.endpoints)}) with a field: {', '.join(COMPARISON_FIELDS)}")
    probe = dict.fromkeys(COMPARISON_FIELDS, 0.0) | {"t_ci": (0.0, 0.0), "boot_ci": (0.0, 0.0), "diff_ci": (0.0, 0.0)}
    try:  # a bad format spec ({acc.p:.4z}) is refused here, not after the data are read
        line.format(arm="a", verdict="v", **{e: type("Comparison", (), probe)() for e in fam.endpoints})
    except (ValueError, KeyError, IndexError, AttributeError) as e:
        raise StudyError(f"{where}: line: {e}") from None
    alpha = _number(d.get("alpha", 0.05), f"{where}: alpha")
    return Verdict(str(d["name"]), fam.name, tuple(cases), str(d["otherwise"]), line, alpha)


def _condition(c: Any, where: str, *, inner: bool = False) -> Condition:
    """One condition of an outcome's case as written (placeholders left in; ``_check_outcome``
    checks what it names)."""
    if isinstance(c, dict) and "any" in c and not inner:
        c = _keys(c, ("any",), ("any",), where)
        if not isinstance(c["any"], list) or len(c["any"]) < 2:
            raise StudyError(f"{where}: any: expected a list of at least 2 conditions, got {c['any']!r}")
        return Condition(any=tuple(_condition(x, f"{where}: any[{i}]", inner=True) for i, x in enumerate(c["any"])))
    fit = isinstance(c, dict) and "fit" in c
    keys = ("fit", "test", "is", "label") if fit else ("family", "endpoint", "group", "arm", "is", "label")
    c = _keys(c, keys, keys[:2] + ("is",) if fit else ("family", "endpoint", "arm", "is"), where)
    states = c["is"] if isinstance(c["is"], list) and c["is"] else [c["is"]]
    if fit:  # YAML reads a bare yes / no as a boolean
        states = ["yes" if x is True else "no" if x is False else x for x in states]
    choices = TEST_STATES if fit else RULE_STATES
    states = tuple(_choice(x, choices, f"{where}: is") for x in states)
    text = {k: c[k] for k in keys if k in c and k != "is"}
    for k, v in text.items():
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            raise StudyError(f"{where}: {k}: expected a name, got {v!r}")
    return Condition(**{k: str(v) for k, v in text.items()}, states=states)


def _outcome(d: Any, where: str, families: list[Family], fits: list[Fit], grouped: bool) -> Outcome:
    """An outcome (``Outcome``), checked: every reference of every case, on every scale, names a
    family with a rule on that endpoint or a ``length_exponent`` fit and one of its tests (the
    groups and arms are checked against the sweep by ``engine.planned_runs``)."""
    d = _keys(d, ("name", "scales", "cases", "otherwise", "mixed"), ("name", "cases", "otherwise"), where)
    raw = d.get("scales") or {}
    if not isinstance(raw, dict) or not all(isinstance(v, dict) and v and all(
            isinstance(k, str) and NAME.fullmatch(k) and isinstance(x, str) for k, x in v.items())
            for v in raw.values()):
        raise StudyError(f"{where}: scales: expected a mapping of scale: {{placeholder: text}} (e.g. accuracy: "
                         f"{{endpoint: acc_level}}), got {raw!r}")
    scales = [(str(scale), tuple(values.items())) for scale, values in raw.items()]
    if len({tuple(k for k, _ in v) for _, v in scales}) > 1:
        raise StudyError(f"{where}: scales: every scale must give the same placeholders, got "
                         + "; ".join(f"{s}: {', '.join(k for k, _ in v)}" for s, v in scales))
    if not isinstance(d["cases"], list) or not d["cases"]:
        raise StudyError(f"{where}: cases: expected a non-empty list of {{when, then}}")
    cases = []
    for i, c in enumerate(d["cases"]):
        cw = f"{where}: cases[{i}]"
        c = _keys(c, ("when", "then"), ("when", "then"), cw)
        if not isinstance(c["when"], list) or not c["when"]:
            raise StudyError(f"{cw}: when: expected a non-empty list of conditions")
        cases.append(Case(tuple(_condition(x, f"{cw}: when[{j}]") for j, x in enumerate(c["when"])), str(c["then"])))
    out = Outcome(str(d["name"]), tuple(cases), str(d["otherwise"]), tuple(scales),
                  str(d.get("mixed", "scale-dependent: {each}")))
    fams = {f.name: f for f in families}
    tests = {f.name: [t.name for t in f.tests] for f in fits if f.kind == "length_exponent"}
    given = [k for k, _ in scales[0][1]] if scales else []
    for scale, values in scales or [("", ())]:
        sw = f"{where}" + (f" (scale {scale})" if scale else "")
        for i, case in enumerate(out.resolved(values)):
            for j, cond in enumerate(case.when):
                for k, c in enumerate(cond.parts()):
                    cw = f"{sw}: cases[{i}]: when[{j}]" + (f": any[{k}]" if cond.any else "")
                    for text in (c.family, c.endpoint, c.group, c.arm, c.fit, c.test, c.label):
                        for m in PLACEHOLDER.finditer(text):
                            raise StudyError(f"{cw}: {{{m.group(1)}}} is not a placeholder of the scales; "
                                             + (f"valid choices: {', '.join('{' + x + '}' for x in given)}" if given
                                                else "give scales: to use placeholders"))
                    if c.fit:
                        _choice(c.fit, tuple(tests), f"{cw}: fit (a length_exponent fit's name)")
                        _choice(c.test, tuple(tests[c.fit]), f"{cw}: test of fit {c.fit}")
                        continue
                    fam = fams[_choice(c.family, tuple(fams), f"{cw}: family")]
                    _choice(c.endpoint, fam.endpoints, f"{cw}: endpoint of family {fam.name}")
                    if not any(fam.rule_for(c.endpoint, r) for r in [x[2] for x in fam.comparisons] or [""]):
                        raise StudyError(f"{cw}: family {fam.name} decides no rule on {c.endpoint} (descriptive); an "
                                         f"outcome reads rule verdicts")
                    if bool(c.group) != grouped:
                        raise StudyError(f"{cw}: group: " + ("needed in a grouped study (the comparison's group)"
                                                             if grouped else "only a grouped study has groups"))
    return out


def _family(f: Any, where: str, names: list[str], rule_names: tuple, control: str, rules: dict) -> Family:
    f = _keys(f, ("name", "endpoints", "rule", "against", "arms", "correction", "show", "note", "headers",
                  "reference_row", "comparisons", "columns", "title", "label", "reference_label", "zero", "names",
                  "table", "heading", "align"), ("name", "endpoints"), where)
    if f["name"] == "runs":
        raise StudyError(f"{where}: name: runs is taken (paragraphs read {{runs[ENDPOINT].max}} as every run's values)")
    if "arms" in f and not (isinstance(f["arms"], list) and f["arms"] and all(isinstance(a, str) for a in f["arms"])):
        raise StudyError(f"{where}: arms: expected a non-empty list of arm names, got {f['arms']!r}")
    eps = _names(f["endpoints"], names, f"{where}: endpoints")
    rule, by_endpoint = f.get("rule") or "", ()
    if isinstance(rule, dict):  # a rule per endpoint
        by_endpoint = tuple((_choice(e, eps, f"{where}: rule: endpoint"), _choice(r, rule_names, f"{where}: rule: {e}"))
                            for e, r in rule.items())
        rule = ""
    elif rule:
        rule = _choice(rule, rule_names, f"{where}: rule")
    against = str(f.get("against", control))
    for a in f.get("arms") or []:
        if f["arms"].count(a) > 1:
            raise StudyError(f"{where}: arms: {a!r} listed twice (it would count twice in the Holm family)")
        if a == against:
            raise StudyError(f"{where}: arms: {a!r} is the reference (against: {against}); an arm is not compared "
                             f"with itself")
    comparisons, bounds = [], []
    for j, c in enumerate(f.get("comparisons") or []):
        cw = f"{where}: comparisons[{j}]"
        c = _keys(c, ("arm", "against", "rule", "bound"), ("arm",), cw)
        r = _choice(c["rule"], rule_names, f"{cw}: rule") if c.get("rule") else ""
        pair = (str(c["arm"]), str(c.get("against", against)))
        if pair[0] == pair[1]:
            raise StudyError(f"{cw}: arm {pair[0]!r} against itself; an arm is not compared with itself")
        if any(pair == (a, b) for a, b, _ in comparisons):
            raise StudyError(f"{cw}: {pair[0]} against {pair[1]} is already compared (it would count twice in the "
                             f"Holm family)")
        comparisons.append((*pair, r))
        bounds.append(_number(c["bound"], f"{cw}: bound") if "bound" in c else None)
    for j, (a, b, r) in enumerate(comparisons):
        for key in eps:
            need = rules[r or dict(by_endpoint).get(key, rule)].requires if (r or dict(by_endpoint).get(key, rule)) else ""
            if need and not any(x == b and y == against for x, y, _ in comparisons[:j]):
                raise StudyError(f"{where}: comparisons[{j}]: its rule requires {need!r} of {b} against {against}, "
                                 f"so that comparison must come before it")
    columns = tuple(c if isinstance(c, str) and c.startswith("verdict:") and _choice(c[8:], rule_names, f"{where}: "
                    f"columns: {c}") else _spec(c, f"{where}: columns") if isinstance(c, str) and ":" in c
                    else _choice(c, CELLS, f"{where}: columns") for c in f.get("columns") or ())
    bounded = {x for x in (*(c[8:] for c in columns if c.startswith("verdict:")), rule, *dict(by_endpoint).values(),
                           *(r for *_, r in comparisons)) if x and rules[x].ratio_bound}
    if bounded and not (comparisons and all(b is not None for b in bounds)):
        raise StudyError(f"{where}: rule {sorted(bounded)[0]} has ratio_bound: give each comparison a bound")
    each = f.get("reference_row", True) == "each"
    if not (each or isinstance(f.get("reference_row", True), bool)):
        raise StudyError(f"{where}: reference_row: {f['reference_row']!r}; valid choices: true, false, each")
    shown = f.get("names") or {}
    if not isinstance(shown, dict):
        raise StudyError(f"{where}: names: expected a mapping of arm: text")
    fam = Family(str(f["name"]), eps, rule, against, tuple(f["arms"]) if isinstance(f.get("arms"), list) else (),
                 _choice(f.get("correction", "holm"), CORRECTIONS, f"{where}: correction"),
                 _names(f["show"], names, f"{where}: show")[0] if f.get("show") else "", str(f.get("note", "")),
                 tuple(str(h) for h in f.get("headers") or ()), each or bool(f.get("reference_row", True)),
                 tuple(comparisons), tuple(bounds), by_endpoint, columns, str(f.get("title", "")),
                 str(f.get("label", "{arm}")), str(f.get("reference_label", "{against}")), each,
                 str(f.get("zero", "0")), tuple((str(a), str(t)) for a, t in shown.items()), bool(f.get("table", True)),
                 bool(f.get("heading", True)), _choice(f.get("align", "auto"), ALIGNS, f"{where}: align"))
    for key, text in (("label", fam.label), ("reference_label", fam.reference_label)):
        bounded_fields(text, f"{where}: {key}")
        try:
            text.format(arm="a", against="b")
        except (KeyError, IndexError, ValueError) as e:
            raise StudyError(f"{where}: {key}: {text!r} is not a format string of {{arm}} and {{against}} ({e})") from None
    if columns and not fam.headers:
        raise StudyError(f"{where}: columns: name each with headers (as many)")
    n_cols = (len(columns) or 5 + bool(fam.show) + bool(fam.rule or by_endpoint or any(r for *_, r in comparisons))) \
        + fam.spans() * ("comparison" in (columns or ("comparison",)))
    if fam.headers and len(fam.headers) != n_cols:
        raise StudyError(f"{where}: headers: {len(fam.headers)} given, the table has {n_cols} columns")
    return fam


def _spec(c: str, where: str) -> str:
    """A ``CELL:SPEC`` column (``FORMATTED``), checked: the cell and its Python format spec."""
    cell, spec = c.split(":", 1)
    _choice(cell, FORMATTED, f"{where}: {c}")
    bounded_spec(spec, f"{where}: {c}")
    try:
        format(1.0, spec)
    except ValueError:
        raise StudyError(f"{where}: {c}: {spec!r} is not a Python format spec for a number (e.g. +.3f)") from None
    return c


def _paragraph(text: Any, where: str, families: list[Family], names: list[str], grouped: bool) -> str:
    """A paragraph with numbers (``PARAGRAPH_FIELDS``), checked: each field names a family and one
    of its endpoints (the comparison is checked once the arms are known), or ``runs`` and any
    endpoint; a comparison field or a run field; its format spec fits a number."""
    if grouped:
        raise StudyError(f"{where}: not available in a grouped study; use the families' tables")
    if not isinstance(text, str):
        raise StudyError(f"{where}: expected text (a Python format string)")
    fams = {f.name: f for f in families}
    try:
        fields = [(f, spec) for _, f, spec, _ in string.Formatter().parse(text) if f is not None]
    except ValueError as e:
        raise StudyError(f"{where}: not a format string ({e})") from None
    for f, spec in fields:
        m = PARAGRAPH_FIELDS.fullmatch(f)
        fam = fams.get(m.group("family")) if m else None
        ok = m is not None and (
            m.group("family") == "runs" and m.group("name") is None and m.group("endpoint") in names
            and m.group("field") in RUN_FIELDS
            or fam is not None and m.group("name") is not None and m.group("endpoint") in fam.endpoints
            and m.group("field") in COMPARISON_FIELDS)
        if not ok:
            raise StudyError(f"{where}: field {{{f}}}; valid: {{FAMILY[ENDPOINT][COMPARISON].FIELD}} (families: "
                             f"{', '.join(fams)}; fields: {', '.join(COMPARISON_FIELDS)}) or {{runs[ENDPOINT].FIELD}} "
                             f"(fields: {', '.join(RUN_FIELDS)})")
        bounded_spec(spec or "", f"{where}: field {{{f}}}")
        try:
            format(1 if m.group("field") == "n" else 1.0, spec or "")
        except ValueError:
            raise StudyError(f"{where}: field {{{f}:{spec}}}: {spec!r} is not a format spec for a number") from None
    return text


def _ranges(v: Any, where: str) -> tuple[tuple[str, float | None, float | None], ...]:
    if not isinstance(v, list) or not v:
        raise StudyError(f"{where}: expected a list of {{then, low, high}} (show range)")
    out = []
    for i, r in enumerate(v):
        r = _keys(r, ("then", "low", "high"), ("then",), f"{where}[{i}]")
        lo, hi = (None if r.get(k) is None else _number(r[k], f"{where}[{i}]: {k}", positive=False) for k in ("low", "high"))
        if lo is None and hi is None:
            raise StudyError(f"{where}[{i}]: give low, high or both")
        out.append((str(r["then"]), lo, hi))
    return tuple(out)


def _grouped_fit(f: dict, kind: str, names: list[str], where: str) -> dict:
    """The ``length`` and ``threshold`` keys of a fit (``Fit``), checked."""
    def count(key: str, default: int) -> int:
        return _int_at_least(f.get(key, default), 1, f"{where}: {key}")

    def numbers(key: str, default: tuple) -> tuple:
        v = f.get(key, list(default))
        if not isinstance(v, list) or not v:
            raise StudyError(f"{where}: {key}: expected a non-empty list of numbers, got {v!r}")
        return tuple(_number(x, f"{where}: {key}") for x in v)

    takes_length = kind in ("length", "predict", "length_exponent")
    out = {"length": _names(f.get("length", "length"), names, f"{where}: length")[0] if takes_length else "length",
           "at": tuple(int(x) if float(x).is_integer() else x for x in numbers("at", (1000, 2000, 4000, 8000))),
           "rho": numbers("rho", (1.0, 2.0)), "min_cells": count("min_cells", 4), "min_groups": count("min_groups", 2),
           "unbounded": _number(f.get("unbounded", 10.0), f"{where}: unbounded"),
           "k3_star": _number(f.get("k3_star", 1e-3), f"{where}: k3_star"),
           "t_star": _number(f.get("t_star", 465.0), f"{where}: t_star"),
           "exponent": _number(f.get("exponent", -1.85), f"{where}: exponent", positive=False),
           "note": str(f.get("note", ""))}
    if kind == "predict" and "at_T" in f:
        out["at_T"] = _number(f["at_T"], f"{where}: at_T")
        out["at_k3"] = numbers("at_k3", ())
    if kind == "threshold":
        t = f.get("tokens")
        if not isinstance(t, dict) or not t:
            raise StudyError(f"{where}: kind threshold needs tokens: a mapping of group: T (the answer length where "
                             f"each group's k3*(T) is taken)")
        out["tokens"] = tuple((str(g), _number(v, f"{where}: tokens: {g}")) for g, v in t.items())
    return out


def _run_fit(f: dict, kind: str, names: list[str], families: list[Family], where: str) -> dict:
    """The ``growth`` and ``signals`` keys of a fit (``Fit``), checked."""
    def count(key: str, default: int) -> int:
        return _int_at_least(f.get(key, default), 0, f"{where}: {key}")

    def steps(key: str, default: tuple) -> tuple:
        v = f.get(key, list(default))
        if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
                and 0 <= v[0] <= v[1]):
            raise StudyError(f"{where}: {key}: expected [first step, last step], got {v!r}")
        return tuple(v)

    out: dict = {"min_falls": count("min_falls", 3)}
    if kind == "growth":
        for key in ("family", "fall", "headers"):
            if key not in f:
                raise StudyError(f"{where}: kind growth needs {key}")
        fam = _choice(f["family"], tuple(x.name for x in families), f"{where}: family")
        if not isinstance(f["headers"], list) or len(f["headers"]) != 6:
            raise StudyError(f"{where}: headers: the growth table has 6 columns, got {f['headers']!r}")
        out.update(family=fam, fall=_names(f["fall"], names, f"{where}: fall")[0],
                   margin=_number(f.get("margin", 0.02), f"{where}: margin"),
                   unmatched=_number(f.get("unmatched", 2.0), f"{where}: unmatched"),
                   headers=tuple(str(h) for h in f["headers"]))
    if kind == "signals":
        sigs = f.get("signals")
        if not isinstance(sigs, list) or not sigs:
            raise StudyError(f"{where}: kind signals needs signals: a list of {{name, metric, factor}}")
        parsed = []
        for i, x in enumerate(sigs):
            sw = f"{where}: signals[{i}]"
            x = _keys(x, ("name", "metric", "factor", "over", "power", "arms"), ("name", "metric"), sw)
            parsed.append(Signal(str(x["name"]), str(x["metric"]), _number(x.get("factor", 1.5), f"{sw}: factor"),
                                 str(x.get("over", "")), _number(x.get("power", 1), f"{sw}: power", positive=False),
                                 str(x.get("arms", ""))))
        out.update(signals=tuple(parsed), reference=steps("reference", (21, 60)), trail=count("trail", 10) or 1,
                   rise_after=count("rise_after", 60), early=count("early", 80), start=steps("start", (1, 5)))
    return out


def _exponent_fit(f: dict, kind: str, where: str) -> dict:
    """The ``length_exponent`` keys of a fit (``Fit``), checked (its ``groups`` are checked against
    the sweep's groups by ``engine.planned_runs``)."""
    if kind != "length_exponent":
        if "groups" in f:
            raise StudyError(f"{where}: groups: only kind length_exponent takes it, not kind {kind}")
        return {}
    for key in ("arm", "name"):
        if not isinstance(f.get(key), str) or not f[key]:
            raise StudyError(f"{where}: kind length_exponent needs {key}: " + (
                "the arm whose cost is fitted against T (e.g. spread)" if key == "arm" else
                "how the text names the fit (its tests are keyed by it)"))
    share = _number(f.get("max_undefined", 0.5), f"{where}: max_undefined", positive=False)
    if not 0 <= share < 1:
        raise StudyError(f"{where}: max_undefined: expected a share from 0 to below 1, got {share!r}")
    tests = []
    for i, t in enumerate(f.get("tests") or []):
        tw = f"{where}: tests[{i}]"
        t = _keys(t, ("name", "then", "otherwise", *INTERVAL_TESTS), ("name",), tw)
        conditions = []
        for key in INTERVAL_TESTS:
            v = t.get(key, [])
            for x in v if isinstance(v, list) else [v]:
                conditions.append((key, _number(x, f"{tw}: {key}", positive=False)))
        if not conditions:
            raise StudyError(f"{tw}: no condition; give one or more of {', '.join(INTERVAL_TESTS)} (e.g. holds: 1, "
                             f"excludes: 0)")
        tests.append(ExponentTest(str(t["name"]), tuple(conditions), str(t.get("then", "**yes**")),
                                  str(t.get("otherwise", "no"))))
    groups = f.get("groups", [])
    if not (isinstance(groups, list) and all(isinstance(g, (str, int)) and not isinstance(g, bool) for g in groups)):
        raise StudyError(f"{where}: groups: expected a list of group values (e.g. [31, 109]), got {groups!r}")
    groups = [str(g) for g in groups]
    if "groups" in f and len(groups) < 2:
        raise StudyError(f"{where}: groups: an exponent needs at least 2 groups, got {groups}")
    if len(set(groups)) < len(groups):
        raise StudyError(f"{where}: groups: {next(g for g in groups if groups.count(g) > 1)} listed twice")
    return {"arm": f["arm"], "tests": tuple(tests), "max_undefined": share, "groups": tuple(groups)}


def _amendment(d: Any, where: str) -> Amendment:
    d = _keys(d, ("date", "reason", "hash"), ("date", "reason", "hash"), where)
    date = d["date"]
    try:
        date = (date if isinstance(date, datetime.date) else datetime.date.fromisoformat(str(date))).isoformat()
    except ValueError:
        raise StudyError(f"{where}: date {d['date']!r} is not a date (YYYY-MM-DD)") from None
    if not isinstance(d["reason"], str) or not d["reason"].strip():
        raise StudyError(f"{where}: reason must say why the registration changed")
    if not isinstance(d["hash"], str) or not re.fullmatch(r"[0-9a-f]{64}", d["hash"]):
        raise StudyError(f"{where}: hash must be the 64-hex-digit registration hash that `timlab study check` prints")
    return Amendment(date, d["reason"].strip(), d["hash"])

