"""Generate the bundled **synthetic** Claude Code sessions (the recipe's train and held-out data) and their tasks.

The sessions are not recordings of real users or of a real model: a scripted agent fixes small, hand-written
Python bugs (``bug_catalogue.py``) in made-up repositories, and ``claude_records.SessionWriter`` (the one writer
of Claude Code records in the tests) puts down what Claude Code 2.1 would have logged. The agent locates the
function (Grep, or it first reproduces the failure), Reads the module,
Edits the fix, runs the tests with Bash and reports, meeting the failures real sessions have: an unknown tool
(``Search``), a Read of a missing path, an Edit without ``new_string`` or with a ``replace_all`` of the wrong
type, an ``old_string`` that does not match, ``pytest: command not found``, failing test runs with tracebacks,
and a follow-up request for a regression test.

Variety: 12 bug families with 4-6 variants each, every session a different variant in a different project,
layout, module name, test command and path through the fix. Held-out sessions are whole sessions: one variant
of each of the first ``num_heldout`` families, so every held-out bug has a training bug of the same kind but
none of its names or values. Each session's :attr:`Session.task` is the same bug as an executable task (its
repository files, the fixed files, the test command and tests, the recorded tool calls as ``solution_actions``).

    python tests/synthetic/generate.py --out composer_replication/data/sessions \
        --tasks-out composer_replication/data/tasks/agentic

writes ``OUT/train/syn-NNN-<function>.jsonl`` and ``OUT/heldout/...``, and every session's task to
``TASKS_OUT/train.jsonl`` / ``heldout.jsonl`` (the agentic task format, docs/rollouts.md; the five hand-written
``train/fix-*.jsonl`` sessions, which are not generated, get theirs from ``hand_tasks.py``). The same seed always
gives byte-identical files (the bundled ones are this command's defaults; tests/core/test_bundled_data.py checks it).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bug_catalogue import FAMILIES, Bug, make_bug  # noqa: E402
from claude_records import SessionWriter, cat_n, pytest_failure, pytest_pass, session_bytes, text_block  # noqa: E402
from hand_tasks import HAND_TASKS  # noqa: E402

DEFAULT_SEED, DEFAULT_NUM_SESSIONS, DEFAULT_NUM_HELDOUT = 0, 48, 10
__all__ = ["FAMILIES", "Session", "build_session", "generate_sessions", "session_bytes", "write_sessions", "task_records",
           "write_tasks", "main"]


# ---------------------------------------------------------------------------- the scripted agent
_PROJECTS = ["ledger", "shopfront", "notes-api", "weatherbot", "taskq", "shortlink", "feedkit", "metricsd",
             "authsvc", "catalog", "scheduler", "invoicer", "chatlog", "recipes-app", "trackr", "pollster",
             "mailer", "geo-tools", "bookshelf", "fleet"]  # fmt: skip
_USERS = ["dev", "alex", "sam", "maria", "kim", "jordan", "priya", "lee"]
_MODULES = {"missing_default": ["config", "loader", "settings"], "floor_pages": ["pager", "batching", "chunks"],
            "strict_limit": ["limits", "policy", "quota"], "mutable_default": ["registry", "collect", "store"],
            "none_input": ["text", "normalize", "clean"], "int_mean": ["stats", "metrics", "summary"],
            "case_compare": ["accounts", "identity", "users"], "sort_order": ["ranking", "leaderboard", "reports"],
            "split_spaces": ["parsing", "search", "tokens"], "tail_slice": ["history", "events", "logs"],
            "dedupe_order": ["tags", "unique", "sets"], "zero_pad": ["fmt", "durations", "display"]}  # fmt: skip


@dataclass(kw_only=True)
class _Repo:
    cwd: str
    module_rel: str
    test_rel: str
    import_name: str
    test_cmd: str
    written: dict[str, str] = field(default_factory=dict)  # files the agent created (the regression test)


def _repo(rng: random.Random, bug: Bug) -> _Repo:
    project, user = rng.choice(_PROJECTS), rng.choice(_USERS)
    pkg, module = project.replace("-", "_"), rng.choice(_MODULES[bug.family])
    folder = rng.choice([f"src/{pkg}", pkg, "app"])
    test_rel = f"tests/test_{module}.py"
    cmd = rng.choice([f"python -m pytest {test_rel} -q", f"pytest -q {test_rel}", f"python -m pytest -q {test_rel}"])
    return _Repo(cwd=f"/home/{user}/{project}", module_rel=f"{folder}/{module}.py", test_rel=test_rel,
                 import_name=f"{folder.removeprefix('src/').replace('/', '.')}.{module}", test_cmd=cmd)  # fmt: skip


class _Agent:
    """Writes one session; ``source`` tracks the module as the agent edits it."""

    def __init__(self, rng: random.Random, bug: Bug, repo: _Repo, w: SessionWriter) -> None:
        self.rng, self.bug, self.repo, self.w = rng, bug, repo, w
        self.source = bug.buggy
        self.module_abs = f"{repo.cwd}/{repo.module_rel}"
        self.test_lines, self.test_info = _test_file(bug, repo)
        self.stem = repo.module_rel.rsplit("/", 1)[-1].removesuffix(".py")

    def say(self, *options: str) -> dict[str, Any]:
        return text_block(self.rng.choice(options))

    def call(self, name: str, args: dict[str, Any], result: str, *, error: bool = False, tur: Any = None,
             text: dict[str, Any] | None = None, thinking: str | None = None) -> None:  # fmt: skip
        blocks = ([self.w.thinking_block(thinking)] if thinking else []) + ([text] if text else [])
        blocks.append(self.w.tool_block(name, args))
        tur = tur if tur is not None else (result if error else {"type": "text"})
        self.w.assistant(blocks, [(result, error, tur)], hook=name in ("Edit", "Write") and self.rng.random() < 0.5)

    def bash(self, command: str, output: str, *, error: bool, text: dict[str, Any] | None = None) -> None:
        tur = {"stdout": output, "stderr": "", "interrupted": False, "isImage": False}
        self.call("Bash", {"command": command, "description": f"Run the {self.stem} tests"}, output, error=error,
                  tur=tur, text=text)  # fmt: skip

    def test_output(self, *, fixed: bool, extra: int = 0) -> tuple[str, bool]:
        n = len(self.bug.tests) + extra
        if fixed:
            return pytest_pass(n, self.rng.uniform(0.01, 0.2)), False
        name = self.bug.tests[0][0]
        signature, body, line = self.test_info[name]
        frame = None
        if self.bug.raises_in_module:
            at = self.source[: self.source.index(self.bug.old)].count("\n") + 1
            frame = (self.repo.module_rel, at, self.bug.fn, self.source.splitlines()[at - 1])
        out = pytest_failure(test_rel=self.repo.test_rel, test=name, signature=signature, body=body, test_line=line,
                             error=self.bug.error, frame=frame, order=[False] + [True] * (n - 1),
                             seconds=self.rng.uniform(0.02, 0.3))  # fmt: skip
        return out, True

    def locate(self) -> None:
        """Find the function: Grep, maybe after reproducing, an unknown tool, or a wrong guess."""
        way = self.rng.choice(["grep", "grep", "reproduce", "guess", "search"])
        if way == "reproduce":
            out, err = self.test_output(fixed=False)
            if self.repo.test_cmd.startswith("pytest"):
                self.repo.test_cmd = "python -m " + self.repo.test_cmd
            self.bash(self.repo.test_cmd, out, error=err,
                      text=self.say("Let me reproduce the failure first.", "First I'll run the tests to see it fail."))
        elif way == "guess":
            msg = f"<tool_use_error>File does not exist. Current working directory: {self.repo.cwd}</tool_use_error>"
            self.call("Read", {"file_path": f"{self.repo.cwd}/{self.stem}.py"}, msg, error=True)
        elif way == "search":
            msg = "<tool_use_error>Error: No such tool available: Search</tool_use_error>"
            self.call("Search", {"query": f"def {self.bug.fn}", "path": self.repo.cwd}, msg, error=True,
                      text=self.say(f"Let me find `{self.bug.fn}`.", "I'll search for the function."))
        lines = self.source.splitlines()
        line = next(i for i, s in enumerate(lines, 1) if s.startswith(f"def {self.bug.fn}("))
        if self.rng.random() < 0.6:
            args = {"pattern": f"def {self.bug.fn}", "path": self.repo.cwd, "output_mode": "content", "-n": True}
            result = f"{self.repo.module_rel}:{line}:{lines[line - 1]}"
        else:
            args = {"pattern": f"def {self.bug.fn}\\(", "path": self.repo.cwd, "glob": "*.py"}
            result = f"Found 1 file\n{self.module_abs}"
        text = None if way != "grep" else self.say(f"Let me find where `{self.bug.fn}` is defined.",
                                                   f"I'll look for `{self.bug.fn}`.", "Searching for the function.")
        if way in ("guess", "search"):
            text = self.say("That didn't work; I'll use Grep.", "Let me search with Grep instead.")
        self.call("Grep", args, result, text=text)

    def read(self) -> None:
        """Read the module (sometimes the test file too, in the same response)."""
        lines = self.source.splitlines()
        info = {"type": "text", "file": {"filePath": self.module_abs, "numLines": len(lines), "startLine": 1}}
        read_module = (self.w.tool_block("Read", {"file_path": self.module_abs}), (cat_n(lines), False, info))
        if self.rng.random() < 0.3:
            read_test = (self.w.tool_block("Read", {"file_path": f"{self.repo.cwd}/{self.repo.test_rel}"}),
                         (cat_n(self.test_lines), False, {"type": "text"}))  # fmt: skip
            blocks = [self.say("Reading the module and its tests.", "Let me read both files."), read_module[0], read_test[0]]
            self.w.assistant(blocks, [read_module[1], read_test[1]], interleave=self.rng.random() < 0.5)
        else:
            self.w.assistant([read_module[0]], [read_module[1]])

    def fix(self) -> None:
        """Edit the fix, after one failed Edit in some sessions."""
        b, path = self.bug, self.module_abs
        trouble = self.rng.choice([None, None, None, "missing", "mismatch", "type"])
        cause = b.cause[0].upper() + b.cause[1:]
        thinking = cause + "." if self.rng.random() < 0.4 else None
        explain = self.say(f"Found it: {b.cause}.", f"The bug: {b.cause}. I'll fix that.", f"{cause}.")
        if trouble == "missing":
            msg = ("<tool_use_error>InputValidationError: Edit failed due to the following issue:\n"
                   "The required parameter `new_string` is missing</tool_use_error>")  # fmt: skip
            self.call("Edit", {"file_path": path, "old_string": b.old}, msg, error=True, text=explain, thinking=thinking)
            explain, thinking = self.say("I left out `new_string`; retrying with the full edit.",
                                         "The edit needs `new_string`."), None  # fmt: skip
        elif trouble == "mismatch":
            wrong = b.old.replace("    ", "  ", 1) if b.old.startswith("    ") else b.old.replace(" ", "  ", 1)
            msg = f"<tool_use_error>String to replace not found in file.\nString: {wrong}</tool_use_error>"
            self.call("Edit", {"file_path": path, "old_string": wrong, "new_string": b.new}, msg, error=True,
                      text=explain, thinking=thinking)  # fmt: skip
            explain, thinking = self.say("The indentation was off; using the exact text from the file.",
                                         "Wrong whitespace in `old_string`; retrying."), None  # fmt: skip
        elif trouble == "type":
            msg = ("<tool_use_error>InputValidationError: Edit failed due to the following issue:\n"
                   "The parameter `replace_all` type is expected as `boolean` but provided as `string`</tool_use_error>")
            self.call("Edit", {"file_path": path, "old_string": b.old, "new_string": b.new, "replace_all": "false"},
                      msg, error=True, text=explain, thinking=thinking)  # fmt: skip
            explain, thinking = self.say("`replace_all` must be a boolean; dropping it.",
                                         "Retrying without `replace_all`."), None  # fmt: skip
        self.source = self.source.replace(b.old, b.new)
        at = self.source[: self.source.index(b.new)].count("\n") + 1
        snippet = cat_n(self.source.splitlines()[max(0, at - 2) : at + b.new.count("\n") + 1], max(1, at - 1))
        result = (f"The file {path} has been updated. Here's the result of running `cat -n` on a snippet of the "
                  f"edited file:\n{snippet}")  # fmt: skip
        self.call("Edit", {"file_path": path, "old_string": b.old, "new_string": b.new}, result, text=explain,
                  thinking=thinking, tur={"filePath": path, "oldString": b.old, "newString": b.new})  # fmt: skip

    def run_tests(self, *, extra: int = 0) -> None:
        """Run the tests after the fix (a missing ``pytest`` executable first, in some sessions)."""
        cmd = self.repo.test_cmd
        if cmd.startswith("pytest") and self.rng.random() < 0.5:
            self.bash(cmd, "Exit code 127\n/bin/bash: line 1: pytest: command not found", error=True,
                      text=self.say("Now the tests.", "Running the tests."))  # fmt: skip
            cmd = self.repo.test_cmd = "python -m " + cmd
            text = self.say("`pytest` is not on PATH; using `python -m pytest`.", "Retrying through the module.")
        else:
            text = self.say("Now let me run the tests.", "Running the tests to confirm.", "Let me verify.") \
                if self.rng.random() < 0.6 else None  # fmt: skip
        out, err = self.test_output(fixed=True, extra=extra)
        self.bash(cmd, out, error=err, text=text)

    def report(self, n_tests: int) -> None:
        b = self.bug
        self.w.assistant([self.say(
            f"Fixed. {b.cause[0].upper() + b.cause[1:]}; {b.fix}. All {n_tests} tests pass.",
            f"Done: {b.fix} in `{self.repo.module_rel}`. The tests pass ({n_tests} passed).",
            f"The bug was that {b.cause}. Now {b.fix}, and `{self.repo.test_rel}` passes.")])
        if self.rng.random() < 0.5:
            self.w.stop_hook()

    def regression_test(self) -> None:
        """The user asks for a regression test: Write a new test file, run it, report."""
        self.w.user(self.rng.choice(["Can you add a regression test for this?", "Please add a test for this case.",
                                     "Thanks. Add a regression test too."]))  # fmt: skip
        name, (_, body) = self.bug.tests[0][0] + "_regression", self.bug.tests[0]
        fixture = "tmp_path" if any("tmp_path" in line for line in body) else ""
        rel = f"tests/test_{self.stem}_regression.py"
        content = "\n".join([f"from {self.repo.import_name} import {self.bug.fn}", *self.bug.imports, "", "",
                             f"def {name}({fixture}):", *body, ""])  # fmt: skip
        path = f"{self.repo.cwd}/{rel}"
        self.repo.written[rel] = content
        self.call("Write", {"file_path": path, "content": content}, f"File created successfully at: {path}",
                  text=self.say("Adding a regression test.", "I'll add a test that fails on the old code."),
                  tur={"type": "create", "filePath": path, "content": content})  # fmt: skip
        self.repo.test_cmd = self.repo.test_cmd.replace(self.repo.test_rel, f"{self.repo.test_rel} {rel}")
        out, _ = self.test_output(fixed=True, extra=1)
        self.bash(self.repo.test_cmd, out, error=False)
        self.w.assistant([self.say(f"Added `{rel}`; it passes with the fix.", f"The regression test is in `{rel}` and passes.")])


def _test_file(bug: Bug, repo: _Repo) -> tuple[list[str], dict[str, tuple[str, list[str], int]]]:
    """The module's test file and, per test, ``(signature, body, line of its last body line)``."""
    lines = [f"from {repo.import_name} import {bug.fn}", *bug.imports, ""]
    info: dict[str, tuple[str, list[str], int]] = {}
    for name, body in bug.tests:
        signature = f"def {name}({'tmp_path' if any('tmp_path' in line for line in body) else ''}):"
        lines += ["", signature, *body]
        info[name] = (signature, body, len(lines))
    return lines + [""], info


# ---------------------------------------------------------------------------- sessions, tasks, files
@dataclass
class Session:
    """One generated session: its Claude Code records and the same bug as an executable task."""

    records: list[dict[str, Any]]
    task: dict[str, Any]
    """``task_id``, ``instruction``, ``files`` (``{relative path: text}``: the repository before the fix),
    ``fixed_files`` (the files the session changed or created, after it), ``test_command`` (argv, exit 0 =
    solved; ``PYTHONHASHSEED=0``: a ``dedupe_order`` bug, ``list(set(...))``, passes its test in about one
    process in six otherwise), ``tests`` (the test names; the first fails before the fix), ``solution_actions`` (the session's
    tool calls that succeeded, in order, ``{"name", "input"}``, paths relative to the workspace),
    ``family``, ``cwd`` (the session's working directory, which the paths were relative to)."""


def _relative(value: Any, cwd: str) -> Any:
    if isinstance(value, str):
        return "." if value == cwd else value.replace(cwd + "/", "")
    return {k: _relative(v, cwd) for k, v in value.items()} if isinstance(value, dict) else value


def build_session(key: str, rng: random.Random, bug: Bug, task_id: str = "") -> Session:
    """The session fixing ``bug`` (``key`` seeds its ids; ``rng`` makes every other choice)."""
    repo = _repo(rng, bug)
    start = datetime(2026, 1, 5, 8) + timedelta(days=rng.randint(0, 70), minutes=rng.randint(0, 600))
    model = rng.choice(["claude-sonnet-4-5-20250929"] * 3 + ["claude-opus-4-5-20251101"])
    w = SessionWriter(rng, key=key, cwd=repo.cwd, start=start, model=model, version=rng.choice(["2.1.42", "2.1.38", "2.1.27"]))
    agent = _Agent(rng, bug, repo, w)
    w.snapshot()
    symptom = bug.symptom[0].upper() + bug.symptom[1:]
    prompt = rng.choice([f"{symptom}. Can you fix it?", f"Bug: {bug.symptom}. Please fix.",
                         f"`{repo.test_rel}::{bug.tests[0][0]}` fails. {symptom}.",
                         f"{symptom}. The fix should be small; please keep the tests passing."])  # fmt: skip
    w.user(prompt)
    agent.locate()
    agent.read()
    agent.fix()
    agent.run_tests()
    agent.report(len(bug.tests))
    if rng.random() < 0.3:
        agent.regression_test()
    files = {repo.module_rel: bug.buggy, repo.test_rel: "\n".join(agent.test_lines),
             "pyproject.toml": '[tool.pytest.ini_options]\npythonpath = [".", "src"]\n'}  # fmt: skip
    task = {"task_id": task_id or key, "instruction": prompt, "files": files,
            "fixed_files": {repo.module_rel: agent.source, **repo.written},
            "test_command": ["env", "PYTHONHASHSEED=0", "python", "-m", "pytest", "-q", repo.test_rel],
            "tests": [t for t, _ in bug.tests],
            "solution_actions": [{"name": n, "input": _relative(a, repo.cwd)} for i, (n, a) in enumerate(w.calls)
                                 if i not in w.failed],
            "family": bug.family, "cwd": repo.cwd}  # fmt: skip
    return Session(w.records, task)


def _plan(seed: int, num_sessions: int, num_heldout: int) -> list[tuple[str, int, bool]]:
    """``(family, variant, held_out)`` per session, in session order."""
    combos = [(f, v) for f, (variants, _) in FAMILIES.items() for v in range(len(variants))]
    if not 1 <= num_sessions <= len(combos):
        raise ValueError(f"'num_sessions' must be in [1, {len(combos)}] (one per bug variant), got {num_sessions}")
    if not 0 <= num_heldout <= min(len(FAMILIES), num_sessions - 1):
        raise ValueError(f"'num_heldout' must be in [0, {min(len(FAMILIES), num_sessions - 1)}] (at most one "
                         f"per bug family, leaving one session to train on), got {num_heldout}")  # fmt: skip
    rng = random.Random(f"plan:{seed}")
    rng.shuffle(combos)
    chosen = combos[:num_sessions]
    held: set[tuple[str, int]] = set()
    for family in dict.fromkeys(f for f, _ in chosen):
        if len(held) == num_heldout:
            break
        mine = [c for c in chosen if c[0] == family]
        if len(mine) > 1:  # keep at least one variant of the family for training
            held.add(mine[0])
    if len(held) < num_heldout:
        raise ValueError(f"only {len(held)} families have two or more sessions among {num_sessions}; "
                         f"raise 'num_sessions' or lower 'num_heldout' ({num_heldout})")  # fmt: skip
    return [(f, v, (f, v) in held) for f, v in chosen]


def generate_sessions(*, seed: int = DEFAULT_SEED, num_sessions: int = DEFAULT_NUM_SESSIONS,
                      num_heldout: int = DEFAULT_NUM_HELDOUT) -> dict[str, dict[str, Session]]:  # fmt: skip
    """``{"train": {stem: Session}, "heldout": {...}}``; everything follows from ``seed``.

    Raises:
        ValueError: a count out of range (names the allowed range).
    """
    out: dict[str, dict[str, Session]] = {"train": {}, "heldout": {}}
    for i, (family, variant, held) in enumerate(_plan(seed, num_sessions, num_heldout)):
        bug = make_bug(family, variant)
        stem = f"syn-{i:03d}-{bug.fn.replace('_', '-')}"
        out["heldout" if held else "train"][stem] = build_session(f"{seed}:{stem}", random.Random(f"session:{seed}:{i}"), bug, stem)
    return out


def write_sessions(out: str | Path, **kwargs: Any) -> list[Path]:
    """Write :func:`generate_sessions` under ``out/train`` and ``out/heldout``, replacing the ``syn-*.jsonl``
    files there (the hand-written sessions stay); returns the written files."""
    written: list[Path] = []
    for split, sessions in generate_sessions(**kwargs).items():
        folder = Path(out) / split
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("syn-*.jsonl"):
            old.unlink()
        for stem, session in sessions.items():
            (path := folder / f"{stem}.jsonl").write_bytes(session_bytes(session.records))
            written.append(path)
    return written


def task_records(**kwargs: Any) -> dict[str, list[dict[str, Any]]]:
    """``{"train": [task, ...], "heldout": [...]}``: every bundled session's executable task, split as its session
    is (the hand-written sessions' tasks, all train, first). ``max_turns`` leaves the solution two spare turns."""
    out: dict[str, list[dict[str, Any]]] = {"train": [], "heldout": []}
    hand = [(t, "train") for t in HAND_TASKS]
    generated = [(s.task, split) for split, sessions in generate_sessions(**kwargs).items() for s in sessions.values()]
    for t, split in hand + generated:
        meta = {"session": f"sessions/{split}/{t['task_id']}.jsonl"}
        meta.update({k: t[k] for k in ("family", "tests") if k in t})
        out[split].append({"task_id": t["task_id"], "instruction": t["instruction"], "files": t["files"],
                           "test_command": t["test_command"], "max_turns": max(8, len(t["solution_actions"]) + 2),
                           "solution_actions": t["solution_actions"], "cwd": t["cwd"], "metadata": meta})
    return out


def write_tasks(out: str | Path, **kwargs: Any) -> list[Path]:
    """Write :func:`task_records` as ``out/train.jsonl`` and ``out/heldout.jsonl``; returns the two paths."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, tasks in task_records(**kwargs).items():
        path = folder / f"{split}.jsonl"
        path.write_text("".join(json.dumps(t, sort_keys=True) + "\n" for t in tasks), encoding="utf-8")
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tests/synthetic/generate.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder to write train/ and heldout/ into")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of every random choice")
    parser.add_argument("--num-sessions", type=int, default=DEFAULT_NUM_SESSIONS, help="sessions in all")
    parser.add_argument("--num-heldout", type=int, default=DEFAULT_NUM_HELDOUT,
                        help="whole sessions held out for evaluation (at most one per bug family)")
    parser.add_argument("--tasks-out", help="folder to write the sessions' tasks into (train.jsonl, heldout.jsonl)")
    args = parser.parse_args(argv)
    counts = dict(seed=args.seed, num_sessions=args.num_sessions, num_heldout=args.num_heldout)
    try:
        paths = write_sessions(args.out, **counts)
        if args.tasks_out:
            write_tasks(args.tasks_out, **counts)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    n_held = sum(p.parent.name == "heldout" for p in paths)
    print(f"wrote {len(paths) - n_held} train and {n_held} held-out sessions under {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
