"""`timlab export`: a run's checkpoint as a plain HF folder (transformers loads it with timlab's
logits), and a run that starts RL from it (learn-then-inject)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from timlab.cli import main
from timlab.experiments.export import EXPORT_INFO, export_checkpoint
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
