"""Python coding tasks scored by unit tests in the sandbox.

A :class:`PythonTask` is a prompt, a reference solution (to test the environment itself) and plain-``assert``
unit tests. :class:`PythonTaskEnvironment` extracts the code of a sampled answer (:func:`extract_code`), runs it
with the tests through :func:`~composer_replication.rollout.sandbox.run_python_sandboxed` and rewards the
fraction of tests passed. Error kinds: no code, or a ``SyntaxError`` / ``IndentationError`` -> ``other``; a
``TypeError`` -> ``type_error``; anything else (failed asserts, exceptions, a timeout) -> ``runtime_error``;
``error_meta`` holds the traceback tail, ``tool_name="python"`` and the task's first sentence as ``intent``.
The bundled tasks (``composer_replication/data/tasks/python_tasks.jsonl``) are one JSON object per line with
``task_id``, ``prompt``, ``entry_point``, ``reference_solution`` and ``tests``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer_replication.data import bundled_path
from composer_replication.rollout.environment import Prompt, Score
from composer_replication.rollout.sandbox import run_python_sandboxed

__all__ = ["PythonTask", "PythonTaskEnvironment", "load_bundled_tasks"]

DEFAULT_TASKS_PATH = bundled_path("tasks/python_tasks.jsonl")
DEFAULT_SYSTEM_PROMPT = (
    "You are a careful Python programmer. Answer with one ```python code block that defines the "
    "requested function. Use only the standard library and do not print anything."
)
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_THINKING = re.compile(r"^\[THINKING\].*?(?=^\S|\Z)", re.DOTALL | re.MULTILINE)


@dataclass(kw_only=True)
class PythonTask:
    """One coding task: a unique ``task_id``, the ``prompt`` shown to the policy, ``tests`` (Python source with
    top-level ``test_*`` functions calling the solution by name), a ``reference_solution`` that passes every test
    (checked by the project's tests) and the ``entry_point`` function the task asks for (informational)."""

    task_id: str
    prompt: str
    tests: str
    reference_solution: str = ""
    entry_point: str = ""


def load_bundled_tasks(path: str | Path | None = None) -> list[PythonTask]:
    """Read tasks from a JSONL file (default: the bundled :data:`DEFAULT_TASKS_PATH`).

    Raises:
        FileNotFoundError: the file does not exist (the bundled file ships with a source checkout).
        ValueError: a line is not a JSON object with ``task_id``, ``prompt`` and ``tests``.
    """
    p = Path(path) if path is not None else DEFAULT_TASKS_PATH
    if not p.is_file():
        raise FileNotFoundError(f"task file {p} does not exist; pass path= to a JSONL file of tasks.")
    tasks = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            tasks.append(PythonTask(**{k: rec[k] for k in rec if k in PythonTask.__dataclass_fields__}))
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"{p}:{n}: each line must be a JSON object with task_id, prompt and tests ({e}).") from e
    return tasks


def extract_code(text: str) -> str:
    """The code in an answer: the last ```python (or ```py) block, else the last fenced block of
    any language, else the whole text without ``[THINKING]`` blocks. An unclosed fence (a
    truncated sample) runs to the end of the text."""
    blocks = _FENCE.findall(text)
    py = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if py:
        return py[-1].strip("\n") + "\n"
    if blocks:
        return blocks[-1][1].strip("\n") + "\n"
    return _THINKING.sub("", text).strip() + "\n"


class PythonTaskEnvironment:
    """Reward = fraction of a task's unit tests that the sampled code passes (sandboxed).

    Args:
        tasks: the tasks (default: :func:`load_bundled_tasks`).
        timeout_s / memory_mb: wall-clock and address-space limits per run.
        os_sandbox: ``"auto"``, ``"require"`` or ``"off"`` (``run_python_sandboxed``; each score's
            ``details["isolation"]`` says which isolation its run had).
        system_prompt: the system message of every prompt.

    Raises:
        ValueError: task ids repeat, or there are no tasks.
    """

    name = "python_tasks"

    def __init__(self, tasks: Sequence[PythonTask] | None = None, *, timeout_s: float = 5.0, memory_mb: int = 256,
                 os_sandbox: str = "auto", system_prompt: str = DEFAULT_SYSTEM_PROMPT) -> None:
        self.tasks = list(tasks) if tasks is not None else load_bundled_tasks()
        if not self.tasks:
            raise ValueError("PythonTaskEnvironment: got no tasks; pass at least one PythonTask.")
        ids = [t.task_id for t in self.tasks]
        if len(set(ids)) != len(ids):
            raise ValueError(f"PythonTaskEnvironment: task ids must be unique, got {ids}.")
        self.timeout_s, self.memory_mb, self.os_sandbox, self.system_prompt = timeout_s, memory_mb, os_sandbox, system_prompt

    def prompts(self) -> list[Prompt]:
        """One prompt per task: system message + the task's instruction."""
        return [Prompt(prompt_id=t.task_id,
                       messages=[{"role": "system", "content": self.system_prompt}, {"role": "user", "content": t.prompt}],
                       reference=f"```python\n{t.reference_solution}```" if t.reference_solution else None,
                       metadata={"tests": t.tests, "entry_point": t.entry_point}) for t in self.tasks]

    def score(self, prompt: Prompt, action_text: str) -> Score:
        """Run the code of ``action_text`` against the prompt's tests."""
        tests = prompt.metadata.get("tests")
        if not isinstance(tests, str):
            raise ValueError(f"prompt {prompt.prompt_id!r} has no tests in metadata['tests']; build prompts with "
                             "PythonTaskEnvironment.prompts().")
        code = extract_code(action_text)
        if not code.strip():
            return Score(0.0, error_kind="other", error_meta=_meta(prompt, "The answer contains no code.", "other"),
                         details={"n_passed": 0, "n_total": 0})
        res = run_python_sandboxed(code, tests, timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                                   os_sandbox=self.os_sandbox)
        details = {"n_passed": res.n_passed, "n_total": res.n_total, "timed_out": res.timed_out,
                   "error_type": res.error_type, "isolation": res.isolation}
        if res.passed:
            return Score(1.0, details=details)
        kind = ("other" if res.error_type in ("SyntaxError", "IndentationError", "TabError")
                else "type_error" if res.error_type == "TypeError" else "runtime_error")
        return Score(res.n_passed / res.n_total if res.n_total else 0.0, error_kind=kind,
                     error_meta=_meta(prompt, res.error or "the tests failed", kind), details=details)


def _meta(prompt: Prompt, message: str, kind: str) -> dict[str, Any]:
    task = str(prompt.messages[-1].get("content", ""))
    return {"error_kind": kind, "error_message": message[-1000:], "tool_name": "python",
            "available_tools": [], "intent": task.split(". ")[0][:300]}
