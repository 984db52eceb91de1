"""One agentic episode: a task's workspace, the student's turns as tool calls, the tests as the reward.

    with Episode(EpisodeConfig()) as ep:
        messages = ep.reset(task)                 # [system, user]: what the student continues
        while not ep.done:
            step = ep.step(action_text)           # runs the turn's [TOOL_USE] calls; messages grow
        reward, components = ep.final_reward()    # runs task.test_command once

The chat has the shape of ingested sessions (``ingestion.history``); every failed call is an error
site whose ``failure`` maps onto ``types.ERROR_KINDS`` (:data:`FAILURE_KINDS`). The reward, its
shaping and the error sites are documented in docs/rollouts.md ("Agentic tasks").
"""

from __future__ import annotations

import hashlib
import json
import math
import posixpath
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer_replication.actions import format_tool_use, parse_action
from composer_replication.ingestion.errors import RepeatTracker, error_site
from composer_replication.ingestion.history import ERROR_PREFIX, SYSTEM_PROMPT, tool_call, tool_message
from composer_replication.rollout.agent.tasks import Task
from composer_replication.rollout.agent.tools import TOOL_SCHEMAS, ToolConfig, ToolError, Workspace, clip
from composer_replication.types import HintContext

__all__ = ["Episode", "EpisodeConfig", "ToolResult", "run_task"]

FAILURE_KINDS = {"unknown_tool": "tool_not_found", "bad_json": "json_decode", "bad_arguments": "type_error",
                 "too_many_calls": "other"}  # fmt: skip
"""Failure -> error kind; every other failure (the call ran and failed) is ``runtime_error``."""
MALFORMED = ("unknown_tool", "bad_json", "bad_arguments")
"""Failures of a call that is not a valid call (penalized in the reward; ``well_formed_call_rate`` counts the rest)."""
_PLAIN = ("command_failed", "test_failure", "timeout")  # shown as Claude Code shows Bash, not as tool_use_error


@dataclass(kw_only=True)
class EpisodeConfig:
    """Limits and reward shaping of an episode."""

    tools: ToolConfig = field(default_factory=ToolConfig)
    """Per-call limits (Bash timeout, memory, file and disk sizes, output length, OS sandbox mode)."""
    test_timeout_s: float = 60.0
    """Wall-clock limit of one ``test_command`` run (a hung run is killed and counts as failed)."""
    episode_timeout_s: float = 300.0
    """Sandbox seconds (all Bash and Grep calls) an episode may spend; past it, the episode ends."""
    max_calls_per_turn: int = 8
    """Tool calls run per turn; later ones are refused (``too_many_calls``)."""
    partial_credit: float = 0.5
    """Reward of an unsolved episode that made every initially failing test pass (scaled by progress)."""
    malformed_penalty: float = 0.1
    """Subtracted per malformed call (unknown tool, bad JSON, bad arguments)."""
    max_penalty: float = 0.5
    """Cap of the total malformed-call penalty."""
    system_prompt: str = SYSTEM_PROMPT
    """The system message (ingestion's default); the tool guide (``tool_guide``) and ``Working directory: <cwd>`` are
    appended."""
    tool_guide: bool = True
    """Append :func:`tool_guide` (the tools, their inputs and the call syntax: what a Claude Code session's API
    request tells the model) to the system message."""
    workdir: str | None = None
    """Folder for the episodes' workspaces (default: the system's temporary folder)."""

    def __post_init__(self) -> None:
        for key in ("test_timeout_s", "episode_timeout_s", "max_calls_per_turn"):
            if not 0 < getattr(self, key) < math.inf:
                raise ValueError(f"EpisodeConfig.{key} must be positive and finite, got {getattr(self, key)!r}")
        for key in ("partial_credit", "malformed_penalty", "max_penalty"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"EpisodeConfig.{key} must be in [0, 1], got {getattr(self, key)!r}")


@dataclass
class ToolResult:
    """One tool call and what it returned.

    Attributes:
        name: the tool named by the call.
        input: its arguments (a dict), or the raw argument text when it was not a JSON object.
        output: the tool message's content as the student sees it (without the ``[ERROR] `` prefix).
        failure: why it failed (see the module notes), ``None`` on success.
        duration_s: wall-clock seconds of the call.
    """

    name: str
    input: Any
    output: str
    failure: str | None
    duration_s: float

    @property
    def error_kind(self) -> str | None:
        """The failure's :data:`~composer_replication.types.ERROR_KINDS` kind (``None`` on success)."""
        return None if self.failure is None else FAILURE_KINDS.get(self.failure, "runtime_error")


@dataclass
class StepResult:
    """One turn: its calls' results, whether the episode is over, and its error site.

    Attributes:
        turn: the turn's index (0-based).
        message_index: index of the turn's assistant message in :attr:`Episode.messages`.
        results: one :class:`ToolResult` per call, in order (empty when the student stopped).
        done: the episode is over.
        error_kind: the error site's kind (``repeated_failure`` for the same failure twice in a row).
        error_site: the first failed call's :class:`~composer_replication.types.HintContext`, or ``None``.
    """

    turn: int
    message_index: int
    results: list[ToolResult]
    done: bool
    error_kind: str | None = None
    error_site: HintContext | None = None


_SUMMARY = re.compile(r"(\d+) (passed|failed|errors?)\b")


def parse_test_summary(output: str) -> tuple[int, int] | None:
    """``(passed, total)`` from the last pytest summary line (``1 failed, 2 passed in 0.1s``) or a unittest
    ``Ran N tests`` report (``FAILED (failures=1, errors=1)``); ``None`` when there is neither."""
    for line in reversed(output.splitlines()):
        if re.search(r"\bin [\d.]+s\b", line) and _SUMMARY.search(line):
            counts = {kind.rstrip("s"): int(n) for n, kind in _SUMMARY.findall(line)}
            passed = counts.get("passed", 0)
            return passed, passed + counts.get("failed", 0) + counts.get("error", 0)
    ran = re.search(r"^Ran (\d+) tests? in", output, re.M)
    if ran is None:
        return None
    failed = re.search(r"^FAILED \((.*)\)", output, re.M)
    bad = sum(int(x) for x in re.findall(r"(?:failures|errors)=(\d+)", failed[1])) if failed else 0
    return max(int(ran[1]) - bad, 0), int(ran[1])


def _failure_lines(output: str) -> str:
    """The lines saying why tests failed (pytest's ``E``/``FAILED``/``ERROR`` lines, unittest's ``FAILED (...)``
    and ``AssertionError`` lines), at most six; ``""`` when there are none."""
    lines = [s for s in output.splitlines() if s.startswith(("E   ", "FAILED ", "ERROR ", "AssertionError"))]
    return "\n".join(dict.fromkeys(lines[:6]))


def _is_test_file(rel: str) -> bool:
    name = posixpath.basename(rel)
    return name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"


def tool_guide() -> str:
    """The tools and the call syntax, for the system message: one ``[TOOL_USE] name=... input={...}`` line per call
    (``actions.format_tool_use``), each tool's input keys from :data:`TOOL_SCHEMAS` (optional ones marked ``?``)."""
    lines = ["Call a tool with one line per call, exactly: [TOOL_USE] name=<tool> input=<JSON object>. Tools:"]
    for name, schema in TOOL_SCHEMAS.items():
        spec = schema["input_schema"]
        keys = [k + ("" if k in spec["required"] else "?") for k in spec["properties"]]
        lines.append(f"- {name}: {', '.join(keys)}")
    lines.append('Example: [TOOL_USE] name=Read input={"file_path": "src/app.py"}')
    lines.append("Paths are relative to the working directory. When the task is done, answer without a tool call.")
    return "\n".join(lines)


def opening_messages(config: EpisodeConfig, task: Task) -> list[dict[str, Any]]:
    """An episode's first two messages: the system message (``config.system_prompt``, the tool guide, the working
    directory) and the task's instruction as the user's."""
    guide = f"\n\n{tool_guide()}" if config.tool_guide else ""
    system = f"{config.system_prompt}{guide}\n\nWorking directory: {posixpath.normpath(task.cwd)}"
    return [{"role": "system", "content": system}, {"role": "user", "content": task.instruction}]


class Episode:
    """Runs episodes one after the other (:meth:`reset` starts the next; :meth:`close` frees the last).

    Args:
        config: limits and reward shaping.
        baselines: cache of each task's test counts before any action (share one dict between the
            episodes of a task group to run the pristine tests once per task).
    """

    def __init__(self, config: EpisodeConfig | None = None, *, baselines: dict | None = None) -> None:
        self.config = config or EpisodeConfig()
        self.baselines = {} if baselines is None else baselines
        self.task: Task | None = None
        self.workspace: Workspace | None = None
        self.messages: list[dict[str, Any]] = []
        self.steps: list[StepResult] = []
        self.done = True
        self._tmp: Path | None = None

    def __enter__(self) -> Episode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ episode
    def reset(self, task: Task) -> list[dict[str, Any]]:
        """Start ``task`` in a fresh workspace (the previous one is deleted); returns the opening messages."""
        self.close()
        self.task, self._tmp = task, Path(tempfile.mkdtemp(prefix="cr-agent-", dir=self.config.workdir))
        self.workspace = _make_workspace(self._tmp / "ws", task, self.config.tools)
        self.messages = opening_messages(self.config, task)
        self.steps, self.done, self._sandbox_s, self._final = [], False, 0.0, None
        self._repeat = RepeatTracker()
        return list(self.messages)

    def step(self, action_text: str) -> StepResult:
        """Run one turn: every ``[TOOL_USE]`` call of ``action_text`` in order (see the module notes).

        Raises:
            RuntimeError: no episode is running (call :meth:`reset`) or it is already done.
        """
        if self.task is None or self.done:
            raise RuntimeError("Episode.step: no episode is running; call reset(task) first (and stop at done)")
        turn, index = len(self.steps), len(self.messages)
        calls = [b for b in parse_action(action_text) if b.kind == "tool_use"]
        ids = [f"call_{turn}_{i}" for i in range(len(calls))]
        message: dict[str, Any] = {"role": "assistant", "content": action_text}
        if any(b.name for b in calls):
            message["tool_calls"] = [tool_call(cid, b.name, b.text) for cid, b in zip(ids, calls) if b.name]
        self.messages.append(message)
        results = []
        for cid, block in zip(ids, calls):
            res = self._call(block, refused=len(results) >= self.config.max_calls_per_turn)
            results.append(res)
            self.messages.append(tool_message(cid, ERROR_PREFIX + res.output if res.failure else res.output))
        step = StepResult(turn=turn, message_index=index, results=results, done=False)
        failed = next((r for r in results if r.failure), None)
        kind = self._repeat.observe((failed.name, failed.output, failed.error_kind) if failed else None)
        if failed is not None:
            why = (_failure_lines(failed.output) if failed.failure == "test_failure"
                   else re.sub(r"</?tool_use_error>", "", failed.output))
            step.error_kind = kind
            step.error_site = error_site(
                kind=kind, message=why, tool_name=failed.name, available_tools=list(TOOL_SCHEMAS),
                tool_schema=TOOL_SCHEMAS.get(failed.name), intent=self.task.instruction)
        over = self._sandbox_s >= self.config.episode_timeout_s
        step.done = self.done = (not calls or turn + 1 >= self.task.max_turns or over
                                 or any(r.failure == "disk_limit" for r in results))
        self.steps.append(step)
        return step

    def _call(self, block: Any, *, refused: bool) -> ToolResult:
        ws, start = self.workspace, time.monotonic()
        args = block.arguments if block.arguments is not None or block.text.strip() else {}
        try:
            if refused:
                raise ToolError("too_many_calls", f"Error: at most {self.config.max_calls_per_turn} tool calls "
                                "run per turn; make the others in the next turn")
            if block.name in TOOL_SCHEMAS and args is None:
                json.loads(block.text)  # raises: the arguments are not JSON
            ws.budget_s = self.config.episode_timeout_s - self._sandbox_s
            out, failure = ws.call(block.name, args), None
            if block.name in ("Bash", "Write", "Edit") and ws.size_bytes() > self.config.tools.disk_mb << 20:
                raise ToolError("disk_limit", f"The workspace is over its {self.config.tools.disk_mb} MiB limit; "
                                "the episode ends")
        except json.JSONDecodeError as e:
            out, failure = f"<tool_use_error>Error parsing tool input: {e}</tool_use_error>", "bad_json"
        except ToolError as e:
            failure = e.failure
            if failure == "command_failed" and _failure_lines(str(e)):
                failure = "test_failure"
            out = str(e) if failure in _PLAIN else f"<tool_use_error>{e}</tool_use_error>"
        duration = time.monotonic() - start
        if block.name in ("Bash", "Grep"):  # the calls that run in the sandbox
            self._sandbox_s += duration
        return ToolResult(name=block.name, input=block.text if args is None else args,
                          output=clip(out, self.config.tools.max_output_chars), failure=failure,
                          duration_s=duration)

    # ------------------------------------------------------------------ reward
    def final_reward(self) -> tuple[float, dict[str, Any]]:
        """``(reward, components)``; runs ``test_command`` once (later calls return the same)."""
        if self.task is None:
            raise RuntimeError("Episode.final_reward: no episode; call reset(task) first")
        if self._final is not None:
            return self._final
        cfg, task = self.config, self.task
        self._restore_tests()
        res = self.workspace.run(task.test_command, cfg.test_timeout_s)
        solved = res.returncode == 0 and not res.timed_out
        counts = parse_test_summary(res.output)
        base = self._baseline() if counts and not solved else None
        progress = 0.0
        if counts and base and counts[1] and base[0] < base[1]:
            progress = min(max((counts[0] / counts[1] - base[0] / base[1]) / (1 - base[0] / base[1]), 0.0), 1.0)
        results = [r for s in self.steps for r in s.results]
        malformed = sum(r.failure in MALFORMED for r in results)
        penalty = min(cfg.malformed_penalty * malformed, cfg.max_penalty)
        reward = (1.0 if solved else cfg.partial_credit * progress) - penalty
        components = {
            "reward": reward, "solved": float(solved), "progress": progress, "penalty": penalty,
            "tests_passed": counts[0] if counts else None, "tests_total": counts[1] if counts else None,
            "baseline_passed": base[0] if base else None, "baseline_total": base[1] if base else None,
            "turns": len(self.steps), "tool_calls": len(results), "tool_errors": sum(bool(r.failure) for r in results),
            "malformed_calls": malformed, "timeouts": sum(r.failure == "timeout" for r in results),
            "test_exit_code": res.returncode, "test_timed_out": res.timed_out,
            "test_summary": "" if solved else _failure_lines(res.output) or res.output.strip()[-300:],
            "isolation": res.isolation,
        }  # fmt: skip
        self._final = (reward, components)
        return self._final

    def _restore_tests(self) -> None:
        """Write the task's test files back as the task gave them, so that editing a test never passes it."""
        for rel, text in self.task.files.items():
            try:
                if _is_test_file(rel):
                    self.workspace.put(self.workspace.resolve(rel), text)
            except (ToolError, OSError):
                continue

    def _baseline(self) -> tuple[int, int] | None:
        """The task's test counts before any action (cached in :attr:`baselines`)."""
        task = self.task
        key = hashlib.sha256(json.dumps([task.files, task.test_command, task.cwd], sort_keys=True).encode()).hexdigest()
        if key not in self.baselines:
            with tempfile.TemporaryDirectory(prefix="cr-agent-base-", dir=self.config.workdir) as tmp:
                ws = _make_workspace(Path(tmp) / "ws", task, self.config.tools)
                self.baselines[key] = parse_test_summary(ws.run(task.test_command, self.config.test_timeout_s).output)
        return self.baselines[key]

    def close(self) -> None:
        """Delete the workspace (nothing of the episode stays on disk)."""
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp, self.task, self.done = None, None, True


def _make_workspace(root: Path, task: Task, limits: ToolConfig) -> Workspace:
    for rel, text in task.files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return Workspace(root, posixpath.normpath(task.cwd), limits)


def run_task(episode: Episode, task: Task, *, policy: str = "solution") -> dict[str, Any]:
    """One episode of ``task`` with a scripted policy: ``"solution"`` replays ``task.solution_actions``
    (one call per turn), ``"none"`` acts not at all. Returns the checker's row (see ``__main__``)."""
    if policy not in ("solution", "none"):
        raise ValueError(f"policy must be 'solution' or 'none', got {policy!r}")
    episode.reset(task)
    for action in task.solution_actions if policy == "solution" else []:
        if episode.done:
            break
        episode.step(format_tool_use(action["name"], action["input"]))
    reward, parts = episode.final_reward()
    failures = [f"turn {s.turn}: {r.name}: {r.failure}" for s in episode.steps for r in s.results if r.failure]
    return {"task_id": task.task_id, "solved": bool(parts["solved"]), "reward": round(reward, 4),
            "turns": parts["turns"], "tool_errors": parts["tool_errors"], "failures": failures,
            "test_summary": parts["test_summary"]}
