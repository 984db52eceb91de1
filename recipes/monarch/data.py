"""The recipe's data on the controller: which trace files ``data.sessions`` and ``data.eval_sessions`` name,
and their states.

Relative paths are tried from the current folder, then from the repository root; ``bundled:<glob>``
names the bundled data (``composer_replication.data``: synthetic Claude Code sessions, ``sessions/train/``
for training and ``sessions/heldout/`` for evaluation). Held-out states go to the trainers only: the
teachers never replay them, so they have no pairs, and no training channel sees them.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_replication.data import resolve_bundled

if TYPE_CHECKING:
    from recipes.monarch.config import RecipeConfig

__all__ = ["REPO_ROOT", "resolve_path", "session_files", "eval_session_files", "load_states", "load_eval_states"]

REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve_path(path: str) -> Path:
    """``path`` as given when it exists (absolute or from the current folder), else from the repository root."""
    p = Path(path).expanduser()
    return p if p.is_absolute() or p.exists() else REPO_ROOT / p


def session_files(config: RecipeConfig) -> list[Path]:
    """The trace files ``data.sessions`` names (globs expanded, sorted, de-duplicated).

    Raises:
        ValueError: an entry matches no file (names the entry and where it looked).
    """
    return _files(config.data.sessions, "data.sessions")


def eval_session_files(config: RecipeConfig) -> list[Path]:
    """The held-out trace files ``data.eval_sessions`` names (``[]`` when it is empty).

    Raises:
        ValueError: an entry matches no file, or a file is also a training file (``data.sessions``).
    """
    files = _files(config.data.eval_sessions, "data.eval_sessions")
    train = {f.resolve() for f in session_files(config)} if files else set()
    shared = [f for f in files if f.resolve() in train]
    if shared:
        raise ValueError(
            f"'data.eval_sessions' and 'data.sessions' both name {shared[0]} ({len(shared)} file(s) in all); held-out "
            "sessions must not be trained on: narrow 'data.sessions' (e.g. bundled:sessions/train/*.jsonl) or "
            "set data.eval_sessions=[]"
        )
    return files


def _files(entries: list[str], key: str) -> list[Path]:
    files: list[Path] = []
    for entry in entries:
        entry = resolve_bundled(entry)
        here = sorted(glob.glob(os.path.expanduser(entry)))
        found = here or sorted(glob.glob(str(REPO_ROOT / entry)))
        if not found:
            raise ValueError(
                f"'{key}' entry {entry!r} matches no file (looked in {Path.cwd()} and {REPO_ROOT}); "
                "give existing trace files or globs"
            )
        files.extend(Path(f) for f in found if Path(f) not in files)
    return files


def load_states(config: RecipeConfig) -> list[dict[str, Any]]:
    """Ingest ``data.sessions`` (any trace format) and keep ``data.max_states`` states spread over all of them
    (a fixed draw, ``engine.data.select_states``: every session can contribute, whatever the file order).

    Raises:
        ValueError: no state could be read, or ``data.num_eval_prompts`` leaves nothing to train on.
    """
    from composer_replication.ingestion import ingest_any

    kwargs: dict[str, Any] = {}
    if config.data.max_history_tokens is not None:
        kwargs["max_history_tokens"] = config.data.max_history_tokens
    from composer_replication.engine.data import select_states

    states = [dict(state) for path in session_files(config) for state in ingest_any(path, **kwargs)]
    states = select_states(states, config.data.max_states, stream="train-states")
    if not states:
        raise ValueError(f"'data.sessions' {config.data.sessions} gave no trace states; check the files' format")
    if config.data.num_eval_prompts >= len(states):
        raise ValueError(
            f"'data.num_eval_prompts' ({config.data.num_eval_prompts}) must be < the number of trace states "
            f"({len(states)}); lower it or raise 'data.max_states'"
        )
    return states


def load_eval_states(config: RecipeConfig) -> list[dict[str, Any]]:
    """The held-out states: every state of ``data.eval_sessions``, then a fixed draw of ``data.max_eval_states``
    spread over them (``engine.data.select_states``); ``[]`` when ``data.eval_sessions`` is empty.

    Raises:
        ValueError: the held-out sessions give no state, or one is also a training file.
    """
    from composer_replication.engine.data import select_states
    from composer_replication.ingestion import ingest_any

    files = eval_session_files(config)
    if not files:
        return []
    kwargs: dict[str, Any] = {}
    if config.data.max_history_tokens is not None:
        kwargs["max_history_tokens"] = config.data.max_history_tokens
    states = [dict(state) for path in files for state in ingest_any(path, **kwargs)]
    if not states:
        raise ValueError(f"'data.eval_sessions' {config.data.eval_sessions} gave no trace states; check the files' format")
    return select_states(states, config.data.max_eval_states, stream="eval-states")
