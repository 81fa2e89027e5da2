"""Atomic, verified checkpoints: an HF model folder plus everything needed to resume bit for bit.

``checkpoints/step_000025/`` holds ``config.json`` + ``model.safetensors`` (+ tokenizer files),
loadable by transformers, ``trainer_state.pt`` (optimizer, scheduler, injector and every RNG
state, counters) and, written last, ``manifest.json``: the size and SHA-256 of every other file.
The folder is written under a temporary name and renamed into place, and ``checkpoints/latest``
is updated atomically afterwards, so a kill at any moment leaves the previous checkpoint intact.
A checkpoint whose files do not match its manifest (a damaged disk, a hand edit), or that has no
manifest, is refused by ``verify_checkpoint``, and a resume falls back to the newest one that passes.

Loading is data-only: ``trainer_state.pt`` is read with ``torch.load(..., weights_only=True)``
(tensors, numbers, strings and containers; no pickled code), so a planted file can make a resume
fail but never run code. The model itself is safetensors.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch

from timlab.errors import TimlabError, disk_full, is_disk_full, out_of_space
from timlab.files import atomic_write_text, sha256_file
from timlab.model.hf_io import save_model
from timlab.rundir import LATEST, STEP_PREFIX, RunDir, checkpoint_name, checkpoint_step

STATE_FILE = "trainer_state.pt"
MANIFEST = "manifest.json"


class CheckpointError(TimlabError, ValueError):
    """A missing or unreadable checkpoint; one-line message naming the path."""


def _write_manifest(folder: Path, step: int) -> None:
    files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    atomic_write_text(folder / MANIFEST, json.dumps({"step": step, "files": files}, indent=1))


def verify_checkpoint(ckpt: Path) -> str | None:
    """None when ``ckpt`` is complete and matches its manifest, else why not (one line). A
    checkpoint without a manifest is refused: timlab writes the manifest last, so its absence
    means an interrupted write or a folder timlab did not write."""
    ckpt = Path(ckpt)
    if not (ckpt / MANIFEST).is_file():
        return f"no {MANIFEST}"
    try:
        files = json.loads((ckpt / MANIFEST).read_text(encoding="utf-8"))["files"]
        if not isinstance(files, dict) or not all(isinstance(w, dict) for w in files.values()):
            raise TypeError("files is not a mapping of mappings")
    except (OSError, ValueError, KeyError, TypeError):
        return f"unreadable {MANIFEST}"
    for name in (STATE_FILE, "config.json", "model.safetensors"):
        if name not in files:
            return f"{MANIFEST} does not list {name}"
    for name, want in files.items():
        p = ckpt / name
        if "/" in name or name in (".", "..") or p.is_symlink() or not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != want.get("size"):
            return f"{name} has {p.stat().st_size} bytes, the manifest says {want['size']}"
        if sha256_file(p) != want["sha256"]:
            return f"{name} does not match its checksum"
    return None


def save_checkpoint(ckpt_root: Path, step: int, model, tokenizer_dir: str | None, state: dict, keep: int = 2) -> Path:
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / checkpoint_name(step)
    tmp = ckpt_root / checkpoint_name(step, temporary=True)
    try:
        if tmp.exists():
            shutil.rmtree(tmp)  # ours: a checkpoint write a kill interrupted
        save_model(model, tmp, tokenizer_dir=tokenizer_dir)
        torch.save(state, tmp / STATE_FILE)
        _write_manifest(tmp, step)
    except Exception as e:
        full = is_disk_full(e) or out_of_space(tmp)  # before our partial files are removed
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise disk_full(tmp) from None
        if isinstance(e, (OSError, RuntimeError)) and not isinstance(e, TimlabError):  # EFBIG, EIO, a quota
            text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"writing checkpoint {final} failed ({type(e).__name__}: {text[:200]})") from e
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(ckpt_root / LATEST, final.name + "\n")
    if keep > 0:
        done = [p for p in checkpoints_newest_first(ckpt_root) if (p / STATE_FILE).exists()]
        for old in done[keep:]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoints_newest_first(ckpt_root: Path) -> list[Path]:
    """step_* folders under ``ckpt_root``, newest step first (not yet verified)."""
    found = []
    for p in Path(ckpt_root).glob(STEP_PREFIX + "*"):
        step = checkpoint_step(p.name)
        if step is not None and p.is_dir() and not p.is_symlink():
            found.append((step, p))
    return [p for _, p in sorted(found, reverse=True)]


def latest_checkpoint(ckpt_root: Path, *, warn: bool = False) -> Path | None:
    """The newest checkpoint folder that passes ``verify_checkpoint``, or None if there is none.
    ``warn``: name each newer checkpoint passed over, and why, in a warning (as a resume does)."""
    for p in checkpoints_newest_first(ckpt_root):
        problem = verify_checkpoint(p)
        if problem is None:
            return p
        if warn:
            warnings.warn(f"checkpoint {p} is unusable ({problem}); passing over it to an older one", stacklevel=2)
    return None


def load_state(ckpt: Path) -> dict:
    """A checkpoint's trainer state, data only (``weights_only=True``: no pickled code runs)."""
    try:
        state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise TypeError(f"a {type(state).__name__}, not a mapping")
        return state
    except Exception as e:  # corrupt, truncated, or holding objects other than data
        raise CheckpointError(f"checkpoint {ckpt} is unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def run_checkpoint(run_dir: str | Path, step: int | None = None) -> Path | None:
    """The checkpoint folder of a run: the latest one that verifies (step None; each newer one passed
    over is named in a warning), ``step_N``, or None for step 0 (the warm start the run began
    from). Missing pieces are one-line errors."""
    d = RunDir(run_dir)
    if not d.path.is_dir():
        raise FileNotFoundError(f"run directory {d.path} does not exist")
    if not d.config.exists():
        raise FileNotFoundError(f"{d.path}: no config.yaml (not a timlab run directory)")
    if step == 0:
        return None
    if step is None:
        ckpt = latest_checkpoint(d.checkpoints, warn=True)
        if ckpt is None:
            raise CheckpointError(f"{d.path}: no complete checkpoint under checkpoints/ (use --step 0 for the warm start)")
        return ckpt
    ckpt = d.checkpoint(step)
    if ckpt.is_symlink():
        raise CheckpointError(f"{ckpt} is a symlink, not a checkpoint folder timlab wrote")
    if not (ckpt / "config.json").exists():
        available = sorted(checkpoint_step(p.name) for p in checkpoints_newest_first(d.checkpoints)
                           if (p / "config.json").exists())
        raise CheckpointError(f"{d.path}: no checkpoint for step {step}; available steps: "
                              f"{', '.join(map(str, [0, *available]))}")
    return ckpt
