"""Bundled data, read as package data with :mod:`importlib.resources`.

- ``sessions/train/`` and ``sessions/heldout/``: **synthetic** Claude Code sessions of an agent fixing
  small Python bugs (no real user's or model's session). ``syn-*.jsonl`` are written by
  :mod:`composer_replication.data.generate_sessions` (``python -m composer_replication.data.generate_sessions
  --out composer_replication/data/sessions``; a test checks the bundled files equal its output); the five
  ``train/fix-*.jsonl`` were written by hand. ``heldout/`` holds whole sessions for evaluation only.
- ``tasks/python_tasks.jsonl``: the Python tasks of the ``python_tasks`` environment.

:func:`bundled_path` gives a real file-system path to one of them; config values written as
``bundled:sessions/train/*.jsonl`` resolve through it.
"""

from __future__ import annotations

from importlib.resources import as_file, files
from pathlib import Path

__all__ = ["BUNDLED_PREFIX", "bundled_path", "resolve_bundled"]

BUNDLED_PREFIX = "bundled:"


def bundled_path(relative: str = "") -> Path:
    """The file-system path of ``relative`` inside the bundled data (``""``: the data folder itself).

    Raises:
        FileNotFoundError: nothing is bundled under that name (the message lists what is).
    """
    root = files(__name__)
    with as_file(root) as folder:  # a real folder for a normal install; zip installs are not supported
        path = Path(folder) / relative
    if relative and not any(Path(folder).glob(relative)):
        have = sorted(p.name for p in Path(folder).iterdir() if not p.name.startswith("_"))
        raise FileNotFoundError(f"no bundled data matches {relative!r}; bundled: {have}")
    return path


def resolve_bundled(path: str) -> str:
    """``bundled:<relative>`` -> the file-system path (glob patterns kept); any other string unchanged."""
    if path.startswith(BUNDLED_PREFIX):
        return str(bundled_path(path[len(BUNDLED_PREFIX) :]))
    return path
