"""Regression tests for the hostile-input and process-fault audit (issue 22): no code runs from a
run directory, no file timlab did not write is touched, no bad value runs silently, signals leave
an honest status. Each test names the finding (the issue's number) it guards."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from timlab import cli
from timlab.config import ConfigError, resolve, validate
from timlab.errors import TimlabError, UsageError
from timlab.files import ForeignFilesError, atomic_write_text, held_folder_lock, take_lock
from timlab.model.hf_io import ModelLoadError, config_from_hf
from timlab.rundir.checkpoint import CheckpointError, checkpoints_newest_first, load_state, verify_checkpoint
from timlab.rundir.metrics_log import without_timings
from timlab.yaml_io import load_yaml

REPO = Path(__file__).resolve().parents[1]
MARK = "timlab-pwned"


def _err(args, capsys) -> str:
    """Run the CLI, require exit code 2 and one line on stderr, return that line."""
    code = cli.main(args)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("timlab: error: "), err
    return err


class _Payload:
    """A pickle that runs code when unpickled with weights_only=False."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _metrics(run: Path) -> pd.DataFrame:
    return without_timings(pd.read_parquet(run / "metrics.parquet"))


@pytest.fixture(scope="module")
def cosine_run(tmp_path_factory):
    """A finished 4-step smoke run with a cosine LR schedule (checkpoints at steps 2 and 4)."""
    run = tmp_path_factory.mktemp("hostile") / "run"
    assert cli.main(["train", "--preset", "smoke", "--run-dir", str(run), "--quiet",
                     "--set", "scheduler.name=cosine"]) == 0
    return run


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


def _rewrite_manifest(ckpt: Path) -> None:
    """What an attacker can do: a manifest that matches the planted files."""
    from timlab.rundir.checkpoint import _write_manifest

    _write_manifest(ckpt, int(ckpt.name.split("_")[1]))


# ------------------------------------------------------------------------- 1. security
def test_1_planted_pickle_in_a_checkpoint_never_runs(cosine_run, tmp_path, capsys):
    run = _copy(cosine_run, tmp_path)
    marker = tmp_path / MARK
    ckpt = run / "checkpoints" / "step_000004"
    torch.save({"step": 4, "evil": _Payload(str(marker))}, ckpt / "trainer_state.pt")
    _rewrite_manifest(ckpt)  # the manifest matches: only data-only loading stops it
    with pytest.raises(CheckpointError, match="unreadable"):
        load_state(ckpt)
    assert not marker.exists()
    # the resume passes over it with a warning (to step 2's checkpoint) and runs no code
    with pytest.warns(UserWarning, match="step_000004 is unusable"):
        from timlab.config import load_run_config
        from timlab.trainer.run import train

        train(load_run_config(run), run, resume=True)
    assert not marker.exists()


def test_1_checkpoint_without_manifest_is_refused(cosine_run, tmp_path):
    run = _copy(cosine_run, tmp_path)
    ckpt = run / "checkpoints" / "step_000004"
    assert verify_checkpoint(ckpt) is None
    (ckpt / "manifest.json").unlink()
    assert verify_checkpoint(ckpt) == "no manifest.json"


def test_1_every_torch_load_is_data_only():
    """grep: no torch.load in the package without weights_only=True."""
    for path in (REPO / "timlab").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "torch.load(" in line:
                assert "weights_only=True" in line, f"{path}:{n}: {line.strip()}"


@pytest.mark.parametrize("where", [
    "1=1; COPY (SELECT 'x') TO '{out}'",
    "1=1 UNION SELECT * FROM read_text('/etc/passwd')",
    "run_id IN (SELECT content FROM read_csv('/etc/passwd'))",
    "1=1 -- comment",
    "length(run_id) > 0",
])
def test_2_runs_where_is_a_predicate_only(tmp_path, where):
    from timlab.experiments.sweeps.index import filter_index

    out = tmp_path / "f.csv"
    df = pd.DataFrame({"run_id": ["a", "b"], "mismatch.magnitude": [0.1, 1.0], "val/accuracy": [0.2, 0.5]})
    with pytest.raises(TimlabError):
        filter_index(df, where.format(out=out))
    assert not out.exists()
    # what a predicate may say still works, with bare dotted and slashed names
    assert list(filter_index(df, "mismatch.magnitude > 0.5 AND val/accuracy >= 0.5")["run_id"]) == ["b"]
    assert list(filter_index(df, "run_id = 'a' OR \"val/accuracy\" > 1")["run_id"]) == ["a"]


def test_2_unknown_where_column_lists_the_columns():
    from timlab.experiments.sweeps.index import filter_index

    df = pd.DataFrame({"run_id": ["a"], "state": ["finished"]})
    with pytest.raises(TimlabError, match="unknown column 'nope'.*valid columns: run_id, state"):
        filter_index(df, "nope > 1")


# ------------------------------------------------------------------------- 2. data loss
@pytest.mark.parametrize("name", ["status.json", "distributions.jsonl"])
def test_3_fresh_run_refuses_files_it_did_not_write(tmp_path, capsys, name):
    run = tmp_path / "run"
    run.mkdir()
    (run / name).write_text("the user's own file\n")
    err = _err(["train", "--preset", "smoke", "--run-dir", str(run), "--quiet"], capsys)
    assert name in err and "did not write" in err
    assert (run / name).read_text() == "the user's own file\n"
    assert not (run / "config.yaml").exists()


def test_3_run_lock_of_the_user_is_never_truncated(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.lock").write_text("my notes\n")
    err = _err(["train", "--preset", "smoke", "--run-dir", str(run), "--quiet"], capsys)
    assert "run.lock" in err and "not a timlab lock file" in err
    assert (run / "run.lock").read_text() == "my notes\n"


@pytest.mark.parametrize("name", ["run.lock", "status.json", "distributions.jsonl", "status.json.tmp"])
def test_3_symlinks_in_a_run_directory_are_never_followed(tmp_path, capsys, name):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / name).symlink_to(outside)
    _err(["train", "--preset", "smoke", "--run-dir", str(run), "--quiet"], capsys)
    assert outside.read_text() == "precious\n"


def test_3_atomic_writes_never_follow_a_planted_temporary_name(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    (tmp_path / "status.json.tmp").symlink_to(outside)  # the old fixed temporary name
    atomic_write_text(tmp_path / "status.json", "{}")
    assert outside.read_text() == "precious\n" and (tmp_path / "status.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside.txt", "status.json", "status.json.tmp"]


def test_4_pretrain_leaves_a_foreign_lock_and_partial_folder_alone(tmp_path, capsys):
    out = tmp_path / "model"
    (tmp_path / "model.lock").write_text("user data\n")
    err = _err(["pretrain", "--preset", "smoke", "--out", str(out), "--quiet"], capsys)
    assert "model.lock" in err and (tmp_path / "model.lock").read_text() == "user data\n"
    (tmp_path / "model.lock").unlink()
    partial = tmp_path / "model.partial"
    partial.mkdir()
    (partial / "config.json").write_text("{\"mine\": 1}")  # a name timlab writes, but not timlab's folder
    err = _err(["pretrain", "--preset", "smoke", "--out", str(out), "--quiet"], capsys)
    assert "model.partial" in err and (partial / "config.json").read_text() == "{\"mine\": 1}"


def test_4_pretrain_out_with_only_timlab_names_but_no_pretrain_json_is_refused(tmp_path, capsys):
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{\"mine\": 1}")
    _err(["pretrain", "--preset", "smoke", "--out", str(out), "--quiet"], capsys)
    assert (out / "config.json").read_text() == "{\"mine\": 1}"


@pytest.mark.parametrize("args", [["--seeds", "0"], ["--steps", "0"], ["--workers", "0"], ["--seeds", "-2"]])
def test_4_demo_checks_its_arguments_before_writing(tmp_path, capsys, args):
    out = tmp_path / "demo"
    err = _err(["demo", "--out", str(out), "--quiet", *args], capsys)
    assert args[0] in err
    assert not out.exists()


def test_4_demo_leaves_a_foreign_sweep_yaml_alone(tmp_path, capsys):
    out = tmp_path / "demo"
    out.mkdir()
    (out / "sweep.yaml").write_text("my: notes\n")
    _err(["demo", "--out", str(out), "--quiet", "--seeds", "1", "--steps", "1"], capsys)
    assert (out / "sweep.yaml").read_text() == "my: notes\n"


# ------------------------------------------------------------------------- 3. config values
@pytest.mark.parametrize("sets, needle", [
    (["mismatch.magnitude=.nan"], "mismatch.magnitude: expected a finite number"),
    (["mismatch.magnitude=.inf"], "mismatch.magnitude: expected a finite number"),
    (["algorithm.clip_low=nan"], "algorithm.clip_low: expected a finite number"),
    (["optim.lr=true"], "optim.lr: expected a number"),
    (["run.steps=.inf"], "run.steps: expected an integer"),
    (["run.steps=inf"], "run.steps: expected an integer"),
    (["run.steps=.nan"], "run.steps: expected an integer"),
    (["run.seed=1e20"], "run.seed: expected an integer in [0, 4294967295]"),
    (["run.seed=" + "9" * 400], "run.seed: expected an integer in"),
    (["mismatch.magnitude=" + "9" * 400], "mismatch.magnitude: expected a finite number"),
    (["run.steps=10000000000"], "run.steps: expected an integer in [0, 1000000000]"),
    (["model.num_layers=1000000"], "model.num_layers: expected an integer in [1, 1024]"),
])
def test_9_every_config_value_is_checked_before_any_work(sets, needle):
    with pytest.raises(ConfigError) as e:
        resolve(preset="smoke", overrides=sets)
    assert needle in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 200


@pytest.mark.parametrize("temperature", [".nan", "1e-40", ".inf", "-1"])
def test_10_rollout_temperature_must_be_finite_and_sane(temperature):
    cfg = resolve(preset="smoke", overrides=[f"rollout.temperature={temperature}"]) if temperature not in (
        ".nan", ".inf") else None
    if cfg is None:
        with pytest.raises(ConfigError, match="rollout.temperature: expected a finite number"):
            resolve(preset="smoke", overrides=[f"rollout.temperature={temperature}"])
        return
    with pytest.raises(ConfigError, match="rollout.temperature must be 0 .greedy. or in"):
        validate(cfg)


def test_13_grpo_with_one_sample_per_prompt_is_refused():
    with pytest.raises(ConfigError, match="rollout.samples_per_prompt=1 .* zero advantage"):
        validate(resolve(preset="smoke", overrides=["rollout.samples_per_prompt=1"]))
    with pytest.warns(UserWarning, match="temperature=0 .greedy."):
        validate(resolve(preset="smoke", overrides=["rollout.temperature=0"]))


def test_13_duplicate_yaml_keys_are_refused(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  lr: 1e-3\n  lr: 1e-4\n")
    with pytest.raises(ConfigError, match="duplicate key 'lr'"):
        resolve(p)
    p.write_text("optim:\n  lr: 1e-3\noptim:\n  eps: 1e-6\n")
    with pytest.raises(ConfigError, match="duplicate key 'optim'"):
        resolve(p)
    # merge keys stay legal, and override what they merge
    assert load_yaml("a: &a {x: 1, y: 2}\nb:\n  <<: *a\n  x: 3\n", "t") == {"a": {"x": 1, "y": 2}, "b": {"x": 3, "y": 2}}


def test_6_yaml_alias_bombs_and_recursive_aliases_are_refused_early(tmp_path, capsys):
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    spec = tmp_path / "bomb.yaml"
    spec.write_text("\n".join(levels) + "\n")  # ~10^9 nodes once expanded
    t = time.perf_counter()
    err = _err(["sweep", str(spec), "--out", str(tmp_path / "out"), "--quiet"], capsys)
    assert time.perf_counter() - t < 5 and "expands to more than" in err and len(err) < 400
    spec.write_text("base: &b\n  set: *b\n")
    err = _err(["sweep", str(spec), "--out", str(tmp_path / "out"), "--quiet"], capsys)
    assert "recursive YAML alias" in err
    assert not (tmp_path / "out").exists()


def test_8_a_huge_grid_is_refused_before_expansion(tmp_path, capsys):
    spec = tmp_path / "grid.yaml"
    spec.write_text("base: {preset: smoke}\ngrid:\n  run.seed: " + json.dumps(list(range(1000)))
                    + "\n  optim.lr: " + json.dumps([1e-4 + i * 1e-6 for i in range(1000)]) + "\n")
    t = time.perf_counter()
    err = _err(["sweep", str(spec), "--out", str(tmp_path / "out"), "--quiet"], capsys)
    assert "1000000 runs" in err and time.perf_counter() - t < 5


_GOOD_HF = {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "eos_token_id": 1,
            "pad_token_id": 0}


@pytest.mark.parametrize("change, needle", [
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
    ({"num_hidden_layers": 1000000}, "num_hidden_layers must be an integer in [1, 1024]"),
    ({"vocab_size": "abc"}, "vocab_size must be an integer"),
    ({"vocab_size": None}, "missing the field 'vocab_size'"),
    ({"hidden_size": -16}, "hidden_size must be an integer"),
    ({"hidden_size": 16.5}, "hidden_size must be an integer"),
    ({"pad_token_id": 99}, "pad_token_id must be an integer in [0, 31]"),
    ({"rope_parameters": "x"}, "rope_parameters must be an object"),
    ({"rope_parameters": {"rope_type": "linear", "factor": "abc"}}, "rope_parameters.factor must be a finite"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number"),
    ({"model_type": ["llama"]}, "unsupported architecture"),
])
def test_13_bad_model_config_values_are_one_line_errors(change, needle):
    with pytest.raises(ModelLoadError) as e:
        config_from_hf({**_GOOD_HF, **change})
    assert needle in str(e.value)


def test_tracebacks_model_folder_non_utf8_deep_json_and_fifo(tmp_path):
    from timlab.model.hf_io import load_model

    (tmp_path / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ModelLoadError, match="invalid JSON"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ModelLoadError, match="invalid JSON"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_GOOD_HF).replace('"vocab_size": 32', '"vocab_size": ' + "9" * 5000))
    with pytest.raises(ModelLoadError):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_GOOD_HF))
    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="not a regular file"):
        load_model(tmp_path)


def _sharded(folder: Path) -> Path:
    """A two-shard model folder (config.json ``_GOOD_HF``, model.safetensors.index.json, shards
    model-00001-of-00002.safetensors and model-00002-of-00002.safetensors) of a seeded tiny model."""
    from safetensors.torch import save_file

    from timlab.model.hf_io import config_from_hf
    from timlab.model.llama import CausalLM

    torch.manual_seed(0)
    state = {k: v.contiguous() for k, v in CausalLM(config_from_hf(_GOOD_HF)).state_dict().items()}
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_GOOD_HF))
    keys = sorted(state)
    names = {k: f"model-0000{1 + (i % 2)}-of-00002.safetensors" for i, k in enumerate(keys)}
    for shard in sorted(set(names.values())):
        save_file({k: state[k] for k in keys if names[k] == shard}, str(folder / shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    return folder


def _rename_shard(folder: Path, new: str) -> None:
    """Point the index's second shard (whatever it names now) at ``new`` instead."""
    index = folder / "model.safetensors.index.json"
    first = "model-00001-of-00002.safetensors"
    wm = json.loads(index.read_text())["weight_map"]
    index.write_text(json.dumps({"weight_map": {k: v if v == first else new for k, v in wm.items()}}))


def test_issue59_2_shard_names_outside_the_folder_are_refused_for_model_path_and_pretrain_init(tmp_path):
    from timlab.model.hf_io import load_model, weight_files
    from timlab.trainer.pretrain_init import init_digest

    other = _sharded(tmp_path / "other")
    assert len(load_model(other).state_dict()) > 2  # the folder loads as it is
    for i, name in enumerate(["../other/model-00002-of-00002.safetensors",
                              str(other / "model-00002-of-00002.safetensors"), "/dev/zero", "..", 7]):
        m = _sharded(tmp_path / f"m{i}")
        _rename_shard(m, name)
        with pytest.raises(ModelLoadError, match="is not a plain file name"):
            weight_files(m)
        with pytest.raises(ModelLoadError, match="is not a plain file name"):  # model.path
            load_model(m)
        with pytest.raises(UsageError, match=r"^model.pretrain_init .*is not a plain file name"):
            init_digest(str(m))


def test_issue59_5_6_a_fifo_or_device_shard_is_refused_before_it_is_opened(tmp_path):
    from timlab.model.hf_io import weight_files
    from timlab.trainer.pretrain_init import init_digest

    m = _sharded(tmp_path / "m")
    os.mkfifo(m / "fifo.safetensors")  # opened, it would block safetensors' native read forever
    (m / "zero.safetensors").symlink_to("/dev/zero")  # hashed, it would never end
    for name in ("fifo.safetensors", "zero.safetensors"):
        _rename_shard(m, name)
        with pytest.raises(ModelLoadError, match=rf"{name}: not a regular file"):
            weight_files(m)
        with pytest.raises(UsageError, match=rf"^model.pretrain_init .*{name}: not a regular file"):
            init_digest(str(m))
    _rename_shard(m, "gone.safetensors")
    with pytest.raises(ModelLoadError, match="shard 'gone.safetensors' is missing"):
        weight_files(m)


# ------------------------------------------------------------------------- 4. corruption / hangs
def test_5_a_second_sweep_into_one_directory_is_refused(tmp_path, capsys):
    out = tmp_path / "sweep"
    out.mkdir()
    spec = tmp_path / "s.yaml"
    spec.write_text("base: {preset: smoke}\ngrid: {run.seed: [0]}\n")
    fd = take_lock(out / "sweep.lock")  # another sweep holds it
    try:
        err = _err(["sweep", str(spec), "--out", str(out), "--quiet"], capsys)
    finally:
        os.close(fd)
    assert "in use by process" in err
    assert not (out / "index.parquet").exists()


def test_5b_deleting_a_held_sweep_lock_file_does_not_let_a_second_sweep_in(tmp_path, capsys):
    out = tmp_path / "sweep"
    out.mkdir()
    spec = tmp_path / "s.yaml"
    spec.write_text("base: {preset: smoke}\ngrid: {run.seed: [0]}\n")
    with held_folder_lock(out, "sweep.lock", busy=RuntimeError):  # another sweep holds it
        (out / "sweep.lock").unlink()  # someone deletes the lock file while it is held
        err = _err(["sweep", str(spec), "--out", str(out), "--quiet"], capsys)
        assert "is in use by process ? (another timlab sweep)" in err
        assert not (out / "index.parquet").exists()
    # released: the folder is free again
    with held_folder_lock(out, "sweep.lock", busy=RuntimeError):
        assert (out / "sweep.lock").read_text() == f"{os.getpid()}\n"


def test_7_an_interrupted_sweep_worker_starts_no_further_run(tmp_path, monkeypatch):
    from timlab.experiments.sweeps import workers as sweep_workers

    monkeypatch.setattr(sweep_workers, "_STOPPED", True)
    res = sweep_workers._run_job("r", resolve(preset="smoke"), str(tmp_path / "r"), "fresh")
    assert res["message"] == "not started: the sweep was interrupted" and not (tmp_path / "r").exists()


def test_7_sigterm_records_an_honest_status_and_resume_is_bitwise(tmp_path):
    sets = ["run.steps=40", "run.checkpoint_every=2", "run.eval_every=20"]
    flags = sum([["--set", s] for s in sets], [])
    ref = tmp_path / "ref"
    assert cli.main(["train", "--preset", "smoke", "--run-dir", str(ref), "--quiet", *flags]) == 0

    run = tmp_path / "term"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "timlab", "train", "--preset", "smoke", "--run-dir", str(run),
                             "--quiet", *flags], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    step = 0
    while time.time() < deadline and step < 3:  # status.json follows the run step by step
        try:
            step = json.loads((run / "status.json").read_text()).get("step", 0)
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    status = json.loads((run / "status.json").read_text())
    assert proc.returncode == 143, err
    assert status["state"] == "failed" and "SIGTERM" in status["message"] and 3 <= status["step"] < 40, status
    assert cli.main(["train", "--run-dir", str(run), "--resume", "--quiet"]) == 0
    pd.testing.assert_frame_equal(_metrics(ref), _metrics(run), check_exact=True)


def test_11_resume_refuses_an_edited_config(cosine_run, tmp_path, capsys):
    run = _copy(cosine_run, tmp_path)
    text = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(text.replace("lr: 0.0003", "lr: 0.001"))
    err = _err(["train", "--run-dir", str(run), "--resume", "--quiet"], capsys)
    assert "optim.lr: 0.0003 -> 0.001" in err
    (run / "config.yaml").write_text(text)
    err = _err(["train", "--run-dir", str(run), "--resume", "--quiet", "--set", "run.steps=8"], capsys)
    assert "run.steps 4 -> 8" in err and "cosine" in err
    assert (run / "config.yaml").read_text() == text


def test_11_resume_with_more_steps_records_them_in_config_yaml(tmp_path):
    run = tmp_path / "run"
    assert cli.main(["train", "--preset", "smoke", "--run-dir", str(run), "--quiet", "--set", "run.steps=2"]) == 0
    assert cli.main(["train", "--run-dir", str(run), "--resume", "--quiet", "--set", "run.steps=3"]) == 0
    assert "steps: 3" in (run / "config.yaml").read_text()


# ------------------------------------------------------------------------- 5. tracebacks
def test_step_abc_checkpoint_folders_are_ignored(tmp_path):
    (tmp_path / "step_abc").mkdir()
    (tmp_path / "step_000002").mkdir()
    (tmp_path / "step_٣").mkdir()  # a non-ASCII digit int() would accept
    assert [p.name for p in checkpoints_newest_first(tmp_path)] == ["step_000002"]


def test_device_meta_is_a_one_line_error(capsys):
    err = _err(["train", "--preset", "smoke", "--run-dir", "/nonexistent/x", "--quiet", "--set", "run.device=meta"],
               capsys)
    assert "run.device" in err


def test_damaged_index_parquet_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "index.parquet").write_bytes(b"PAR1 not really")
    err = _err(["runs", str(tmp_path)], capsys)
    assert "index.parquet" in err


def test_damaged_pretrain_json_rebuilds_the_cache_entry():
    from timlab.trainer.pretrain import ensure_warm_start

    cfg = resolve(preset="smoke", overrides=["model.pretrain_steps=3"])  # a cache entry of its own, cheap to build
    warm = Path(ensure_warm_start(cfg).path)
    (warm / "pretrain.json").write_text("{not json")
    with pytest.warns(UserWarning, match="damaged"):
        res = ensure_warm_start(cfg)
    assert not res.cached and json.loads((warm / "pretrain.json").read_text())["steps"] == 3


def test_pickle_payload_is_what_weights_only_false_would_run(tmp_path):
    """The attack in test_1 is real: the same file runs code under weights_only=False."""
    f = tmp_path / "s.pt"
    torch.save({"evil": _Payload(str(tmp_path / MARK))}, f)
    torch.load(f, weights_only=False)
    assert (tmp_path / MARK).exists()


def test_13_probe_prompts_split_at_newlines_only(tmp_path):
    from timlab.experiments.diagnostics.probe import _read_prompts

    f = tmp_path / "p.txt"
    f.write_text("a\x0bb\x0cc\u2028d\r\nsecond\n\n", encoding="utf-8")
    assert _read_prompts(f) == ["a\x0bb\x0cc\u2028d", "second"]


def test_mathtext_in_a_label_does_not_abort_a_plot():
    from timlab.experiments.reports.page import new_figure, png_uri

    fig = new_figure()
    ax = fig.add_subplot()
    ax.plot([0, 1], [0, 1], label=r"$\foo$ condition")
    ax.legend()
    ax.set_title(r"$\frac{x")
    assert png_uri(fig).startswith("data:image/png;base64,")


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_12_data_parallel_means_are_exact_with_uneven_shards(tmp_path):
    """3 prompts on 2 ranks: 8 and 4 sequences. The mean of 0/1 rewards over all 12 is k/12; the
    old mean of per-rank means, (a/8 + b/4)/2, is not."""
    run = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    # --standalone: the rendezvous takes a free port, so tests running side by side (xdist) never collide
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "-m", "timlab", "train", "--preset", "smoke", "--run-dir", str(run), "--quiet",
           "--set", "run.steps=4", "--set", "rollout.prompts_per_step=3", "--set", "optim.lr=3e-3"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rewards = pd.read_parquet(run / "metrics.parquet")["train/reward_mean"].dropna() * 12
    assert len(rewards) == 4 and ((rewards - rewards.round()).abs() < 1e-9).all(), rewards.tolist()


def test_non_utf8_parquet_column_name_is_a_one_line_error(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from timlab.experiments.diagnostics.analyze import AnalyzeError, analyze_file

    f = tmp_path / "x.parquet"
    pq.write_table(pa.table({"trainer_logprobs": [[-0.1]], "rollout_logprobs": [[-0.2]], "zqzq": [1]}), f)
    f.write_bytes(f.read_bytes().replace(b"zqzq", b"\xff\xfe\xff\xfe"))  # the name, in the schema and the footer
    with pytest.raises(AnalyzeError, match="not a readable Parquet file"):
        analyze_file(f)


def test_a_failed_checkpoint_write_is_a_one_line_error(tmp_path, monkeypatch):
    import errno

    from timlab.rundir import checkpoint

    def efbig(*args, **kwargs):
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(checkpoint.torch, "save", efbig)
    model = torch.nn.Linear(2, 2)
    monkeypatch.setattr(checkpoint, "save_model", lambda m, path, tokenizer_dir=None: Path(path).mkdir(parents=True))
    with pytest.raises(CheckpointError, match="writing checkpoint .*step_000003 failed .OSError: .*File too large"):
        checkpoint.save_checkpoint(tmp_path, 3, model, None, {"step": 3})
    assert list(tmp_path.iterdir()) == []  # no partial checkpoint left
