"""One SFT warm start per settings: ``timlab pretrain --out DIR`` fills the cache that ``train``
and ``demo`` read (under $TIMLAB_CACHE), and copies the model to DIR; the test session itself
caches in a temporary folder, never in the user's ~/.cache/timlab."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

from timlab.cli import main
from timlab.config import resolve
from timlab.files import release_lock, take_lock
from timlab.trainer.pretrain import cache_root, ensure_warm_start, warm_start_dir

REPO = Path(__file__).resolve().parents[1]

SETTINGS = ["--preset", "smoke", "--set", "model.pretrain_steps=3", "--quiet"]


def test_pretrain_out_fills_the_cache_that_train_reads(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TIMLAB_CACHE", str(tmp_path / "cache"))
    cfg = resolve(preset="smoke", overrides=["model.pretrain_steps=3"])
    cache = warm_start_dir(cfg)
    assert cache.parent == tmp_path / "cache" / "pretrained" and not cache.exists()
    assert main(["pretrain", "--out", str(tmp_path / "a"), *SETTINGS]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"pretrained {tmp_path / 'a'}: ") and f"cached as {cache} (TIMLAB_CACHE)" in out
    weights = (cache / "model.safetensors").read_bytes()
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == weights
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(p.name for p in cache.iterdir())
    mtime = (cache / "model.safetensors").stat().st_mtime_ns

    start = ensure_warm_start(cfg)  # what `timlab train` starts from: the cached model, not a new SFT
    assert start.cached and start.path == cache
    assert main(["pretrain", "--out", str(tmp_path / "b"), *SETTINGS]) == 0
    assert capsys.readouterr().out.startswith(f"reused {tmp_path / 'b'}: ")
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == weights
    assert (cache / "model.safetensors").stat().st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "a.lock", "b", "b.lock", "cache"]


def test_the_test_session_caches_in_a_temporary_folder():
    from conftest import _OWN_CACHE, cache_note

    root = cache_root()
    assert root == Path(os.environ["TIMLAB_CACHE"])
    if _OWN_CACHE:  # the usual case (make test): not the user's cache, and the run says where
        assert root.parent == Path(tempfile.gettempdir()) and root.name.startswith("timlab-test-cache-")
        assert cache_note() == (f"timlab: SFT warm starts cached in {root} (TIMLAB_CACHE: "
                                                      "a temporary folder, deleted at the end)")


BUILD = """
import json, sys
from timlab.config import resolve
from timlab.trainer.pretrain import pretrain
cfg = resolve(preset="smoke", overrides=["model.pretrain_steps=3"])
print("ready", flush=True)
res = pretrain(cfg)
print(json.dumps({"cached": res.cached, "path": str(res.path)}), flush=True)
"""


def test_two_processes_that_need_one_warm_start_at_once_build_it_once(tmp_path, monkeypatch):
    """What test workers running side by side (pytest -n 2) rely on: while the entry's lock is
    held, both processes wait; then one trains and the other reuses its complete folder."""
    monkeypatch.setenv("TIMLAB_CACHE", str(tmp_path / "cache"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cache = warm_start_dir(resolve(preset="smoke", overrides=["model.pretrain_steps=3"]))
    cache.parent.mkdir(parents=True)
    lock = take_lock(cache.with_name(cache.name + ".lock"))  # both builders start while it is held
    procs = [subprocess.Popen([sys.executable, "-c", BUILD], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        assert [p.stdout.readline() for p in procs] == ["ready\n"] * 2
        time.sleep(1.0)  # both reach the lock (had one not yet, the outcome below would be the same)
        assert not cache.exists()
    finally:
        release_lock(lock)
    results = [json.loads(p.communicate(timeout=300)[0]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert sorted(r["cached"] for r in results) == [False, True] and {r["path"] for r in results} == {str(cache)}
    assert sorted(p.name for p in cache.parent.iterdir()) == [cache.name, cache.name + ".lock"]  # no partial folder
    assert json.loads((cache / "pretrain.json").read_text())["steps"] == 3


def test_a_warm_start_made_with_other_bits_is_reused_with_a_warning(tmp_path, monkeypatch):
    """The cache key is the settings; a model built on a machine of another fingerprint (another CPU,
    or the same one with other MKL/oneDNN settings) is another model than this machine builds. It is
    reused (never replaced under concurrent runs), with a warning naming both fingerprints and
    --force; --force builds it here and records this machine's fingerprint."""
    from timlab.machine import fingerprint

    monkeypatch.setenv("TIMLAB_CACHE", str(tmp_path / "cache"))
    cfg = resolve(preset="smoke", overrides=["model.pretrain_steps=3"])
    first = ensure_warm_start(cfg)
    info = json.loads((first.path / "pretrain.json").read_text())
    assert not first.cached and info["fingerprint"] == fingerprint()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same machine: reused without a word
        assert ensure_warm_start(cfg).cached
    (first.path / "pretrain.json").write_text(json.dumps({**info, "fingerprint": "0123456789ab"}))
    with pytest.warns(UserWarning, match=f"fingerprint 0123456789ab, here {fingerprint()}\\): reused as it is; "
                                         "`timlab pretrain --force` builds it"):
        assert ensure_warm_start(cfg).cached
    assert main(["pretrain", *SETTINGS, "--force"]) == 0
    assert json.loads((first.path / "pretrain.json").read_text())["fingerprint"] == fingerprint()
    del info["fingerprint"]  # made before fingerprints were recorded: reused, as before
    (first.path / "pretrain.json").write_text(json.dumps(info))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ensure_warm_start(cfg).cached
