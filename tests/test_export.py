"""`timlab export`: a run's checkpoint as a plain HF folder (transformers loads it with timlab's
logits), and a run that starts RL from it (learn-then-inject)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
import yaml
from safetensors.torch import load_file

from timlab.cli import main
from timlab.trainer.export import EXPORT_INFO, export_checkpoint
from timlab.model.forward import full_step, positions_from_valid
from timlab.model.hf_io import load_model


@pytest.fixture(scope="module")
def source_run(tmp_path_factory):
    """A 4-step smoke run with checkpoints at steps 2 and 4 (and evaluations at 0, 2, 4)."""
    run = tmp_path_factory.mktemp("export") / "src"
    assert main(["train", "--preset", "smoke", "--run-dir", str(run), "--quiet"]) == 0
    return run


def test_export_is_an_hf_folder_with_timlab_logits(source_run, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "exported"
    assert main(["export", str(source_run), "--step", "2", "--out", str(out)]) == 0
    assert "exported step 2" in capsys.readouterr().out
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", EXPORT_INFO} <= names
    assert not names & {"trainer_state.pt", "manifest.json"}  # the resume state stays behind
    ckpt = source_run / "checkpoints" / "step_000002"
    assert (out / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()
    assert json.loads((out / EXPORT_INFO).read_text())["step"] == 2

    ours = load_model(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, ours.config.vocab_size, (3, 12), generator=g)
    valid = torch.ones_like(tokens, dtype=torch.bool)
    valid[1, :4] = False  # left padding
    with torch.no_grad():
        ref = hf(input_ids=tokens, attention_mask=valid.long(), position_ids=positions_from_valid(valid)).logits
        got = ours(tokens, full_step(valid))
    assert float((ref[valid] - got[valid]).abs().max()) <= 1e-5
    assert float(got.abs().max()) > 1  # not trivially small logits
    # the tokenizer files load in transformers too
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    assert len(tok("12+34")["input_ids"]) > 0


def test_rl_starts_from_an_exported_policy(source_run, tmp_path):
    out = tmp_path / "learned"
    res = export_checkpoint(source_run, out)  # the latest checkpoint: step 4
    assert res.step == 4
    run = tmp_path / "from_export"
    assert main(["train", "--preset", "smoke", "--run-dir", str(run), "--quiet",
                 "--set", f"model.path={out}", "--set", "run.steps=2"]) == 0
    src = pd.read_parquet(source_run / "metrics.parquet").set_index("step")["val/accuracy"]
    new = pd.read_parquet(run / "metrics.parquet").set_index("step")["val/accuracy"]
    # the new run's step-0 evaluation is the source policy at step 4 (same task, same val set)
    assert new.loc[0] == src.loc[4]
    start = load_file(str(out / "model.safetensors"))
    after = load_file(str(run / "checkpoints" / "step_000002" / "model.safetensors"))
    assert start.keys() == after.keys()
    assert any(not torch.equal(start[k], after[k]) for k in start)  # and RL moved it


def test_export_step_0_is_the_warm_start_and_errors_are_one_line(source_run, tmp_path, capsys):
    res = export_checkpoint(source_run, tmp_path / "warm", step=0)
    assert res.step == 0
    assert not (tmp_path / "warm" / "trainer_state.pt").exists()
    assert main(["export", str(source_run), "--step", "3", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no checkpoint for step 3" in err and "available steps: 0, 2, 4" in err
    assert main(["export", str(source_run), "--out", str(tmp_path / "warm")]) == 2  # not empty
    assert "already exists" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "y")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


# ---------------------------------------------------------------------------- hostile inputs (issue 42)
def _copy_run(run, tmp_path):
    import shutil

    dst = tmp_path / "run"
    shutil.copytree(run, dst, symlinks=True)
    return dst


def test_42_1_export_copies_only_manifest_files_never_a_planted_symlink(source_run, tmp_path, capsys):
    """Finding 1: a symlink planted as a tokenizer file in the checkpoint never carries an outside
    file into the export; a symlink the manifest names fails the checkpoint's check; a step folder
    that is a symlink is refused."""
    import hashlib
    import os

    run = _copy_run(source_run, tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("outside the run\n")
    ckpt = run / "checkpoints" / "step_000004"
    (ckpt / "vocab.json").symlink_to(secret)  # not in the manifest
    (ckpt / "merges.txt").write_text("planted\n")  # a regular file, not in the manifest either
    out = tmp_path / "out"
    assert main(["export", str(run), "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    listed = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert names == sorted([*(n for n in listed if n != "trainer_state.pt"), EXPORT_INFO])
    assert "vocab.json" not in names and "merges.txt" not in names
    assert not any(p.is_symlink() for p in out.iterdir())
    assert "exported step 4" in capsys.readouterr().out

    # the manifest rewritten to name the symlink (with the outside file's true hash): refused
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["vocab.json"] = {"size": secret.stat().st_size,
                                       "sha256": hashlib.sha256(secret.read_bytes()).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    assert main(["export", str(run), "--step", "4", "--out", str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "vocab.json is missing" in err and "refusing to export" in err
    assert not (tmp_path / "out2").exists()

    # a step folder that is a symlink to a checkpoint elsewhere
    os.symlink(source_run / "checkpoints" / "step_000002", run / "checkpoints" / "step_000006")
    assert main(["export", str(run), "--step", "6", "--out", str(tmp_path / "out3")]) == 2
    assert "is a symlink" in capsys.readouterr().err
    assert not (tmp_path / "out3").exists()


def test_42_1_warm_start_export_refuses_a_symlink(source_run, tmp_path, capsys):
    """Step 0 (no manifest) copies regular files only."""
    import shutil

    warm = tmp_path / "warm"
    assert main(["export", str(source_run), "--step", "0", "--out", str(warm)]) == 0
    capsys.readouterr()
    start = tmp_path / "start"
    shutil.copytree(warm, start)
    (tmp_path / "secret.txt").write_text("outside\n")
    (start / "vocab.json").symlink_to(tmp_path / "secret.txt")
    run = tmp_path / "r"
    run.mkdir()
    cfg = yaml.safe_load((source_run / "config.yaml").read_text())
    cfg["model"]["path"] = str(start)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["export", str(run), "--step", "0", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "vocab.json is a symlink" in err
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.export-*"))


def test_42_2_export_never_deletes_a_folder_it_did_not_create(source_run, tmp_path):
    """Finding 2: the user's ``.tmp_OUT`` (the old scratch name) and any look-alike stay untouched."""
    mine = tmp_path / ".tmp_out"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious\n")
    res = export_checkpoint(source_run, tmp_path / "out", step=2)
    assert res.step == 2
    assert (mine / "notes.txt").read_text() == "precious\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp_out", "out"]  # no scratch folder left
    assert oct((tmp_path / "out").stat().st_mode & 0o777) != oct(0o700)  # an ordinary folder, not mkdtemp's


def test_42_3_two_exports_to_one_out_never_mix(source_run, tmp_path, monkeypatch):
    """Finding 3: a second export of another step finishes while the first is copying; the first
    then fails with one line, and the folder holds the second's step with that step's weights."""
    from timlab.errors import UsageError
    from timlab.trainer import export as export_mod
    from timlab.files import sha256_file

    out = tmp_path / "out"
    real_copy = export_mod._copy_file
    nested = []

    def copy_and_race(src, dst):
        if not nested:
            nested.append(None)
            nested[0] = export_checkpoint(source_run, out, step=4)  # the other process, start to end
        return real_copy(src, dst)

    monkeypatch.setattr(export_mod, "_copy_file", copy_and_race)
    with pytest.raises(UsageError, match="filled by another process"):
        export_checkpoint(source_run, out, step=2)
    assert nested[0].step == 4
    info = json.loads((out / EXPORT_INFO).read_text())
    assert info["step"] == 4
    want = json.loads((source_run / "checkpoints" / "step_000004" / "manifest.json").read_text())
    assert sha256_file(out / "model.safetensors") == info["model.safetensors sha256"] \
        == want["files"]["model.safetensors"]["sha256"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # both scratch folders gone


def test_42_3_a_file_changed_during_the_copy_is_refused(source_run, tmp_path, monkeypatch):
    """The bytes copied are hashed and must match the manifest the checkpoint was verified with."""
    from timlab.errors import UsageError
    from timlab.trainer import export as export_mod

    real_copy = export_mod._copy_file

    def copy_garbled(src, dst):
        digest = real_copy(src, dst)
        return "0" * 64 if src.name == "model.safetensors" else digest

    monkeypatch.setattr(export_mod, "_copy_file", copy_garbled)
    with pytest.raises(UsageError, match="changed while it was exported"):
        export_checkpoint(source_run, tmp_path / "out", step=4)
    assert list(tmp_path.iterdir()) == []


def test_42_16_export_without_step_warns_when_it_passes_over_a_damaged_checkpoint(source_run, tmp_path, capsys):
    """Finding 16: the latest checkpoint fails its checksum; export takes step 2 and says why."""
    run = _copy_run(source_run, tmp_path)
    weights = run / "checkpoints" / "step_000004" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 0
    cap = capsys.readouterr()
    assert "exported step 2" in cap.out
    assert cap.err.count("timlab: warning:") == 1
    assert f"checkpoint {weights.parent} is unusable (model.safetensors does not match its checksum)" in cap.err
    assert json.loads((tmp_path / "out" / EXPORT_INFO).read_text())["step"] == 2
