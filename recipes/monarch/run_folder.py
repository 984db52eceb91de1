"""The recipe's run folder checks: one run per folder, and a fresh run writes only into a new or empty folder.

Both run in the controller before any mesh is spawned; their errors are ``ValueError`` (the recipe prints
``config error: ...`` and exits 2).
"""

from __future__ import annotations

import os
from pathlib import Path

from composer_replication.engine import RunDir
from composer_replication.losses.config import shown

__all__ = ["check_fresh_run_dir", "open_run_dir"]


def check_fresh_run_dir(run_dir: str | os.PathLike[str]) -> None:
    """A fresh run writes only into a folder that does not exist or is empty (a ``.lock`` alone does not count):
    it never overwrites the ``config.yaml``, ``summary.json`` or ``pairs.jsonl`` of a project or an earlier run.

    Raises:
        ValueError: the folder holds anything, naming it and its first entries (use ``--resume`` for a run).
    """
    path = Path(run_dir)
    try:
        names = sorted(p.name for p in path.iterdir() if p.name != ".lock") if path.is_dir() else []
    except OSError as exc:
        raise ValueError(f"'run.dir' {shown(str(path))} cannot be listed ({exc.strerror}); choose another run.dir"
                         ) from None
    if names:
        more = f", ... ({len(names)} entries)" if len(names) > 5 else ""
        raise ValueError(f"'run.dir' {shown(str(path))} is not empty (holds {shown(', '.join(names[:5]))[1:-1]}{more}): "
                         "a fresh run writes only into a new or empty folder; choose another run.dir, or continue a "
                         f"run there with --resume {shown(str(path))[1:-1]}")


def open_run_dir(run_dir: str | os.PathLike[str], *, resuming: bool) -> RunDir:
    """Open the run folder and hold its lock for the whole run; a fresh run also checks the folder is new.

    The lock (``<run>/.lock``, see :class:`~composer_replication.engine.RunDir`) makes a second run or
    resume on the same folder stop here, before anything is spawned. Close the returned ``RunDir``.

    Raises:
        ValueError: the folder is in use by another run (``RunDirInUseError``: names the folder and the
            PID), is not empty (fresh runs only), or cannot be created (names the folder).
    """
    if not resuming:
        check_fresh_run_dir(run_dir)  # before RunDir writes its .lock there
    try:
        run = RunDir(run_dir)
    except OSError as exc:
        raise ValueError(f"'run.dir' {shown(str(run_dir))} cannot be used as the run folder: {exc.strerror or exc}"
                         ) from exc
    if not resuming:
        try:
            check_fresh_run_dir(run.path)  # again under the lock: a run that started since is not overwritten
        except ValueError:
            run.close()
            raise
    return run
