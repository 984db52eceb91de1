"""Bundled data, read as package data with :mod:`importlib.resources`.

- ``sessions/train/`` and ``sessions/heldout/``: **synthetic** Claude Code sessions of an agent fixing small
  Python bugs (no real user's or model's session). ``syn-*.jsonl`` are written by ``tests/synthetic/generate.py``
  (``python tests/synthetic/generate.py --out composer_replication/data/sessions``; a test checks the bundled
  files equal its output); the five ``train/fix-*.jsonl`` were written by hand. ``heldout/`` holds whole
  sessions for evaluation only.
- ``tasks/python_tasks.jsonl``: the Python tasks of the ``python_tasks`` environment.

:func:`bundled_path` gives a real file-system path to one of them; config values written as
``bundled:sessions/train/*.jsonl`` resolve through :func:`resolve_bundled`.
"""

from __future__ import annotations

from importlib.resources import as_file, files
from pathlib import Path

__all__ = ["bundled_path", "resolve_bundled"]

BUNDLED_PREFIX = "bundled:"


def bundled_path(relative: str = "") -> Path:
    """The file-system path of ``relative`` (a name or a glob) inside the bundled data (``""``: the folder).

    Raises:
        FileNotFoundError: nothing is bundled under that name (the message lists what is).
    """
    with as_file(files(__name__)) as folder:  # a real folder for a normal install; zip installs are not supported
        folder = Path(folder)
    if relative and not any(folder.glob(relative)):
        have = sorted(p.name for p in folder.iterdir() if not p.name.startswith("_"))
        raise FileNotFoundError(f"no bundled data matches {relative!r}; bundled: {have}")
    return folder / relative


def resolve_bundled(path: str) -> str:
    """``bundled:<relative>`` -> the file-system path (glob patterns kept); any other string unchanged."""
    return str(bundled_path(path[len(BUNDLED_PREFIX) :])) if path.startswith(BUNDLED_PREFIX) else path
