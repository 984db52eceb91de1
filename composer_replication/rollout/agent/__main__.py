"""Check a task file: replay each task's ``solution_actions`` (or nothing) in the sandbox.

    python -m composer_replication.rollout.agent TASKS.jsonl --policy solution   # exit 0: every task solved
    python -m composer_replication.rollout.agent TASKS.jsonl --policy none       # no action: all should fail

One JSON line per task on stdout (``task_id``, ``solved``, ``reward``, ``turns``, ``tool_errors``,
``failures``); a bad task file or a solution that does not solve its task is reported on stderr,
naming the line and the field. Exit status: 0 every task solved, 1 some not, 2 bad input or no sandbox.
Workspaces are temporary folders, deleted after each task.
"""

from __future__ import annotations

import argparse
import json
import sys

from composer_replication.rollout.agent.episode import Episode, EpisodeConfig, run_task
from composer_replication.rollout.agent.tasks import load_tasks
from composer_replication.rollout.agent.tools import ToolConfig
from composer_replication.rollout.sandbox import SandboxUnavailableError


def main(argv: list[str] | None = None) -> int:
    """Run the checker (see the module notes); returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m composer_replication.rollout.agent", description=__doc__.split("\n")[0])
    p.add_argument("tasks", help="a JSONL file of tasks (docs/rollouts.md, 'Agentic tasks')")
    p.add_argument("--policy", choices=("solution", "none"), default="solution",
                   help="solution: replay each task's solution_actions; none: run no action")
    p.add_argument("--os-sandbox", choices=("require", "auto", "off"), default="require",
                   help="require bubblewrap (default); auto: without it where it cannot run; off: never")
    p.add_argument("--test-timeout", type=float, default=60.0, help="seconds one test_command run may take")
    args = p.parse_args(argv)
    try:
        tasks = load_tasks(args.tasks)
        config = EpisodeConfig(tools=ToolConfig(os_sandbox=args.os_sandbox), test_timeout_s=args.test_timeout)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    unsolved = 0
    with Episode(config) as episode:
        for task in tasks:
            try:
                row = run_task(episode, task, policy=args.policy)
            except SandboxUnavailableError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            print(json.dumps({k: v for k, v in row.items() if k != "test_summary"}), flush=True)
            if not row["solved"]:
                unsolved += 1
                if args.policy == "solution":
                    print(f"error: {task.source}: task {task.task_id!r}: `solution_actions` do not solve it "
                          f"(failed calls: {row['failures'] or 'none'}; tests: {row['test_summary']})", file=sys.stderr)
    return 0 if unsolved == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
