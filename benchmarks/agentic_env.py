"""Throughput of agentic episodes and what the OS sandbox adds to a tool call.

An agentic GRPO step runs G episodes of several turns per task; the environment must cost little next to
sampling. Target (issue #21): bubblewrap adds at most 50 ms per tool call at the median.

    python -m benchmarks.agentic_env [--calls 40] [--episodes 6] [--no-record]

Tool calls: each tool on a small workspace, one call at a time; Bash and Grep (sandboxed) alternate
``os_sandbox="require"`` (bubblewrap) and ``"off"`` (the same code path without namespaces), so the overhead
is a difference measured side by side. Episodes: the first bundled training task (what the ``agentic`` preset
trains on) replayed from its recorded fix, and with no action; turns and episodes per second.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from benchmarks.report import parser, record, table, timed
from composer_replication.data import bundled_path
from composer_replication.rollout.agent import Episode, EpisodeConfig, ToolConfig, load_tasks, run_task
from composer_replication.rollout.agent.tasks import BUNDLED_TASKS
from composer_replication.rollout.agent.tools import Workspace
from composer_replication.rollout.sandbox import os_sandbox_status

_EDIT = {"file_path": "pkg/mod_0.py"}
CALLS = {  # tool -> argument sets, used in turn
    "Read": [{"file_path": "pkg/mod_0.py"}],
    "Glob": [{"pattern": "**/*.py"}],
    "Edit": [{**_EDIT, "old_string": "x + 1\n", "new_string": "x + 1  # e\n"},
             {**_EDIT, "old_string": "x + 1  # e\n", "new_string": "x + 1\n"}],
}
SANDBOXED = {  # label -> (tool, input): the calls that run in the sandbox
    "Bash `true`": ("Bash", {"command": "true"}),
    "Bash `ls -R`": ("Bash", {"command": "ls -R"}),
    "Bash `python -c pass`": ("Bash", {"command": "python -c pass"}),
    "Grep (regex in the sandbox)": ("Grep", {"pattern": "def f_1", "output_mode": "content", "-n": True}),
}


def _seconds(ws: Workspace, name: str, args: dict) -> float:
    return timed(ws.call, name, args)[0]


def tool_latency(n: int) -> list[tuple[str, float, float | None]]:
    """``(tool, median ms in the sandbox, median ms without it)``; sandboxed calls alternate the two modes."""
    with tempfile.TemporaryDirectory() as tmp:
        ws = {m: Workspace(Path(tmp, m), "/workspace", ToolConfig(os_sandbox=m)) for m in ("require", "off")}
        for w in ws.values():
            for i in range(20):  # 20 modules of 50 functions
                text = "".join(f"def f_{j}(x):\n    return x + {j}\n\n" for j in range(50))
                w.call("Write", {"file_path": f"pkg/mod_{i}.py", "content": text})
        rows: list[tuple[str, float, float | None]] = [
            (name, 1e3 * statistics.median(_seconds(ws["require"], name, sets[i % len(sets)]) for i in range(n)), None)
            for name, sets in CALLS.items()
        ]
        for label, (name, args) in SANDBOXED.items():
            pairs = [[_seconds(ws[m], name, args) for m in ("require", "off")] for _ in range(n)]
            rows.append((label, 1e3 * statistics.median(p[0] for p in pairs), 1e3 * statistics.median(p[1] for p in pairs)))
    return rows


def episodes(n: int) -> list[tuple[str, float, float, float]]:
    """``(policy, episodes/s, turns/s, median s per episode)`` of the first bundled training task (the ``agentic``
    preset's), replayed from its ``solution_actions`` and with no action."""
    task, out = load_tasks(bundled_path(BUNDLED_TASKS["train"]))[0], []
    with tempfile.TemporaryDirectory() as tmp, Episode(EpisodeConfig(workdir=tmp)) as ep:
        for policy in ("solution", "none"):
            times, turns = [], 0
            for _ in range(n):
                seconds, row = timed(run_task, ep, task, policy=policy)
                times.append(seconds)
                turns += row["turns"]
                assert row["solved"] == (policy == "solution"), row
            out.append((policy, n / sum(times), turns / sum(times), statistics.median(times)))
    return out


def to_markdown(tools: list, eps: list, cmd: str) -> str:
    """The agentic_env section of docs/benchmarks.md: tool-call latencies, then episodes."""
    lines = ["# Agentic episodes", "", f"`{cmd}`: tool-call latency on a 20-file workspace and episodes of "
             "the first bundled training task (its recorded fix, then the final test run). Median milliseconds; "
             "`off` is the same code path without bubblewrap, measured in alternation.", "",
             *table(["tool call", "sandbox (ms)", "without OS sandbox (ms)", "sandbox adds (ms)"],
                    [[name, f"{ms:.2f}", *(["-", "in-process"] if off is None else [f"{off:.2f}", f"{ms - off:+.1f}"])]
                     for name, ms, off in tools])]
    adds = [ms - off for _, ms, off in tools if off is not None]
    lines += ["", f"The sandbox adds at most {max(adds):.0f} ms per call at the median (target: 50 ms).", "",
              *table(["policy", "episodes/s", "turns/s", "s per episode (median)"],
                     [[p, f"{e:.2f}", f"{t:.2f}" if t else "-", f"{s:.2f}"] for p, e, t, s in eps])]
    lines += ["", "An episode's cost is its test runs: `solution` runs pytest twice (its Bash call and the final "
              "run), `none` once (plus, once per task, the pristine baseline of the partial credit). Absolute "
              "figures move with the machine's load (the stamp below); the sandbox's cost is a difference measured "
              "side by side."]
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=40, help="calls per tool (and per sandbox mode for Bash)")
    p.add_argument("--episodes", type=int, default=6, help="episodes per policy")
    args = p.parse_args()
    ok, reason = os_sandbox_status()
    if not ok:
        raise SystemExit(f"benchmarks.agentic_env needs bubblewrap: {reason}")
    tools, eps = tool_latency(args.calls), episodes(args.episodes)
    md = to_markdown(tools, eps, f"python -m benchmarks.agentic_env --calls {args.calls} --episodes {args.episodes}")
    record(args, "agentic_env", md, echo=True)


if __name__ == "__main__":
    main()
