"""The recipe's data on the controller: which trace files ``data.sessions`` names, and their states.

Relative paths are tried from the current folder, then from the repository root; ``bundled:<glob>``
names the bundled sample data (``composer_replication.data``).
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_replication.data import resolve_bundled

if TYPE_CHECKING:
    from recipes.monarch.config import RecipeConfig

__all__ = ["REPO_ROOT", "resolve_path", "session_files", "load_states"]

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
    files: list[Path] = []
    for entry in config.data.sessions:
        entry = resolve_bundled(entry)
        here = sorted(glob.glob(os.path.expanduser(entry)))
        found = here or sorted(glob.glob(str(REPO_ROOT / entry)))
        if not found:
            raise ValueError(
                f"'data.sessions' entry {entry!r} matches no file (looked in {Path.cwd()} and {REPO_ROOT}); "
                "give existing trace files or globs"
            )
        files.extend(Path(f) for f in found if Path(f) not in files)
    return files


def load_states(config: RecipeConfig) -> list[dict[str, Any]]:
    """Ingest ``data.sessions`` (any trace format) and keep the first ``data.max_states`` states.

    Raises:
        ValueError: no state could be read, or ``data.num_eval_prompts`` leaves nothing to train on.
    """
    from composer_replication.ingestion import ingest_any

    kwargs: dict[str, Any] = {}
    if config.data.max_history_tokens is not None:
        kwargs["max_history_tokens"] = config.data.max_history_tokens
    states: list[dict[str, Any]] = []
    for path in session_files(config):
        for state in ingest_any(path, **kwargs):
            states.append(dict(state))
            if len(states) >= config.data.max_states:
                break
        if len(states) >= config.data.max_states:
            break
    if not states:
        raise ValueError(f"'data.sessions' {config.data.sessions} gave no trace states; check the files' format")
    if config.data.num_eval_prompts >= len(states):
        raise ValueError(
            f"'data.num_eval_prompts' ({config.data.num_eval_prompts}) must be < the number of trace states "
            f"({len(states)}); lower it or raise 'data.max_states'"
        )
    return states
