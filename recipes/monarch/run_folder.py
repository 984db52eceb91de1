"""The recipe's run folder checks: one run per folder, and a fresh run never writes into an earlier one.

Both run in the controller before any mesh is spawned; their errors are ``ValueError`` (the recipe prints
``config error: ...`` and exits 2).
"""

from __future__ import annotations

import os
from pathlib import Path

from composer_replication.engine import RunDir

__all__ = ["check_fresh_run_dir", "open_run_dir"]


def check_fresh_run_dir(run_dir: str | os.PathLike[str]) -> None:
    """A fresh run must not write into the folder of an earlier run (its metrics would mix).

    Raises:
        ValueError: the folder already holds ``metrics.jsonl`` or checkpoints (use ``--resume`` or another ``run.dir``).
    """
    path = Path(run_dir)
    if (path / "metrics.jsonl").is_file() or any((path / "checkpoints").glob("step_*")):
        raise ValueError(
            f"'run.dir' {str(path)!r} already holds a run (metrics or checkpoints); continue it with "
            f"--resume {path}, or choose another run.dir"
        )


def open_run_dir(run_dir: str | os.PathLike[str], *, resuming: bool) -> RunDir:
    """Open the run folder and hold its lock for the whole run; a fresh run also checks the folder is new.

    The lock (``<run>/.lock``, see :class:`~composer_replication.engine.RunDir`) makes a second run or
    resume on the same folder stop here, before anything is spawned. Close the returned ``RunDir``.

    Raises:
        ValueError: the folder is in use by another run (``RunDirInUseError``: names the folder and the
            PID), holds an earlier run (fresh runs only), or cannot be created (names the folder).
    """
    try:
        run = RunDir(run_dir)
    except OSError as exc:
        raise ValueError(f"'run.dir' {str(run_dir)!r} cannot be used as the run folder: {exc}") from exc
    if not resuming:
        try:
            check_fresh_run_dir(run.path)
        except ValueError:
            run.close()
            raise
    return run
