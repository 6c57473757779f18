"""Writing files: the one place every command's output goes through (docs/cli.md, "Guarantees").

- :func:`atomic_write`: a file is written under a temporary name in its own folder, flushed to disk, then
  renamed over the target, so a full disk or a crash never leaves a half-written file; the temporary file is
  removed on any error.
- Folders (an artifact, an export) are built as ``NAME.partial`` and renamed the same way by their writers;
  :func:`environment_errors` turns a full disk or a read-only file system met while writing into one line.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import UserError

ENV_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)
ACCESS_ERRNOS = (errno.EACCES, errno.EPERM)


def _inside(a: Path, b: Path) -> bool:
    return a == b or b in a.parents


def is_environment_error(e: OSError, out: Path) -> bool:
    """A full disk, a quota, a read-only file system, or permissions on ``out``'s folder: bad input, not a bug."""
    if e.errno in ENV_ERRNOS:
        return True
    name = getattr(e, "filename", None)
    return e.errno in ACCESS_ERRNOS and bool(name) and _inside(Path(str(name)).resolve(), Path(out).parent.resolve())


def cannot_write(what: str, path: Path | str, e: OSError) -> UserError:
    """The one line for a write the environment refused (``what``: the option naming the file, e.g. ``--plot``)."""
    return UserError(f"{what}: cannot write {path}: {e.strerror or type(e).__name__}")


def file_mode() -> int:
    """The mode a plain ``open(..., "w")`` would give a new file (0666 less the umask)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path: str | Path, data: bytes | str, what: str) -> Path:
    """Write ``data`` to ``path`` atomically (temporary name in the same folder, fsync, rename); an existing file
    is replaced only once the new one is complete. Any OSError is one line (UserError) and leaves nothing."""
    p = Path(path)
    if p.is_symlink():
        raise UserError(f"{what}: {p} is a symbolic link; not written")
    if p.is_dir():
        raise UserError(f"{what}: {p} is a folder; not written")
    if not p.parent.is_dir():
        raise UserError(f"{what}: folder {p.parent} does not exist")
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    except OSError as e:
        raise cannot_write(what, p, e) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, file_mode())  # mkstemp makes 0600
        os.replace(tmp, p)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)  # the temporary file this function made
        raise cannot_write(what, p, e) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


@contextlib.contextmanager
def environment_errors(what: str, out: Path, cleanup: Callable[[], None] | None = None) -> Iterator[None]:
    """Inside: a full disk, a read-only file system or a permission refused on ``out`` runs ``cleanup`` (removing
    what the command made) and becomes one line naming ``out``; other errors pass through unchanged."""
    try:
        yield
    except OSError as e:
        if not is_environment_error(e, out):
            raise
        if cleanup is not None:
            cleanup()
        raise cannot_write(what, out, e) from None
