"""Writing files without losing or corrupting data: atomic replaces, and deletes of only what
timlab wrote.

``atomic_write_bytes`` writes a temporary sibling, fsyncs it and renames it over the target, so a
reader (or a kill) sees the old file or the new one, never half of one; the temporary file is
removed when the write fails, and a full disk becomes one ``DiskFullError`` naming the mount
point and the path. ``remove_owned`` deletes a folder only when every entry in it is a name
timlab writes there, so a path that a user pointed at their own data is never emptied.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import shutil
from pathlib import Path
from typing import Iterable

from timlab.errors import BadFileError, TimlabError, UsageError, disk_full, is_disk_full


class ForeignFilesError(TimlabError):
    """A folder timlab would replace holds files timlab did not write; nothing was deleted."""


def read_text(path: str | os.PathLike, *, what: str = "file") -> str:
    """A UTF-8 text file's content; a file that is not UTF-8 is a one-line error naming it."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise BadFileError(f"{what} {os.fspath(path)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)  # our own temporary file: never leave it behind
        if isinstance(e, Exception) and is_disk_full(e):
            raise disk_full(path) from None
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def json_safe(obj):
    """``obj`` with every NaN or infinite float replaced by None: standard JSON has no
    ``Infinity``, and a log-prob of -1e308 makes some metrics infinite."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_json(path: str | os.PathLike, obj) -> Path:
    """Write ``obj`` as standard JSON (non-finite numbers as null), atomically."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{path} is a folder; give a file name to write the JSON to")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(json_safe(obj), indent=2, allow_nan=False, default=str))
    return path


def check_output_file(path: str | os.PathLike | None, flag: str) -> None:
    """An output path must not be an existing folder (checked before any work is done)."""
    if path is not None and Path(path).is_dir():
        raise UsageError(f"{flag} {os.fspath(path)} is a folder; give a file name")


def overwrite_in_place(path: Path, text: str) -> None:
    """Rewrite a small existing file without a temporary one: the last resort when the disk is
    full (the file's blocks are already allocated). Not atomic; used only for status lines."""
    data = text.encode()
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate(len(data))


def foreign_entries(folder: Path, patterns: Iterable[str]) -> list[str]:
    """Names directly under ``folder`` that match none of ``patterns`` (fnmatch globs)."""
    pats = tuple(patterns)
    return sorted(p.name for p in Path(folder).iterdir() if not any(fnmatch.fnmatch(p.name, g) for g in pats))


def remove_owned(folder: Path, patterns: Iterable[str], *, what: str) -> None:
    """Delete ``folder`` if every entry directly in it matches ``patterns`` (the names timlab
    writes there); otherwise raise ``ForeignFilesError`` and delete nothing."""
    folder = Path(folder)
    if not folder.exists():
        return
    if not folder.is_dir():
        raise ForeignFilesError(f"{folder} is a file, not {what}; remove it or choose another path")
    foreign = foreign_entries(folder, patterns)
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise ForeignFilesError(f"{folder} holds {foreign[0]!r}{more}, which timlab did not write; it is not {what}, "
                                "so timlab leaves it alone: choose another path or move those files")
    shutil.rmtree(folder)


__all__ = ["read_text", "atomic_write_bytes", "atomic_write_text", "json_safe", "write_json", "check_output_file",
           "overwrite_in_place", "foreign_entries", "remove_owned",
           "ForeignFilesError"]
