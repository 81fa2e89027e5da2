"""Hostile and careless study files and sweep folders (issue 59, the study engine's findings): each
is refused in one line naming the field, or handled without losing data; the FINDINGS file is
written atomically and never with a block marker inside a block."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from study_sweep import write_sweep
from test_study import STEPS, make, metrics, registration
from timlab import cli
from timlab.experiments.studies.engine import analyze, planned_runs
from timlab.experiments.studies.registration import StudyError, freeze, load_study, study_from_dict
from timlab.experiments.studies.text import splice_block

REPO = Path(__file__).resolve().parents[1]
FINDINGS = {"findings": {"file": "FINDINGS.md", "block": "planted"}}
PROSE = "".join(f"prose line {i} written by hand after the block\n" for i in range(60))


def one_line_error(change: dict, match: str, **kw) -> str:
    """The ``StudyError`` that the registration with ``change`` raises (it must hold ``match`` and be one line)."""
    with pytest.raises(StudyError) as e:
        study_from_dict(registration(**change), source="s.yaml", **kw)
    assert match in str(e.value) and "\n" not in str(e.value), str(e.value)
    return str(e.value)


# ------------------------------------------------------------------------------- 3: atomic writes
def test_a_findings_write_over_a_file_size_limit_leaves_the_file_whole(tmp_path):
    study, out = make(tmp_path, over=FINDINGS)
    path = tmp_path / "planted.yaml"
    path.write_text(yaml.safe_dump(registration(**FINDINGS)))
    findings = tmp_path / "FINDINGS.md"
    findings.write_text("x\n<!-- findings:planted -->\nold\n<!-- /findings:planted -->\n" + PROSE)
    before = findings.read_bytes()
    limit = len(before) + 200  # the new block is some 2 KB longer: the write passes the limit mid-file
    code = ("import resource, signal, sys\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\nfrom timlab import cli\n"
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
            f"sys.exit(cli.main(['study', 'analyze', {str(path)!r}, '--out', {str(out)!r}, '--write']))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 2, p.stderr[-500:]
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("timlab: error: ") and "the file is unchanged" in err[0]
    assert findings.read_bytes() == before  # not truncated: every line of prose after the block is there
    assert [x.name for x in tmp_path.iterdir() if x.name.startswith(".FINDINGS")] == []  # no temporary file left


# ------------------------------------------------------------------------------- 4: block markers
@pytest.mark.parametrize("change, field", [
    ({"notes": ["see above", "ends here <!-- /findings:planted --> and goes on"]}, "notes[1]"),
    ({"families": [{"name": "cost", "endpoints": ["acc"], "rule": "lowers", "note": "<!-- findings:other -->"}]},
     "families[0].note"),
    ({"rules": [{"name": "lowers", "fails": "no <!--/findings:planted-->"}]}, "rules[0].fails"),
])
def test_study_text_holding_a_findings_marker_is_refused_naming_the_field(change, field):
    one_line_error(change, f"s.yaml: {field}: holds a FINDINGS block marker")


def test_a_block_body_holding_a_marker_is_never_spliced():
    text = "a\n<!-- findings:b -->\nold\n<!-- /findings:b -->\ntail\n"
    assert splice_block(text, "b", "new") == "a\n<!-- findings:b -->\nnew\n<!-- /findings:b -->\ntail\n"
    with pytest.raises(Exception, match="holds a FINDINGS block marker"):
        splice_block(text, "b", "x\n<!-- /findings:b -->\ny")


# ------------------------------------------------------------------------------- 9: format widths
WIDE = "10000000"  # 1e7 characters: refused before any is built (issue 59 found 1e10 in a label)
TABLE = [{"title": "t", "columns": [{"header": "h", "show": "mean", "endpoint": "acc", "format": f">{WIDE}.3f"}]}]


@pytest.mark.parametrize("change, field", [
    ({"families": [{"name": "cost", "endpoints": ["acc"], "rule": "lowers", "label": f"{{arm:>{WIDE}}}"}]},
     "families[0]: label"),
    ({"families": [{"name": "cost", "endpoints": ["acc"], "rule": "lowers", "reference_label": f"{{against:^{WIDE}}}"}]},
     "families[0]: reference_label"),
    ({"families": [{"name": "cost", "endpoints": ["acc"], "rule": "lowers", "columns": ["comparison", f"diff:+.{WIDE}f"],
                    "headers": ["a", "b"]}]}, f"families[0]: columns: diff:+.{WIDE}f"),
    ({"tables": TABLE}, "tables[0]: columns[0]: format"),
    ({"tables": [{"columns": [{"header": "h", "show": "mean", "endpoint": "acc", "partial": f"{{k:{WIDE}}}"}]}]},
     "tables[0]: columns[0]: partial"),
    ({"families": [{"name": "cost", "endpoints": ["acc"]}],
      "verdicts": [{"name": "v", "family": "cost", "cases": [{"when": {"acc": "below"}, "then": "y"}], "otherwise": "n",
                    "line": f"{{arm}} {{acc.diff:{WIDE}.4f}}"}]}, "verdicts[0]: line"),
    ({"paragraphs": [f"top {{runs[acc].max:0{WIDE}.3f}}"]}, "paragraphs[0]: field {runs[acc].max}"),
    ({"families": [{"name": "cost", "endpoints": ["acc"], "rule": "lowers", "label": "{arm:>{against}}"}]},
     "families[0]: label: format spec '>{against}': a nested {field} is not allowed"),
])
def test_format_widths_a_study_file_gives_are_capped(change, field):
    err = one_line_error(change, f"s.yaml: {field}")
    assert "above the limit of 100" in err or "nested" in err


def test_a_width_at_the_cap_is_accepted():
    fam = [{"name": "cost", "endpoints": ["acc"], "rule": "lowers", "label": "{arm:>100}"}]
    assert study_from_dict(registration(families=fam)).families[0].label == "{arm:>100}"


# ------------------------------------------------------------------------------- 15, 16: names and arms
@pytest.mark.parametrize("change, match", [
    ({"rules": [{"name": "lowers"}, {"name": "lowers", "test": "above"}]},
     "s.yaml: rules: two named 'lowers'; each needs its own name"),
    ({"families": [{"name": "cost", "endpoints": ["acc"], "rule": "lowers"},
                   {"name": "cost", "endpoints": ["slope"], "rule": "lowers", "arms": ["tiny"]}]},
     "s.yaml: families: two named 'cost'; each needs its own name"),
    ({"families": [{"name": "cost", "endpoints": ["acc"]}],
      "verdicts": [{"name": "v", "family": "cost", "cases": [{"when": {"acc": "below"}, "then": "y"}], "otherwise": "n",
                    "line": "{arm}"}] * 2}, "s.yaml: verdicts: two named 'v'"),
    ({"tables": [{"name": "t", "columns": [{"header": "h", "show": "mean", "endpoint": "acc"}]}] * 2},
     "s.yaml: tables: two named 't'"),
])
def test_a_name_given_twice_is_refused(change, match):
    one_line_error(change, match)


@pytest.mark.parametrize("family, match", [
    ({"arms": ["head", "head"]}, "families[0]: arms: 'head' listed twice"),
    ({"arms": ["control"]}, "families[0]: arms: 'control' is the reference (against: control); an arm is not compared"),
    ({"arms": ["tiny"], "against": "tiny"}, "families[0]: arms: 'tiny' is the reference (against: tiny)"),
    ({"comparisons": [{"arm": "head"}, {"arm": "head"}]},
     "families[0]: comparisons[1]: head against control is already compared"),
    ({"comparisons": [{"arm": "head", "against": "head"}]}, "families[0]: comparisons[0]: arm 'head' against itself"),
])
def test_a_family_compares_each_arm_once_and_never_with_itself(family, match):
    one_line_error({"families": [{"name": "cost", "endpoints": ["acc"], "rule": "lowers", **family}]}, match)


# ------------------------------------------------------------------------------- 13, 18, 20: machine blocks
AMD = {"name": "amd", "isa": "avx2", "seeds": [0, 1, 2, 3, 4]}
INTEL = {"name": "intel", "isa": "avx2-intel", "seeds": [7], "out": "sweep_intel"}
SPLIT = [{**AMD, "seeds": [0, 1, 2, 3]}, {**INTEL, "seeds": [4]}]


def test_a_block_that_holds_none_of_the_sweeps_seeds_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    from timlab.experiments.studies.blocks import block_spec
    from timlab.experiments.sweeps.spec import spec_from_dict

    st = study_from_dict(registration(out="sweep", blocks=[AMD, INTEL]), root=tmp_path, source="b.yaml")
    with pytest.raises(StudyError, match=r"b.yaml: blocks: block intel holds none of the sweep's seeds \(its seeds: 7; "
                                         r"the sweep's: 0-4\); each block needs runs"):
        planned_runs(st)
    ok = study_from_dict(registration(out="sweep", blocks=SPLIT), root=tmp_path)
    with pytest.raises(StudyError, match="block gpu: holds none of the sweep's runs; nothing to run"):
        block_spec(spec_from_dict(ok.sweep, root=ok.sweep_root), planned_runs(ok), "gpu")
    f = tmp_path / "b.yaml"
    f.write_text(yaml.safe_dump(registration(out="sweep", blocks=[AMD, INTEL])))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("timlab.machine.bits", lambda: "avx2-intel")
    for action in ("run", "check"):  # run: no unregistered base run trained; check: no KeyError (finding 20)
        assert cli.main(["study", action, str(f), "--quiet"] if action == "run" else ["study", action, str(f)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "block intel holds none of the sweep's seeds" in err[0]
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "sweep_intel").exists()  # nothing written


def test_a_fingerprint_yaml_reads_as_a_number_is_refused():
    blocks = yaml.safe_load("- {name: amd, isa: avx2, seeds: [0, 1, 2, 3]}\n"
                            "- {name: intel, isa: avx2-intel, seeds: [4], fingerprint: 000000000000}\n")
    assert blocks[1]["fingerprint"] == 0  # what YAML makes of it
    one_line_error({"blocks": blocks}, "s.yaml: blocks[1]: fingerprint: expected text, the 12 hex digits "
                                       "machine.fingerprint() gives, in quotes (e.g. '000000000000'), got int 0")
    one_line_error({"frozen": 123}, "s.yaml: frozen: expected text, the 64-hex-digit registration hash in quotes")


# ------------------------------------------------------------------------------- 14: steps
def test_the_studys_steps_must_be_the_runs_steps(tmp_path, capsys):
    st = study_from_dict(registration(steps=5), source="s.yaml")  # its runs train run.steps = 100
    with pytest.raises(StudyError, match=r"s.yaml: steps: 5, but run control_s0__\w+ of the sweep stops at run.steps "
                                         r"100; every run must train the study's steps"):
        planned_runs(st)
    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump(registration(steps=5)))
    assert cli.main(["study", "check", str(f), "--out", str(tmp_path / "sweep")]) == 2
    assert "steps: 5, but run control_s0__" in capsys.readouterr().err
    assert len(planned_runs(study_from_dict(registration()))) == 15


# ------------------------------------------------------------------------------- 12: runs without an index
def test_run_folders_count_as_runs_when_the_index_and_the_freeze_are_deleted(tmp_path, capsys):
    study, out = make(tmp_path)
    for run in (p for p in out.iterdir() if p.is_dir()):
        (run / "config.yaml").write_text("run: {steps: 100}\n")  # every run writes its config.yaml first
    (out / "study.json").unlink()
    (out / "index.parquet").unlink()
    changed = registration()
    changed["endpoints"][0]["window"] = [30, None]
    with pytest.raises(StudyError, match=f"{out} holds runs but no frozen registration"):
        freeze(study_from_dict(changed, root=tmp_path, source="planted.yaml"), out)
    assert not (out / "study.json").exists()  # nothing frozen over the finished runs
    f = tmp_path / "planted.yaml"
    f.write_text(yaml.safe_dump(changed))
    assert cli.main(["study", "check", str(f), "--out", str(out)]) == 2
    assert "holds runs but no frozen registration" in capsys.readouterr().err
    fresh = tmp_path / "fresh"
    assert freeze(study, fresh) and (fresh / "study.json").exists()  # an empty directory is frozen as before


# ------------------------------------------------------------------------------- 19: a study that reads itself
def test_a_study_whose_place_fit_reads_itself_or_a_cycle_is_named(tmp_path):
    def place(other):
        return registration(fits=[{"kind": "place", "study": other, "endpoint": ["slope"], "arms": "head"}])

    (tmp_path / "self.yaml").write_text(yaml.safe_dump(place("self.yaml")))
    with pytest.raises(StudyError) as e:
        load_study(tmp_path / "self.yaml")
    assert str(e.value) == (f"{tmp_path}/self.yaml: fits[0]: study: {tmp_path}/self.yaml references this study itself "
                            f"({tmp_path}/self.yaml -> {tmp_path}/self.yaml); a place fit reads another study")
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(place("b.yaml")))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(place("a.yaml")))
    with pytest.raises(StudyError, match=r"b.yaml: fits\[0\]: study: .*a.yaml references this study itself \(.*a.yaml -> "
                                         r".*b.yaml -> .*a.yaml\)"):
        load_study(tmp_path / "a.yaml")


# ------------------------------------------------------------------------------- 17: amendments
def test_amendments_are_dated_after_the_freeze_and_recorded_when_first_used(tmp_path):
    import datetime
    import json

    study, out = make(tmp_path)
    today = datetime.date.today().isoformat()
    assert json.loads((out / "study.json").read_text())["frozen_at"] == today
    d1 = registration()
    d1["endpoints"][0]["window"] = [30, None]
    h1 = study_from_dict(d1, root=tmp_path).hash
    old = {"date": "1990-01-01", "reason": "a later window", "hash": h1}
    with pytest.raises(StudyError, match=f"amendments\\[0\\]: dated 1990-01-01, before the registration was frozen at "
                                         f"the first run \\({today}, {out}/study.json\\)"):
        analyze(study_from_dict({**d1, "amendments": [old]}, root=tmp_path, source="planted.yaml"), out)
    a1 = {**old, "date": today}
    amended = study_from_dict({**d1, "amendments": [a1]}, root=tmp_path, source="planted.yaml")
    assert analyze(amended, out).status == "complete"
    assert not freeze(amended, out)  # `study run` resuming: the amendment is recorded at its first use
    rec = json.loads((out / "study.json").read_text())
    assert rec["hash"] == study.hash and rec["amendments"] == [{**a1, "first_used": today}]
    assert not freeze(amended, out) and json.loads((out / "study.json").read_text()) == rec  # once
    edited = {**a1, "reason": "another story"}
    with pytest.raises(StudyError, match=f"the amendment of {today} \\(hash {h1[:12]}\\) that {out}/study.json recorded "
                                         f"when it was first used is no longer in the file as it was"):
        analyze(study_from_dict({**d1, "amendments": [edited]}, root=tmp_path), out)
    d2 = registration()
    d2["endpoints"][0]["window"] = [40, None]
    a2 = {"date": today, "reason": "later still", "hash": study_from_dict(d2, root=tmp_path).hash}
    assert analyze(study_from_dict({**d2, "amendments": [a1, a2]}, root=tmp_path), out).status == "complete"
    with pytest.raises(StudyError, match="no longer in the file as it was"):  # the first one dropped unseen
        analyze(study_from_dict({**d2, "amendments": [a2]}, root=tmp_path), out)
    one_line_error({"amendments": [a1, {**a2, "date": "2000-01-01"}]},
                   "amendments[1]: dated 2000-01-01, before amendments[0]")


def test_analyze_write_records_the_amendment_it_used(tmp_path, capsys):
    import datetime
    import json

    study, out = make(tmp_path, over=FINDINGS)
    (tmp_path / "FINDINGS.md").write_text("<!-- findings:planted -->\n<!-- /findings:planted -->\n")
    d = registration(**FINDINGS)
    d["endpoints"][0]["window"] = [30, None]
    a = {"date": datetime.date.today().isoformat(), "reason": "a later window",
         "hash": study_from_dict(d, root=tmp_path).hash}
    f = tmp_path / "planted.yaml"
    f.write_text(yaml.safe_dump({**d, "amendments": [a]}))
    assert cli.main(["study", "analyze", str(f), "--out", str(out)]) == 0
    assert "amendments" not in json.loads((out / "study.json").read_text())  # a read-only analysis records nothing
    assert cli.main(["study", "analyze", str(f), "--out", str(out), "--write"]) == 0
    assert [x["hash"] for x in json.loads((out / "study.json").read_text())["amendments"]] == [a["hash"]]


# ------------------------------------------------------------------------------- 11: what the sweep reads
def with_config(tmp_path, every: int) -> dict:
    """The planted registration with its evaluation interval in a base.config file (cfg.yaml)."""
    (tmp_path / "cfg.yaml").write_text(f"run: {{eval_every: {every}}}\n")
    d = registration()
    d["sweep"]["base"]["config"] = "cfg.yaml"
    return d


def test_a_change_inside_the_sweeps_base_config_changes_the_registration(tmp_path):
    first = study_from_dict(with_config(tmp_path, 10), root=tmp_path, source="s.yaml")
    out = tmp_path / "sweep"
    freeze(first, out)
    same = study_from_dict(with_config(tmp_path, 10), root=tmp_path, source="s.yaml")
    assert same.hash == first.hash and first.registration["sweep"]["base"]["config"] == {"run": {"eval_every": 10}}
    changed = study_from_dict(with_config(tmp_path, 20), root=tmp_path, source="s.yaml")
    assert changed.hash != first.hash
    with pytest.raises(StudyError, match=r"changed after its first run .*sweep\.base\.config\.run\.eval_every: 10 -> 20"):
        freeze(changed, out)
    # a spec without base.config is hashed as written: the committed studies keep their hashes
    assert study_from_dict(registration()).registration["sweep"] == registration()["sweep"]


def test_study_run_refuses_a_start_whose_files_changed_since_the_freeze(tmp_path):
    import json

    start = tmp_path / "start"
    start.mkdir()
    (start / "model.safetensors").write_bytes(b"weights v1")
    (start / "config.json").write_text("{}")
    d = registration()
    d["sweep"]["base"]["set"]["model.path"] = str(start)
    study = study_from_dict(d, root=tmp_path, source="s.yaml")
    out = tmp_path / "sweep"
    assert freeze(study, out)
    rec = json.loads((out / "study.json").read_text())
    assert sorted(rec["inputs"][study.hash]) == [str(start / "config.json"), str(start / "model.safetensors")]
    assert not freeze(study, out)  # unchanged: `study run` resumes
    (start / "model.safetensors").write_bytes(b"weights v2")
    with pytest.raises(StudyError, match=f"s.yaml: input {start}/model.safetensors changed \\(SHA-256 \\w{{12}} -> "
                                         f"\\w{{12}}\\) since the registration was frozen in {out}/study.json"):
        freeze(study, out)
    (start / "model.safetensors").unlink()
    with pytest.raises(StudyError, match="model.safetensors is gone since"):
        freeze(study, out)
