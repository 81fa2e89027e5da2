"""``model.pretrain_init``: an SFT warm start that continues from another model folder.

Tiny smoke-preset models, a few SFT steps, one thread. The warm starts are cached in the test
session's own folder (conftest); each test that builds one points TIMLAB_CACHE at its tmp_path.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from timlab.cli import main
from timlab.config import resolve, validate
from timlab.errors import TimlabError
from timlab.model.hf_io import load_model
from timlab.tokenizer import save_char_tokenizer
from timlab.trainer.pretrain import pretrain, warm_start_dir, warm_start_key

SMOKE = ["model.pretrain_steps=3"]


def smoke(*overrides: str, init: Path | str | None = None):
    return resolve(preset="smoke", overrides=[*SMOKE, *overrides, *([f"model.pretrain_init={init}"] if init else [])])


@pytest.fixture(scope="module")
def init_dir(tmp_path_factory) -> Path:
    """A smoke warm start (reverse, 3 SFT steps), written with ``--out``: the init of these tests."""
    root = tmp_path_factory.mktemp("init")
    mp = pytest.MonkeyPatch()
    mp.setenv("TIMLAB_CACHE", str(root / "cache"))
    try:
        return pretrain(smoke(), root / "a").path
    finally:
        mp.undo()


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


# Computed with main's code before model.pretrain_init existed (commit 2880e5c): existing caches and
# the start hashes of committed runs must keep their keys.
KEYS_BEFORE = {"default": "778bdad1b0d6", "surge": "b1c93a747d88", "smoke": "5e781b0b64f3", "demo": "8224424fa7c7",
               "surge_moe": "7ab8b93730fc"}


@pytest.mark.parametrize("preset", sorted(KEYS_BEFORE))
def test_the_key_of_a_config_without_init_is_unchanged(preset):
    assert warm_start_key(resolve(preset=preset)) == KEYS_BEFORE[preset]
    assert warm_start_key(resolve(preset=preset, overrides=["model.pretrain_init="])) == KEYS_BEFORE[preset]


def test_the_key_of_a_long_answer_config_without_init_is_unchanged():
    cfg = resolve(preset="surge", overrides=["task.kwargs.restate=31", "task.kwargs.scratch_frac=1.0"])
    assert warm_start_key(cfg) == "f7e15a2216f1"


def test_continuing_from_a_model_starts_from_its_weights_and_repeats_bit_for_bit(init_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TIMLAB_CACHE", str(tmp_path / "cache"))
    scratch = pretrain(smoke(), tmp_path / "scratch")  # the same SFT from a random init
    cont = pretrain(smoke(init=init_dir), tmp_path / "cont")
    assert not cont.cached and cont.steps == 3
    w_init, w_scratch, w_cont = weights(init_dir), weights(scratch.path), weights(cont.path)
    assert w_init.keys() == w_scratch.keys() == w_cont.keys()
    # the random-init SFT of these settings repeats the init itself (same seed, same batches)...
    assert all(torch.equal(w_scratch[k], w_init[k]) for k in w_init)
    # ...continuing from it is 3 more steps: different weights, within a few steps' reach of the init
    moved = max((w_cont[k] - w_init[k]).abs().max().item() for k in w_init)
    assert 1e-4 < moved < 0.1

    first = (cont.path / "model.safetensors").read_bytes()
    again = pretrain(smoke(init=init_dir), tmp_path / "again", force=True)  # trains again, from the same init
    assert not again.cached
    assert (again.path / "model.safetensors").read_bytes() == first


def test_the_continued_model_differs_from_a_random_init_of_its_own_settings(init_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TIMLAB_CACHE", str(tmp_path / "cache"))
    # pretrain_seed 1: the init (seed 0's model) is not this config's random-init model
    scratch = pretrain(smoke("model.pretrain_seed=1"), tmp_path / "scratch")
    cont = pretrain(smoke("model.pretrain_seed=1", init=init_dir), tmp_path / "cont")
    w_scratch, w_cont, w_init = weights(scratch.path), weights(cont.path), weights(init_dir)
    gap = lambda a, b: max((a[k] - b[k]).abs().max().item() for k in a)  # noqa: E731
    assert gap(w_cont, w_scratch) > 0.02  # the two starts differ by about the init scale (std 0.02)
    assert gap(w_cont, w_init) < gap(w_scratch, w_init)  # the continued model stays near its init


def test_the_key_follows_the_weights_not_the_path(init_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TIMLAB_CACHE", str(tmp_path / "cache"))
    key = warm_start_key(smoke(init=init_dir))
    assert key != warm_start_key(smoke())
    copy = Path(shutil.copytree(init_dir, tmp_path / "copy"))
    assert warm_start_key(smoke(init=copy)) == key
    moved = copy.rename(tmp_path / "moved")
    assert warm_start_key(smoke(init=moved)) == key
    monkeypatch.chdir(tmp_path)
    assert warm_start_key(smoke(init="moved")) == key  # a relative path

    built = pretrain(smoke(init=init_dir))
    assert built.path == warm_start_dir(smoke(init=moved)) and built.path.name == f"reverse-{key}"
    reused = pretrain(smoke(init=moved))  # the moved folder's weights are the same: the cached start is reused
    assert reused.cached and reused.path == built.path

    w = weights(moved)
    w["lm_head.weight"][0, 0] += 1e-3  # another init: another key, another cached start
    from safetensors.torch import save_file

    save_file(w, str(moved / "model.safetensors"), metadata={"format": "pt"})
    assert warm_start_key(smoke(init=moved)) not in (key, warm_start_key(smoke()))
    assert not pretrain(smoke(init=moved)).cached


def test_the_warm_start_records_its_init_with_its_sha256(init_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TIMLAB_CACHE", str(tmp_path / "cache"))
    sha = hashlib.sha256((init_dir / "model.safetensors").read_bytes()).hexdigest()
    assert main(["pretrain", "--preset", "smoke", "--set", "model.pretrain_steps=3", "--set",
                 f"model.pretrain_init={init_dir}", "--out", str(tmp_path / "b"), "--quiet"]) == 0
    assert f"continued from model.pretrain_init {init_dir} (model.safetensors SHA-256 {sha[:16]}...)" in \
        capsys.readouterr().out
    info = json.loads((tmp_path / "b" / "pretrain.json").read_text())
    parent = json.loads((init_dir / "pretrain.json").read_text())
    assert info["init"] == {"path": str(init_dir), "sha256": {"model.safetensors": sha},
                            "pretrain": {"key": parent["key"], "task": "reverse", "task_kwargs": parent["task_kwargs"],
                                         "val_accuracy": parent["val_accuracy"]}}
    assert info["model"]["pretrain_init"] == str(init_dir)
    assert info["key"] == warm_start_key(smoke(init=init_dir)) != parent["key"]

    # a second stage from that model: its record names the whole chain
    c = pretrain(smoke("model.pretrain_steps=2", init=tmp_path / "b"), tmp_path / "c").path
    chain = json.loads((c / "pretrain.json").read_text())["init"]
    assert chain["pretrain"]["key"] == info["key"] and chain["pretrain"]["init"] == info["init"]


def _error(cfg) -> str:
    with pytest.raises(TimlabError) as e:
        validate(cfg)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_errors_name_the_field_for_a_missing_or_empty_folder(init_dir, tmp_path):
    missing = tmp_path / "nope"
    assert _error(smoke(init=missing)) == f"model.pretrain_init {missing}: no such folder"
    (tmp_path / "file").write_text("x")
    assert _error(smoke(init=tmp_path / "file")).startswith(f"model.pretrain_init {tmp_path / 'file'}: not a folder")
    (tmp_path / "empty").mkdir()
    assert _error(smoke(init=tmp_path / "empty")) == (
        f"model.pretrain_init {tmp_path / 'empty'}: no model.safetensors, model.safetensors.index.json or "
        "pytorch_model.bin")
    no_config = Path(shutil.copytree(init_dir, tmp_path / "no_config"))
    (no_config / "config.json").unlink()
    assert _error(smoke(init=no_config)) == f"model.pretrain_init {no_config}: no config.json (not a model folder)"
    assert _error(smoke(f"model.path={init_dir}", init=init_dir)).startswith(
        f"model.pretrain_init={str(init_dir)!r} with model.path={str(init_dir)!r}: RL starts from model.path")


@pytest.mark.parametrize("override, field, got, want", [
    ("model.hidden_size=64", "hidden_size", 48, "the config's model.hidden_size is 64"),
    ("model.num_layers=3", "num_hidden_layers", 2, "the config's model.num_layers is 3"),
    ("model.num_heads=6", "num_attention_heads", 4, "the config's model.num_heads is 6"),
    ("model.num_kv_heads=4", "num_key_value_heads", 2, "the config's model.num_kv_heads is 4"),
    ("model.intermediate_size=64", "intermediate_size", 96, "the config's model.intermediate_size is 64"),
    ("model.model_type=qwen3", "model_type", "'llama'", "the config's model.model_type is 'qwen3'"),
])
def test_an_architecture_mismatch_names_the_field_and_both_values(init_dir, override, field, got, want):
    assert _error(smoke(override, init=init_dir)) == (
        f"model.pretrain_init {init_dir}: {field}={got} in its config.json, but {want}; "
        "the init must have the warm start's architecture")


def test_a_vocabulary_mismatch_names_the_alphabet(init_dir, tmp_path):
    # reverse's alphabet (38 characters + 4 specials) is not addition's (15 + 4)
    assert _error(smoke("task.name=addition", init=init_dir)) == (
        f"model.pretrain_init {init_dir}: vocab_size=42 in its config.json, but task 'addition''s alphabet gives "
        "19 tokens (its characters and 4 special tokens)")
    # copy has reverse's alphabet: a reverse model is a valid init for it
    validate(smoke("task.name=copy", init=init_dir))
    # the same size, other characters: its tokenizer says so
    other = Path(shutil.copytree(init_dir, tmp_path / "other"))
    save_char_tokenizer("0123456789:=ABCDEFGHIJKLMNOPQRSTUVWXYZ", other)
    assert _error(smoke(init=other)) == (
        f"model.pretrain_init {other}: its tokenizer differs from task 'reverse''s alphabet: 'a' is absent there, "
        "id 16 here")


def test_the_cli_refuses_a_bad_init_in_one_line_and_an_out_that_is_the_init(init_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TIMLAB_CACHE", str(tmp_path / "cache"))
    args = ["pretrain", "--preset", "smoke", "--set", "model.pretrain_steps=3", "--quiet"]
    assert main([*args, "--set", "model.hidden_size=64", "--set", f"model.pretrain_init={init_dir}"]) == 2
    assert capsys.readouterr().err == (f"timlab: error: model.pretrain_init {init_dir}: hidden_size=48 in its "
                                       "config.json, but the config's model.hidden_size is 64; the init must have the "
                                       "warm start's architecture\n")
    out = Path(shutil.copytree(init_dir, tmp_path / "same"))
    before = (out / "model.safetensors").read_bytes()
    assert main([*args, "--set", f"model.pretrain_init={out}", "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith(f"timlab: error: --out {out} is model.pretrain_init: the SFT would "
                                              "replace the model it starts from")
    assert (out / "model.safetensors").read_bytes() == before
    assert not list((tmp_path / "cache").rglob("model.safetensors"))  # both refused before any SFT


def test_a_model_written_by_transformers_loads_as_init(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("TIMLAB_CACHE", str(tmp_path / "cache"))
    cfg = smoke(init=tmp_path / "hf")
    hf_cfg = transformers.LlamaConfig(vocab_size=42, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(7)
    hf = transformers.LlamaForCausalLM(hf_cfg)
    hf.save_pretrained(tmp_path / "hf")  # a model alone: no tokenizer in the folder
    validate(cfg)

    from timlab.model.llama import CausalLM
    from timlab.trainer.pretrain_init import load_init

    ours = CausalLM(load_model(tmp_path / "hf").config)
    load_init(ours, str(tmp_path / "hf"))
    theirs = hf.state_dict()
    assert all(torch.equal(t, theirs[k]) for k, t in ours.state_dict().items())

    res = pretrain(cfg, tmp_path / "out")
    info = json.loads((res.path / "pretrain.json").read_text())
    sha = hashlib.sha256((tmp_path / "hf" / "model.safetensors").read_bytes()).hexdigest()
    assert info["init"] == {"path": str(tmp_path / "hf"), "sha256": {"model.safetensors": sha}}
    moved = max((weights(res.path)[k] - theirs[k]).abs().max().item() for k in theirs)
    assert 1e-4 < moved < 0.1  # 3 SFT steps from transformers' weights
    assert load_model(res.path).config.max_position_embeddings >= 32  # the warm start's context, not the init's


def test_a_run_starts_from_a_curriculum_start_like_any_start(init_dir, tmp_path, monkeypatch):
    from timlab.trainer.export import export_checkpoint
    from timlab.rundir import read_status

    monkeypatch.setenv("TIMLAB_CACHE", str(tmp_path / "cache"))
    start = pretrain(smoke(init=init_dir), tmp_path / "start")
    run = tmp_path / "run"
    assert main(["train", "--preset", "smoke", "--run-dir", str(run), "--quiet", "--set", f"model.path={start.path}",
                 "--set", "run.steps=2"]) == 0
    status = read_status(run)
    assert (status["state"], status["step"]) == ("finished", 2)
    export_checkpoint(run, tmp_path / "step0", step=0)  # the run's own record of what it started from
    assert (tmp_path / "step0" / "model.safetensors").read_bytes() == (start.path / "model.safetensors").read_bytes()


def test_a_sharded_or_pickled_init_is_hashed_file_by_file_and_loads_the_same_weights(tmp_path):
    transformers = pytest.importorskip("transformers")
    from timlab.model.llama import CausalLM
    from timlab.trainer.pretrain_init import init_digest, load_init

    hf_cfg = transformers.LlamaConfig(vocab_size=42, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                                      tie_word_embeddings=False)
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(hf_cfg)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 1
    sums = init_digest(str(tmp_path / "sharded"))
    assert list(sums) == ["model.safetensors.index.json", *shards]
    assert sums[shards[0]] == hashlib.sha256((tmp_path / "sharded" / shards[0]).read_bytes()).hexdigest()

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(tmp_path / "sharded" / "config.json", pickled)
    torch.save(hf.state_dict(), pickled / "pytorch_model.bin")
    assert list(init_digest(str(pickled))) == ["pytorch_model.bin"]

    theirs = hf.state_dict()
    for folder in ("sharded", "pickled"):
        validate(smoke(init=tmp_path / folder))
        ours = CausalLM(load_model(tmp_path / folder).config)
        load_init(ours, str(tmp_path / folder))
        assert all(torch.equal(t, theirs[k]) for k, t in ours.state_dict().items())
    assert warm_start_key(smoke(init=tmp_path / "sharded")) != warm_start_key(smoke(init=pickled))
