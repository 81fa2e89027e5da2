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

The checkpoint must pass its manifest check, and only files its manifest names are copied: a
file planted in the checkpoint folder after it was written is left behind, and a symlink is never
followed (a checkpoint whose manifest names one fails its check; a ``step_N`` folder that is a
symlink is refused). Each file is hashed as it is copied and must
match the manifest, so a file swapped in the meantime is refused too. Without ``--step`` the
latest checkpoint that passes is exported, and each newer one passed over is named in a warning.
Step 0 (a warm start: no manifest) copies regular files only; a symlink there is refused.

The output folder must not exist yet (or be empty). The export writes a scratch folder of its
own, created beside ``--out`` (``.OUT.export-XXXXXXXX``, unique per process, so two exports never
share one and no folder of the user's is ever deleted) and renames it into place in one step: if
another export filled ``--out`` meanwhile, this one fails with one line and removes only its own
scratch folder.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from timlab.errors import UsageError
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


def _source(run_dir: Path, step: int | None) -> tuple[Path, int, dict[str, str] | None]:
    """(folder to copy, its step, the SHA-256 its manifest records per file): a verified
    checkpoint, or the run's warm start for step 0 (no manifest: None)."""
    from timlab.config import load_run_config
    from timlab.rundir.checkpoint import MANIFEST, CheckpointError, run_checkpoint, verify_checkpoint
    from timlab.trainer.pretrain import warm_start_dir

    ckpt = run_checkpoint(run_dir, step)
    if ckpt is not None:
        bad = verify_checkpoint(ckpt)
        if bad is not None:
            raise CheckpointError(f"{ckpt}: {bad}; refusing to export a damaged checkpoint")
        files = json.loads((ckpt / MANIFEST).read_text(encoding="utf-8"))["files"]  # verified just above
        return ckpt, int(ckpt.name.split("_", 1)[1]), {name: want["sha256"] for name, want in files.items()}
    cfg = load_run_config(run_dir)
    warm = Path(cfg.model.path) if cfg.model.path else warm_start_dir(cfg)
    if not (warm / "config.json").exists():
        raise FileNotFoundError(f"{run_dir}: the warm start {warm} is gone (no config.json); export a later step")
    return warm, 0, None


def _copy_file(src: Path, dst: Path) -> str:
    """Copy the regular file ``src`` (never through a symlink, never a FIFO or device) to the new
    file ``dst``; return the SHA-256 of the bytes copied."""
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UsageError(f"{src} is a symlink; export copies regular files only") from None
        raise
    h = hashlib.sha256()
    with os.fdopen(fd, "rb") as f, open(dst, "xb") as g:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise UsageError(f"{src} is not a regular file; export copies regular files only")
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            g.write(block)
    return h.hexdigest()


def _scratch_folder(out: Path) -> Path:
    """A new, empty folder of this process's own beside ``out``, with the permissions a plain
    ``mkdir`` would give it (``mkdtemp`` makes it private)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp


def export_checkpoint(run_dir: str | Path, out_dir: str | Path, step: int | None = None) -> ExportResult:
    """Copy run ``run_dir``'s checkpoint of ``step`` (None: the latest; 0: the warm start) to
    ``out_dir`` as an HF model folder (see the module docstring)."""
    run_dir, out = Path(run_dir), Path(out_dir)
    if step is not None and step < 0:
        raise UsageError(f"--step must be >= 0, got {step}")
    if out.is_symlink() or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
        raise UsageError(f"--out {out} already exists and is not an empty folder; choose a new path")
    src, got_step, manifest = _source(run_dir, step)
    wanted = (*MODEL_FILES, *TOKENIZER_FILES)
    if manifest is not None:  # a checkpoint: exactly the model files its manifest names
        names = [n for n in wanted if n in manifest]
    else:  # the warm start: the model files it has (a symlink among them is refused when copied)
        names = [n for n in wanted if (src / n).is_file() or (src / n).is_symlink()]
    if "model.safetensors" not in names:
        raise UsageError(f"{src}: no model.safetensors to export")
    load_model(src)  # refuses (one line) a folder that is not a loadable model before anything is written
    tmp = _scratch_folder(out)
    try:
        sums = {}
        for name in names:
            sums[name] = _copy_file(src / name, tmp / name)
            if manifest is not None and sums[name] != manifest[name]:
                raise UsageError(f"{src / name} changed while it was exported (it no longer matches the "
                                 "checkpoint's manifest); nothing was written")
        info = {"run_dir": str(run_dir.resolve()), "step": got_step, "source": str(src.resolve()),
                "model.safetensors sha256": sums["model.safetensors"]}
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=1) + "\n")
        try:
            os.rename(tmp, out)  # atomic; replaces an empty folder, fails on a filled one
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise UsageError(f"--out {out} was filled by another process during the export; nothing was "
                                 "written: choose a new path") from None
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # our own scratch folder, made by mkdtemp above
        raise
    return ExportResult(out, src, got_step, tuple(names))


__all__ = ["export_checkpoint", "ExportResult", "MODEL_FILES", "EXPORT_INFO"]
