"""One base for every error a user can cause: ``TimlabError``.

The CLI turns a ``TimlabError`` (and an ``OSError`` from the environment: a full disk, a
permission, a missing file, with the path it names) into one line ``timlab: error: ...`` and
exit code 2; anything else is a bug and keeps its traceback. Each error class of the project
derives from ``TimlabError``; those that were ``ValueError`` (or ``RuntimeError``, ``KeyError``)
stay so, so library code that catches the builtin types keeps working.

This module imports nothing, so the pure layer (metrics, remedies, schedulers) can raise these
without depending on anything above it.
"""

from __future__ import annotations

import errno
import os


class TimlabError(Exception):
    """A user-facing error: bad input, a bad file, a busy or broken run directory. Its message is
    one line that names the key, file or path at fault."""


class UsageError(TimlabError, ValueError):
    """A bad argument, option or value (a ``ValueError``)."""


class BadFileError(TimlabError, ValueError):
    """A file that exists but cannot be used (not UTF-8, malformed, truncated, a directory where a
    file is expected); the message names the file."""


class DiskFullError(TimlabError, OSError):
    """No space left while writing; the message names the file system's mount point and the path."""


def mount_point(path: str | os.PathLike) -> str:
    """The mount point of the file system that holds ``path`` (or would hold it)."""
    p = os.path.abspath(os.fspath(path))
    while not os.path.exists(p):
        p = os.path.dirname(p)
    while not os.path.ismount(p):
        p = os.path.dirname(p)
    return p


def is_disk_full(e: BaseException) -> bool:
    """Whether ``e`` (or an exception it was raised from) says the disk is full. Libraries that
    write through their own code (safetensors, torch.save) wrap ENOSPC in their own types."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e)
        if "No space left on device" in text or "code: 28" in text or "StorageFull" in text:
            return True
        e = e.__cause__ or e.__context__
    return False


def out_of_space(path: str | os.PathLike, margin: int = 1 << 20) -> bool:
    """Whether the file system holding ``path`` has less than ``margin`` bytes free: the check
    for writers (torch.save) whose error on a full disk does not say so."""
    try:
        st = os.statvfs(mount_point(path))
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < margin


def disk_full(path: str | os.PathLike) -> DiskFullError:
    """The one-line error for a write to ``path`` that ran out of space."""
    mount = mount_point(path)
    try:
        st = os.statvfs(mount)
        free = f", {st.f_bavail * st.f_frsize / 2**20:.1f} MiB free"
    except OSError:
        free = ""
    return DiskFullError(errno.ENOSPC, f"no space left on the disk mounted at {mount}{free} "
                                       f"(writing {os.fspath(path)})")


def one_line(e: BaseException, *, with_type: bool = False) -> str:
    """The message the CLI prints for a user-facing error: its first line, with the path an
    ``OSError`` names. ``with_type`` puts the exception's class name in front (``ValueError: ...``):
    for a message that stands without its traceback, such as a failed sweep run's in the index."""
    if isinstance(e, DiskFullError):
        text = e.strerror or str(e)
    elif isinstance(e, OSError) and e.strerror and not isinstance(e, TimlabError):
        where = f"{e.filename}: " if e.filename else ""
        text = f"{where}{e.strerror}" + (f" -> {e.filename2}" if e.filename2 else "")
    else:
        text = str(e.args[0] if isinstance(e, KeyError) and len(e.args) == 1 else e).strip()
        text = text.splitlines()[0] if text else ""
    if not text:
        return type(e).__name__
    return f"{type(e).__name__}: {text}" if with_type else text


__all__ = ["TimlabError", "UsageError", "BadFileError", "DiskFullError", "disk_full", "is_disk_full", "out_of_space",
           "mount_point", "one_line"]
