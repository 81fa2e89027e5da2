"""A study's registration: the study file (YAML) read into frozen dataclasses, its hash, and the
freeze that keeps it from changing once its first run exists.

The file holds everything registered before the data: the sweep (a spec file, or the spec inline),
the endpoints (metric, statistic, step window, or the difference of two), the comparison families
with their correction and decision rule (per group in a grouped study: one control, validity check
and correction per group, e.g. per verbosity level), verdicts that combine several comparisons of an arm,
outcomes that combine rule verdicts and fit tests of the whole study (per scale, then across
scales), the validity checks (and runs that must repeat an earlier sweep's), descriptive tables,
fits, paragraphs with the analysis' numbers, and the FINDINGS block it writes.
docs/studies.md describes every field; each dataclass below documents its own. Paths in the file
are relative to the file's folder, except ``out`` (the sweep directory), which is relative to the
working directory, like every ``--out`` of timlab.

Freeze by hash. ``registration_hash`` is the SHA-256 of the registration (the file's mapping
without ``amendments``, ``frozen`` and ``out``, with a referenced sweep spec's own mapping in place of its
path, and the spec's ``base.config`` file's mapping in place of its path), in canonical JSON.
``timlab study run`` records it in ``<out>/study.json`` before the first run starts. From then on
the hash must stay that one, or equal the ``hash`` of the last entry of ``amendments`` (each with
its ``date`` and ``reason``, dated no earlier than the freeze): ``check_freeze`` refuses anything
else, so a registration cannot change after the data exist without saying when and why; each
amendment is recorded in ``study.json`` when first used (``record_amendments``) and may not be
edited or removed after. The files the runs read by path only (model folders, a dataset file:
``input_digests``) are recorded there by content too, and ``study run`` refuses to go on when one
changed (``check_inputs``). A sweep run before ``timlab study run`` existed has no ``study.json``;
its study file then names the hash it was registered with in ``frozen``.

The file's format lives in three modules: ``schema`` (its choices and dataclasses), ``sections``
(one parser per top-level section) and ``entries`` (the parsers of one entry of a section); this
module puts the sections together (``study_from_dict``, ``load_study``) and keeps the freeze. It
re-exports the names other modules import from it.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
from pathlib import Path
from typing import Any

from timlab.experiments.studies.entries import _int_at_least, _keys, _unique
# The study file's schema and value checks, re-exported: other modules import them from here.
from timlab.experiments.studies.entries import bounded_fields, bounded_spec  # noqa: F401
from timlab.experiments.studies.schema import (  # noqa: F401
    ALIGNS, CASE_TESTS, CELLS, COMPARISON_FIELDS, CORRECTIONS, DERIVED, FITS, FORMATTED, FREEZE_FILE, GROUPED_FITS,
    INTERVAL_TESTS, MARGIN_TESTS, MAX_FORMAT_WIDTH, NAME, PARAGRAPH_FIELDS, PLACEHOLDER, RULE_STATES, RUN_FIELDS,
    SECTIONS, SHOWS, STUDY_KEYS, TESTS, TEST_STATES, UNHASHED, Amendment, Block, Case, Column, Condition, Endpoint,
    ExponentTest, Family, Fit, Outcome, PredictedBy, Repeats, Rule, Signal, Study, StudyError, Table, Validity, Verdict,
    first_case, refuse_markers)
from timlab.experiments.studies.sections import (Context, _amendments, _arms, _blocks, _endpoints, _families, _findings,
                                                 _fits, _frozen, _notes, _order, _outcomes, _paragraphs, _predicted_by,
                                                 _repeats, _rules, _sweep, _tables, _validity, _verdicts)
from timlab.files import read_text
from timlab.yaml_io import load_yaml


def canonical(obj: Any) -> str:
    """``obj`` as canonical JSON (sorted keys, no spaces): what the registration hash is taken of."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def registration_hash(registration: dict) -> str:
    """SHA-256 of a registration mapping (``Study.registration``) in canonical JSON."""
    return hashlib.sha256(canonical(registration).encode()).hexdigest()


def study_from_dict(d: Any, *, root: str | Path = ".", source: str = "<dict>", loading: tuple[str, ...] = ()) -> Study:
    """Validate a study mapping (``root``: the folder its relative paths start from; ``loading``: the
    study files whose fits are reading this one, so a cycle of ``study`` references is named): each
    section by its parser in ``sections``, in this order (the order errors are found in)."""
    w = source
    d = _keys(d, STUDY_KEYS, ("study", "sweep", "steps", "endpoints", "families"), w)
    refuse_markers(d, w)
    sweep, sweep_root, sweep_source = _sweep(d, root, source, w)
    steps = _int_at_least(d["steps"], 1, f"{w}: steps")
    endpoints = _endpoints(d, w)
    names = [e.name for e in endpoints]
    rules = _rules(d, w)
    control = str(d.get("control", "control"))
    families = _families(d, w, names, rules, control)
    tables = _tables(d, w, names)
    fits = _fits(d, w, names, families, Context(root, source, loading, load_study))
    validity = _validity(d, w)
    findings, blank_end = _findings(d, root, w)
    arm_pattern, groups = _arms(d, w)
    repeats = _repeats(d, w, steps)
    verdicts = _verdicts(d, w, families)
    _unique([t.name for t in tables if t.name], f"{w}: tables")  # checked here, after the verdicts, as always
    outcomes = _outcomes(d, w, families, fits, bool(groups))
    order = _order(d.get("order"), list(families), list(tables), list(fits), verdicts, w, outcomes)
    notes = _notes(d, w)
    paragraphs = _paragraphs(d, w, families, names, bool(groups))
    amendments = _amendments(d, w)
    frozen = _frozen(d, w)
    predicted_by = _predicted_by(d, w, root, control)
    registration = {k: v for k, v in d.items() if k not in UNHASHED}
    registration["sweep"] = _with_config(sweep, sweep_root, w)
    return Study(name=str(d["study"]), sweep=sweep, sweep_root=str(sweep_root), sweep_source=sweep_source, steps=steps,
                 endpoints=endpoints, families=families, rules=rules, control=control, groups=groups,
                 out=str(d.get("out") or ""), validity=validity, tables=tables, fits=fits, findings=findings,
                 blank_end=blank_end, arm_pattern=arm_pattern, repeats=repeats, verdicts=verdicts, outcomes=outcomes,
                 order=order, frozen=frozen, amendments=amendments, notes=notes, paragraphs=paragraphs, source=source,
                 hash=registration_hash(registration), registration=registration, predicted_by=predicted_by,
                 blocks=_blocks(d.get("blocks"), w))


def _with_config(sweep: dict, root: Path, w: str) -> dict:
    """The sweep spec as the registration hashes it: with its ``base.config`` file's content (its
    YAML mapping) in place of the file's name, so a change inside that file is a change of the
    registration (a spec without ``base.config`` is hashed as written, as before)."""
    base = sweep.get("base")
    if not (isinstance(base, dict) and isinstance(base.get("config"), str)):
        return sweep
    p = Path(base["config"]) if Path(base["config"]).is_absolute() else Path(root) / base["config"]
    if not p.is_file():
        raise StudyError(f"{w}: sweep: base.config file not found: {p}")
    content = load_yaml(read_text(p, what="base config"), str(p), StudyError) or {}
    return {**sweep, "base": {**base, "config": content}}


def study_mapping(path: str | Path) -> tuple[Path, dict]:
    """A study file's path and its YAML mapping, read once (every kind of study file: ``load_study``, the
    predictor and held-out studies' loaders)."""
    p = Path(path)
    if not p.is_file():
        raise StudyError(f"study file not found: {p}")
    return p, load_yaml(read_text(p, what="study file"), str(p), StudyError) or {}


def load_study(path: str | Path, *, loading: tuple[str, ...] = ()) -> Study:
    """Read and validate a study file (``loading``: see ``study_from_dict``)."""
    p, d = study_mapping(path)
    return study_from_dict(d, root=p.parent, source=str(p), loading=loading)


# ------------------------------------------------------------------------------ the freeze
def _first_difference(old: Any, new: Any, where: str = "") -> str:
    """The first path at which two registrations differ, with both values."""
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new)):
            if canonical(old.get(k)) != canonical(new.get(k)):
                return _first_difference(old.get(k), new.get(k), f"{where}.{k}" if where else str(k))
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new)):
            if canonical(a) != canonical(b):
                return _first_difference(a, b, f"{where}[{i}]")
    return f"{where or 'the registration'}: {canonical(old)} -> {canonical(new)}"


def frozen_record(out: str | Path) -> dict | None:
    """The freeze record in a sweep directory, or None."""
    p = Path(out) / FREEZE_FILE
    if not p.exists():
        return None
    try:
        rec = json.loads(read_text(p, what="freeze record"))
    except json.JSONDecodeError as e:
        raise StudyError(f"{p}: not JSON ({e.msg}); it records the registration frozen at the first run") from None
    if not isinstance(rec, dict) or not re.fullmatch(r"[0-9a-f]{64}", str(rec.get("hash", ""))):
        raise StudyError(f"{p}: no registration hash in it")
    return rec


def holds_runs(out: str | Path) -> bool:
    """Whether a sweep directory holds runs: its index, or any run folder (a folder holding a
    config.yaml and a status.json, as every run leaves from its first step), so a sweep whose index
    was deleted still counts as run and no registration is frozen over its runs."""
    from timlab.experiments.sweeps.index import INDEX_FILE
    from timlab.rundir import CONFIG, STATUS

    d = Path(out)
    if (d / INDEX_FILE).exists():
        return True
    try:
        children = list(d.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return False
    return any((c / CONFIG).is_file() and (c / STATUS).is_file() for c in children if c.is_dir())


def check_freeze(study: Study, out: str | Path, *, has_runs: bool) -> str:
    """Raise ``StudyError`` unless ``study``'s registration is the one frozen at its first run (or
    the last amendment's); return a line saying which. ``has_runs``: the sweep has runs, so a
    registration that was never frozen is refused too."""
    rec = frozen_record(out)
    frozen = rec["hash"] if rec else study.frozen
    if not frozen:
        if has_runs:
            raise StudyError(f"{study.source}: {out} holds runs but no frozen registration (no {FREEZE_FILE}, no "
                             f"frozen:); start runs with `timlab study run`, or record the hash they were registered "
                             f"with as frozen: {study.hash}")
        return "not frozen yet (no run)"
    _check_recorded(study, rec, out)
    if study.hash == frozen:
        return f"frozen registration {frozen[:12]} unchanged"
    last = study.amendments[-1] if study.amendments else None
    if last is not None and study.hash == last.hash:
        at = (rec or {}).get("frozen_at")
        for i, a in applied_amendments(study, frozen):
            if at and a.date < str(at):
                raise StudyError(f"{study.source}: amendments[{i}]: dated {a.date}, before the registration was frozen "
                                 f"at the first run ({at}, {Path(out) / FREEZE_FILE}); an amendment is made after it")
        return f"frozen registration {frozen[:12]}, amended {last.date} ({len(study.amendments)} amendment(s)): {last.reason}"
    what = _first_difference(rec["registration"], study.registration) if rec and "registration" in rec else \
        "no frozen copy to compare"
    raise StudyError(f"{study.source}: the registration changed after its first run (frozen {frozen[:12]}, now "
                     f"{study.hash[:12]}; {what}); record an amendment with date, reason and hash: {study.hash}")


def applied_amendments(study: Study, frozen: str) -> list[tuple[int, Amendment]]:
    """The (index, amendment) pairs that amend the registration frozen as ``frozen``: those after
    the last amendment whose hash is ``frozen`` (a block frozen at an amended registration), else all."""
    k = max((i for i, a in enumerate(study.amendments) if a.hash == frozen), default=-1)
    return list(enumerate(study.amendments))[k + 1:]


def _check_recorded(study: Study, rec: dict | None, out: str | Path) -> None:
    """Each amendment the freeze record holds (``record_amendments``: recorded when first used) must
    still be in the study file as it was then: an amendment once used is never edited or removed."""
    listed = {(a.date, a.reason, a.hash) for a in study.amendments}
    for i, r in enumerate((rec or {}).get("amendments") or []):
        if not isinstance(r, dict) or (str(r.get("date")), str(r.get("reason")), str(r.get("hash"))) not in listed:
            what = f"{r.get('date')} (hash {str(r.get('hash'))[:12]})" if isinstance(r, dict) else repr(r)
            raise StudyError(f"{study.source}: amendments: the amendment of {what} that {Path(out) / FREEZE_FILE} "
                             f"recorded when it was first used is no longer in the file as it was; an amendment once "
                             f"used is not edited or removed (add a new one)")


def record_amendments(study: Study, out: str | Path) -> int:
    """Record in ``<out>/study.json`` each amendment that amends its frozen registration (its date,
    reason, hash and the day it was first used) and is not recorded yet, once ``check_freeze``
    passed; returns how many it added. Without a ``study.json`` (a sweep frozen by ``frozen:`` in
    the file) nothing is recorded."""
    rec = frozen_record(out)
    if rec is None or study.hash == rec["hash"]:
        return 0
    from timlab.files import atomic_write_text

    have = rec.get("amendments") or []
    seen = {(r.get("date"), r.get("reason"), r.get("hash")) for r in have if isinstance(r, dict)}
    new = [{"date": a.date, "reason": a.reason, "hash": a.hash, "first_used": datetime.date.today().isoformat()}
           for _, a in applied_amendments(study, rec["hash"]) if (a.date, a.reason, a.hash) not in seen]
    if new:
        rec["amendments"] = [*have, *new]
        atomic_write_text(Path(out) / FREEZE_FILE, json.dumps(rec, indent=1, default=str) + "\n")
    return len(new)


def input_digests(study: Study) -> dict[str, str]:
    """{file: SHA-256} of the files the sweep's runs read that the registration names only by their
    path: each regular file directly in a run's ``model.path`` and ``model.pretrain_init`` folder
    (config.json, the weights, the tokenizer), and the dataset task's ``task.kwargs.path``. A path
    that does not exist (yet) is left out."""
    import stat

    from timlab.experiments.sweeps.spec import expand, spec_from_dict
    from timlab.files import sha256_file

    def regular(p: Path) -> bool:  # never a FIFO or a device: reading one could block or never end
        try:
            return stat.S_ISREG(p.stat().st_mode)
        except OSError:
            return False

    spec = spec_from_dict(study.sweep, root=study.sweep_root, source=study.sweep_source)
    files: set[Path] = set()
    for r in expand(spec):
        m, task = r.config.model, r.config.task
        for folder in (Path(x) for x in (m.path, m.pretrain_init) if x):
            if folder.is_dir():
                files.update(f for f in folder.iterdir() if regular(f))
        if task.name == "dataset" and task.kwargs.get("path") and regular(Path(task.kwargs["path"])):
            files.add(Path(task.kwargs["path"]))
    return {str(f): sha256_file(f) for f in sorted(files)}


def check_inputs(study: Study, out: str | Path) -> str:
    """Compare ``input_digests`` with those ``<out>/study.json`` recorded for this registration
    (keyed by its hash: an amendment may name other inputs), raising ``StudyError`` at the first
    that changed, or record them when none are recorded yet (their first use); a line saying which.
    Run by ``timlab study run`` only: the inputs are local files (a start in ``runs/`` is not
    committed, and each machine block makes its own), which an analysis never reads."""
    rec = frozen_record(out)
    if rec is None:
        return "inputs not recorded (no study.json)"
    now, have = input_digests(study), (rec.get("inputs") or {}).get(study.hash)
    if have is None:
        from timlab.files import atomic_write_text

        rec["inputs"] = {**(rec.get("inputs") or {}), study.hash: now}
        atomic_write_text(Path(out) / FREEZE_FILE, json.dumps(rec, indent=1, default=str) + "\n")
        return f"{len(now)} input file(s) recorded"
    for f in sorted(set(have) | set(now)):
        if have.get(f) != now.get(f):
            what = ("is gone" if f not in now else "is new" if f not in have else
                    f"changed (SHA-256 {have[f][:12]} -> {now[f][:12]})")
            raise StudyError(f"{study.source}: input {f} {what} since the registration was frozen in "
                             f"{Path(out) / FREEZE_FILE}; its runs would read other data than the runs made so far")
    return f"{len(now)} input file(s) as frozen"


def freeze(study: Study, out: str | Path) -> bool:
    """Record ``study``'s registration in ``<out>/study.json`` before the first run; once a record
    exists (or the file names ``frozen``), check against it instead; a sweep that already holds runs
    without either is refused (its registration was never frozen). Returns whether it wrote one."""
    if frozen_record(out) is not None or study.frozen or holds_runs(out):
        check_freeze(study, out, has_runs=True)  # runs made without a freeze: refused unless frozen: is set
        record_amendments(study, out)
        check_inputs(study, out)
        return False
    from timlab.files import atomic_write_with

    Path(out).mkdir(parents=True, exist_ok=True)
    rec = {"study": study.name, "hash": study.hash, "frozen_at": datetime.date.today().isoformat(),
           "source": study.source, "registration": study.registration, "inputs": {study.hash: input_digests(study)}}
    atomic_write_with(Path(out) / FREEZE_FILE, lambda tmp: Path(tmp).write_text(json.dumps(rec, indent=1, default=str) + "\n"))
    return True
