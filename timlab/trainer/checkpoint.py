"""Atomic checkpoints: an HF model folder plus everything needed to resume bit for bit.

``checkpoints/step_000025/`` holds ``config.json`` + ``model.safetensors`` (+ tokenizer files),
loadable by transformers, and ``trainer_state.pt`` (optimizer, scheduler, injector and every
RNG state, counters). The folder is written under a temporary name and renamed into place, and
``checkpoints/latest`` is updated atomically afterwards, so a kill at any moment leaves the
previous checkpoint intact.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from timlab.model.hf_io import save_model
from timlab.trainer.logging import atomic_write_text

STATE_FILE = "trainer_state.pt"


class CheckpointError(ValueError):
    """A missing or unreadable checkpoint; one-line message naming the path."""


def save_checkpoint(ckpt_root: Path, step: int, model, tokenizer_dir: str | None, state: dict, keep: int = 2) -> Path:
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f".tmp_step_{step:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    save_model(model, tmp, tokenizer_dir=tokenizer_dir)
    torch.save(state, tmp / STATE_FILE)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(ckpt_root / "latest", final.name + "\n")
    if keep > 0:
        done = sorted(p for p in ckpt_root.glob("step_*") if (p / STATE_FILE).exists())
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The newest complete checkpoint folder, or None if there is none."""
    pointer = ckpt_root / "latest"
    if pointer.exists():
        cand = ckpt_root / pointer.read_text().strip()
        if (cand / STATE_FILE).exists():
            return cand
    done = sorted(p for p in ckpt_root.glob("step_*") if (p / STATE_FILE).exists())
    return done[-1] if done else None


def load_state(ckpt: Path) -> dict:
    try:
        return torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=False)
    except Exception as e:  # corrupt or truncated file
        raise CheckpointError(f"checkpoint {ckpt} is unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
