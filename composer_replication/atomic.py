"""Atomic file writes: a reader sees the old file or the new one, never half of one.

The text goes to a temporary file in the target's folder, is flushed and fsynced, then renamed over the
target with ``os.replace`` (atomic on POSIX and Windows), and the folder is fsynced so the rename
survives a crash. On any error the temporary file is removed and the target is left as it was.
"""

from __future__ import annotations

import os
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


@contextmanager
def atomic_writer(path: str | os.PathLike[str], *, encoding: str = "utf-8") -> Iterator[TextIO]:
    """A text handle whose content replaces ``path`` only when the ``with`` block ends without error.

    For output written as it is produced (e.g. states streamed from many sessions). Creates missing
    parent folders. If the block raises, the temporary file is removed, ``path`` is left as it was, and
    the exception propagates: raise to discard the output.
    """
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding=encoding) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike[str], text: str, *, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically; creates missing parent folders. Returns the path."""
    with atomic_writer(path, encoding=encoding) as fh:
        fh.write(text)
    return Path(path).expanduser()
