"""Atomic file writes: a reader sees the old file or the new one, never half of one.

The text goes to a temporary file in the target's folder, is flushed and fsynced, then renamed over the
target with ``os.replace`` (atomic on POSIX and Windows), and the folder is fsynced so the rename
survives a crash. On any error the temporary file is removed and the target is left as it was.

A target that is a symlink is written *through*: the link is resolved first, so the file it points at
is replaced and the link stays a link. The new file gets the usual mode of a new file (``0o666`` less
the umask, e.g. ``0644``), or the mode of the file it replaces, never the ``0600`` of a temporary file.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

__all__ = ["atomic_writer", "atomic_write_text", "fsync_dir"]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a folder so that renames into it are durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (``/proc/self/status``)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # pragma: no cover - no /proc: the classic read-and-restore
    os.umask(mask)  # pragma: no cover
    return mask  # pragma: no cover


def _target_mode(real: Path) -> int:
    """The mode the written file gets: the replaced file's, else ``0o666 & ~umask``."""
    try:
        return stat.S_IMODE(os.stat(real).st_mode)
    except FileNotFoundError:
        return 0o666 & ~current_umask()


@contextmanager
def atomic_writer(path: str | os.PathLike[str], *, encoding: str = "utf-8") -> Iterator[TextIO]:
    """A text handle whose content replaces ``path`` only when the ``with`` block ends without error.

    For output written as it is produced (e.g. states streamed from many sessions). Creates missing
    parent folders. A symlink at ``path`` is followed (the file it points at is replaced, the link
    stays); the result keeps the replaced file's mode, or gets ``0o666 & ~umask`` when new. If the
    block raises, the temporary file is removed, ``path`` is left as it was, and the exception
    propagates: raise to discard the output.

    Raises:
        IsADirectoryError: ``path`` (after following symlinks) is a folder.
        OSError: the folder cannot be created or written (e.g. a parent is a file, no permission).
    """
    real = Path(os.path.realpath(Path(path).expanduser()))
    if real.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a folder, not a file: give a file path", str(path))
    real.parent.mkdir(parents=True, exist_ok=True)
    mode = _target_mode(real)
    fd, tmp = tempfile.mkstemp(prefix=f".{real.name}.", suffix=".tmp", dir=real.parent)
    try:
        with os.fdopen(fd, "w", encoding=encoding) as fh:
            yield fh
            fh.flush()
            os.fchmod(fh.fileno(), mode)
            os.fsync(fh.fileno())
        os.replace(tmp, real)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(real.parent)


def atomic_write_text(path: str | os.PathLike[str], text: str, *, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_writer`); creates missing parent
    folders and writes through a symlink. Returns ``path`` (user-expanded, links not resolved)."""
    with atomic_writer(path, encoding=encoding) as fh:
        fh.write(text)
    return Path(path).expanduser()
