"""Copy a sweep's finished runs into the repository, as the committed sweeps keep them.

    python scripts/keep_runs.py WORK_SWEEP REPO_SWEEP [--steps N]

A long sweep runs in a working folder (a worktree, so commits do not disturb it) and its runs are
committed as they finish. This copies, for every run of WORK_SWEEP's index that has finished at its
last step (``--steps``: at that step), diverged, or been stopped by the zero-mismatch guard (a
study's evidence too), what the repository keeps of a run (its config, its per-step metrics and its
status; .gitignore leaves checkpoints and logs out), plus the sweep's own records (the index, the
study freeze, the machine record), into REPO_SWEEP. A run already kept is copied again only when its
status changed. It prints the runs it copied, one per line, and never deletes anything.

Only the index's run ids are runs: any other folder (another sweep's run, a symlink to one) is left
out, and an id that is not a plain folder name (a path, a newline) is skipped with a warning. Nothing
goes through a symlink on either side: a run folder or a kept file that is a link, or anything but a
regular file, stops the copy with one line naming it before anything is written, and each file is
written atomically (a temporary file of its own, renamed over the target).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import secrets
import stat
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timlab.experiments.studies.registration import FREEZE_FILE  # noqa: E402
from timlab.experiments.sweeps.runner import INDEX_FILE, ISA_FILE  # noqa: E402
from timlab.rundir import CONFIG, DIVERGED, FINISHED, GUARD_FAILED, METRICS, STATUS  # noqa: E402

SWEEP_FILES = (INDEX_FILE, FREEZE_FILE, ISA_FILE)
"""A sweep folder's own records that are kept (those it has)."""
KEPT_FILES = (CONFIG, METRICS, STATUS)
"""What the repository keeps of a run (its config, metrics and status)."""
_NOFOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Refused(SystemExit):
    """A symlink or a non-regular file where keep_runs reads or writes; nothing was written."""

    def __init__(self, path: Path, what: str):
        super().__init__(f"keep_runs: {path} is {what}; keep_runs copies regular files only and never "
                         "through a link: remove it or replace it with the real folder or file")


def _kind(mode: int) -> str:
    return "a symlink" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode) else "not a regular file"


def open_dir(path: Path, *, create: bool = False) -> int | None:
    """An fd of the folder ``path`` (not followed if a link: ``Refused``); None when it is missing
    (created first with ``create``)."""
    if create:
        try:
            os.mkdir(path)
        except FileExistsError:
            pass
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError:  # ELOOP (a link) or ENOTDIR
        raise Refused(path, _kind(os.lstat(path).st_mode)) from None


def read_regular(dir_fd: int, name: str, where: Path) -> bytes | None:
    """The bytes of the regular file ``name`` in the folder ``dir_fd`` (``where``, for messages);
    None when it is missing; ``Refused`` for a link or anything but a regular file (a FIFO is not
    opened for reading, so it cannot block)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise Refused(where / name, _kind(st.st_mode))
    fd = os.open(name, os.O_RDONLY | _NOFOLLOW, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise Refused(where / name, "not a regular file")
        return f.read()


def check_target(dir_fd: int, name: str, where: Path) -> None:
    """``name`` in ``dir_fd`` is missing or a regular file (a link there is refused, not replaced)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise Refused(where / name, _kind(st.st_mode))


def write_atomic(dir_fd: int, name: str, data: bytes) -> None:
    """Replace ``name`` in the folder ``dir_fd`` with ``data``: a fresh temporary file of its own
    (created exclusively, never through a link), fsynced, renamed over the target."""
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise


def plain_name(name) -> bool:
    """A run id that names one folder: no path separator, not . or .., printable (no newline)."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and name.isprintable()


def run_ids(index: bytes, where: Path) -> list[str]:
    """The run ids of a sweep's index (plain names only; any other is skipped with a warning)."""
    df = pd.read_parquet(io.BytesIO(index))
    if "run_id" not in df.columns:
        raise SystemExit(f"keep_runs: {where} has no run_id column; it is not a sweep's index")
    ids = []
    for name in df["run_id"]:
        if plain_name(name):
            ids.append(name)
        else:
            print(f"keep_runs: skipped the index's run id {name!r}: not a plain folder name", file=sys.stderr)
    return sorted(set(ids))


def read_run(path: Path) -> dict[str, bytes] | None:
    """The kept files of the run folder ``path`` ({name: bytes}), or None when the folder or one of
    them is missing."""
    fd = open_dir(path)
    if fd is None:
        return None
    try:
        files = {f: read_regular(fd, f, path) for f in KEPT_FILES}
    finally:
        os.close(fd)
    return None if any(v is None for v in files.values()) else files


def done(status: bytes | None, steps: int | None) -> bool:
    """Finished (at ``steps`` when given), diverged, or stopped by the guard."""
    try:
        status = json.loads(status)
    except (TypeError, ValueError):
        return False
    state = status.get("state") if isinstance(status, dict) else None
    return state in (DIVERGED, GUARD_FAILED) or (state == FINISHED and (steps is None or status.get("step") == steps))


def keep(src: Path, dst: Path, steps: int | None = None) -> list[str]:
    """Copy the finished runs of ``src``'s index (and its records) into ``dst``; the names of the
    runs copied. Everything is read and checked before the first write."""
    src, dst = Path(src), Path(dst)
    sfd = open_dir(src)
    if sfd is None:
        raise SystemExit(f"keep_runs: {src}: no such folder")
    fds = [sfd]
    try:
        index = read_regular(sfd, INDEX_FILE, src)
        if index is None:
            raise SystemExit(f"keep_runs: {src} is not a sweep folder (no {INDEX_FILE})")
        dst.mkdir(parents=True, exist_ok=True)
        dfd = open_dir(dst)
        fds.append(dfd)
        plan: list[tuple[str, dict[str, bytes]]] = []  # (run id, {file: bytes}) to write
        for name in run_ids(index, src / INDEX_FILE):
            files = read_run(src / name)
            if files is None or not done(files[STATUS], steps):
                continue
            tfd = open_dir(dst / name)
            if tfd is not None:
                try:
                    for f in KEPT_FILES:
                        check_target(tfd, f, dst / name)
                    if read_regular(tfd, STATUS, dst / name) == files[STATUS]:
                        continue
                finally:
                    os.close(tfd)
            plan.append((name, files))
        records = {f: read_regular(sfd, f, src) for f in SWEEP_FILES}
        records = {f: b for f, b in records.items() if b is not None}
        for f in records:
            check_target(dfd, f, dst)
        for name, files in plan:
            tfd = open_dir(dst / name, create=True)
            try:
                for f in (CONFIG, METRICS, STATUS):  # the status last: a run counts as kept once it is there
                    write_atomic(tfd, f, files[f])
            finally:
                os.close(tfd)
        for f, data in records.items():
            write_atomic(dfd, f, data)
        return [name for name, _ in plan]
    finally:
        for fd in fds:
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="the working sweep folder")
    ap.add_argument("dst", type=Path, help="the sweep folder in the repository")
    ap.add_argument("--steps", type=int, help="count a finished run only at this step (a study's last step)")
    args = ap.parse_args(argv)
    for name in keep(args.src, args.dst, args.steps):
        print(name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
