"""One writer per output: ``OUT.lock`` beside the output, held for the whole run (docs/cli.md, "Guarantees").

The lock is an exclusive ``flock`` on that file, which holds the writer's pid and host for the message a second
writer prints. The kernel releases a flock when its holder exits, however it exits, so a lock file left by a
killed run is free: the next writer takes it over without deleting anything, and a live writer's lock is never
removed. The holder removes the file when it is done (while still holding it); a writer that locked a file
removed meanwhile tries again on the new one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

from .errors import UserError
from .files import cannot_write

MAGIC = b"unionsparse-lock"
_TRIES = 20


def lock_path(out: str | Path) -> Path:
    p = Path(out)
    return p.with_name(p.name + ".lock")


def _holder(fd: int) -> str:
    """``pid N on HOST`` from a lock file's content (what its holder wrote), else a plain phrase."""
    words = os.pread(fd, 512, 0).decode("utf-8", "replace").split()
    info = dict(zip(words[1::2], words[2::2], strict=False)) if words[:1] == [MAGIC.decode()] else {}
    if "pid" in info and "host" in info:
        return f"pid {info['pid']} on {info['host']}"
    return "another process"


def _open(p: Path, out: str | Path, what: str) -> int:
    try:
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(f"{what}: {p} is a symbolic link, not a unionsparse lock file; not touched") from None
        raise cannot_write(what, out, e) from None  # a read-only or full file system, permissions
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(f"{what}: {p} is not a regular file, not a unionsparse lock file; not touched")
    return fd


def _same_file(fd: int, p: Path) -> bool:
    try:
        cur = os.stat(p, follow_symlinks=False)
    except FileNotFoundError:
        return False
    st = os.fstat(fd)
    return (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino)


def _take(fd: int, p: Path, out: str | Path, what: str) -> bool:
    """Lock the open lock file ``fd`` (UserError when a live writer holds it); False when ``p`` is no longer this
    file (its holder removed it as we opened it); True once it holds our pid and host."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UserError(f"{what}: {out} is being written by another unionsparse run ({_holder(fd)}; lock "
                        f"{p}); wait for it to end or choose another output") from None
    if not _same_file(fd, p):
        return False
    content = os.pread(fd, len(MAGIC), 0)
    if content and content != MAGIC:
        raise UserError(f"{what}: {p} exists and is not a unionsparse lock file; not touched (move it away)")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, MAGIC + f" pid {os.getpid()} host {socket.gethostname()}\n".encode(), 0)
    except OSError:  # a full disk: the file, ours now (locked), is not left behind
        p.unlink(missing_ok=True)
        raise
    return True


def acquire(out: str | Path, what: str) -> int:
    """Take the lock of ``out`` (UserError naming its holder when another live process holds it); returns its fd."""
    p = lock_path(out)
    for _ in range(_TRIES):
        fd = _open(p, out, what)
        try:
            taken = _take(fd, p, out, what)
        except OSError as e:
            os.close(fd)
            raise cannot_write(what, out, e) from None
        except BaseException:
            os.close(fd)
            raise
        if taken:
            return fd
        os.close(fd)  # try again on the file now at p
    raise UserError(f"{what}: could not take the lock {p} (it keeps being replaced); try again")


def release(out: str | Path, fd: int) -> None:
    """Remove the lock file (ours: still the file this fd holds) and let go of it."""
    p = lock_path(out)
    try:
        if _same_file(fd, p):
            p.unlink()  # our own lock file, still locked by us
    except OSError:
        pass  # a read-only folder by now: the file stays, and is free once the fd closes
    finally:
        os.close(fd)


@contextlib.contextmanager
def output_lock(out: str | Path, what: str) -> Iterator[Path]:
    """Hold the lock of ``out`` for the duration of the block (``what``: the option naming ``out``)."""
    fd = acquire(out, what)
    try:
        yield lock_path(out)
    finally:
        release(out, fd)
