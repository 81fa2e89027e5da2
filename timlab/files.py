"""Writing files without losing or corrupting data: atomic replaces, and deletes of only what
timlab wrote.

``atomic_write_bytes`` writes a temporary sibling, fsyncs it and renames it over the target, so a
reader (or a kill) sees the old file or the new one, never half of one; the temporary file is
removed when the write fails, and a full disk becomes one ``DiskFullError`` naming the mount
point and the path. Each write gets its own temporary file (``.NAME.<random>.tmp``, created
exclusively: never an existing file or a symlink), so two writers of one file never mix their
bytes and a planted link is never followed; ``atomic_write_with`` does the same for writers that
take a path (``DataFrame.to_parquet``). ``open_append`` appends without following a symlink.
``remove_owned`` deletes a folder only when every entry in it is a name timlab writes there, so a
path that a user pointed at their own data is never emptied. ``take_lock`` locks a pid file and
refuses one that is not timlab's (a symlink, or anything but a pid in it) without truncating it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import hashlib
import json
import math
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterable

from timlab.errors import BadFileError, TimlabError, UsageError, disk_full, is_disk_full


class ForeignFilesError(TimlabError):
    """A folder timlab would replace holds files timlab did not write; nothing was deleted."""


def sha256_file(path: str | os.PathLike) -> str:
    """The hex SHA-256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_text(path: str | os.PathLike, *, what: str = "file") -> str:
    """A UTF-8 text file's content; a file that is not UTF-8 is a one-line error naming it."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise BadFileError(f"{what} {os.fspath(path)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def temp_pattern(name: str) -> str:
    """The glob of the temporary files an atomic write of ``name`` leaves if killed."""
    return f".{name}.*.tmp"


def atomic_write_with(path: str | os.PathLike, write: Callable[[Path], None], *, durable: bool = False) -> None:
    """Replace ``path`` atomically with what ``write(tmp)`` writes to a fresh, unique temporary
    sibling (``durable``: fsync it before the rename). The temporary file is removed on failure."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    try:
        os.fchmod(fd, 0o644)
        os.close(fd)
        write(tmp)
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)  # our own temporary file: never leave it behind
        if isinstance(e, Exception) and is_disk_full(e):
            raise disk_full(path) from None
        raise


def atomic_write_bytes(path: Path, data: bytes, *, durable: bool = True) -> None:
    atomic_write_with(path, lambda tmp: tmp.write_bytes(data), durable=durable)


def atomic_write_text(path: Path, text: str, *, durable: bool = True) -> None:
    atomic_write_bytes(path, text.encode(), durable=durable)


def open_append(path: str | os.PathLike):
    """``open(path, "a")`` that refuses a symlink (ELOOP) and anything but a regular file."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BadFileError(f"{os.fspath(path)} is not a regular file; timlab appends only to its own files")
    return os.fdopen(fd, "a", encoding="utf-8")


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


_LOCK_TEXT = re.compile(rb"\s*(\d+\s*)?")
"""What timlab writes in a lock file: the holder's pid, or nothing yet."""


def take_lock(path: str | os.PathLike, *, busy: Callable[[str], Exception] | None = None) -> int:
    """Open ``path`` (created if missing) and take an exclusive ``flock`` on it; return the fd,
    with this process's pid written in the file. ``busy(holder_pid)`` makes the error raised when
    another process holds the lock; without it, wait. A path that is a symlink, not a regular
    file, or a file holding anything but a pid is not timlab's: ``ForeignFilesError``, untouched.
    The kernel drops the lock when the process dies, even by kill -9."""
    path = Path(path)
    foreign = ForeignFilesError(f"{path} is not a timlab lock file (timlab writes a pid there); "
                                "timlab leaves it alone: choose another path or move that file")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # a symlink, a socket, a folder
            raise foreign from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode) or not _LOCK_TEXT.fullmatch(os.pread(fd, 64, 0)):
            raise foreign
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (fcntl.LOCK_NB if busy is not None else 0))
        except OSError as e:
            if busy is not None and e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise busy(os.pread(fd, 64, 0).decode(errors="replace").strip() or "?") from None
            raise
        os.ftruncate(fd, 0)  # ours (checked above): the pid of the last holder
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def release_lock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


@contextlib.contextmanager
def held_lock(path: str | os.PathLike, *, busy: Callable[[str], Exception] | None = None):
    """``take_lock`` for the body of a ``with`` block."""
    fd = take_lock(path, busy=busy)
    try:
        yield fd
    finally:
        release_lock(fd)


@contextlib.contextmanager
def held_folder_lock(folder: str | os.PathLike, lock_name: str, *, busy: Callable[[str], Exception]):
    """An exclusive ``flock`` on ``folder`` itself, then ``take_lock`` on ``folder/lock_name`` (which
    names the holder's pid), for the body of a ``with`` block. The folder's lock is the one that
    excludes: deleting the lock file while it is held (which would let a second ``take_lock`` create a
    new file and lock that) does not let a second holder in. ``busy(holder_pid)`` makes the error
    when another process holds it."""
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            try:
                holder = (Path(folder) / lock_name).read_bytes()[:64].decode(errors="replace").strip()
            except OSError:
                holder = ""
            raise busy(holder or "?") from None
        with held_lock(Path(folder) / lock_name, busy=busy) as fd:
            yield fd
    finally:
        os.close(dfd)  # drops the folder's flock


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


__all__ = ["read_text", "atomic_write_bytes", "atomic_write_text", "atomic_write_with", "temp_pattern", "open_append", "json_safe", "write_json", "check_output_file",
           "overwrite_in_place", "foreign_entries", "remove_owned", "take_lock", "release_lock", "held_lock",
           "ForeignFilesError"]
