"""The study engine (timlab.experiments.studies) on synthetic sweeps with planted effects: the
registration's checks and hash, the freeze and its amendments, the refusals (incomplete, void),
the endpoints over windows, the comparison families with Holm and the verdicts, the power-law fit,
and ``timlab study`` itself."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from study_sweep import write_sweep
from timlab import cli
from timlab.experiments.studies.engine import analyze, planned_runs
from timlab.experiments.studies.registration import StudyError, freeze, load_study, study_from_dict
from timlab.experiments.studies.endpoints import window_stat
from timlab.experiments.studies.fits import fit_power, power_law_section

REPO = Path(__file__).resolve().parents[1]
STEPS = 100
SEEDS = 5
ARMS = {"control": 0.0, "head": -0.10, "tiny": 0.0}
"""Arm -> its planted shift of greedy accuracy (the control's level is 0.9)."""


def registration(**over) -> dict:
    """Three arms x 5 seeds on the smoke preset, one condition per (arm, seed)."""
    conds = [{"name": f"{a}_s{s}", "set": {"mismatch.injector": "none" if a == "control" else "head_perturb",
                                           **({} if a == "control" else {"mismatch.magnitude": 1.0 if a == "head" else 0.01}),
                                           "run.seed": s, "mismatch.seed": s}}
             for s in range(SEEDS) for a in ARMS]
    d = {"study": "planted", "sweep": {"base": {"preset": "smoke", "set": {"run.steps": STEPS}}, "conditions": conds},
         "steps": STEPS, "control": "control", "validity": {"control_exact": True, "min_start_accuracy": 0.5,
                                                           "same_start": True},
         "endpoints": [{"name": "acc", "metric": "val/accuracy", "stat": "level", "window": [20, None],
                        "label": "mean accuracy, steps 20-100"},
                       {"name": "slope", "metric": "val/accuracy", "stat": "slope", "window": [20, None]},
                       {"name": "k3", "metric": "rollout_corr/k3_kl", "stat": "level", "window": [1, None],
                        "label": "realized k3"},
                       {"name": "fell", "metric": "val/accuracy", "stat": "fall"},
                       {"name": "final", "metric": "val/accuracy", "stat": "final"}],
         "families": [{"name": "cost", "endpoints": ["acc", "slope"], "rule": "lowers", "show": "k3"}],
         "rules": [{"name": "lowers", "test": "below", "alpha": 0.05, "fails": "no (costs {cost})"}],
         "tables": [{"title": "Secondary", "columns": [
             {"header": "falls", "show": "count", "endpoint": "fell"},
             {"header": "final accuracy [95% t]", "show": "t", "endpoint": "final"}]}]}
    d.update(over)
    return d


def metrics(name: str) -> pd.DataFrame:
    """A run's table: accuracy 0.9 + its arm's shift from step 10 on (+ seed noise of sd 1e-3),
    evaluated every 10 steps, step 0 the same start in every run; k3 exactly 0 in the control."""
    arm, seed = name.rsplit("_s", 1)
    rng = np.random.default_rng(int(seed) + 10 * list(ARMS).index(arm))
    steps = np.arange(STEPS + 1)
    ev = np.where(steps % 10 == 0, 1.0, np.nan)
    acc = 0.9 + np.where(steps >= 10, ARMS[arm], 0.0) + np.where(steps > 0, 1e-3 * rng.standard_normal(), 0.0)
    rl = np.where(steps >= 1, 1.0, np.nan)
    k3 = {"control": 0.0, "head": 0.1, "tiny": 1e-4}[arm]
    return pd.DataFrame({"step": steps, "val/accuracy": ev * acc, "val/gold_logprob": ev * (-0.3),
                         "rollout_corr/k3_kl": rl * k3, "mismatch/frac_bitwise_equal": rl * (1.0 if k3 == 0 else 0.4),
                         "train/step_time_s": 0.1})


def make(tmp_path, *, states=None, over=None, runs=None, metrics_of=metrics):
    study = study_from_dict(registration(**(over or {})), root=tmp_path, source="planted.yaml")
    ids = {p.name: p.run_id for p in planned_runs(study)}
    out = tmp_path / "sweep"
    freeze(study, out)
    write_sweep(out, runs or list(ids), metrics_of, STEPS, states=states, run_ids=ids)
    return study, out


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("planted")
    study, out = make(tmp)
    return study, out, analyze(study, out)


# ------------------------------------------------------------------------------- the analysis
def test_planted_effect_is_found_with_its_numbers(done):
    study, _, res = done
    assert res.status == "complete" and res.freeze.endswith("unchanged")
    lines = res.text.splitlines()
    assert lines[0] == ("Validity: control guard (k3 exactly 0, every token bitwise equal, every step) held; control "
                        "step-0 accuracy 0.900 (bar 0.5); step-0 evaluation the same in all 15 runs (accuracy 0.900, "
                        "gold log-prob -0.300): VALID.")
    head = next(line for line in lines if line.startswith("| head | 0.100 | "))
    cells = [c.strip() for c in head.split("|")[1:-1]]
    # 5 vs 5: the floor is 2/252; Holm over the 2 treated arms doubles it
    assert float(cells[3].split()[0]) == pytest.approx(-0.10, abs=2e-3)
    assert cells[4] == f"{2 / 252:.4f}" and cells[5] == f"{4 / 252:.4f}" and cells[6] == "**yes**"
    tiny = next(line for line in lines if line.startswith("| tiny | 1.0e-04 | "))
    assert "| no (costs at most -" in tiny
    assert res.verdicts[("cost", "acc", "head")] is True and res.verdicts[("cost", "acc", "tiny")] is False
    assert "| control | 0 | +0.9" in res.text  # the control's k3, exactly 0 by its guard
    # the flat accuracy after step 20 has a slope of 0 up to the noise: neither arm lowers it
    assert res.verdicts[("cost", "slope", "head")] is False
    assert "| head | 0/5 [0.00, 0.52] | 0.800 [" in res.text


def test_endpoint_statistics_over_windows():
    m = pd.DataFrame({"step": [0, 10, 20, 30, 40], "x": [1.0, 2.0, math.nan, 4.0, 6.0]})
    assert window_stat(m, "x", "level", (10, 30)) == 3.0
    # (10, 2), (30, 4), (40, 6): Sxy = 60, Sxx = 1400 / 3
    assert window_stat(m, "x", "slope", (10, 40)) == pytest.approx(100 * 60 / (1400 / 3))
    assert window_stat(m, "x", "first", (0, None), n=2) == 1.5 and window_stat(m, "x", "last", n=2) == 5.0
    assert window_stat(m, "x", "start", (10, None)) == 2.0 and window_stat(m, "x", "final") == 6.0
    assert math.isnan(window_stat(m, "x", "slope", (40, None))) and math.isnan(window_stat(m, "y", "level"))


def test_an_incomplete_sweep_is_refused_naming_the_missing_runs(tmp_path):
    study, out = make(tmp_path, states={"head_s3": ("running", 50)})
    res = analyze(study, out)
    assert res.status == "incomplete" and res.text == (
        "INCOMPLETE: 14 of 15 runs finished at step 100 (missing: head seed 3); no endpoint is computed before "
        "the study is complete (no interim analysis).")


def test_a_broken_control_or_a_different_start_voids_the_study(tmp_path):
    def leaky(name):
        m = metrics(name)
        if name == "control_s2":
            m.loc[m["step"] == 7, "rollout_corr/k3_kl"] = 1e-9
        return m

    study, out = make(tmp_path / "a", metrics_of=leaky)
    res = analyze(study, out)
    assert res.status == "void" and "guard (k3 exactly 0, every token bitwise equal, every step) BROKEN" in res.text
    assert res.text.endswith(": VOID (re-run, do not analyse).") and "|" not in res.text

    def moved(name):
        m = metrics(name)
        if name == "tiny_s4":
            m.loc[m["step"] == 0, "val/accuracy"] = 0.8
        return m

    study, out = make(tmp_path / "b", metrics_of=moved)
    assert "step-0 evaluation DIFFERS between runs (2 distinct)" in analyze(study, out).text
    study, out = make(tmp_path / "c", states={"control_s1": ("guard_failed", 12)})
    assert analyze(study, out).text.startswith("VOID: the zero-mismatch guard stopped control_s1 ")


def test_three_seeds_cannot_pass_alpha_and_say_so(tmp_path):
    d = registration()
    d["sweep"]["conditions"] = [c for c in d["sweep"]["conditions"] if int(c["name"][-1]) < 3]
    study = study_from_dict(d, root=tmp_path, source="three.yaml")
    ids = {p.name: p.run_id for p in planned_runs(study)}
    freeze(study, tmp_path / "s")
    write_sweep(tmp_path / "s", list(ids), metrics, STEPS, run_ids=ids)
    res = analyze(study, tmp_path / "s")
    # 3 vs 3: the smallest p is 2/20 = 0.1, times 2 under Holm
    assert "| not testable here (smallest attainable p 0.200) |" in res.text
    assert res.verdicts[("cost", "acc", "head")] is None


def test_power_law_fit_recovers_a_planted_law():
    k3 = {"head_a": 4e-4, "head_b": 1e-3, "head_c": 3e-3, "head_d": 1e-2, "head_e": 3e-2, "head_f": 0.1}
    assert fit_power(np.array(list(k3.values())), -2e-3 * np.array(list(k3.values())) ** 0.8) == pytest.approx((2e-3, 0.8))
    assert fit_power(np.array([1e-3, 1e-2, 0.1]), np.array([-1.0, 1.0, 1.0])) is None  # < 3 negative arms
    rng = np.random.default_rng(0)
    col = {"control": {"k3": np.zeros(8), "s": 1e-5 * rng.standard_normal(8)}}
    for a, k in [*k3.items(), ("fp8", 0.1)]:  # fp8 lies on the law (its excess planted from its own k3)
        k = k * (1 + 0.05 * rng.standard_normal(8))  # realized k3 per seed
        col[a] = {"k3": k, "s": -2e-3 * k ** 0.8 * 100 + 1e-5 * rng.standard_normal(8)}
    col["stale"] = {"k3": np.full(8, 1e-3), "s": np.full(8, -0.2)}
    lines = power_law_section(col, "control", [*k3, "fp8", "stale"], "head_", "s", "accuracy slope", 0.1,
                              "0.1 accuracy", 1e-3, {a: True for a in [*k3, "fp8", "stale"]})
    c = float(lines[0].split("c = ")[1].split(" ")[0])
    alpha = float(lines[0].split("alpha = ")[1].split(" ")[0])
    t = float(lines[0].split("cost 0.1 accuracy: ")[1].split(" ")[0])
    assert c == pytest.approx(2e-3, rel=0.1) and alpha == pytest.approx(0.8, abs=0.03)  # k3 noise of 5% per seed
    assert t == pytest.approx(0.1 / (2e-3 * 1e-3 ** 0.8), rel=0.2)  # 1.26e4 steps
    assert "agrees with the fit" in lines[1] and lines[1].startswith("- fp8:")
    assert "off the curve" in lines[2] and lines[2].startswith("- stale:")


# ------------------------------------------------------------------------------- the freeze
def test_a_changed_registration_is_refused_unless_amended(tmp_path):
    study, out = make(tmp_path)
    assert (out / "study.json").exists()
    changed = registration()
    changed["endpoints"][0]["window"] = [30, None]
    moved = study_from_dict(changed, root=tmp_path, source="planted.yaml")
    assert moved.hash != study.hash
    with pytest.raises(StudyError, match=r"changed after its first run .*endpoints\[0\]\.window\[0\]: 20 -> 30\); "
                                         r"record an amendment"):
        analyze(moved, out)
    wrong = {"date": "2026-12-01", "reason": "a later window", "hash": study.hash}
    with pytest.raises(StudyError, match="changed after its first run"):
        analyze(study_from_dict({**changed, "amendments": [wrong]}, root=tmp_path), out)
    ok = {"date": "2026-12-01", "reason": "steps 20-30 were still learning", "hash": moved.hash}
    res = analyze(study_from_dict({**changed, "amendments": [ok]}, root=tmp_path), out)
    assert res.status == "complete" and "amended 2026-12-01" in res.freeze
    assert res.text.endswith("Amendments after the first run: 2026-12-01: steps 20-30 were still learning")
    with pytest.raises(StudyError, match="reason must say why"):
        study_from_dict({**changed, "amendments": [{**ok, "reason": " "}]})
    with pytest.raises(StudyError, match=r"date 'soon' is not a date \(YYYY-MM-DD\)"):
        study_from_dict({**changed, "amendments": [{**ok, "date": "soon"}]})


def test_runs_without_a_freeze_are_refused(tmp_path):
    study = study_from_dict(registration(), root=tmp_path)
    ids = {p.name: p.run_id for p in planned_runs(study)}
    write_sweep(tmp_path / "s", list(ids), metrics, STEPS, run_ids=ids)  # run without `timlab study run`
    with pytest.raises(StudyError, match=f"holds runs but no frozen registration .* frozen: {study.hash}"):
        analyze(study, tmp_path / "s")
    with pytest.raises(StudyError, match="holds runs but no frozen registration"):
        freeze(study, tmp_path / "s")  # `timlab study run` does not freeze late either
    assert not (tmp_path / "s" / "study.json").exists()
    assert analyze(study_from_dict({**registration(), "frozen": study.hash}, root=tmp_path), tmp_path / "s").status == "complete"


def test_hash_ignores_amendments_and_formatting_but_not_the_sweep(tmp_path):
    a = study_from_dict(registration(), root=tmp_path)
    b = study_from_dict(yaml.safe_load(yaml.safe_dump(registration(), default_flow_style=True)), root=tmp_path)
    assert a.hash == b.hash == study_from_dict({**registration(), "frozen": a.hash}, root=tmp_path).hash
    d = registration()
    d["sweep"]["base"]["set"]["run.steps"] = 101
    assert study_from_dict(d, root=tmp_path).hash != a.hash


@pytest.mark.parametrize("change, message", [
    ({"wrong": 1}, "unknown key 'wrong'; valid choices: study, sweep, out, steps,"),
    ({"steps": 0}, "steps must be an integer >= 1, got 0"),
    ({"rules": [{"name": "lowers", "test": "lower"}]}, "rules[0]: test: 'lower'; valid choices: below, above"),
    ({"families": [{"name": "f", "endpoints": ["accuracy"], "rule": "lowers"}]},
     "families[0]: endpoints: 'accuracy'; valid choices: acc, slope, k3, fell, final"),
    ({"families": [{"name": "f", "endpoints": ["acc"], "rule": "lowers", "correction": "bonferroni"}]},
     "families[0]: correction: 'bonferroni'; valid choices: holm, none"),
    ({"families": [{"name": "f", "endpoints": ["acc"], "rule": "lowers", "arms": "head"}]},
     "families[0]: arms: expected a non-empty list of arm names, got 'head'"),
    ({"endpoints": [{"name": "a", "metric": "m", "stat": "median"}]},
     "endpoints[0]: stat: 'median'; valid choices: level, slope, log_slope, first, last, start, final, max, min, "
     "sum, fall, fall_step, difference, plus, log"),
    ({"endpoints": [{"name": "a", "metric": "m", "stat": "level", "window": [50, 10]}]},
     "endpoints[0]: window: first step 50 after last step 10"),
    ({"sweep": "missing.yaml"}, "sweep: spec file not found"),
])
def test_bad_registrations_are_one_line_errors_naming_the_field(tmp_path, change, message):
    with pytest.raises(StudyError) as e:
        study_from_dict(registration(**change), root=tmp_path, source="s.yaml")
    assert message in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------- the command
def test_study_command_checks_analyzes_and_writes_a_block(tmp_path, capsys):
    findings = {"findings": {"file": "FINDINGS.md", "block": "planted"}}
    study, out = make(tmp_path, over=findings)
    path = tmp_path / "planted.yaml"
    (tmp_path / "FINDINGS.md").write_text("x\n<!-- findings:planted -->\nold\n<!-- /findings:planted -->\ny\n")
    path.write_text(yaml.safe_dump(registration(**findings)))  # the registration frozen at the first run
    assert cli.main(["study", "check", str(path), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"registration hash: {load_study(path).hash}" in text and "arms: control (5), head (5), tiny (5)" in text
    assert "runs not finished: none" in text
    assert cli.main(["study", "analyze", str(path), "--out", str(out), "--write"]) == 0
    text = capsys.readouterr().out
    assert "| head |" not in text and "**" not in text and "planted: complete; frozen registration" in text
    assert any(line.startswith("head ") and " 0.100 " in line for line in text.splitlines())  # plain text
    body = (tmp_path / "FINDINGS.md").read_text()
    assert "| head | 0.100 |" in body  # the block keeps its Markdown, and --markdown prints it
    assert cli.main(["study", "analyze", str(path), "--out", str(out), "--markdown"]) == 0
    assert "| head | 0.100 |" in capsys.readouterr().out
    assert body.startswith("x\n<!-- findings:planted -->\nValidity: ") and body.endswith("<!-- /findings:planted -->\ny\n")
    d = yaml.safe_load(path.read_text())
    d["endpoints"][0]["window"] = [25, None]  # changed after the first run, no amendment
    path.write_text(yaml.safe_dump(d))
    assert cli.main(["study", "analyze", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("timlab: error: ") and "changed after its first run" in err and err.count("\n") == 1


def test_figure_of_a_complete_study_and_refusal_of_an_incomplete_one(done, tmp_path):
    from timlab.experiments.studies.engine import figure

    study, out, _ = done
    png = figure(study, tmp_path / "f.png", out)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    partial, pout = make(tmp_path / "p", states={"tiny_s0": ("running", 3)})
    with pytest.raises(StudyError, match="no figure: INCOMPLETE: 14 of 15 runs"):
        figure(partial, tmp_path / "g.png", pout)


def test_an_arm_the_sweep_does_not_have_is_named(tmp_path):
    d = registration(families=[{"name": "cost", "endpoints": ["acc"], "rule": "lowers", "arms": ["haed"]}])
    with pytest.raises(StudyError, match=r"families: cost: 'haed' is not an arm of the sweep; arms: control, head, tiny"):
        planned_runs(study_from_dict(d, root=tmp_path, source="s.yaml"))


# ------------------------------------------------------------------------------- features as data
def test_a_difference_endpoint_a_descriptive_family_and_a_combined_verdict(tmp_path):
    over = {
        "endpoints": registration()["endpoints"] + [
            {"name": "start", "metric": "val/accuracy", "stat": "level", "window": [0, 0]},
            {"name": "change", "stat": "difference", "of": ["acc", "start"], "label": "change from the start"}],
        "families": registration()["families"] + [
            {"name": "desc", "endpoints": ["change"], "note": ", arm minus control", "reference_row": False,
             "headers": ["arm", "arm mean", "excess", "perm p", "Holm p"]}],
        "verdicts": [{"name": "moved", "family": "desc", "alpha": 0.05, "otherwise": "unclear",
                      "cases": [{"when": {"change": "below"}, "then": "**lowered**"},
                                {"when": {"change": ["not below", "not above"]}, "then": "flat"}],
                      "line": "{arm}: {verdict} ({change.diff:+.2f}, Holm p {change.p_holm:.4f})"}],
        "order": ["tables", "families", "verdicts", "fits"],
        "tables": [{"title": "Start and end", "note": " (means)", "columns": [
            {"header": "start -> level", "show": "change", "endpoints": ["start", "acc"], "format": ".2f"},
            {"header": "final [95% t]", "show": "t", "endpoint": "final", "digits": 4}]}]}
    study, out = make(tmp_path, over=over)
    res = analyze(study, out)
    lines = res.text.splitlines()
    # the run's change is its level minus its start (0.9 in every run), exactly
    from timlab.experiments.studies.engine import run_record
    rec = run_record(study, metrics("head_s0"), diverged=False)
    assert rec["change"] == rec["acc"] - rec["start"] and rec["change"] == pytest.approx(-0.1, abs=5e-3)
    # the descriptive table comes first (order), with its note, a format and 4 digits
    assert lines.index("**Start and end** (means)") < lines.index("**mean accuracy, steps 20-100**")
    assert "| head | 0.90 -> 0.80 | 0.8" in res.text and re.search(r"\| control \| 0\.90 -> 0\.90 \| 0\.9\d{3} \[", res.text)
    i = lines.index("**change from the start**, arm minus control")
    assert lines[i + 2:i + 4] == ["| arm | arm mean | excess | perm p | Holm p |", "|---|---:|---:|---:|---:|"]
    cells = [c.strip() for c in lines[i + 4].split("|")[1:-1]]  # no reference row, no verdict column
    assert cells[0] == "head" and len(cells) == 5 and float(cells[2].split()[0]) == pytest.approx(-0.1, abs=2e-3)
    assert cells[3:] == [f"{2 / 252:.4f}", f"{4 / 252:.4f}"]
    # the verdict: 5 vs 5, Holm over 2 arms: head at the floor 2/252, doubled
    assert f"head: **lowered** (-0.10, Holm p {4 / 252:.4f})" in lines
    assert res.decisions == {("moved", "head"): "**lowered**", ("moved", "tiny"): "flat"}
    assert ("desc", "change", "head") not in res.verdicts  # a family without a rule decides nothing


def test_an_outcome_in_an_ungrouped_study_per_scale_and_combined(tmp_path):
    """head lowers the accuracy level from step 10 on and then holds it, so its level costs and its
    slope over steps 20-100 does not; tiny costs nothing. An outcome read on the two endpoints as
    two scales disagrees between them."""
    when = [{"family": "cost", "endpoint": "{e}", "arm": "head", "is": "holds"},
            {"family": "cost", "endpoint": "{e}", "arm": "tiny", "is": ["fails", "not testable"],
             "label": "tiny ({e})"}]
    over = {"outcomes": [
        {"name": "E", "scales": {"level": {"e": "acc"}, "slope": {"e": "slope"}}, "otherwise": "no cost shown",
         "cases": [{"when": when, "then": "head alone costs"}]},
        {"name": "F", "otherwise": "x", "cases": [{"when": [{"any": [
            {"family": "cost", "endpoint": "slope", "arm": "head", "is": "holds"},
            {"family": "cost", "endpoint": "acc", "arm": "tiny", "is": "opposite"}]}], "then": "y"}]}]}
    study, out = make(tmp_path, over=over)
    res = analyze(study, out)
    assert res.states["cost", "acc", "head"] == "holds" and res.states["cost", "slope", "head"] == "fails"
    assert res.states["cost", "acc", "tiny"] == res.states["cost", "slope", "tiny"] == "fails"
    assert res.outcomes == {("E", "level"): "head alone costs", ("E", "slope"): "no cost shown",
                            ("E", ""): "scale-dependent: head alone costs on level, no cost shown on slope",
                            ("F", ""): "x"}
    lines = res.text.splitlines()
    i = lines.index("Verdict E, on each scale (the parts it read, each with its value):")
    assert lines[i + 1:i + 6] == [
        "", "- level: **head alone costs** (cost acc head: holds; tiny (acc): fails)",
        "- slope: **no cost shown** (cost slope head: fails; tiny (slope): fails)", "",
        "Verdict E: **scale-dependent: head alone costs on level, no cost shown on slope** (level: head alone costs; "
        "slope: no cost shown)."]
    assert "Verdict F: **x** (cost slope head: fails; cost acc tiny: fails)." in lines


def test_repeats_name_the_runs_that_differ(tmp_path):
    study, out = make(tmp_path, over={"repeats": {"sweep": "earlier", "last_step": 30}})
    ids = {p.name: p.run_id for p in planned_runs(study)}

    def earlier(name):
        m = metrics(name)
        if name == "head_s2":
            m.loc[m["step"] == 20, "val/accuracy"] += 1e-12
        m["train/step_time_s"] = 9.0  # timings are not compared
        return m

    write_sweep(tmp_path / "earlier", list(ids), earlier, 30)
    lines = analyze(study, out, root=tmp_path).text.splitlines()
    assert lines[1].startswith("Steps 0-30 against earlier's runs of the same name: 14 of 15 identical in every "
                               "logged value but timings; differ: head_s2 (step 20 val/accuracy: ")
    assert lines[2] == ""
    assert analyze(study, out, root=tmp_path / "nowhere").text.splitlines()[1] == (
        "Steps 0-30 against earlier's runs of the same name: 0 of 0 identical in every logged value but timings.")


@pytest.mark.parametrize("change, message", [
    ({"endpoints": [{"name": "d", "stat": "difference", "of": ["a", "b"]},
                    {"name": "a", "metric": "m", "stat": "level"}]},
     "endpoints[0]: of (endpoints listed before it): 'a'; valid choices: "),
    ({"endpoints": registration()["endpoints"] + [{"name": "d", "stat": "difference", "of": ["acc"]}]},
     "of: difference takes two endpoints [a, b] (a - b), got ['acc']"),
    ({"verdicts": [{"name": "v", "family": "cost", "cases": [{"when": {"acc": "lower"}, "then": "x"}],
                    "otherwise": "y", "line": "{arm}"}]},
     "verdicts[0]: cases[0]: when: acc: 'lower'; valid choices: below, above, not below, not above"),
    ({"verdicts": [{"name": "v", "family": "cost", "cases": [{"when": {"acc": "below"}, "then": "x"}],
                    "otherwise": "y", "line": "{arm}: {acc.dif:+.3f}"}]},
     "verdicts[0]: line: field {acc.dif}; valid choices: {arm}, {verdict}, or an endpoint of family cost (acc, slope)"),
    ({"verdicts": [{"name": "v", "family": "cost", "cases": [{"when": {"acc": "below"}, "then": "x"}],
                    "otherwise": "y", "line": "{arm}: {acc.p:.4z}"}]},
     "verdicts[0]: line: Unknown format code 'z'"),
    ({"order": ["verdicts", "families", "tables", "fits"]}, "order: fits and verdicts read the families' comparisons"),
    ({"order": ["families", "tables"]}, "order: expected each of families, tables, fits, verdicts once"),
    ({"families": [{"name": "f", "endpoints": ["acc"], "headers": ["a", "b"]}]},
     "families[0]: headers: 2 given, the table has 5 columns"),
    ({"arm_pattern": "(.+)_s\\d+"}, "arm_pattern: needs a group named arm"),
    ({"repeats": {"sweep": "x", "last_step": 101}}, "repeats: last_step must be an integer from 0 to steps (100)"),
    ({"groups": "level"}, "groups: set, but arm_pattern has no group named group"),
    ({"arm_pattern": "(?P<group>[a-z]+)_(?P<arm>.+)_s\\d+"}, "groups: unset, but arm_pattern has a group named group"),
    ({"fits": [{"kind": "length", "endpoint": "acc"}]}, "fits[0]: kind length needs groups: (a grouped study)"),
    ({"tables": [{"title": "t", "columns": [{"header": "h", "show": "scaled", "endpoint": "k3"}]}]},
     "tables[0]: columns[0]: show scaled needs by:"),
])
def test_bad_feature_registrations_are_one_line_errors(tmp_path, change, message):
    with pytest.raises(StudyError) as e:
        study_from_dict(registration(**change), root=tmp_path, source="s.yaml")
    assert message in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------- Study E3d's file
E3D = load_study(REPO / "docs" / "examples" / "studies" / "e3d.yaml")


def e3d_run(name: str, *, early: float, late: float) -> pd.DataFrame:
    """A 500-step run of E3d (``v1_<arm>_s<seed>``): accuracy 0.97 (noise 2e-3 per evaluation,
    every 25 steps), the treated arm losing ``early`` at the evaluations of steps 25-150 and
    ``late`` after; the same step-0 evaluation in every run."""
    arm, seed = name[3:].rsplit("_s", 1)
    rng = np.random.default_rng([1, int(arm != "control"), int(seed)])
    ev = np.arange(0, 501, 25)
    acc = 0.97 + rng.normal(0, 2e-3, ev.size)
    gold = -0.10 + rng.normal(0, 1e-3, ev.size)
    if arm != "control":
        cost = np.where(ev <= 150, early, late) * (ev >= 25)
        acc, gold = acc - cost, gold - 10 * cost
    acc[0], gold[0] = 0.99, -0.05
    t = np.arange(1, 501)
    train = pd.DataFrame({"step": t, "rollout_corr/k3_kl": 0.0 if arm == "control" else 5e-3 * np.exp(rng.normal(0, .02, t.size)),
                          "mismatch/frac_bitwise_equal": 1.0 if arm == "control" else 0.2,
                          "train/response_length_mean": 66.0 + rng.normal(0, 0.5, t.size), "train/step_time_s": 0.3})
    m = pd.DataFrame({"step": ev, "val/accuracy": acc, "val/gold_logprob": gold}).merge(train, on="step", how="outer")
    return m.sort_values("step")[["step"] + sorted(c for c in m.columns if c != "step")]


def e3d_sweeps(root, *, late: float, shift: float = 0.0, names=None):
    """E3d's sweep at ``root``/sweeps/e3d and E3b's runs of the same names at ``root``/sweeps/e3b,
    cut at step 150 (accuracy at step 25 shifted by ``shift``: then no run repeats)."""
    ids = {p.name: p.run_id for p in planned_runs(E3D)}
    write_sweep(root / "sweeps" / "e3d", names or list(ids), lambda n: e3d_run(n, early=0.05, late=late), 500,
                run_ids=ids)

    def cut(n):
        m = e3d_run(n, early=0.05, late=late)
        m = m[m["step"] <= 150].copy()
        m.loc[m["step"] == 25, "val/accuracy"] += shift
        return m
    write_sweep(root / "sweeps" / "e3b", list(ids), cut, 150)


@pytest.mark.parametrize("late, verdict", [(0.0, "**heals**"), (0.05, "**persists**"), (0.02, "**partly heals**"),
                                           (0.10, "**grows**")])
def test_e3d_study_file_finds_each_planted_course(tmp_path, late, verdict):
    e3d_sweeps(tmp_path, late=late)
    res = analyze(E3D, root=tmp_path)
    lines = res.text.splitlines()
    assert lines[0].startswith("Validity, level 1: control guard (k3 exactly 0, every token bitwise equal, every step) "
                               "held; step-0 evaluation the same in all its runs (accuracy 0.990, gold log-prob -0.050): VALID.")
    assert lines[1] == ("Steps 0-150 against sweeps/e3b's runs of the same name: 16 of 16 identical in every logged "
                        "value but timings.")
    line = next(x for x in lines if x.startswith("Verdict, level 1 head_0.95: "))
    assert line.startswith(f"Verdict, level 1 head_0.95: {verdict} (late excess "), line
    assert float(line.split("late excess ")[1].split(" ")[0]) == pytest.approx(-late, abs=2e-3)
    assert float(line.split("control's ")[1].split(" ")[0]) == pytest.approx(0.05 - late, abs=2e-3)
    assert res.decisions == {("heals", "head_0.95"): verdict} and res.text.endswith(").\n")  # the block's last blank line
    row = next(x for x in lines if x.startswith("| head_0.95 | 0.9"))  # the windows' table, 4 decimals
    early = [c.strip() for c in row.split("|")[1:-1]][1]
    assert re.fullmatch(r"0\.\d{4} \[0\.\d{4}, 0\.\d{4}\]", early) and float(early.split()[0]) == pytest.approx(0.92, abs=3e-3)


def test_e3d_study_file_names_runs_that_do_not_repeat_and_refuses_an_incomplete_sweep(tmp_path):
    e3d_sweeps(tmp_path / "a", late=0.0, shift=0.01)
    text = analyze(E3D, root=tmp_path / "a").text
    assert "against sweeps/e3b's runs of the same name: 0 of 16 identical" in text and "v1_control_s0 (step 25 " in text
    e3d_sweeps(tmp_path / "b", late=0.0, names=[p.name for p in planned_runs(E3D)][:3])
    assert analyze(E3D, root=tmp_path / "b").text == (
        "INCOMPLETE: 3 of 16 runs finished at step 500 (missing: head_0.95 seeds 1-7, control seeds 2-7); no endpoint "
        "is computed before the study is complete (no interim analysis).")


# ------------------------------------------------------------------------------- comparisons as data
LAW = {"control": 0.0, "head_a": 1e-3, "head_b": 1e-2, "head_c": 0.1, "head_d": 1.0}
"""A dose study's arms -> realized k3; its accuracy slope is the law -C * k3^ALPHA per step."""
C, ALPHA = 2e-3, 0.8


def law_metrics(k3_of: dict, slope_of) -> callable:
    """Run tables whose accuracy falls at ``slope_of(arm, k3)`` per step from step 20 (noise 2e-4
    per evaluation, every 10 steps), k3 constant, the same step-0 evaluation everywhere."""
    def run(name):
        arm, seed = name.rsplit("_s", 1)
        rng = np.random.default_rng([int(seed), list(k3_of).index(arm), 7])
        steps = np.arange(STEPS + 1)
        ev = np.where(steps % 10 == 0, 1.0, np.nan)
        acc = 0.9 + slope_of(arm, k3_of[arm]) * np.maximum(steps - 20, 0) + 2e-4 * rng.standard_normal(steps.size)
        acc[0] = 0.9
        rl = np.where(steps >= 1, 1.0, np.nan)
        return pd.DataFrame({"step": steps, "val/accuracy": ev * acc, "val/gold_logprob": ev * (-0.3),
                             "rollout_corr/k3_kl": rl * k3_of[arm],
                             "mismatch/frac_bitwise_equal": rl * (1.0 if k3_of[arm] == 0 else 0.4),
                             "train/step_time_s": 0.1})
    return run


def law_study(tmp_path, *, runs=None, broken=False) -> None:
    """The dose study at ``tmp_path``/law.yaml, its sweep at ``tmp_path``/law_sweep (``runs``: only
    these; ``broken``: a control step with k3 above 0)."""
    conds = [{"name": f"{a}_s{s}", "set": {"mismatch.injector": "none" if a == "control" else "head_perturb",
                                           **({} if a == "control" else {"mismatch.magnitude": 0.5}),
                                           "run.seed": s, "mismatch.seed": s}} for s in range(SEEDS) for a in LAW]
    d = registration(study="law", out="law_sweep", sweep={"base": {"preset": "smoke", "set": {"run.steps": STEPS}},
                                                          "conditions": conds}, tables=[],
                     families=[{"name": "cost", "endpoints": ["slope"]}])
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "law.yaml").write_text(yaml.safe_dump(d))
    law = load_study(tmp_path / "law.yaml")
    run = law_metrics(LAW, lambda a, k: -C * k ** ALPHA)

    def metrics_of(name):
        m = run(name)
        if broken and name == "control_s1":
            m.loc[m["step"] == 5, "rollout_corr/k3_kl"] = 1e-9
        return m
    write_sweep(tmp_path / "law_sweep", runs or [p.name for p in planned_runs(law)], metrics_of, STEPS,
                run_ids={p.name: p.run_id for p in planned_runs(law)})


PLACE = {"fits": [{"kind": "place", "study": "law.yaml", "endpoint": ["slope"], "name": ["accuracy slope"],
                   "arms": "head_", "k3": "k3", "title": "Cross: ", "dose_label": "the dose arms"}],
         "families": [{"name": "cost", "endpoints": ["acc"]}]}


def test_arms_are_placed_against_another_studys_law(tmp_path):
    """head (k3 0.1) falls on the law; tiny (k3 1e-4) falls far faster than the law allows there."""
    law_study(tmp_path)
    on_law = {"control": 0.0, "head": 0.1, "tiny": 1e-4}
    study, out = make(tmp_path, over=PLACE, metrics_of=law_metrics(
        on_law, lambda a, k: 0.0 if a == "control" else -C * k ** ALPHA if a == "head" else -5e-4))
    lines = analyze(study, out, root=tmp_path).text.splitlines()
    i = lines.index("Cross: accuracy slope, each arm's excess over this study's control (per step) minus the law "
                    "study's fit at the arm's realized k3, with its 95% interval:")
    head, tiny = lines[i + 1], lines[i + 2]
    assert head.startswith("- head: realized k3 0.100, ") and head.endswith(": costs what the dose arms costs at the same k3.")
    d = float(head.split(", ")[1].split(" ")[0])
    assert abs(d) < 2e-5  # the law at k3 0.1 is -3.2e-04 per step; the arm sits on it
    assert tiny.startswith("- tiny: realized k3 1.0e-04, ") and tiny.endswith(": costs more than the dose arms at the same k3.")
    assert float(tiny.split(", ")[1].split(" ")[0]) == pytest.approx(-5e-4 + C * 1e-4 ** ALPHA, rel=0.05)


def test_placing_refuses_an_incomplete_or_void_law_study(tmp_path):
    law_study(tmp_path / "a", runs=["control_s0", "head_a_s0"])
    study, out = make(tmp_path / "a", over=PLACE)
    assert ("Cross: the law study is not complete (2 of 25 runs), so it has no fit; nothing is placed."
            in analyze(study, out, root=tmp_path / "a").text.splitlines())
    law_study(tmp_path / "b", broken=True)
    study, out = make(tmp_path / "b", over=PLACE)
    assert ("Cross: the law study is void (its validity checks), so it has no fit; nothing is placed."
            in analyze(study, out, root=tmp_path / "b").text.splitlines())


PAIRS = {"families": [{"name": "pairs", "endpoints": ["acc", "k3"], "rule": {"acc": "lowers", "k3": "less"},
                       "comparisons": [{"arm": "head"}, {"arm": "tiny"}, {"arm": "tiny", "against": "head", "rule": "gains"}],
                       "label": "{arm} - {against}", "reference_label": "{against} (reference)",
                       "headers": ["comparison", "mean", "diff", "p", "Holm p", "verdict"]},
                      {"name": "ratio", "title": "Ratios", "endpoints": ["k3"], "reference_row": False,
                       "comparisons": [{"arm": "tiny", "against": "head"}], "rule": "less",
                       "columns": ["endpoint", "comparison", "ratio", "diff_fmt", "p", "verdict"],
                       "headers": ["endpoint", "pair", "ratio", "difference", "p", "verdict"], "label": "{arm} / {against}"}],
         "rules": [{"name": "lowers", "test": "below", "fails": "no (costs {cost})"},
                   {"name": "gains", "test": "above", "requires": "lowers", "holds": "**gains**",
                    "unmet": "higher, not claimed ({against} does not lower it)", "opposite": "lower than {against}",
                    "fails": "no"},
                   {"name": "less", "test": "below", "holds": "less", "opposite": "more", "fails": "not separable"}],
         "order": ["ratio", "families", "tables", "fits", "verdicts"]}


def test_explicit_comparisons_a_dependent_rule_a_ratio_and_an_opposite(tmp_path):
    study, out = make(tmp_path, over=PAIRS)
    res = analyze(study, out)
    lines = res.text.splitlines()
    # the named family comes first (order), one table titled once, its own columns
    i = lines.index("**Ratios**")
    assert i < lines.index("**mean accuracy, steps 20-100**") and lines[i + 3] == "|---|---|---:|---:|---:|---|"
    # tiny's k3 (1e-4) over head's (0.1): exactly 1e-3 in every resample; lower, a family of 1
    assert lines[i + 4] == (f"| realized k3 | tiny / head | 1.0e-03 [1.0e-03, 1.0e-03] | -0.100 [-0.100, -0.100] | "
                            f"{2 / 252:.4f} | less |")
    acc = lines[lines.index("**mean accuracy, steps 20-100**") + 4:][:4]
    assert acc[0].startswith("| control (reference) | +0.9") and acc[0].endswith(" | - | - | - | - |")
    assert acc[1].startswith("| head - control | ") and acc[1].endswith("| **yes** |")
    assert acc[2].startswith("| tiny - control | ") and "| no (costs at most " in acc[2]
    # tiny is 0.1 above head and head lowers accuracy (the rule gains requires), so the gain is claimed
    assert acc[3].startswith("| tiny - head | ") and acc[3].endswith("| **gains** |")
    assert res.verdicts[("pairs", "acc", "tiny - head")] is True and res.verdicts[("pairs", "acc", "head")] is True
    k3 = lines[lines.index("**realized k3**") + 4:][:4]
    # k3 (the endpoint's rule less): head's above the control's is the opposite; tiny - head keeps its own rule,
    # gains, whose opposite it meets (k3 below head's)
    assert k3[1].endswith("| more |") and k3[3].endswith("| lower than head |")
    # the same gain over an arm whose lowering is not established (here: not testable at alpha 1e-9) is not claimed
    over = dict(PAIRS, order=None, rules=[dict(PAIRS["rules"][0], alpha=1e-9), *PAIRS["rules"][1:]],
                families=[dict(PAIRS["families"][0], comparisons=[
                    {"arm": "head"}, {"arm": "tiny"}, {"arm": "head", "against": "tiny", "rule": "gains"},
                    {"arm": "tiny", "against": "head", "rule": "gains"}])])
    res = analyze(*make(tmp_path / "b", over=over))
    text = res.text.splitlines()
    assert any(x.startswith("| head - tiny | ") and x.endswith("| lower than tiny |") for x in text)
    assert any(x.startswith("| tiny - head | ") and x.endswith("| higher, not claimed (head does not lower it) |") for x in text)


def test_descriptive_cells_ranges_and_pairs(tmp_path):
    cols = [{"header": "k3 [t] [boot]", "show": "t_boot", "endpoint": "k3"},
            {"header": "where", "show": "range", "endpoint": "k3", "control": "-", "otherwise": "elsewhere",
             "ranges": [{"then": "high", "low": 0.01, "high": 1.0}, {"then": "low", "high": 0.001}]},
            {"header": "boot", "show": "boot", "endpoint": "acc"}, {"header": "mean", "show": "mean", "endpoint": "k3"},
            {"header": "pair", "show": "pair", "endpoints": ["k3", "acc"]}]
    study, out = make(tmp_path, over={"tables": [{"title": "Cells", "columns": cols}]})
    lines = analyze(study, out).text.splitlines()
    i = lines.index("**Cells**")
    assert lines[i + 3] == "|---|---:|---|---:|---:|---|"
    assert lines[i + 4].startswith("| control | 0.000 [0.000, 0.000] [0.000, 0.000] | - | 0.9")
    assert lines[i + 5].startswith("| head | 0.100 [0.100, 0.100] [0.100, 0.100] | high | 0.8") and \
        lines[i + 5].endswith("| 0.100 | 0.100 / 0.800 |")
    assert lines[i + 6].startswith("| tiny | 1.0e-04 [1.0e-04, 1.0e-04] [1.0e-04, 1.0e-04] | low | 0.9")


@pytest.mark.parametrize("change, message", [
    ({"families": [{"name": "f", "endpoints": ["acc"], "comparisons": [{"arm": "tiny", "against": "head", "rule": "g"}]}],
      "rules": [{"name": "lowers"}, {"name": "g", "test": "above", "requires": "lowers"}]},
     "families[0]: comparisons[0]: its rule requires 'lowers' of head against control, so that comparison must come before it"),
    ({"rules": [{"name": "lowers", "requires": "lowers"}]}, "rules[0]: requires: 'lowers'; valid choices: "),
    ({"families": [{"name": "f", "endpoints": ["acc"], "columns": ["comparison", "odds"], "headers": ["a", "b"]}]},
     "families[0]: columns: 'odds'; valid choices: endpoint, comparison, show, show_t, mean, geo, diff, diff_fmt, ratio, "
     "ratio_exp, p, p_holm, verdict"),
    ({"families": [{"name": "f", "endpoints": ["acc"], "columns": ["comparison", "verdict:nope"], "headers": ["a", "b"]}]},
     "families[0]: columns: verdict:nope: 'nope'; valid choices: lowers"),
    ({"rules": [{"name": "lowers", "ratio_bound": True}]},
     "families[0]: rule lowers has ratio_bound: give each comparison a bound"),
    ({"families": [{"name": "f", "endpoints": ["acc"], "reference_row": "every"}]},
     "families[0]: reference_row: 'every'; valid choices: true, false, each"),
    ({"families": [{"name": "f", "endpoints": ["acc"], "names": {"head": "a | b"}, "headers": ["a"] * 5}]},
     "families[0]: headers: 5 given, the table has 6 columns"),  # the name "a | b" fills two
    ({"validity": {"controls": "control"}}, "validity: controls: expected a list of arm names"),
    ({"endpoints": [{"name": "k3", "metric": "rollout_corr/k3_kl", "stat": "level"},
                    {"name": "lk", "stat": "log", "of": ["k3", "k3"]}]}, "endpoints[1]: of: log takes one endpoint"),
    ({"fits": [{"kind": "growth", "endpoint": "slope", "family": "cost", "fall": "fell", "headers": ["a"]}]},
     "fits[0]: headers: the growth table has 6 columns"),
    ({"fits": [{"kind": "signals", "endpoint": "fell", "signals": [{"name": "g"}]}]},
     "fits[0]: signals[0]: missing key 'metric'"),
    ({"families": [{"name": "f", "endpoints": ["acc"], "columns": ["comparison", "p"]}]},
     "families[0]: columns: name each with headers (as many)"),
    ({"families": [{"name": "f", "endpoints": ["acc"], "rule": {"slope": "lowers"}}]},
     "families[0]: rule: endpoint: 'slope'; valid choices: acc"),
    ({"families": [{"name": "f", "endpoints": ["acc"], "label": "{arm} - {other}"}]},
     "families[0]: label: '{arm} - {other}' is not a format string of {arm} and {against}"),
    ({"tables": [{"title": "t", "columns": [{"header": "h", "show": "range", "endpoint": "k3",
                                             "ranges": [{"then": "x"}]}]}]},
     "tables[0]: columns[0]: ranges[0]: give low, high or both"),
    ({"tables": [{"title": "t", "columns": [{"header": "h", "show": "pair", "endpoint": "k3"}]}]},
     "tables[0]: columns[0]: show pair takes two endpoints"),
    ({"order": ["families", "tables", "fits", "verdicts", "nope"]}, "order: 'nope'; valid choices: families, tables"),
    ({"fits": [{"kind": "place", "endpoint": "slope", "arms": "head_"}]}, "fits[0]: kind place needs study: "),
    ({"fits": [{"kind": "power_law", "endpoint": ["slope", "acc"], "arms": "head_"}]},
     "fits[0]: endpoint: kind power_law fits one endpoint"),
    ({"notes": "text"}, "notes: expected a list of paragraphs (text)"),
])
def test_bad_comparison_registrations_are_one_line_errors(tmp_path, change, message):
    with pytest.raises(StudyError) as e:
        study_from_dict(registration(**change), root=tmp_path, source="s.yaml")
    assert message in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------- grouped studies
GROUPED = {"arm_pattern": "g(?P<group>\\d)_(?P<arm>.+)_s\\d+", "groups": "group",
           "validity": {"control_exact": True, "same_start": True, "start_bar": 0.8, "title": "Validity, group {group}",
                        "runs": "its runs"}}


def grouped(**over) -> dict:
    """``registration``'s arms in two groups, g0 and g1 (conditions g<group>_<arm>_s<seed>)."""
    d = registration(**GROUPED, **over)
    d["sweep"]["conditions"] = [dict(c, name=f"g{g}_{c['name']}") for g in (0, 1) for c in d["sweep"]["conditions"]]
    return d


def grouped_metrics(start1: float = 0.9):
    """``metrics`` per run, group 1's shifts doubled and its k3 x 10; its runs' step-0 accuracy ``start1``."""
    def of(name: str) -> pd.DataFrame:
        g, rest = name[1], name[3:]
        m = metrics(rest)
        if g == "1":
            arm = rest.rsplit("_s", 1)[0]
            late = m["step"] >= 10
            m.loc[late, "val/accuracy"] += ARMS[arm]  # twice the shift
            m["rollout_corr/k3_kl"] *= 10
            m.loc[m["step"] == 0, "val/accuracy"] = start1
        return m
    return of


def test_a_grouped_study_compares_within_groups_and_leaves_a_void_group_out(tmp_path):
    over = {"tables": [{"title": "Dose", "columns": [
        {"header": "k3", "show": "mean", "endpoint": "k3"},
        {"header": "k3 x final^2", "show": "scaled", "endpoint": "k3", "by": "final", "power": 2}],
        "after": "T is the group's control final accuracy."}]}
    study = study_from_dict(grouped(**over), root=tmp_path, source="grouped.yaml")
    ids = {p.name: p.run_id for p in planned_runs(study)}
    assert {(p.group, p.arm) for p in planned_runs(study)} == {(g, a) for g in "01" for a in ARMS}
    freeze(study, tmp_path / "a")
    write_sweep(tmp_path / "a", list(ids), grouped_metrics(), STEPS, run_ids=ids)
    res = analyze(study, tmp_path / "a")
    text = res.text
    assert text.startswith("Validity, group 0: control guard") and "Validity, group 1: control guard" in text
    # one table per endpoint, each group's rows under one header, Holm over the group's 2 arms
    assert "| group | arm | realized k3 | mean [95% t] [95% bootstrap] |" in text
    assert "| 0 | head | 0.100 | +0.8003 [+0.7990, +0.8016] [+0.7995, +0.8011] | -0.1001 [-0.1013, -0.0990] | 0.0079 | " \
           "0.0159 | **yes** |" in text
    assert "| 1 | head | 1.000 | +0.7003 [+0.6990, +0.7016] [+0.6995, +0.7011] | -0.2001 [-0.2013, -0.1990] | 0.0079 | " \
           "0.0159 | **yes** |" in text  # each group's control is its own reference
    assert text.count("| control | 0 | +0.9004 [") == 2
    assert res.verdicts["cost", "acc", ("0", "head")] is True and res.verdicts["cost", "acc", ("1", "tiny")] is False
    # the scaled column: k3 x (the group's control final accuracy, 0.9 + noise)^2: 0.1 x 0.9^2 = 0.081 in group 0
    assert "| 0 | head | 0.100 | 0.081 |" in text and "| 1 | head | 1.000 | 0.811 |" in text
    assert text.endswith("| 1 | tiny | 1.0e-03 | 8.1e-04 |\n\nT is the group's control final accuracy.")
    # group 1's runs start below the others': only group 1 is void, left out of every table
    study_b = study_from_dict(grouped(**over), root=tmp_path, source="grouped.yaml")
    freeze(study_b, tmp_path / "b")
    write_sweep(tmp_path / "b", list(ids), grouped_metrics(start1=0.5), STEPS, run_ids=ids)
    b = analyze(study_b, tmp_path / "b").text
    assert "Validity, group 0: control guard (k3 exactly 0, every token bitwise equal, every step) held; step-0 " \
           "evaluation the same in all its runs (accuracy 0.900, gold log-prob -0.300): VALID." in b
    assert "Validity, group 1: control guard (k3 exactly 0, every token bitwise equal, every step) held; step-0 " \
           "evaluation the same in all its runs (accuracy 0.500, gold log-prob -0.300), below the bar 0.8: VOID (left out " \
           "of every table and fit)." in b
    assert "| 0 | head |" in b and "| 1 |" not in b


def test_plain_text_aligns_tables_and_drops_markdown_marks():
    """Issue 60: `study analyze` printed raw Markdown to a terminal."""
    from timlab.experiments.studies.text import plain_text

    md = ("Validity: held.\n\n**mean accuracy**\n\n| arm | k3 | p |\n|---|---:|---|\n| control | 0 | - |\n"
          "| head_2 | 1.334 | `0.5` \\| 0.6 |\n\nend")
    assert plain_text(md) == ("Validity: held.\n\nmean accuracy\n\narm         k3  p\n-------  -----  ---------\n"
                              "control      0  -\nhead_2   1.334  0.5 | 0.6\n\nend")


def test_an_accuracy_level_interval_stays_within_0_and_1():
    """Issue 60: `0.083 [-0.154, 0.321]` for an accuracy; a slope or a difference keeps its sign."""
    from timlab.experiments.studies.endpoints import endpoint_bounds
    from timlab.experiments.studies.text import mean_cells, t_cells

    x = [0.0, 0.0, 0.25]
    assert t_cells(x) == "0.083 [-0.275, 0.442]"
    assert t_cells(x, bounds=(0.0, 1.0)) == "0.083 [0.000, 0.442]"
    assert mean_cells(x, (0.0, 1.0)).startswith("+0.0833 [+0.0000, +0.4419] [")
    assert endpoint_bounds("val/accuracy", "final") == endpoint_bounds("val/accuracy", "level") == (0.0, 1.0)
    assert endpoint_bounds("val/accuracy", "slope") is None and endpoint_bounds("val/accuracy", "level", "logit") is None
    assert endpoint_bounds("rollout_corr/k3_kl", "level") is None
    from dataclasses import replace

    quickstart = load_study(Path(__file__).resolve().parents[1] / "docs/examples/study_quickstart.yaml")
    assert quickstart.bounds("final_acc") is None  # the FINDINGS blocks keep the intervals they were published with
    shown = replace(quickstart, clip_bounded=True)  # what `study analyze` prints to a terminal
    assert shown.bounds("final_acc") == shown.bounds("acc_level") == (0.0, 1.0) and shown.bounds("acc_slope") is None
