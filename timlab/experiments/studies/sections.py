"""One parser per top-level section of a study file, in the order ``registration.study_from_dict``
calls them (that order is also the order errors are found in): ``sweep``, ``endpoints``, ``rules``,
``families``, ``tables``, ``fits``, ``validity``, ``findings``, ``arm_pattern`` and ``groups``,
``repeats``, ``verdicts``, ``outcomes``, ``order``, ``notes``, ``paragraphs``, ``amendments``,
``frozen``, ``predicted_by``, ``blocks``. The parsers of one entry of a section live in ``entries``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, NamedTuple

from timlab.experiments.studies.entries import (_amendment, _choice, _endpoint, _exponent_fit, _family, _grouped_fit,
                                                _keys, _names, _number, _outcome, _paragraph, _ranges, _run_fit,
                                                _unique, _verdict, bounded_fields, bounded_spec)
from timlab.experiments.studies.schema import (ALIGNS, FITS, GROUPED_FITS, MARGIN_TESTS, SECTIONS, SHOWS, TESTS,
                                               Amendment, Block, Column, Endpoint, Family, Fit, Outcome, PredictedBy,
                                               Repeats, Rule, StudyError, Table, Validity, Verdict)
from timlab.files import read_text
from timlab.yaml_io import load_yaml


class Context(NamedTuple):
    """Where a study file is read from, for the fits that read another study: ``root`` (the folder
    its relative paths start from), ``source`` (the name its errors go by), ``loading`` (the study
    files reading this one, so a cycle is named) and ``load`` (``registration.load_study``, passed
    in so that this module does not import ``registration``, which imports it)."""
    root: str | Path
    source: str
    loading: tuple[str, ...]
    load: Callable[..., Any]


def _sweep(d: dict, root: Path, source: str, w: str) -> tuple[dict, Path, str]:
    """``sweep``: a spec file (relative to ``root``) or an inline spec; with the folder its own paths
    start from and the name its errors go by."""
    sweep = d["sweep"]
    if isinstance(sweep, str):
        p = Path(root) / sweep
        if not p.exists():
            raise StudyError(f"{w}: sweep: spec file not found: {p}")
        sweep = load_yaml(read_text(p, what="sweep spec"), str(p), StudyError) or {}
        sweep_root, sweep_source = p.parent, str(p)
    else:
        sweep_root, sweep_source = Path(root), f"{source}: sweep"
    if not isinstance(sweep, dict):
        raise StudyError(f"{w}: sweep: expected a spec file name or an inline spec mapping")
    return sweep, sweep_root, sweep_source


def _endpoints(d: dict, w: str) -> tuple[Endpoint, ...]:
    """``endpoints``: a non-empty list, each named once; a derived one reads endpoints listed before it."""
    if not isinstance(d["endpoints"], list) or not d["endpoints"]:
        raise StudyError(f"{w}: endpoints: expected a non-empty list")
    endpoints: list[Endpoint] = []
    for i, e in enumerate(d["endpoints"]):
        endpoints.append(_endpoint(e, f"{w}: endpoints[{i}]", [x.name for x in endpoints]))
    names = [e.name for e in endpoints]
    if len(set(names)) != len(names):
        raise StudyError(f"{w}: endpoints: duplicate name {next(n for n in names if names.count(n) > 1)!r}")
    return tuple(endpoints)


def _rule(r: Any, where: str) -> Rule:
    """One entry of ``rules``: a test with its alpha and texts; the margin tests with their margin."""
    r = _keys(r, ("name", "test", "alpha", "holds", "fails", "opposite", "requires", "unmet", "ratio_bound",
                  "interval", "margin", "margin_of"), ("name",), where)
    alpha = _number(r.get("alpha", 0.05), f"{where}: alpha")
    if alpha >= 1:
        raise StudyError(f"{where}: alpha must be below 1, got {alpha}")
    test = _choice(r.get("test", "below"), TESTS, f"{where}: test")
    if test in MARGIN_TESTS:
        for key in ("margin", "margin_of"):
            if key not in r:
                raise StudyError(f"{where}: test {test} needs {key} (the margin is margin x the cost of the arm "
                                 f"margin_of, e.g. margin: 0.5, margin_of: spread)")
        if not isinstance(r["margin_of"], str) or not r["margin_of"]:
            raise StudyError(f"{where}: margin_of: expected an arm's name, got {r['margin_of']!r}")
    else:
        for key in ("margin", "margin_of"):
            if key in r:
                raise StudyError(f"{where}: {key}: only the margin tests ({', '.join(MARGIN_TESTS)}) take it, "
                                 f"not test {test}")
    return Rule(str(r["name"]), test, alpha,
                str(r.get("holds", "**yes**")), str(r.get("fails", "no")), str(r.get("opposite", "")),
                str(r.get("requires", "")), str(r.get("unmet", "")), bool(r.get("ratio_bound", False)),
                bool(r.get("interval", True)),
                _number(r["margin"], f"{where}: margin") if test in MARGIN_TESTS else 0.0,
                str(r.get("margin_of", "")))


def _rules(d: dict, w: str) -> tuple[Rule, ...]:
    """``rules``: each named once; a rule ``requires`` another rule of the list."""
    if not isinstance(d.get("rules") or [], list):
        raise StudyError(f"{w}: rules: expected a list")
    rules = [_rule(r, f"{w}: rules[{i}]") for i, r in enumerate(d.get("rules") or [])]
    rule_names = [r.name for r in rules]
    _unique(rule_names, f"{w}: rules")
    for i, r in enumerate(rules):
        if r.requires:
            _choice(r.requires, tuple(n for n in rule_names if n != r.name), f"{w}: rules[{i}]: requires")
    return tuple(rules)


def _families(d: dict, w: str, names: list[str], rules: tuple[Rule, ...], control: str) -> tuple[Family, ...]:
    """``families``: a non-empty list, each named once."""
    rule_names = tuple(r.name for r in rules)
    families = []
    for i, f in enumerate(d["families"] if isinstance(d["families"], list) and d["families"] else [None]):
        where = f"{w}: families[{i}]"
        families.append(_family(f, where, names, rule_names, control, {r.name: r for r in rules}))
    _unique([f.name for f in families], f"{w}: families")
    return tuple(families)


def _column(c: Any, cw: str, names: list[str]) -> Column:
    """One column of a table: what it shows of which endpoints, and how it prints it."""
    c = _keys(c, ("header", "show", "endpoint", "endpoints", "digits", "format", "ranges", "otherwise",
                  "control", "by", "power", "ci", "partial"), ("header", "show"), cw)
    show = _choice(c["show"], SHOWS, f"{cw}: show")
    eps = _names(c.get("endpoints", c.get("endpoint")), names, f"{cw}: endpoint")
    two = show in ("change", "pair")
    if show != "nonzero" and len(eps) != (2 if two else 1):
        raise StudyError(f"{cw}: show {show} takes {'two endpoints' if two else 'one endpoint'}")
    ranges = _ranges(c.get("ranges"), f"{cw}: ranges") if show == "range" else ()
    digits = c.get("digits", 3)
    if isinstance(digits, bool) or not isinstance(digits, int) or not 0 <= digits <= 8:
        raise StudyError(f"{cw}: digits must be an integer from 0 to 8, got {digits!r}")
    spec = bounded_spec(str(c.get("format", "")), f"{cw}: format")
    try:
        format(1.0, spec)
    except ValueError:
        raise StudyError(f"{cw}: format {spec!r} is not a Python format spec for a number (e.g. .1f)") from None
    if show == "scaled" and "by" not in c:
        raise StudyError(f"{cw}: show scaled needs by: the endpoint whose control mean scales the mean")
    by = _names(c["by"], names, f"{cw}: by")[0] if show == "scaled" else ""
    bounded_fields(str(c.get("partial", "")), f"{cw}: partial")
    try:
        str(c.get("partial", "")).format(k=1, n=2)
    except (KeyError, IndexError, ValueError) as e:
        raise StudyError(f"{cw}: partial: not a format string of {{k}} and {{n}} ({e})") from None
    return Column(str(c["header"]), show, eps, digits, spec, ranges, str(c.get("otherwise", "")),
                  None if c.get("control") is None else str(c["control"]), by,
                  _number(c.get("power", 1), f"{cw}: power", positive=False), bool(c.get("ci", True)),
                  str(c.get("partial", "")))


def _tables(d: dict, w: str, names: list[str]) -> tuple[Table, ...]:
    """``tables``: descriptive tables of the arms, each a list of columns (their names are checked
    unique later, after the verdicts, by ``study_from_dict``)."""
    tables = []
    for i, t in enumerate(d.get("tables") or []):
        where = f"{w}: tables[{i}]"
        t = _keys(t, ("title", "columns", "note", "name", "after", "arm_header", "names", "align"), ("columns",), where)
        if not isinstance(t.get("names") or {}, dict):
            raise StudyError(f"{where}: names: expected a mapping of arm: text")
        cols = [_column(c, f"{where}: columns[{j}]", names)
                for j, c in enumerate(t["columns"] if isinstance(t["columns"], list) else [None])]
        tables.append(Table(str(t.get("title", "")), tuple(cols), str(t.get("arm_header", "arm")),
                            str(t.get("note", "")), str(t.get("name", "")), str(t.get("after", "")),
                            tuple((str(a), str(x)) for a, x in (t.get("names") or {}).items()),
                            _choice(t.get("align", "auto"), ALIGNS, f"{where}: align")))
    return tuple(tables)


def _other_study(f: dict, kind: str, eps: tuple, k3: str, where: str, ctx: Context) -> str:
    """The study a ``place`` or ``predict`` fit reads (``study``): its path, once checked that it is
    another study (no cycle), of the other kind (grouped or not), with the endpoints the fit names."""
    if not f.get("study"):
        raise StudyError(f"{where}: kind {kind} needs study: the file of the study whose "
                         + ("law it places arms against" if kind == "place" else "length fit it tests"))
    other = str(Path(ctx.root) / f["study"])
    chain = (*ctx.loading, ctx.source)
    if any(Path(x).resolve() == Path(other).resolve() for x in chain if Path(x).is_file()):
        raise StudyError(f"{where}: study: {other} references this study itself ("
                         f"{' -> '.join((*chain, other))}); a {kind} fit reads another study")
    o = ctx.load(other, loading=chain)
    if bool(o.groups) != (kind == "predict"):
        raise StudyError(f"{where}: study: {other} is {'an ungrouped' if kind == 'predict' else 'a grouped'} "
                         f"study; {kind} needs {'a grouped' if kind == 'predict' else 'an ungrouped'} one")
    if kind == "predict":
        _names([f.get("length", "length")], [x.name for x in o.endpoints], f"{where}: length (an endpoint of "
                                                                           f"{other} too)")
    for key, e in [("endpoint", e) for e in eps] + [("k3", k3)]:
        _choice(e, tuple(x.name for x in o.endpoints), f"{where}: {key} (an endpoint of {other} too)")
    return other


def _fit(f: Any, where: str, d: dict, names: list[str], families: tuple[Family, ...], ctx: Context) -> Fit:
    """One entry of ``fits``: its kind (grouped or not, as the study is), endpoints and names, and
    the keys of its kind (``_grouped_fit``, ``_run_fit``, ``_exponent_fit``, ``_other_study``)."""
    f = _keys(f, ("kind", "endpoint", "arms", "k3", "loss", "what", "k3_ref", "name", "dose_label", "study", "title",
                  "length", "at", "rho", "min_cells", "min_groups", "unbounded", "tokens", "k3_star", "t_star",
                  "exponent", "note", "at_T", "at_k3", "family", "fall", "min_falls", "margin", "unmatched",
                  "headers", "signals", "reference", "trail", "rise_after", "early", "start", "arm", "tests",
                  "max_undefined", "groups"), ("kind", "endpoint"), where)
    kind = _choice(f["kind"], FITS, f"{where}: kind")
    if (kind in GROUPED_FITS) != bool(d.get("groups")):
        raise StudyError(f"{where}: kind {kind} " + ("needs groups: (a grouped study)" if kind in GROUPED_FITS
                         else "fits arms of an ungrouped study; with groups: use " + " or ".join(GROUPED_FITS)))
    if kind not in (*GROUPED_FITS, "growth", "signals") and "arms" not in f:
        raise StudyError(f"{where}: missing key 'arms'")
    eps = _names(f["endpoint"], names, f"{where}: endpoint")
    ep = eps[0]
    if len(eps) > 1 and kind != "place":
        raise StudyError(f"{where}: endpoint: kind {kind} fits one endpoint, got {list(eps)}")
    labels = f.get("name", "")
    labels = labels if isinstance(labels, list) else [labels] * len(eps)
    if len(labels) != len(eps):
        raise StudyError(f"{where}: name: one per endpoint ({len(eps)}), got {len(labels)}")
    k3 = _names(f.get("k3", "k3"), names, f"{where}: k3")[0]
    other = _other_study(f, kind, eps, k3, where, ctx) if kind in ("place", "predict") else ""
    return Fit(kind, ep, str(f.get("arms", "")), k3, _number(f.get("loss", 0.1), f"{where}: loss"),
               str(f.get("what", "")), _number(f.get("k3_ref", 1e-3), f"{where}: k3_ref"),
               str(labels[0]), str(f.get("dose_label", "head_perturb")), other, str(f.get("title", "")), eps,
               tuple(str(x) for x in labels), **_grouped_fit(f, kind, names, where),
               **_run_fit(f, kind, names, list(families), where), **_exponent_fit(f, kind, where))


def _fits(d: dict, w: str, names: list[str], families: tuple[Family, ...], ctx: Context) -> tuple[Fit, ...]:
    """``fits``: each checked by ``_fit``; the ``length_exponent`` fits each named once."""
    fits = tuple(_fit(f, f"{w}: fits[{i}]", d, names, families, ctx) for i, f in enumerate(d.get("fits") or []))
    named = [f.name for f in fits if f.kind == "length_exponent"]
    twice = [n for n in named if named.count(n) > 1]
    if twice:
        raise StudyError(f"{w}: fits: two length_exponent fits named {twice[0]!r}; each needs its own name (its "
                         f"tests are keyed by it)")
    return fits


def _validity(d: dict, w: str) -> Validity:
    """``validity``: the checks of the runs before any comparison (all optional)."""
    v = _keys(d.get("validity") or {}, ("control_exact", "min_start_accuracy", "same_start", "start_bar", "title",
                                        "runs", "controls"), (), f"{w}: validity")
    controls = v.get("controls") or []
    if not (isinstance(controls, list) and all(isinstance(a, str) for a in controls)):
        raise StudyError(f"{w}: validity: controls: expected a list of arm names, got {controls!r}")
    bar, start_bar = v.get("min_start_accuracy"), v.get("start_bar")
    return Validity(bool(v.get("control_exact", True)),
                    None if bar is None else _number(bar, f"{w}: validity: min_start_accuracy", positive=False),
                    bool(v.get("same_start", False)),
                    None if start_bar is None else _number(start_bar, f"{w}: validity: start_bar", positive=False),
                    str(v.get("title", "Validity")), str(v.get("runs", "")), tuple(controls))


def _findings(d: dict, root: Path, w: str) -> tuple[tuple[str, str] | None, bool]:
    """``findings``: the (file, block) the analysis writes, and whether the block ends in a blank line."""
    if d.get("findings") is None:
        return None, False
    fd = _keys(d["findings"], ("file", "block", "blank_end"), ("file", "block"), f"{w}: findings")
    return (str(Path(root) / fd["file"]), str(fd["block"])), bool(fd.get("blank_end", False))


def _arms(d: dict, w: str) -> tuple[str, str]:
    """``arm_pattern`` and ``groups``: the regex that reads a run's arm (and group) from its name,
    and the group's name; a grouped study needs both, and has no ``verdicts``."""
    arm_pattern = str(d.get("arm_pattern") or "")
    if arm_pattern:
        try:
            ok = "arm" in re.compile(arm_pattern).groupindex
        except re.error as e:
            raise StudyError(f"{w}: arm_pattern: not a regular expression ({e})") from None
        if not ok:
            raise StudyError(f"{w}: arm_pattern: needs a group named arm, e.g. v1_(?P<arm>.+)_s\\d+")
    groups = str(d.get("groups") or "")
    if bool(groups) != ("group" in (re.compile(arm_pattern).groupindex if arm_pattern else {})):
        raise StudyError(f"{w}: groups: {'set' if groups else 'unset'}, but arm_pattern "
                         f"{'has no' if groups else 'has a'} group named group; a grouped study needs both, e.g. "
                         f"groups: level with arm_pattern: v(?P<group>\\d+)_(?P<arm>.+)_s\\d+")
    if groups and d.get("verdicts"):
        raise StudyError(f"{w}: verdicts: not available in a grouped study (groups: {groups}); use the families' rules")
    return arm_pattern, groups


def _repeats(d: dict, w: str, steps: int) -> Repeats | None:
    """``repeats``: the earlier sweep whose runs these must repeat, up to ``last_step``."""
    if d.get("repeats") is None:
        return None
    r = _keys(d["repeats"], ("sweep", "last_step"), ("sweep", "last_step"), f"{w}: repeats")
    last = r["last_step"]
    if isinstance(last, bool) or not isinstance(last, int) or not 0 <= last <= steps:
        raise StudyError(f"{w}: repeats: last_step must be an integer from 0 to steps ({steps}), got {last!r}")
    return Repeats(str(r["sweep"]), last)


def _verdicts(d: dict, w: str, families: tuple[Family, ...]) -> tuple[Verdict, ...]:
    """``verdicts``: each named once."""
    verdicts = tuple(_verdict(x, f"{w}: verdicts[{i}]", list(families)) for i, x in enumerate(d.get("verdicts") or []))
    _unique([v.name for v in verdicts], f"{w}: verdicts")
    return verdicts


def _outcomes(d: dict, w: str, families: tuple[Family, ...], fits: tuple[Fit, ...], grouped: bool
              ) -> tuple[Outcome, ...]:
    """``outcomes``: a list, each named once."""
    if not isinstance(d.get("outcomes") or [], list):
        raise StudyError(f"{w}: outcomes: expected a list")
    outcomes = tuple(_outcome(x, f"{w}: outcomes[{i}]", list(families), list(fits), grouped)
                     for i, x in enumerate(d.get("outcomes") or []))
    twice = [o.name for o in outcomes if [x.name for x in outcomes].count(o.name) > 1]
    if twice:
        raise StudyError(f"{w}: outcomes: two named {twice[0]!r}; each needs its own name")
    return outcomes


def _notes(d: dict, w: str) -> tuple[str, ...]:
    """``notes``: paragraphs of text, printed as written."""
    notes = d.get("notes") or []
    if not (isinstance(notes, list) and all(isinstance(x, str) for x in notes)):
        raise StudyError(f"{w}: notes: expected a list of paragraphs (text)")
    return tuple(notes)


def _paragraphs(d: dict, w: str, families: tuple[Family, ...], names: list[str], grouped: bool) -> tuple[str, ...]:
    """``paragraphs``: format strings of the analysis' numbers (``_paragraph``)."""
    return tuple(_paragraph(x, f"{w}: paragraphs[{i}]", list(families), names, grouped)
                 for i, x in enumerate(d.get("paragraphs") or []))


def _amendments(d: dict, w: str) -> tuple[Amendment, ...]:
    """``amendments``: each dated, with its reason and hash, oldest first."""
    amendments = tuple(_amendment(a, f"{w}: amendments[{i}]") for i, a in enumerate(d.get("amendments") or []))
    for i in range(1, len(amendments)):
        if amendments[i].date < amendments[i - 1].date:
            raise StudyError(f"{w}: amendments[{i}]: dated {amendments[i].date}, before amendments[{i - 1}] "
                             f"({amendments[i - 1].date}); amendments are listed oldest first")
    return amendments


def _frozen(d: dict, w: str) -> str:
    """``frozen``: the hash a sweep run before ``timlab study run`` was registered with, or ""."""
    frozen = d.get("frozen", "")
    if not isinstance(frozen, str):  # YAML reads a hash of decimal digits alone as a number
        raise StudyError(f"{w}: frozen: expected text, the 64-hex-digit registration hash in quotes, got "
                         f"{type(frozen).__name__} {frozen!r}")
    if frozen and not re.fullmatch(r"[0-9a-f]{64}", str(frozen)):
        raise StudyError(f"{w}: frozen must be a 64-hex-digit registration hash, got {frozen!r}")
    return str(frozen)


def _predicted_by(d: dict, w: str, root: Path, control: str) -> PredictedBy | None:
    """``predicted_by``: the predictor study whose probe this study's arms test, with each arm's kind."""
    if d.get("predicted_by") is None:
        return None
    pb = _keys(d["predicted_by"], ("study", "kinds", "probe"), ("study", "kinds", "probe"), f"{w}: predicted_by")
    kinds = pb["kinds"]
    if not (isinstance(kinds, dict) and kinds and all(isinstance(x, str) and x for x in kinds.values())):
        raise StudyError(f"{w}: predicted_by.kinds: expected a mapping arm -> kind of mismatch, got {kinds!r}")
    if control in kinds:
        raise StudyError(f"{w}: predicted_by.kinds: the control {control!r} is not a cell")
    if not (Path(root) / str(pb["study"])).is_file():
        raise StudyError(f"{w}: predicted_by.study: predictor study file not found: {Path(root) / str(pb['study'])}")
    return PredictedBy(str(Path(root) / str(pb["study"])), {str(k): v for k, v in kinds.items()}, str(pb["probe"]))


def _order(v: Any, families: list[Family], tables: list[Table], fits: list[Fit], verdicts: tuple, w: str,
           outcomes: tuple = ()) -> tuple[str, ...]:
    """The parts after the validity line: each kind of ``SECTIONS`` once (it places the items of
    its kind not named elsewhere), any family or named table by its name, and the fits of a kind by
    the kind (e.g. ``growth``). A fit or verdict comes after the families it reads; outcomes
    (printed with the verdicts) come after the fits whose tests they read."""
    order = tuple(v or SECTIONS)
    order += ("paragraphs",) * ("paragraphs" not in order)
    items = [f.name for f in families] + [t.name for t in tables if t.name] + [f.kind for f in fits] + ["paragraphs"]
    kinds = [x for x in order if x in SECTIONS]
    if sorted(kinds) != sorted(SECTIONS) or len(set(order)) != len(order):
        raise StudyError(f"{w}: order: expected each of {', '.join(SECTIONS)} once (and any family or named table "
                         f"once), got {list(order)}")
    for x in order:
        _choice(x, SECTIONS + tuple(items), f"{w}: order")
    fams = [i for i, x in enumerate(order) if x == "families" or x in {f.name for f in families}]
    where = lambda name: order.index(name) if name in order else order.index("families")  # noqa: E731
    placed = [(order.index(f.kind), x) for f in fits if f.kind in order  # a fit kind placed by itself
              for x in ([f.family] if f.kind == "growth" else [x.name for x in families] if f.kind == "power_law" else [])]
    if min(order.index("fits"), order.index("verdicts")) < max(fams) or any(at < where(x) for at, x in placed):
        raise StudyError(f"{w}: order: fits and verdicts read the families' comparisons, so families come before them")
    read = any(c.fit for o in outcomes for case in o.cases for x in case.when for c in x.parts())
    if read and order.index("verdicts") < max(order.index(x) for x in ("fits", "length_exponent") if x in order):
        raise StudyError(f"{w}: order: outcomes (printed with the verdicts) read the fits' tests, so fits come before "
                         f"verdicts")
    if order.index("paragraphs") < max(fams):
        raise StudyError(f"{w}: order: paragraphs read the families' comparisons, so families come before them")
    return order


def _blocks(d: Any, w: str) -> tuple[Block, ...]:
    """The ``blocks`` list: each with a name, a machine label and its seeds; no seed in two blocks."""
    from timlab.machine import PINNED_LABELS

    if d is None:
        return ()
    if not isinstance(d, list) or len(d) < 2:
        raise StudyError(f"{w}: blocks: expected a list of at least two blocks (name, isa, seeds)")
    out, seen = [], {}
    for i, b in enumerate(d):
        where = f"{w}: blocks[{i}]"
        b = _keys(b, ("name", "isa", "seeds", "out", "fingerprint"), ("name", "isa", "seeds"), where)
        isa = _choice(b["isa"], PINNED_LABELS, f"{where}: isa")
        seeds = b["seeds"]
        if not (isinstance(seeds, list) and seeds and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                          for x in seeds)):
            raise StudyError(f"{where}: seeds: expected a non-empty list of seeds (integers >= 0), got {seeds!r}")
        for x in seeds:
            if x in seen:
                raise StudyError(f"{where}: seeds: seed {x} is already in block {seen[x]!r}; a seed runs in one block")
            seen[x] = str(b["name"])
        fp = b.get("fingerprint", "")
        if not isinstance(fp, str):  # YAML reads 000000000000 as the integer 0, 123456789012 as a number
            raise StudyError(f"{where}: fingerprint: expected text, the 12 hex digits machine.fingerprint() gives, in "
                             f"quotes (e.g. '000000000000'), got {type(fp).__name__} {fp!r}")
        if fp and not re.fullmatch(r"[0-9a-f]{12}", fp):
            raise StudyError(f"{where}: fingerprint: expected the 12 hex digits machine.fingerprint() gives, got {fp!r}")
        out.append(Block(str(b["name"]), isa, tuple(seeds), str(b.get("out") or ""), fp))
    names = [b.name for b in out]
    if len(set(names)) < len(names):
        raise StudyError(f"{w}: blocks: two named {next(n for n in names if names.count(n) > 1)!r}")
    return tuple(out)

