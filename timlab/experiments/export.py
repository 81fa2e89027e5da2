"""Export a run's checkpoint as an ordinary HF model folder, to start new runs from a learned policy.

    timlab export RUN_DIR --step N --out DIR
    timlab train --preset surge --set model.path=DIR ...     # RL from the learned policy

A checkpoint (``RUN_DIR/checkpoints/step_N``) is already an HF folder plus timlab's resume state
(``trainer_state.pt``, ``manifest.json``). The export copies the model files byte for byte
(``config.json``, ``generation_config.json``, ``model.safetensors`` and the tokenizer files timlab
writes for model folders), leaves the resume state behind, and adds ``timlab_export.json`` (which
run and step it came from, and the weights' SHA-256). So the folder loads in ``transformers``
(``AutoModelForCausalLM.from_pretrained``) and in timlab with the same logits as the run's policy
at step N, and ``model.path=DIR`` starts RL there (learn-then-inject: inject a mismatch only
into a policy that has already learned). Step 0 exports the warm start the run began from.

The checkpoint must pass its manifest check, the output folder must not exist yet (or be
empty), and the folder is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from timlab.errors import UsageError
from timlab.files import sha256_file
from timlab.model.hf_io import TOKENIZER_FILES, load_model

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors")
"""The model files an export copies (plus whichever of ``TOKENIZER_FILES`` the source has)."""
EXPORT_INFO = "timlab_export.json"
"""Provenance file written into the exported folder (ignored by transformers)."""


@dataclass(frozen=True)
class ExportResult:
    """Where an export went and what it holds."""

    path: Path
    """The exported HF model folder."""
    source: Path
    """The checkpoint folder (or the warm-start folder for step 0) it was copied from."""
    step: int
    """The training step of the exported weights (0: the warm start)."""
    files: tuple[str, ...]
    """The files copied (model and tokenizer files; ``timlab_export.json`` comes on top)."""


def _source(run_dir: Path, step: int | None) -> tuple[Path, int]:
    """(folder to copy, its step): a verified checkpoint, or the run's warm start for step 0."""
    from timlab.config import load_run_config
    from timlab.rundir.checkpoint import CheckpointError, run_checkpoint, verify_checkpoint
    from timlab.trainer.pretrain import warm_start_dir

    ckpt = run_checkpoint(run_dir, step)
    if ckpt is not None:
        bad = verify_checkpoint(ckpt)
        if bad is not None:
            raise CheckpointError(f"{ckpt}: {bad}; refusing to export a damaged checkpoint")
        return ckpt, int(ckpt.name.split("_", 1)[1])
    cfg = load_run_config(run_dir)
    warm = Path(cfg.model.path) if cfg.model.path else warm_start_dir(cfg)
    if not (warm / "config.json").exists():
        raise FileNotFoundError(f"{run_dir}: the warm start {warm} is gone (no config.json); export a later step")
    return warm, 0


def export_checkpoint(run_dir: str | Path, out_dir: str | Path, step: int | None = None) -> ExportResult:
    """Copy run ``run_dir``'s checkpoint of ``step`` (None: the latest; 0: the warm start) to
    ``out_dir`` as an HF model folder (see the module docstring)."""
    run_dir, out = Path(run_dir), Path(out_dir)
    if step is not None and step < 0:
        raise UsageError(f"--step must be >= 0, got {step}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out} already exists and is not an empty folder; choose a new path")
    src, got_step = _source(run_dir, step)
    load_model(src)  # refuses (one line) a folder that is not a loadable model before anything is written
    names = [n for n in (*MODEL_FILES, *TOKENIZER_FILES) if (src / n).is_file()]
    if "model.safetensors" not in names:
        raise UsageError(f"{src}: no model.safetensors to export")
    tmp = out.parent / f".tmp_{out.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        for name in names:
            shutil.copyfile(src / name, tmp / name)
        info = {"run_dir": str(run_dir.resolve()), "step": got_step, "source": str(src.resolve()),
                "model.safetensors sha256": sha256_file(tmp / "model.safetensors")}
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=1) + "\n")
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(out, src, got_step, tuple(names))


__all__ = ["export_checkpoint", "ExportResult", "MODEL_FILES", "EXPORT_INFO"]
