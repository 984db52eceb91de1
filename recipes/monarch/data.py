"""The recipe's data on the controller: the trace files ``data.sessions`` and ``data.eval_sessions`` name, their states.

Relative paths are tried from the current folder, then the repository root; ``bundled:<glob>`` names the bundled
synthetic sessions (``sessions/train/``, ``sessions/heldout/``). The held-out split is the engine's
(``engine.data.heldout_split``): held-out states go to the trainers' evaluation only.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_replication.data import resolve_bundled
from composer_replication.engine.data import heldout_split, select_states
from composer_replication.losses.config import shown

if TYPE_CHECKING:
    from recipes.monarch.config import RecipeConfig

__all__ = ["REPO_ROOT", "resolve_path", "session_files", "eval_session_files", "load_states", "load_eval_states",
           "load_data", "load_agentic_tasks"]

REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve_path(path: str) -> Path:
    """``path`` as given when it exists (absolute or from the current folder), else from the repository root."""
    p = Path(path).expanduser()
    return p if p.is_absolute() or p.exists() else REPO_ROOT / p


def _files(entries: list[str], key: str) -> list[Path]:
    """The files ``entries`` name (globs expanded, sorted, de-duplicated); ``ValueError`` for an entry with none."""
    files: list[Path] = []
    for entry in map(resolve_bundled, entries):
        found = sorted(glob.glob(os.path.expanduser(entry))) or sorted(glob.glob(str(REPO_ROOT / entry)))
        if not found:
            raise ValueError(f"'{key}' entry {shown(entry)} matches no file (looked in {Path.cwd()} and {REPO_ROOT}); "
                             "give existing trace files or globs")
        files.extend(Path(f) for f in found if Path(f) not in files)
    return files


def session_files(config: RecipeConfig) -> list[Path]:
    """The training trace files (``data.sessions``)."""
    return _files(config.data.sessions, "data.sessions")


def eval_session_files(config: RecipeConfig) -> list[Path]:
    """The held-out trace files (``data.eval_sessions``; ``[]`` when it is empty)."""
    return _files(config.data.eval_sessions, "data.eval_sessions")


def _ingest(files: list[Path], config: RecipeConfig, key: str) -> list[dict[str, Any]]:
    from composer_replication.ingestion import ingest_any

    d = config.data
    kwargs = {} if d.max_history_tokens is None else {"max_history_tokens": d.max_history_tokens}
    states = [dict(state) for path in files for state in ingest_any(path, **kwargs)]
    if files and not states:
        raise ValueError(f"'{key}' {getattr(d, key.split('.')[1])} gave no trace states; check the files' format")
    return states


def load_states(config: RecipeConfig) -> list[dict[str, Any]]:
    """The training states: ``data.sessions`` ingested (any trace format), then a fixed draw of ``data.max_states``
    spread over them (``engine.data.select_states``). ``ValueError``: no state could be read, or
    ``data.num_eval_prompts`` leaves nothing to train on."""
    states = select_states(_ingest(session_files(config), config, "data.sessions"), config.data.max_states,
                           stream="train-states")
    heldout_split([s["state_id"] for s in states], num_eval_prompts=config.data.num_eval_prompts)
    return states


def load_eval_states(config: RecipeConfig) -> list[dict[str, Any]]:
    """The held-out states: ``data.eval_sessions`` ingested, then a fixed draw of ``data.max_eval_states``."""
    return select_states(_ingest(eval_session_files(config), config, "data.eval_sessions"),
                         config.data.max_eval_states, stream="eval-states")


def load_data(config: RecipeConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(training states, held-out states)``, checked by the engine's held-out split before any spawn.

    Raises:
        ValueError: as :func:`load_states`, or a held-out state is also a training state, or both
            ``data.eval_sessions`` and ``data.num_eval_prompts`` hold out.
    """
    if config.student.rollout.environment == "agentic":
        return [], []  # episodes start from tasks (load_agentic_tasks), not from trace states
    states, held = load_states(config), load_eval_states(config)
    heldout_split([s["state_id"] for s in states], eval_ids=[s["state_id"] for s in held],
                  num_eval_prompts=config.data.num_eval_prompts)
    return states, held


def load_agentic_tasks(config: RecipeConfig) -> tuple[list[Any], list[Any]]:
    """``agentic``: ``(training tasks, held-out tasks)`` from ``data.tasks`` / ``data.eval_tasks`` (default: the
    bundled train and held-out splits), each a fixed draw of ``data.max_tasks`` / ``data.max_eval_tasks``;
    ``([], [])`` for the other environments.

    Raises:
        ValueError: a task file that does not exist or holds a bad task (``file:line`` and the field), or a held-out
            task id that is also a training task's.
    """
    from composer_replication.data import bundled_path
    from composer_replication.rollout.agent import load_tasks
    from composer_replication.rollout.agent.tasks import BUNDLED_TASKS

    d = config.data
    if config.student.rollout.environment != "agentic":
        return [], []

    def read(path: str | None, default: str, key: str) -> list[Any]:
        if path == "":
            return []
        p = resolve_path(path) if path else bundled_path(default)
        if not p.is_file():
            raise ValueError(f"{key} {shown(path)} is not a file (looked in {Path.cwd()} and {REPO_ROOT}); give a tasks "
                             "JSONL (docs/rollouts.md, 'The task format')")
        return load_tasks(p)

    tasks = select_states(read(d.tasks, BUNDLED_TASKS["train"], "data.tasks"), d.max_tasks, stream="train-tasks")
    if not tasks:
        raise ValueError(f"data.tasks {shown(d.tasks)} holds no task; give a tasks JSONL with at least one")
    held = select_states(read(d.eval_tasks, BUNDLED_TASKS["heldout"], "data.eval_tasks"), d.max_eval_tasks,
                         stream="eval-tasks")
    heldout_split([t.task_id for t in tasks], eval_ids=[t.task_id for t in held], num_eval_prompts=d.num_eval_prompts)
    return tasks, held
