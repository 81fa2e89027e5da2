"""scripts/keep_runs.py: a long sweep's finished runs copied into the repository as they finish."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pandas as pd
import pytest

from study_sweep import write_sweep
from timlab.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("keep_runs", REPO / "scripts" / "keep_runs.py")
keep_runs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(keep_runs)


def metrics(name: str) -> pd.DataFrame:
    return pd.DataFrame({"step": range(11), "val/accuracy": 0.5})


def test_keeps_finished_diverged_and_guard_stopped_runs_only(tmp_path, capsys):
    src, dst = tmp_path / "work" / "s", tmp_path / "repo" / "s"
    names = ["a_s0", "b_s0", "c_s0", "d_s0", "e_s0"]
    write_sweep(src, names, metrics, 10, states={"b_s0": ("running", 4), "c_s0": ("diverged", 6),
                                                 "d_s0": ("guard_failed", 1), "e_s0": ("finished", 7)})
    for n in names:
        (src / f"{n}__abc123" / "config.yaml").write_text(f"name: {n}\n")
    (src / "a_s0__abc123" / "checkpoints").mkdir()
    (src / "study.json").write_text("{}")
    assert keep_runs.main([str(src), str(dst), "--steps", "10"]) == 0
    assert capsys.readouterr().out.split() == ["a_s0__abc123", "c_s0__abc123", "d_s0__abc123"]
    assert sorted(p.name for p in dst.iterdir()) == ["a_s0__abc123", "c_s0__abc123", "d_s0__abc123", "index.parquet",
                                                     "study.json"]
    assert sorted(p.name for p in (dst / "a_s0__abc123").iterdir()) == ["config.yaml", "metrics.parquet",
                                                                        "status.json"]
    assert keep_runs.keep(src, dst, 10) == []  # nothing new
    assert keep_runs.keep(src, dst) == ["e_s0__abc123"]  # without --steps a run finished early counts
    status = src / "b_s0__abc123" / "status.json"
    status.write_text(json.dumps({**json.loads(status.read_text()), "state": "finished", "step": 10}))
    assert keep_runs.keep(src, dst, 10) == ["b_s0__abc123"]


def one_finished_run(tmp_path, name="a_s0"):
    """A work sweep holding one finished run ``<name>__abc123`` (its config ``name: <name>``)."""
    src = write_sweep(tmp_path / "work" / "s", [name], metrics, 10)
    (src / f"{name}__abc123" / "config.yaml").write_text(f"name: {name}\n")
    return src, tmp_path / "repo" / "s"


def test_a_symlinked_run_folder_or_file_in_the_repository_is_refused_and_nothing_outside_is_written(tmp_path):
    src, dst = one_finished_run(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("precious\n")
    dst.mkdir(parents=True)
    (dst / "a_s0__abc123").symlink_to(outside)  # the run folder a link out of the repository
    (outside / "config.yaml").symlink_to(victim)
    with pytest.raises(SystemExit, match=r"a_s0__abc123 is a symlink"):
        keep_runs.keep(src, dst, 10)
    (dst / "a_s0__abc123").unlink()
    (dst / "a_s0__abc123").mkdir()
    (dst / "a_s0__abc123" / "config.yaml").symlink_to(victim)  # a kept file a link out of it
    with pytest.raises(SystemExit, match=r"config.yaml is a symlink"):
        keep_runs.keep(src, dst, 10)
    (dst / "index.parquet").symlink_to(victim)  # and the sweep's own record
    (dst / "a_s0__abc123" / "config.yaml").unlink()
    with pytest.raises(SystemExit, match=r"index.parquet is a symlink"):
        keep_runs.keep(src, dst, 10)
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in outside.iterdir()) == ["config.yaml", "victim.txt"]
    assert list((dst / "a_s0__abc123").iterdir()) == []  # refused before the first write


def test_a_symlinked_file_in_the_work_sweep_is_not_copied_into_the_repository(tmp_path):
    src, dst = one_finished_run(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET\n")
    cfg = src / "a_s0__abc123" / "config.yaml"
    cfg.unlink()
    cfg.symlink_to(secret)
    with pytest.raises(SystemExit, match=r"config.yaml is a symlink"):
        keep_runs.keep(src, dst, 10)
    assert not any("SECRET" in p.read_text(errors="ignore") for p in dst.rglob("*") if p.is_file())
    cfg.unlink()
    os.mkfifo(cfg)  # a FIFO is refused without being opened (which would block)
    with pytest.raises(SystemExit, match=r"config.yaml is not a regular file"):
        keep_runs.keep(src, dst, 10)


def test_only_the_index_run_ids_are_kept_and_odd_names_are_skipped_with_a_warning(tmp_path, capsys):
    other = write_sweep(tmp_path / "work" / "other", ["z_s0"], metrics, 10)
    src = tmp_path / "work" / "s"
    names = ["a_s0", "b\nfake_s0"]
    write_sweep(src, names, metrics, 10)
    for n in names:
        (src / f"{n}__abc123" / "config.yaml").write_text("x: 1\n")
    stray = RunDir(src / "stray__abc123")  # a finished run folder the index does not name
    stray.path.mkdir()
    for f in ("config.yaml", "metrics.parquet"):
        (stray.path / f).write_text("x")
    stray.write_status("finished", step=10, total_steps=10)
    (src / "z_s0__abc123").symlink_to(other / "z_s0__abc123")  # another sweep's run, linked in
    dst = tmp_path / "repo" / "s"
    assert keep_runs.main([str(src), str(dst), "--steps", "10"]) == 0
    out, err = capsys.readouterr()
    assert out == "a_s0__abc123\n"
    assert err == "keep_runs: skipped the index's run id 'b\\nfake_s0__abc123': not a plain folder name\n"
    assert sorted(p.name for p in dst.iterdir()) == ["a_s0__abc123", "index.parquet"]
