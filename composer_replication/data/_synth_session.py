"""The agent script of the synthetic session generator: one bug-fix session as Claude Code records.

The scripted agent does what a strong coding agent does on a small bug: locate the function (Grep,
or first reproduce the failure with the tests), Read the module, Edit the fix, run the tests with
Bash, and report. Random choices (all from one seeded ``random.Random``) vary the path and insert
the failures real sessions have: an unknown tool (``Search``), a Read of a path that does not exist,
an Edit without ``new_string`` or with a ``replace_all`` of the wrong type, an ``old_string`` that
does not match, ``pytest: command not found``, failing test runs with tracebacks, and a follow-up
request that makes the agent Write a regression test.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from composer_replication.data._synth_bugs import Bug
from composer_replication.data._synth_records import (
    SessionWriter,
    cat_n,
    pytest_failure,
    pytest_pass,
    text_block,
)

__all__ = ["build_session"]

_PROJECTS = ["ledger", "shopfront", "notes-api", "weatherbot", "taskq", "shortlink", "feedkit", "metricsd",
             "authsvc", "catalog", "scheduler", "invoicer", "chatlog", "recipes-app", "trackr", "pollster",
             "mailer", "geo-tools", "bookshelf", "fleet"]
_USERS = ["dev", "alex", "sam", "maria", "kim", "jordan", "priya", "lee"]
_MODULES = {"missing_default": ["config", "loader", "settings"], "floor_pages": ["pager", "batching", "chunks"],
            "strict_limit": ["limits", "policy", "quota"], "mutable_default": ["registry", "collect", "store"],
            "none_input": ["text", "normalize", "clean"], "int_mean": ["stats", "metrics", "summary"],
            "case_compare": ["accounts", "identity", "users"], "sort_order": ["ranking", "leaderboard", "reports"],
            "split_spaces": ["parsing", "search", "tokens"], "tail_slice": ["history", "events", "logs"],
            "dedupe_order": ["tags", "unique", "sets"], "zero_pad": ["fmt", "durations", "display"]}


@dataclass(kw_only=True)
class _Repo:
    cwd: str
    module_rel: str
    test_rel: str
    import_name: str
    test_cmd: str


def _repo(rng: random.Random, bug: Bug) -> _Repo:
    project, user = rng.choice(_PROJECTS), rng.choice(_USERS)
    pkg, module = project.replace("-", "_"), rng.choice(_MODULES[bug.family])
    folder = rng.choice([f"src/{pkg}", pkg, "app"])
    test_rel = f"tests/test_{module}.py"
    cmd = rng.choice([f"python -m pytest {test_rel} -q", f"pytest -q {test_rel}", f"python -m pytest -q {test_rel}"])
    return _Repo(cwd=f"/home/{user}/{project}", module_rel=f"{folder}/{module}.py", test_rel=test_rel,
                 import_name=f"{folder.removeprefix('src/').replace('/', '.')}.{module}", test_cmd=cmd)


class _Agent:
    """Writes one session; ``source`` tracks the module as the agent edits it."""

    def __init__(self, rng: random.Random, bug: Bug, repo: _Repo, w: SessionWriter) -> None:
        self.rng, self.bug, self.repo, self.w = rng, bug, repo, w
        self.source = "\n".join(bug.source)
        self.module_abs = f"{repo.cwd}/{repo.module_rel}"
        self.test_lines, self.test_info = _test_file(bug, repo)

    # ------------------------------------------------------------------ helpers
    def say(self, *options: str) -> dict[str, Any]:
        return text_block(self.rng.choice(options))

    def call(self, name: str, args: dict[str, Any], result: str, *, error: bool = False, tur: Any = None,
             text: dict[str, Any] | None = None, thinking: str | None = None) -> None:
        blocks = ([self.w.thinking_block(thinking)] if thinking else []) + ([text] if text else [])
        blocks.append(self.w.tool_block(name, args))
        tur = tur if tur is not None else (result if error else {"type": "text"})
        self.w.assistant(blocks, [(result, error, tur)], hook=name in ("Edit", "Write") and self.rng.random() < 0.5)

    def bash(self, command: str, output: str, *, error: bool, text: dict[str, Any] | None = None) -> None:
        tur = {"stdout": output, "stderr": "", "interrupted": False, "isImage": False}
        self.call("Bash", {"command": command, "description": f"Run the {self.stem} tests"}, output,
                  error=error, tur=tur, text=text)

    @property
    def stem(self) -> str:
        return self.repo.module_rel.rsplit("/", 1)[-1].removesuffix(".py")

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
                             seconds=self.rng.uniform(0.02, 0.3))
        return out, True

    # ------------------------------------------------------------------ steps
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
            wrong = f"{self.repo.cwd}/{self.stem}.py"
            msg = f"<tool_use_error>File does not exist. Current working directory: {self.repo.cwd}</tool_use_error>"
            self.call("Read", {"file_path": wrong}, msg, error=True)
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
        read_module = (self.w.tool_block("Read", {"file_path": self.module_abs}),
                       (cat_n(lines), False, {"type": "text", "file": {"filePath": self.module_abs,
                                                                       "numLines": len(lines), "startLine": 1}}))
        if self.rng.random() < 0.3:
            test_abs = f"{self.repo.cwd}/{self.repo.test_rel}"
            read_test = (self.w.tool_block("Read", {"file_path": test_abs}),
                         (cat_n(self.test_lines), False, {"type": "text"}))
            blocks = [self.say("Reading the module and its tests.", "Let me read both files."),
                      read_module[0], read_test[0]]
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
                   "The required parameter `new_string` is missing</tool_use_error>")
            self.call("Edit", {"file_path": path, "old_string": b.old}, msg, error=True, text=explain,
                      thinking=thinking)
            explain, thinking = self.say("I left out `new_string`; retrying with the full edit.",
                                         "The edit needs `new_string`."), None
        elif trouble == "mismatch":
            wrong = b.old.replace("    ", "  ", 1) if b.old.startswith("    ") else b.old.replace(" ", "  ", 1)
            msg = f"<tool_use_error>String to replace not found in file.\nString: {wrong}</tool_use_error>"
            self.call("Edit", {"file_path": path, "old_string": wrong, "new_string": b.new}, msg, error=True,
                      text=explain, thinking=thinking)
            explain, thinking = self.say("The indentation was off; using the exact text from the file.",
                                         "Wrong whitespace in `old_string`; retrying."), None
        elif trouble == "type":
            msg = ("<tool_use_error>InputValidationError: Edit failed due to the following issue:\n"
                   "The parameter `replace_all` type is expected as `boolean` but provided as `string`"
                   "</tool_use_error>")
            self.call("Edit", {"file_path": path, "old_string": b.old, "new_string": b.new, "replace_all": "false"},
                      msg, error=True, text=explain, thinking=thinking)
            explain, thinking = self.say("`replace_all` must be a boolean; dropping it.",
                                         "Retrying without `replace_all`."), None
        self.source = self.source.replace(b.old, b.new)
        at = self.source[: self.source.index(b.new)].count("\n") + 1
        snippet = cat_n(self.source.splitlines()[max(0, at - 2): at + b.new.count("\n") + 1], max(1, at - 1))
        result = (f"The file {path} has been updated. Here's the result of running `cat -n` on a snippet of the "
                  f"edited file:\n{snippet}")
        self.call("Edit", {"file_path": path, "old_string": b.old, "new_string": b.new}, result, text=explain,
                  thinking=thinking, tur={"filePath": path, "oldString": b.old, "newString": b.new})

    def run_tests(self, *, extra: int = 0) -> None:
        """Run the tests after the fix (a missing ``pytest`` executable first, in some sessions)."""
        cmd = self.repo.test_cmd
        if cmd.startswith("pytest") and self.rng.random() < 0.5:
            self.bash(cmd, "Exit code 127\n/bin/bash: line 1: pytest: command not found", error=True,
                      text=self.say("Now the tests.", "Running the tests."))
            cmd = "python -m " + cmd
            self.repo.test_cmd = cmd
            text = self.say("`pytest` is not on PATH; using `python -m pytest`.", "Retrying through the module.")
        else:
            text = self.say("Now let me run the tests.", "Running the tests to confirm.", "Let me verify.") \
                if self.rng.random() < 0.6 else None
        out, err = self.test_output(fixed=True, extra=extra)
        self.bash(cmd, out, error=err, text=text)

    def report(self, n_tests: int) -> None:
        """The closing text turn."""
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
                                     "Thanks. Add a regression test too."]))
        name, (_, body) = self.bug.tests[0][0] + "_regression", self.bug.tests[0]
        fixture = "tmp_path" if any("tmp_path" in line for line in body) else ""
        rel = f"tests/test_{self.stem}_regression.py"
        content = "\n".join([f"from {self.repo.import_name} import {self.bug.fn}", *self.bug.imports, "", "",
                             f"def {name}({fixture}):", *body, ""])
        path = f"{self.repo.cwd}/{rel}"
        self.call("Write", {"file_path": path, "content": content}, f"File created successfully at: {path}",
                  text=self.say("Adding a regression test.", "I'll add a test that fails on the old code."),
                  tur={"type": "create", "filePath": path, "content": content})
        self.repo.test_cmd = self.repo.test_cmd.replace(self.repo.test_rel, f"{self.repo.test_rel} {rel}")
        out, _ = self.test_output(fixed=True, extra=1)
        self.bash(self.repo.test_cmd, out, error=False)
        self.w.assistant([self.say(f"Added `{rel}`; it passes with the fix.",
                                   f"The regression test is in `{rel}` and passes.")])


def _test_file(bug: Bug, repo: _Repo) -> tuple[list[str], dict[str, tuple[str, list[str], int]]]:
    """The module's test file and, per test, ``(signature, body, line of its last body line)``."""
    lines = [f"from {repo.import_name} import {bug.fn}", *bug.imports, ""]
    info: dict[str, tuple[str, list[str], int]] = {}
    for name, body in bug.tests:
        fixture = "tmp_path" if any("tmp_path" in line for line in body) else ""
        signature = f"def {name}({fixture}):"
        lines += ["", signature, *body]
        info[name] = (signature, body, len(lines))
    return lines + [""], info


def _prompt(rng: random.Random, bug: Bug, repo: _Repo) -> str:
    symptom = bug.symptom[0].upper() + bug.symptom[1:]
    test = bug.tests[0][0]
    return rng.choice([f"{symptom}. Can you fix it?", f"Bug: {bug.symptom}. Please fix.",
                       f"`{repo.test_rel}::{test}` fails. {symptom}.",
                       f"{symptom}. The fix should be small; please keep the tests passing."])


def build_session(key: str, rng: random.Random, bug: Bug) -> list[dict[str, Any]]:
    """The Claude Code records of one session fixing ``bug`` (``key`` seeds its ids)."""
    repo = _repo(rng, bug)
    start = datetime(2026, 1, 5, 8) + timedelta(days=rng.randint(0, 70), minutes=rng.randint(0, 600))
    model = rng.choice(["claude-sonnet-4-5-20250929"] * 3 + ["claude-opus-4-5-20251101"])
    w = SessionWriter(rng, key=key, cwd=repo.cwd, start=start, model=model,
                      version=rng.choice(["2.1.42", "2.1.38", "2.1.27"]))
    agent = _Agent(rng, bug, repo, w)
    w.snapshot()
    w.user(_prompt(rng, bug, repo))
    agent.locate()
    agent.read()
    agent.fix()
    agent.run_tests()
    agent.report(len(bug.tests))
    if rng.random() < 0.3:
        agent.regression_test()
    return w.records
