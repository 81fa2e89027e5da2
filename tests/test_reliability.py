"""Regression tests for the reliability defects an attack on the CLI found: no data loss, one
process per run directory, resumes that survive kills and damaged files, and one-line errors
(never a traceback) for bad input. Each test names the defect it guards."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest

from timlab import cli
from timlab.config import resolve
from timlab.errors import BadFileError, DiskFullError, TimlabError, UsageError, is_disk_full, one_line
from timlab.files import ForeignFilesError, atomic_write_text, remove_owned
from timlab.rundir.checkpoint import latest_checkpoint, verify_checkpoint
from timlab.rundir.metrics_log import without_timings
from timlab.trainer.pretrain import pretrain
from timlab.rundir import RunDir, RunDirBusyError

REPO = Path(__file__).resolve().parents[1]


def _err(args, capsys) -> str:
    """Run the CLI, require exit code 2 and one line on stderr, return that line."""
    code = cli.main(args)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("timlab: error: "), err
    return err


def _metrics(run: Path) -> pd.DataFrame:
    return without_timings(pd.read_parquet(run / "metrics.parquet"))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 4-step smoke run (checkpoints at steps 2 and 4), never interrupted."""
    run = tmp_path_factory.mktemp("rel") / "run"
    assert cli.main(["train", "--preset", "smoke", "--run-dir", str(run), "--quiet"]) == 0
    return run


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


def _resume_equals(run: Path, original: Path, capsys) -> str:
    assert cli.main(["train", "--run-dir", str(run), "--resume", "--quiet"]) == 0
    out = capsys.readouterr()
    pd.testing.assert_frame_equal(_metrics(run), _metrics(original))
    assert (run / "distributions.jsonl").read_text() == (original / "distributions.jsonl").read_text()
    assert RunDir(run).read_status()["state"] == "finished"
    return out.err


# ---------------------------------------------------------------------------- 1. data loss
def test_pretrain_refuses_a_folder_it_did_not_write(tmp_path, capsys):
    out = tmp_path / "mymodels"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / "sub" / "data.csv").write_text("a,b\n")
    err = _err(["pretrain", "--preset", "smoke", "--task", "reverse", "--out", str(out), "--quiet"], capsys)
    assert "not a timlab model folder" in err and "notes.txt" in err
    assert (out / "notes.txt").read_text() == "mine" and (out / "sub" / "data.csv").read_text() == "a,b\n"


def test_remove_owned_deletes_only_timlab_folders(tmp_path):
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "config.json").write_text("{}")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "config.json").write_text("{}")
    (theirs / "notes.txt").write_text("mine")
    remove_owned(ours, ("config.json",), what="a model folder")
    assert not ours.exists()
    with pytest.raises(ForeignFilesError, match="notes.txt"):
        remove_owned(theirs, ("config.json",), what="a model folder")
    assert (theirs / "notes.txt").exists() and (theirs / "config.json").exists()


def test_run_dir_clear_keeps_foreign_files(tmp_path):
    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()
    for name in ("config.yaml", "status.json", "metrics.parquet", "notes.txt"):
        (rd.path / name).write_text("x")
    (rd.checkpoints / "step_000002").mkdir(parents=True)
    rd.clear()
    assert sorted(p.name for p in rd.path.iterdir()) == ["notes.txt"]


# ---------------------------------------------------------------------------- 2. the lock
def test_second_process_on_a_run_dir_gets_one_line_naming_the_holder(tmp_path, capsys):
    run = tmp_path / "run"
    with RunDir(run):
        err = _err(["train", "--preset", "smoke", "--run-dir", str(run), "--quiet"], capsys)
        assert f"in use by process {os.getpid()}" in err
        with pytest.raises(RunDirBusyError):
            RunDir(run).lock()
    assert not (run / "config.yaml").exists()  # the refused run wrote nothing
    RunDir(run).lock().unlock()  # released


def test_resume_cuts_append_only_files_back_to_the_checkpoint(finished_run, tmp_path, capsys):
    run = _copy(finished_run, tmp_path)
    # killed after logging step 4 but before its checkpoint, with a line cut short (defect 5)
    shutil.rmtree(run / "checkpoints" / "step_000004")
    (run / "checkpoints" / "latest").write_text("step_000004\n")
    with open(run / "distributions.jsonl", "a") as f:
        f.write('{"step": 5, "histogram": {"edges": [0.1, ')
    _resume_equals(run, finished_run, capsys)
    assert len((run / "distributions.jsonl").read_text().splitlines()) == 4


def test_a_damaged_line_inside_distributions_names_the_file(finished_run, tmp_path, capsys):
    run = _copy(finished_run, tmp_path)
    lines = (run / "distributions.jsonl").read_text().splitlines()
    lines[0] = lines[0][:40]
    (run / "distributions.jsonl").write_text("\n".join(lines) + "\n")
    err = _err(["train", "--run-dir", str(run), "--resume", "--quiet"], capsys)
    assert "distributions.jsonl: line 1" in err


# ---------------------------------------------------------------------------- 3. killed early
def test_killed_before_the_first_checkpoint_resumes_from_step_0(finished_run, tmp_path, capsys):
    run = _copy(finished_run, tmp_path)
    shutil.rmtree(run / "checkpoints")
    RunDir(run).write_status("running", step=1, total_steps=4)
    err = _resume_equals(run, finished_run, capsys)
    assert "Traceback" not in err


# ---------------------------------------------------------------------------- 4. damaged checkpoints
@pytest.mark.parametrize("damage", ["truncate", "random_bytes", "state", "config"])
def test_a_damaged_latest_checkpoint_falls_back_and_says_so(finished_run, tmp_path, capsys, damage):
    run = _copy(finished_run, tmp_path)
    ckpt = run / "checkpoints" / "step_000004"
    weights = ckpt / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "random_bytes":
        weights.write_bytes(os.urandom(weights.stat().st_size))
    elif damage == "state":
        state = ckpt / "trainer_state.pt"
        state.write_bytes(state.read_bytes()[:100])
    else:
        (ckpt / "config.json").unlink()
    assert verify_checkpoint(ckpt) is not None
    assert latest_checkpoint(run / "checkpoints") == run / "checkpoints" / "step_000002"
    err = _resume_equals(run, finished_run, capsys)
    assert f"checkpoint {ckpt} is unusable" in err and "timlab: warning:" in err


# ---------------------------------------------------------------------------- 6-9. one-line errors
def test_malformed_config_yaml_on_resume(finished_run, tmp_path, capsys):
    run = _copy(finished_run, tmp_path)
    (run / "config.yaml").write_text("run: [steps: 3\n")
    assert "config.yaml: invalid YAML" in _err(["train", "--run-dir", str(run), "--resume"], capsys)
    (run / "config.yaml").write_bytes(b"run:\n  steps: \xff\xfe\n")
    assert "not a UTF-8 text file" in _err(["train", "--run-dir", str(run), "--resume"], capsys)


def test_run_dir_that_is_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("mine")
    assert "is a file" in _err(["train", "--preset", "smoke", "--run-dir", str(tmp_path / "afile")], capsys)
    assert (tmp_path / "afile").read_text() == "mine"


@pytest.mark.parametrize("setting", [
    "model.hidden_size=0", "model.num_heads=0", "model.num_layers=0", "model.pretrain_steps=0",
    "model.hidden_size=50", "task.kwargs.max_len=100000", "task.n_train=0", "optim.lr=nan", "optim.lr=.inf",
    "run.device=nosuchdevice",
])
def test_bad_config_values_are_one_line_errors(tmp_path, capsys, setting):
    err = _err(["train", "--preset", "smoke", "--run-dir", str(tmp_path / "r"), "--set", setting], capsys)
    assert setting.split("=")[0].split(".kwargs")[0].rsplit(".", 1)[-1] in err or "task" in err


def test_cuda_without_cuda_is_one_line(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    err = _err(["train", "--preset", "smoke", "--run-dir", str(tmp_path / "r"), "--set", "run.device=cuda"], capsys)
    assert "CUDA is not available" in err


def test_bad_pretrain_values_and_workers(tmp_path, capsys):
    _err(["pretrain", "--preset", "smoke", "--out", str(tmp_path / "m"), "--set", "model.pretrain_steps=0"], capsys)
    spec = tmp_path / "spec.yaml"
    spec.write_text("base: {preset: smoke}\nconditions: [{name: a}]\n")
    assert "--workers" in _err(["sweep", str(spec), "--out", str(tmp_path / "s"), "--workers", "-1"], capsys)


@pytest.fixture(scope="module")
def model_dir():
    return pretrain(resolve(preset="smoke")).path


@pytest.mark.parametrize("damage", ["config_list", "tokenizer", "weights_truncated", "weights_garbage"])
def test_damaged_model_folders_are_one_line_errors(model_dir, tmp_path, capsys, damage):
    m = tmp_path / "model"
    shutil.copytree(model_dir, m)
    if damage == "config_list":
        (m / "config.json").write_text("[1, 2]")
    elif damage == "tokenizer":
        (m / "tokenizer.json").write_text("not json")
    elif damage == "weights_truncated":
        (m / "model.safetensors").write_bytes((m / "model.safetensors").read_bytes()[:500])
    else:
        (m / "model.safetensors").write_bytes(b"\x08" + os.urandom(200))
    err = _err(["probe", "--model", str(m), "--task", "reverse", "--num-prompts", "2", "--max-new-tokens", "4"], capsys)
    assert str(m) in err
    _err(["train", "--preset", "smoke", "--run-dir", str(tmp_path / "r"), "--set", f"model.path={m}"], capsys)
    assert not (tmp_path / "r" / "config.yaml").exists()  # a start that failed in setup leaves no run behind


# ---------------------------------------------------------------------------- 10-11. outputs
def _analyze_file(path: Path, logp: float) -> Path:
    rows = [{"trainer_logprobs": [-0.1, logp, -0.5], "rollout_logprobs": [-0.2, -0.3, -0.5]} for _ in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_outputs_that_are_folders(tmp_path, capsys):
    data = _analyze_file(tmp_path / "a.jsonl", -0.3)
    (tmp_path / "d").mkdir()
    assert "--json" in _err(["analyze", str(data), "--json", str(tmp_path / "d")], capsys)
    assert "--out" in _err(["analyze", str(data), "--out", str(tmp_path / "d")], capsys)
    assert "--out" in _err(["report", str(tmp_path), "--out", str(tmp_path / "d")], capsys)
    assert "--json" in _err(["probe", "--model", str(tmp_path), "--task", "reverse", "--json", str(tmp_path / "d")],
                            capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "d"]  # no .tmp left behind


def test_analyze_absurd_logprobs_are_refused_and_the_rest_gives_a_report_and_standard_json(tmp_path, capsys):
    # -1e308 is finite, but its sums overflow: such rows are refused (naming the column), never inf means
    data = _analyze_file(tmp_path / "inf.jsonl", -1e308)
    err = _err(["analyze", str(data), "--json", str(tmp_path / "r.json")], capsys)
    assert "column trainer_logprobs" in err and "below -1e+100" in err and not (tmp_path / "r.json").exists()
    with data.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in json.loads(json.dumps([
            {"trainer_logprobs": [-0.1, -0.3, -0.5], "rollout_logprobs": [-0.2, -0.3, -0.5]}] * 4))))
    assert cli.main(["analyze", str(data), "--out", str(tmp_path / "r.html"), "--json", str(tmp_path / "r.json")]) == 1
    text = (tmp_path / "r.json").read_text()
    res = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert res["num_valid"] == 4 and all(math.isfinite(v) for v in res["metrics"].values())
    assert (tmp_path / "r.html").stat().st_size > 0


# ---------------------------------------------------------------------------- 12. sweep workers
def test_sweep_workers_die_with_their_parent(tmp_path):
    script = textwrap.dedent("""
        import os, sys, time
        from concurrent.futures import ProcessPoolExecutor
        import multiprocessing as mp
        from timlab.experiments.sweeps.workers import _worker_init
        if __name__ == "__main__":
            pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"), initializer=_worker_init,
                                       initargs=(None, os.getpid()))
            print(pool.submit(os.getpid).result(), flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    worker = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    for _ in range(50):
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return
        if Path(f"/proc/{worker}/stat").exists() and Path(f"/proc/{worker}/stat").read_text().split()[2] == "Z":
            return  # a zombie: dead, waiting for init to reap it
        time.sleep(0.1)
    os.kill(worker, signal.SIGKILL)
    pytest.fail("the worker outlived the sweep's process")


# ---------------------------------------------------------------------------- 13. full disk
def test_one_line_with_type_names_the_class_for_messages_without_a_traceback():
    """What a sweep's index records for a failed run: the class name, then the CLI's one line."""
    assert one_line(ValueError("bad value\nmore"), with_type=True) == "ValueError: bad value"
    assert one_line(ValueError("bad value\nmore")) == "bad value"
    assert one_line(RuntimeError(), with_type=True) == "RuntimeError"
    assert one_line(KeyError("k"), with_type=True) == "KeyError: k"
    assert one_line(FileNotFoundError(2, "No such file or directory", "s.yaml"),
                    with_type=True) == "FileNotFoundError: s.yaml: No such file or directory"


def test_disk_full_is_one_line_naming_the_mount_and_leaves_no_tmp(tmp_path, monkeypatch):
    target = tmp_path / "status.json"
    target.write_text('{"state": "running"}')

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(DiskFullError) as e:
        atomic_write_text(target, "x" * 100)
    assert "no space left on the disk mounted at" in one_line(e.value) and str(target) in one_line(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]
    RunDir(tmp_path).write_status("failed", step=3, total_steps=4, message="disk full")  # in place
    assert RunDir(tmp_path).read_status()["state"] == "failed"
    assert is_disk_full(RuntimeError("IoError(Os { code: 28, kind: StorageFull })"))


# ---------------------------------------------------------------------------- 14. smaller ones
def test_non_utf8_files_are_named(tmp_path, capsys):
    bad = tmp_path / "prompts.txt"
    bad.write_bytes(b"abc\n\xff\xfe\n")
    from timlab.experiments.diagnostics.probe import _read_prompts

    with pytest.raises(BadFileError, match="prompts.txt"):
        _read_prompts(bad)
    spec = tmp_path / "spec.yaml"
    spec.write_bytes(b"base: {preset: \xff}\n")
    assert "spec.yaml" in _err(["sweep", str(spec), "--out", str(tmp_path / "s")], capsys)


def test_resuming_a_finished_run_reports_its_last_row(finished_run, tmp_path, capsys):
    run = _copy(finished_run, tmp_path)
    assert cli.main(["train", "--run-dir", str(run), "--resume", "--quiet"]) == 0
    assert "done: step=4," in capsys.readouterr().out


def test_sweep_index_shows_the_live_state(tmp_path):
    from timlab.experiments.sweeps.runner import INDEX_FILE, read_index

    pd.DataFrame([{"run_id": "a", "run_dir": "a", "state": "pending", "last_step": float("nan")}]).to_parquet(
        tmp_path / INDEX_FILE)
    RunDir(tmp_path / "a").path.mkdir()
    RunDir(tmp_path / "a").write_status("running", step=76, total_steps=150)
    df = read_index(tmp_path)
    assert df.loc[0, "state"] == "running" and df.loc[0, "last_step"] == 76


def test_every_error_class_is_a_timlab_error():
    import timlab.cli
    import timlab.engines.hf
    import timlab.engines.vllm
    import timlab.experiments.diagnostics.analyze
    import timlab.experiments.sweeps.runner
    import timlab.registry
    import timlab.trainer.run

    classes = [timlab.cli.CLIError, timlab.config.ConfigError, timlab.registry.UnknownNameError,
               timlab.engines.hf.MissingTransformersError, timlab.engines.vllm.MissingVLLMError,
               timlab.experiments.diagnostics.analyze.AnalyzeError, timlab.experiments.sweeps.runner.SweepError,
               timlab.trainer.run.NonFiniteError, timlab.trainer.run.ZeroMismatchViolation, RunDirBusyError, UsageError]
    assert all(issubclass(c, TimlabError) for c in classes)
    assert issubclass(timlab.config.ConfigError, ValueError)  # library callers that catch ValueError keep working
