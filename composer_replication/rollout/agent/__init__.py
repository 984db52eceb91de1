"""Agentic episodes: the student fixes a repository with Claude Code's tools; the tests give the reward.

- :mod:`.tasks`: :class:`Task` (a repository, a request, a test command) and :func:`load_tasks` (JSONL).
- :mod:`.tools`: Read, Write, Edit, Grep, Glob in-process on the workspace; Bash in the OS sandbox.
- :mod:`.episode`: :class:`Episode` (``reset(task) -> messages``, ``step(action_text)``,
  ``final_reward()``), the error sites and the reward.
- ``python -m composer_replication.rollout.agent TASKS.jsonl --policy solution``: the task checker.
"""

from composer_replication.rollout.agent.episode import Episode, EpisodeConfig, ToolResult, run_task
from composer_replication.rollout.agent.tasks import Task, load_tasks, parse_task
from composer_replication.rollout.agent.tools import TOOL_SCHEMAS, ToolConfig

__all__ = ["TOOL_SCHEMAS", "Episode", "EpisodeConfig", "Task", "ToolConfig", "ToolResult", "load_tasks",
           "parse_task", "run_task"]
