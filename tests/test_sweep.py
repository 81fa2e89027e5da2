"""Sweeps: expansion and validation, a real 2-condition x 2-seed smoke sweep, skip/resume/restart
on rerun, a failing run that does not stop the others, and `timlab runs` filtering."""

import json
import re
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from timlab import cli
from timlab.experiments.sweeps.runner import SweepError, expand, load_spec, read_index, run_sweep, spec_from_dict
from timlab.rundir.metrics_log import TIMING_KEYS

SPEC = {
    "base": {"preset": "smoke", "set": {"run.steps": 3}},
    "conditions": [
        {"name": "control", "set": {"mismatch.injector": "none"}},
        {"name": "head_2", "set": {"mismatch.injector": "head_perturb", "mismatch.magnitude": 2.0}},
    ],
    "grid": {"run.seed": [0, 1]},
    "workers": 2,
}


def mtimes(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): p.stat().st_mtime_ns
            for p in d.glob("*/*") if p.name in ("metrics.parquet", "status.json", "config.yaml")}


def non_timing(df: pd.DataFrame) -> pd.DataFrame:
    return df.drop(columns=[c for c in df.columns if c in TIMING_KEYS]).reset_index(drop=True)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    spec_path = root / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(SPEC))
    events = []
    df = run_sweep(spec_path, root / "out", progress=lambda *e: events.append(e))
    return spec_path, root / "out", df, events


# ------------------------------------------------------------------------------- no runs needed
def test_expand_ids_conditions_and_configs():
    runs = expand(spec_from_dict(SPEC))
    assert [r.condition for r in runs] == ["control", "control", "head_2", "head_2"]
    assert all(re.fullmatch(r"(control|head_2)__seed[01]__[0-9a-f]{6}", r.run_id) for r in runs)
    assert [r.run_id for r in runs] == [r.run_id for r in expand(spec_from_dict(SPEC))]  # stable
    assert len({r.run_id for r in runs}) == 4
    head = runs[3]
    assert head.config.mismatch.magnitude == 2.0 and head.config.run.seed == 1 and head.config.run.steps == 3
    assert head.overrides == {"run.steps": 3, "mismatch.injector": "head_perturb", "mismatch.magnitude": 2.0,
                              "run.seed": 1}
    # a non-seed grid key becomes part of the condition label
    grid = expand(spec_from_dict({"base": {"preset": "smoke"},
                                  "grid": {"mismatch.magnitude": [0.0, 0.5], "run.seed": [3]}}))
    assert [r.condition for r in grid] == ["magnitude0", "magnitude0.5"]
    assert grid[1].run_id.startswith("magnitude0.5__seed3__")


def test_base_config_path_is_relative_to_the_spec(tmp_path):
    (tmp_path / "base.yaml").write_text("optim:\n  lr: 0.00123\n")
    (tmp_path / "spec.yaml").write_text("base: {preset: smoke, config: base.yaml}\n")
    (run,) = expand(load_spec(tmp_path / "spec.yaml"))
    assert run.config.optim.lr == 0.00123 and run.condition == "base"


@pytest.mark.parametrize("change, match", [
    ({"conditions": [{"name": "x", "set": {"mismatch.magnitud": 1.0}}]}, "unknown key mismatch.magnitud"),
    ({"conditions": [{"name": "x", "set": {"task.name": "nope"}}]}, "unknown task.name 'nope'"),
    ({"grid": {"run.seed": []}}, "empty list"),
    ({"conditions": [{"name": "a"}, {"name": "a"}]}, "duplicate condition name 'a'"),
    ({"conditions": []}, "conditions is an empty list"),
    ({"sweeps": 3}, "unknown key 'sweeps'"),
    ({"base": {"preset": "smoke", "steps": 3}}, "unknown key 'steps'"),
    ({"conditions": [{"name": "a", "sett": {}}]}, "unknown key 'sett'"),
    ({"grid": {"run.seed": [0, 0]}}, "duplicate values"),
    ({"grid": {"seed": [0]}}, "not of the form section.key"),
    ({"executor": "slurm"}, "unknown executor 'slurm'"),
])
def test_bad_specs_fail_before_anything_runs(tmp_path, change, match):
    spec = {**SPEC, **change}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(SweepError, match=match) as e:
        run_sweep(tmp_path / "spec.yaml", tmp_path / "out")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_bad_spec_cli_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({**SPEC, "grid": {"run.seed": []}}))
    assert cli.main(["sweep", str(tmp_path / "spec.yaml"), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("timlab: error:") and "run.seed" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_ray_executor_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises, installed or not
    with pytest.raises(SweepError, match="needs the ray package"):
        run_sweep(SPEC, tmp_path / "out", executor="ray")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------- real runs
def test_smoke_sweep_finishes_with_an_index(sweep):
    _, out, df, events = sweep
    assert len(df) == 4 and set(df["state"]) == {"finished"}
    assert sorted(df.attrs["executed"]) == sorted(df["run_id"]) and df.attrs["failed"] == {}
    idx = read_index(out)
    assert list(idx["run_id"]) == list(df["run_id"])
    for col in ("condition", "state", "mismatch.magnitude", "run.seed", "peak_accuracy", "final_accuracy",
                "collapsed", "steps_to_collapse", "k3_kl_mean", "auc_accuracy", "grad_norm_max"):
        assert col in idx.columns, col
    assert (idx["last_step"] == 3).all()
    assert list(idx["mismatch.magnitude"]) == [0.0, 0.0, 2.0, 2.0]
    k3 = idx.groupby("condition")["k3_kl_mean"].mean()
    assert k3["control"] == 0.0 and k3["head_2"] > 0  # control is exact, the head perturbation is not
    for run_id in idx["run_id"]:
        assert json.loads((out / run_id / "status.json").read_text())["state"] == "finished"
    done = [e for e in events if e[0] == "sweep"]
    assert done[0][1:3] == (0, 4) and done[-1][1:3] == (4, 4)
    assert {e[0] for e in events if e[0].startswith("train:")} == {f"train:{r}" for r in idx["run_id"]}


def test_rerun_skips_finished_runs(sweep, capsys):
    spec_path, out, _, _ = sweep
    before = mtimes(out)
    assert len(before) == 12
    df = run_sweep(spec_path, out)
    assert df.attrs["executed"] == [] and set(df.attrs["plan"].values()) == {"skip"}
    assert mtimes(out) == before and len(df) == 4
    assert cli.main(["sweep", str(spec_path), "--out", str(out), "--quiet"]) == 0
    assert "ran 0, skipped 4" in capsys.readouterr().out
    assert mtimes(out) == before


def test_changed_spec_on_old_dir_is_an_error(sweep, tmp_path):
    _, out, _, _ = sweep
    # same overrides (same run ids), different preset underneath: refuse to mix the two in one directory
    (tmp_path / "base.yaml").write_text("run:\n  eval_every: 1\n")
    bad = {**SPEC, "base": {**SPEC["base"], "config": str(tmp_path / "base.yaml")}}
    before = mtimes(out)
    with pytest.raises(SweepError, match="different config .*run.eval_every"):
        run_sweep(bad, out)
    assert mtimes(out) == before


def test_42_12_a_sweep_folder_refuses_a_second_instruction_set(sweep, tmp_path, monkeypatch, capsys):
    """Issue 42, finding 12: an AVX2-pinned sweep followed by an unpinned one on an AVX-512 machine
    mixed both in one folder. The folder records its first sweep's bits and refuses others."""
    from timlab.experiments.sweeps import runner as sweep_mod
    from timlab.machine import bits, describe

    spec_path, out, df, _ = sweep
    record = json.loads((out / sweep_mod.ISA_FILE).read_text())
    assert record["isa"] == bits() and record["cpu_capability"] == describe()["cpu_capability"]
    assert record["fingerprint"] == describe()["fingerprint"]
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    other = "AVX512" if bits() != "AVX512" else "avx2"
    monkeypatch.setattr(sweep_mod, "machine_bits", lambda: other)
    assert run_sweep(spec_path, copy).attrs["executed"] == []  # nothing to run: nothing computed, no refusal
    missing = df["run_id"][3]
    shutil.rmtree(copy / missing)
    before = mtimes(copy)
    assert cli.main(["sweep", str(spec_path), "--out", str(copy), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"timlab: error: sweep directory {copy} holds runs computed with {bits()} (sweep_isa.json), but "
                   f"this process computes with {other}: one folder never mixes instruction sets; "
                   + {"avx2": "continue it as `timlab --isa avx2 sweep ...` on a machine whose CPU is not Intel's",
                      "avx2-intel": "continue it as `timlab --isa avx2 sweep ...` on an Intel machine"}.get(
                       bits(), f"continue it on a machine that computes with {bits()}, unpinned") + ", or choose a new --out")
    assert mtimes(copy) == before and not (copy / missing).exists()
    # the same name but another fingerprint (e.g. an Intel and an AMD CPU under one label): refused too
    monkeypatch.setattr(sweep_mod, "machine_bits", bits)
    real = describe()
    monkeypatch.setattr(sweep_mod, "describe_machine", lambda: {**real, "fingerprint": "0123456789ab"})
    assert cli.main(["sweep", str(spec_path), "--out", str(copy), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"timlab: error: sweep directory {copy} holds runs whose machine has fingerprint "
                          f"{real['fingerprint']} (sweep_isa.json), but this process computes 0123456789ab ({bits()}, "
                          f"torch {real['torch']}): the same operations round differently here; ")
    assert mtimes(copy) == before and not (copy / missing).exists()
    # a record written before fingerprints is checked by its name alone
    legacy = {k: v for k, v in record.items() if k != "fingerprint"}
    (copy / sweep_mod.ISA_FILE).write_text(json.dumps(legacy))
    assert cli.main(["sweep", str(spec_path), "--out", str(copy), "--quiet"]) == 0
    assert (copy / missing / "status.json").exists()
    shutil.rmtree(copy / missing)
    (copy / sweep_mod.ISA_FILE).write_text("{oops")
    with pytest.raises(SweepError, match="sweep_isa.json is unreadable"):
        run_sweep(spec_path, copy)


def test_killed_sweep_continues_only_the_partial_runs(sweep, tmp_path):
    _, out, df, _ = sweep
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    resumed, restarted, untouched = df["run_id"][1], df["run_id"][2], [df["run_id"][0], df["run_id"][3]]
    original = {r: pd.read_parquet(out / r / "metrics.parquet") for r in (resumed, restarted)}
    # killed after the step-2 checkpoint: still "running", the step-3 checkpoint never written
    d = copy / resumed
    (d / "status.json").write_text(json.dumps({"state": "running", "step": 2, "total_steps": 3, "message": ""}))
    shutil.rmtree(d / "checkpoints" / "step_000003")
    # killed before its first checkpoint: only config.yaml is left
    d = copy / restarted
    for name in ("status.json", "metrics.parquet", "distributions.jsonl"):
        (d / name).unlink()
    shutil.rmtree(d / "checkpoints")
    before = mtimes(copy)

    again = run_sweep(SPEC, copy)
    assert sorted(again.attrs["executed"]) == sorted([resumed, restarted])
    # both resume: one from its step-2 checkpoint, the other from step 0 (the warm start)
    assert again.attrs["plan"][resumed] == "resume" and again.attrs["plan"][restarted] == "resume"
    after = mtimes(copy)
    for r in untouched:
        assert all(after[k] == v for k, v in before.items() if k.startswith(r))
    assert set(again["state"]) == {"finished"}
    for r, orig in original.items():  # resume and restart both reproduce the uninterrupted run
        pd.testing.assert_frame_equal(non_timing(pd.read_parquet(copy / r / "metrics.parquet")), non_timing(orig))


def test_a_failing_run_is_recorded_and_the_others_finish(tmp_path, capsys):
    spec = {
        "base": {"preset": "smoke", "set": {"run.steps": 1}},
        "conditions": [{"name": "ok"}, {"name": "broken", "set": {"model.path": str(tmp_path / "no_model")}}],
        "workers": 1,
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    rc = cli.main(["sweep", str(tmp_path / "spec.yaml"), "--out", str(tmp_path / "out"), "--quiet"])
    assert rc == 1
    printed = capsys.readouterr().out
    idx = read_index(tmp_path / "out").set_index("condition")
    assert idx.loc["ok", "state"] == "finished"
    assert idx.loc["broken", "state"] == "failed" and "model.path" in idx.loc["broken", "message"]
    assert "failed broken__" in printed and "1 finished" in printed and "1 failed" in printed


def test_runs_cli_filters_with_sql(sweep, capsys):
    _, out, df, _ = sweep
    assert cli.main(["runs", str(out), "--where", "mismatch.magnitude > 0.5"]) == 0
    text = capsys.readouterr().out
    assert "head_2__seed0" in text and "head_2__seed1" in text and "control__" not in text
    assert "(2 of 4 runs; collapsed: the peak rule, the default (the demo's headline and the study tables use the " \
           "plateau rule: --rule plateau))" in " ".join(text.split())
    assert cli.main(["runs", str(out), "--where", "condition = 'control' AND \"run.seed\" = 1",
                     "--columns", "run_id,state", "--sort", "run_id"]) == 0
    text = capsys.readouterr().out
    assert "control__seed1" in text and "control__seed0" not in text and "peak_accuracy" not in text
    assert cli.main(["runs", str(out), "--where", "no_such_column > 1"]) == 2
    assert "timlab: error: --where" in capsys.readouterr().err
    assert cli.main(["runs", str(out), "--columns", "nope"]) == 2


def test_runs_cli_fits_120_columns_and_names_the_rule_in_the_header(sweep, capsys):
    """Issue 60: `timlab runs` printed 185-296 character lines and a bare "collapsed" column whose
    verdicts (peak rule) disagreed with the study tables' (plateau rule)."""
    _, out, df, _ = sweep
    assert cli.main(["runs", str(out)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert max(map(len, lines)) <= 120 and "collapsed[peak]" in text and "steps_to_collapse[peak]" in text
    assert " condition " not in lines[0] and "condition: the run_id before '__'" in " ".join(text.split())
    assert sum(line.startswith("head_2__seed0") for line in lines) >= 1
    assert cli.main(["runs", str(out), "--wide", "--rule", "plateau"]) == 0
    wide = capsys.readouterr().out.splitlines()
    assert len(wide) == 1 + 4 + 1 and "condition" in wide[0] and "collapsed[plateau]" in wide[0]
    assert max(map(len, wide[:5])) > 120  # the whole row on one line


def test_ray_executor_runs_a_sweep(tmp_path):
    pytest.importorskip("ray")
    spec = {**SPEC, "grid": {"run.seed": [0]}, "conditions": SPEC["conditions"][:1], "executor": "ray"}
    df = run_sweep(spec, tmp_path / "out", workers=1)
    assert list(df["state"]) == ["finished"]


def test_runs_and_report_of_a_demo_folder_find_its_sweep_and_name_the_rule(sweep, tmp_path, capsys):
    """``timlab demo --out DIR`` puts its sweep in DIR/runs; ``timlab runs DIR`` lists it."""
    _, out, df, _ = sweep
    demo_out = tmp_path / "demo_out"
    shutil.copytree(out, demo_out / "runs")
    assert cli.main(["runs", str(demo_out), "--rule", "plateau"]) == 0
    text = capsys.readouterr().out
    assert "head_2__seed0" in text and "(4 of 4 runs; collapsed: the plateau rule)" in text
    assert cli.main(["report", str(demo_out), "--out", str(tmp_path / "r.html")]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'r.html'}: 4 runs")
    assert cli.main(["runs", str(tmp_path)]) == 2
    assert "no index.parquet (not a sweep directory" in capsys.readouterr().err
