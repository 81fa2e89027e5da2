"""The run directory: its layout, states and lock (``RunDir``), its checkpoints and its metrics log.

This package owns every file name a run writes and imports nothing of timlab above ``files``,
``errors`` and ``model`` (the checkpoint writes an HF model folder):

- ``timlab.rundir`` (here): ``RunDir``, the layout below, the run states, ``read_metrics``;
- ``timlab.rundir.checkpoint``: atomic, verified checkpoints (manifest, resume state);
- ``timlab.rundir.metrics_log``: ``MetricsLog``, the per-step metrics.parquet writer.

::

    RUN_DIR/
      config.yaml          the fully resolved config the run started with (written first)
      status.json          {"state", "step", "total_steps", "message"}, replaced atomically
      metrics.parquet      one row per logged step, replaced atomically every step
      distributions.jsonl  per-step histograms, append-only (truncated back on resume)
      samples.jsonl        only with run.log_samples=N: N greedy validation replies per evaluation,
                           one JSON object each ({"step", "prompt", "reply", "reference", "reward"});
                           append-only, truncated back on resume like distributions.jsonl
      checkpoints/         step_NNNNNN/ folders + ``latest`` (see ``timlab.rundir.checkpoint``)
      tensorboard/         only with run.tensorboard=true
      run.lock             holds the pid of the process that owns the run

States: ``running``, then one of ``finished``, ``diverged`` (non-finite values),
``guard_failed`` (the zero-mismatch guard tripped) or ``failed`` (an error); a directory with no
status yet reads ``pending``.

One process at a time: ``RunDir.lock()`` takes an exclusive ``flock`` on ``run.lock`` for the
life of the run, and a second process gets a one-line ``RunDirBusyError`` naming the holder's
pid. The kernel drops the lock when its holder dies, even by kill -9, so a stale lock file never
blocks a resume.

Files timlab did not write are left alone: a ``run.lock`` that is a symlink, not a regular file,
or holds anything but a pid is refused (never truncated), a fresh run refuses a folder that
already holds a status, metrics or distributions file, appends never follow a symlink, and every
replace goes through a temporary file of its own (``timlab.files``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd

from timlab.errors import BadFileError, TimlabError, UsageError, is_disk_full
from timlab.files import (ForeignFilesError, atomic_write_text, overwrite_in_place, release_lock, remove_owned, take_lock,
                          temp_pattern)

CONFIG = "config.yaml"
STATUS = "status.json"
METRICS = "metrics.parquet"
DISTRIBUTIONS = "distributions.jsonl"
SAMPLES = "samples.jsonl"
CHECKPOINTS = "checkpoints"
TENSORBOARD = "tensorboard"
LOCK = "run.lock"

STEP_PREFIX = "step_"
"""A checkpoint folder is ``checkpoints/step_NNNNNN`` (``checkpoint_name``)."""
LATEST = "latest"
"""``checkpoints/latest`` names the newest checkpoint folder."""
CHECKPOINT_ENTRIES = (f"{STEP_PREFIX}*", f".tmp_{STEP_PREFIX}*", LATEST, f"{LATEST}.tmp")
"""The names timlab writes in a run's checkpoints/ folder."""


def checkpoint_name(step: int, *, temporary: bool = False) -> str:
    """The folder name of the checkpoint of ``step`` (``temporary``: the name it is written under)."""
    return f"{'.tmp_' if temporary else ''}{STEP_PREFIX}{step:06d}"


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint folder name ``step_NNNNNN``, or None for any other name."""
    digits = name[len(STEP_PREFIX):] if name.startswith(STEP_PREFIX) else ""
    return int(digits) if digits.isascii() and digits.isdigit() else None


RUN_FILES = (CONFIG, STATUS, METRICS, DISTRIBUTIONS, SAMPLES, CHECKPOINTS, TENSORBOARD, LOCK,
             STATUS + ".tmp", METRICS + ".tmp", DISTRIBUTIONS + ".tmp", CONFIG + ".tmp")
"""Every name timlab writes directly in a run directory (what ``clear`` may delete; the ``.tmp``
names are an older version's temporary files)."""
TEMP_FILES = tuple(temp_pattern(name) for name in (CONFIG, STATUS, METRICS, DISTRIBUTIONS, SAMPLES))
"""Globs of the temporary files of this version's atomic writes (a kill can leave one)."""

RUNNING, FINISHED, DIVERGED, GUARD_FAILED, FAILED, PENDING = (
    "running", "finished", "diverged", "guard_failed", "failed", "pending")
DONE_STATES = (FINISHED, DIVERGED, GUARD_FAILED)
"""States a run ends in and that a rerun of a sweep skips."""
COMPLETE_STATES = (FINISHED, DIVERGED)
"""States whose metrics cover the whole outcome of the run (collapse statistics use these)."""


class RunDirBusyError(TimlabError):
    """Another process holds the run directory's lock."""


class RunDir:
    """A run directory at ``path`` (which need not exist yet)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock_fd: int | None = None

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # ---------------------------------------------------------------------------- layout
    @property
    def config(self) -> Path:
        return self.path / CONFIG

    @property
    def status_file(self) -> Path:
        return self.path / STATUS

    @property
    def metrics_file(self) -> Path:
        return self.path / METRICS

    @property
    def distributions_file(self) -> Path:
        return self.path / DISTRIBUTIONS

    @property
    def samples_file(self) -> Path:
        return self.path / SAMPLES

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def tensorboard(self) -> Path:
        return self.path / TENSORBOARD

    def checkpoint(self, step: int) -> Path:
        """The folder of the checkpoint of ``step`` (which may not exist)."""
        return self.checkpoints / checkpoint_name(step)

    def has_run(self) -> bool:
        """Whether a run was started here (config, metrics or checkpoints exist)."""
        return any(p.exists() for p in (self.config, self.metrics_file, self.checkpoints))

    def has_steps(self) -> bool:
        """Whether the run has logged or checkpointed anything."""
        return self.metrics_file.exists() or self.checkpoints.exists() or self.status_file.exists()

    def check_not_file(self) -> None:
        if self.path.exists() and not self.path.is_dir():
            raise UsageError(f"run directory {self.path} is a file, not a folder; choose another --run-dir")

    def check_fresh(self) -> None:
        """Before a fresh run writes anything: refuse a folder holding a run's files that no run
        here wrote (a status, metrics, distributions or tensorboard entry with no config.yaml),
        or any of timlab's names as a symlink; timlab would overwrite or append to them."""
        for name in RUN_FILES:
            p = self.path / name
            if name == LOCK and not p.is_symlink():
                continue  # lock() checks it: ours holds a pid
            if p.exists() or p.is_symlink():
                link = " (a symlink)" if p.is_symlink() else ""
                raise ForeignFilesError(f"run directory {self.path} holds {name}{link}, which this run did not write; "
                                        "timlab leaves it alone: choose another --run-dir or move that file")

    # ---------------------------------------------------------------------------- status
    def read_status(self) -> dict:
        """status.json as a dict; {} when absent or unreadable (a run killed mid-write)."""
        try:
            status = json.loads(self.status_file.read_text())
        except (OSError, ValueError):
            return {}
        return status if isinstance(status, dict) else {}

    def state(self) -> str:
        return self.read_status().get("state", PENDING)

    def write_status(self, state: str, *, step: int, total_steps: int, message: str = "",
                     durable: bool = True) -> None:
        """Replace status.json (``durable``: fsync it; a per-step progress update skips that).
        On a full disk the file is rewritten in place (its blocks exist), so a run that ran out
        of space still says ``failed``."""
        text = json.dumps({"state": state, "step": step, "total_steps": total_steps, "message": message})
        try:
            atomic_write_text(self.status_file, text, durable=durable)
        except OSError as e:
            if not (is_disk_full(e) and self.status_file.exists()):
                raise
            overwrite_in_place(self.status_file, text)

    # ---------------------------------------------------------------------------- metrics
    def read_metrics(self) -> pd.DataFrame | None:
        """metrics.parquet sorted by step, or None when the run has logged nothing yet."""
        if not self.metrics_file.exists():
            return None
        try:
            df = pd.read_parquet(self.metrics_file)
        except Exception as e:  # pyarrow raises several types for a damaged file
            raise BadFileError(f"{self.metrics_file}: unreadable ({type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''})") from None
        return df.sort_values("step").reset_index(drop=True) if "step" in df.columns else df

    def read_distributions(self, up_to_step: int | None = None) -> list[str]:
        """The lines of distributions.jsonl (of steps <= ``up_to_step``). A last line cut short by
        a kill is dropped; a damaged line elsewhere is an error naming the file and line."""
        return self._step_lines(self.distributions_file, up_to_step)

    def read_samples(self, up_to_step: int | None = None) -> list[dict]:
        """The records of samples.jsonl (of steps <= ``up_to_step``), read like distributions.jsonl."""
        return [json.loads(line) for line in self._step_lines(self.samples_file, up_to_step)]

    def _step_lines(self, path: Path, up_to_step: int | None) -> list[str]:
        """The lines of a JSON-lines file whose objects each hold a ``step`` (of steps <= ``up_to_step``)."""
        if not path.exists():
            return []
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise BadFileError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None
        lines = text.split("\n")
        kept = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError) as e:
                if n >= len(lines) - 1 and not text.endswith("\n"):
                    break  # the line a kill interrupted: it belongs to an unfinished step
                raise BadFileError(f"{path}: line {n} is not a JSON object with a step "
                                   f"({type(e).__name__}); remove that line to resume") from None
            if up_to_step is None or step <= up_to_step:
                kept.append(line)
        return kept

    # ---------------------------------------------------------------------------- lock
    def lock(self) -> "RunDir":
        """Take the run's exclusive lock (creating the folder), or raise ``RunDirBusyError``
        naming the pid that holds it. Released by ``unlock`` or when this process dies."""
        if self._lock_fd is not None:
            return self
        self.check_not_file()
        self.path.mkdir(parents=True, exist_ok=True)
        fd = take_lock(self.path / LOCK, busy=lambda holder: RunDirBusyError(
            f"run directory {self.path} is in use by process {holder} (another timlab train or sweep); "
            "wait for it or stop it"))
        self._lock_fd = fd
        return self

    def unlock(self) -> None:
        if self._lock_fd is not None:
            release_lock(self._lock_fd)
            self._lock_fd = None

    def remove_if_unused(self, *, created: bool) -> None:
        """After a start that failed before writing anything: delete the lock file when it is
        all the folder holds, and the folder too when this start ``created`` it. The caller has
        released the lock."""
        try:
            if not self.path.is_dir() or {p.name for p in self.path.iterdir()} - {LOCK}:
                return
            (self.path / LOCK).unlink(missing_ok=True)
            if created:
                self.path.rmdir()
        except OSError:
            pass  # another process took the folder meanwhile: it is theirs

    def __enter__(self) -> "RunDir":
        return self.lock()

    def __exit__(self, *exc) -> None:
        self.unlock()

    # ---------------------------------------------------------------------------- clearing
    def clear(self) -> None:
        """Delete what timlab wrote here (config, status, metrics, checkpoints, ...) and nothing
        else; the caller holds the lock."""
        for name in RUN_FILES:
            p = self.path / name
            if name == LOCK or not (p.exists() or p.is_symlink()):
                continue
            if name == CHECKPOINTS and p.is_dir() and not p.is_symlink():
                remove_owned(p, CHECKPOINT_ENTRIES, what="a timlab checkpoints folder")
            elif name == TENSORBOARD and p.is_dir() and not p.is_symlink():
                remove_owned(p, ("events.out.tfevents.*",), what="a timlab tensorboard folder")
            elif not p.is_dir():
                p.unlink()
        for pattern in TEMP_FILES:
            for p in self.path.glob(pattern):
                if p.is_file() or p.is_symlink():
                    p.unlink()


def read_status(run_dir: str | os.PathLike) -> dict:
    """status.json of a run directory ({} when absent or unreadable)."""
    return RunDir(run_dir).read_status()


def read_metrics(run_dir: str | os.PathLike) -> pd.DataFrame | None:
    """metrics.parquet of a run directory sorted by step, or None when the run has logged nothing
    yet (``RunDir.read_metrics``; the one reader of the file)."""
    return RunDir(run_dir).read_metrics()


__all__ = ["RunDir", "RunDirBusyError", "read_status", "read_metrics", "DONE_STATES", "COMPLETE_STATES",
           "RUNNING", "FINISHED", "DIVERGED", "GUARD_FAILED", "FAILED", "PENDING", "CONFIG", "STATUS", "METRICS",
           "DISTRIBUTIONS", "SAMPLES", "CHECKPOINTS", "LOCK", "CHECKPOINT_ENTRIES", "checkpoint_name", "checkpoint_step"]
