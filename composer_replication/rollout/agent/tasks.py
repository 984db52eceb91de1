"""Agentic tasks: a repository, a request, a test command that decides whether it is done.

One JSON object per line (:func:`load_tasks`): ``task_id``, ``instruction``, ``files`` (``{relative
path: text}``), ``test_command`` (argv run in the workspace; exit 0 = solved), optional ``max_turns``
(8), ``solution_actions`` (a recorded fix, one ``{"name", "input"}`` call per turn), ``cwd`` (the
workspace's path in the sandbox, ``/workspace``) and ``metadata``. Format: docs/rollouts.md.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer_replication.rollout.agent.tools import TOOL_SCHEMAS

__all__ = ["Task", "load_tasks", "parse_task", "BUNDLED_TASKS"]

BUNDLED_TASKS = {"train": "tasks/agentic/train.jsonl", "heldout": "tasks/agentic/heldout.jsonl"}
"""The bundled tasks' paths under ``composer_replication/data`` (``data.bundled_path``), by split."""
_REQUIRED = ("task_id", "instruction", "files", "test_command")
_OPTIONAL = ("max_turns", "solution_actions", "cwd", "metadata")
_RESERVED = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/dev", "/tmp", "/.cr")


@dataclass(frozen=True, kw_only=True)
class Task:
    """One executable task (fields as in the module notes; ``source`` is ``"file:line"`` for messages)."""

    task_id: str
    instruction: str
    files: dict[str, str]
    test_command: list[str]
    max_turns: int = 8
    solution_actions: list[dict[str, Any]] = field(default_factory=list)
    cwd: str = "/workspace"
    metadata: dict[str, Any] = field(default_factory=dict)
    source: str = field(default="<task>", compare=False)

    def __post_init__(self) -> None:
        _check(self)


def _fail(task: Any, key: str, rule: str) -> None:
    where = getattr(task, "source", "<task>")
    raise ValueError(f"{where}: task {getattr(task, 'task_id', '?')!r}: `{key}` {rule}")


def _check(t: Task) -> None:  # noqa: C901 - one check per field, in order
    if not isinstance(t.task_id, str) or not t.task_id.strip():
        _fail(t, "task_id", f"must be a non-empty string, got {t.task_id!r}")
    if not isinstance(t.instruction, str) or not t.instruction.strip():
        _fail(t, "instruction", "must be a non-empty string (the user's request)")
    if not isinstance(t.files, dict) or not t.files:
        _fail(t, "files", "must be a non-empty object {relative path: file text}")
    for path, text in t.files.items():
        norm = posixpath.normpath(path) if isinstance(path, str) and path else ""
        if not norm or path.startswith("/") or norm == "." or norm.split("/")[0] == ".." or "\\" in path:
            _fail(t, "files", f"has the path {path!r}; paths must be relative, inside the workspace (no '..')")
        if not isinstance(text, str):
            _fail(t, "files", f"[{path!r}] must be the file's text (a string), got {type(text).__name__}")
    if len({posixpath.normpath(p) for p in t.files}) != len(t.files):
        _fail(t, "files", "names one file twice (after normalizing the paths)")
    cmd = t.test_command
    if not isinstance(cmd, list) or not cmd or not all(isinstance(a, str) and a for a in cmd):
        _fail(t, "test_command", f"must be a non-empty list of strings (argv), got {cmd!r}; "
              'e.g. ["python", "-m", "pytest", "-q"]')
    if isinstance(t.max_turns, bool) or not isinstance(t.max_turns, int) or t.max_turns < 1:
        _fail(t, "max_turns", f"must be a positive integer, got {t.max_turns!r}")
    cwd = posixpath.normpath(t.cwd) if isinstance(t.cwd, str) else ""
    if not cwd.startswith("/") or cwd == "/" or any(cwd == r or cwd.startswith(r + "/") for r in _RESERVED):
        _fail(t, "cwd", f"must be an absolute folder outside the system folders, got {t.cwd!r}")
    if not isinstance(t.metadata, dict):
        _fail(t, "metadata", "must be an object")
    acts = t.solution_actions
    if not isinstance(acts, list):
        _fail(t, "solution_actions", 'must be a list of {"name", "input"} tool calls')
    for i, a in enumerate(acts):
        if not isinstance(a, dict) or a.get("name") not in TOOL_SCHEMAS or not isinstance(a.get("input"), dict):
            _fail(t, "solution_actions", f"[{i}] must be {{\"name\": one of {sorted(TOOL_SCHEMAS)}, "
                  f"\"input\": {{...}}}}, got {a!r}")
    if len(acts) > t.max_turns:
        _fail(t, "solution_actions", f"has {len(acts)} calls but max_turns is {t.max_turns} (one call per turn)")


def parse_task(obj: Any, *, source: str = "<task>") -> Task:
    """A :class:`Task` from one decoded JSON object.

    Raises:
        ValueError: a missing or unknown key, or a field that breaks its rule (the message names
            ``source``, the task and the field).
    """
    if not isinstance(obj, dict):
        raise ValueError(f"{source}: a task must be a JSON object, got {type(obj).__name__}")
    for key in _REQUIRED:
        if key not in obj:
            raise ValueError(f"{source}: task {obj.get('task_id', '?')!r}: missing required key `{key}`")
    unknown = sorted(set(obj) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise ValueError(f"{source}: task {obj['task_id']!r}: unknown key(s) {unknown}; allowed: "
                         f"{list(_REQUIRED + _OPTIONAL)} (put anything else under `metadata`)")
    return Task(**obj, source=source)


def load_tasks(path: str | Path) -> list[Task]:
    """Every task of a JSONL file (blank lines skipped; task ids must be unique).

    Raises:
        ValueError: a line that is not JSON or not a valid task (the message names ``file:line``).
    """
    tasks: list[Task] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e}); write one task object per line") from None
            task = parse_task(obj, source=where)
            if task.task_id in seen:
                raise ValueError(f"{where}: `task_id` {task.task_id!r} is used by an earlier line; ids must be unique")
            seen.add(task.task_id)
            tasks.append(task)
    return tasks
