"""Claude Code's tools on one workspace: Read, Write, Edit, Grep, Glob in-process, Bash in the OS sandbox.

Inputs follow Claude Code's schemas (:data:`TOOL_SCHEMAS`) and results read as Claude Code shows them
(``     1→text`` lines, ``<tool_use_error>...</tool_use_error>``, ``Exit code N``), so live episodes look
like ingested sessions. Paths are relative to the workspace or absolute under its sandbox path; one
that resolves outside it (``..``, a symlink leading out) is refused, and only regular files are read.
Results and limits: docs/rollouts.md ("The tools and their results").
"""

from __future__ import annotations

import json
import math
import os
import posixpath
import re
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer_replication.rollout.sandbox import CommandResult, os_sandbox_status, run_command_sandboxed

__all__ = ["TOOL_SCHEMAS", "ToolConfig", "Workspace"]

_S, _I, _B, _N = "string", "integer", "boolean", "number"


def _schema(name: str, required: list[str], props: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "input_schema": {"type": "object", "required": required, "additionalProperties": False,
                                           "properties": {k: {"type": t} for k, t in props.items()}}}


TOOL_SCHEMAS: dict[str, dict[str, Any]] = {s["name"]: s for s in (
    _schema("Read", ["file_path"], {"file_path": _S, "offset": _I, "limit": _I}),
    _schema("Write", ["file_path", "content"], {"file_path": _S, "content": _S}),
    _schema("Edit", ["file_path", "old_string", "new_string"],
            {"file_path": _S, "old_string": _S, "new_string": _S, "replace_all": _B}),
    _schema("Bash", ["command"], {"command": _S, "timeout": _N, "description": _S}),
    _schema("Grep", ["pattern"], {"pattern": _S, "path": _S, "glob": _S, "output_mode": _S, "-i": _B, "-n": _B,
                                  "head_limit": _I}),
    _schema("Glob", ["pattern"], {"pattern": _S, "path": _S}),
)}
"""Each tool's input schema, Anthropic ``{"name", "input_schema"}`` form (``Bash.timeout`` is in ms)."""
_TYPES = {_S: (str,), _I: (int,), _B: (bool,), _N: (int, float)}
_GREP_CHILD = """import json, os, re, sys
pattern, flags, base, glob, cap = json.loads(sys.argv[1])
rx, keep, out = re.compile(pattern, flags), re.compile(glob or ".*"), []
walk = [(os.path.dirname(base), [], [os.path.basename(base)])] if os.path.isfile(base) else os.walk(base)
for folder, dirs, names in walk:
    dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
    for name in sorted(names):
        f = os.path.normpath(os.path.join(folder, name))
        if os.path.islink(f) or not os.path.isfile(f) or not keep.match(name if "/" not in glob else f):
            continue
        with open(f, "rb") as fh:
            data = fh.read()
        found = [(k, s[:2000]) for k, s in enumerate(data.decode("utf-8", "replace").splitlines(), 1) if rx.search(s)]
        if found and b"\\0" not in data[:8192]:
            out.append((f, found[:cap]))
print(json.dumps(out))
"""  # the Grep child, run in the workspace: (pattern, flags, base, glob regex, lines per file) -> [(file, [(n, line)])]
_ENV = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}
_READ_LINES, _LINE_CHARS, _GLOB_MAX, _GREP_MAX = 2000, 2000, 100, 250


class ToolError(Exception):
    """A failed call: ``failure`` names why (``file_not_found``, ``old_string_not_found``, ...)."""

    def __init__(self, failure: str, message: str) -> None:
        super().__init__(message)
        self.failure = failure


def _json_type(value: Any) -> str:
    return {bool: _B, str: _S, int: _I, float: _N, list: "array", dict: "object"}.get(type(value), "null")


def validate_input(name: str, args: Any) -> None:
    """Check one call against :data:`TOOL_SCHEMAS` (raises :class:`ToolError` as Claude Code words it)."""
    if name not in TOOL_SCHEMAS:
        raise ToolError("unknown_tool", f"Error: No such tool available: {name}")
    if not isinstance(args, dict):
        raise ToolError("bad_json", f"Error parsing tool input: the input of {name} must be one JSON object")
    props = TOOL_SCHEMAS[name]["input_schema"]["properties"]
    head = f"InputValidationError: {name} failed due to the following issue:\n"
    for key in TOOL_SCHEMAS[name]["input_schema"]["required"]:
        if key not in args:
            raise ToolError("bad_arguments", f"{head}The required parameter `{key}` is missing")
    for key, value in args.items():
        if key not in props:
            raise ToolError("bad_arguments", f"{head}An unexpected parameter `{key}` was provided")
        want = props[key]["type"]
        if (not isinstance(value, _TYPES[want]) or (want != _B and isinstance(value, bool))
                or (want == _N and not math.isfinite(value))):
            raise ToolError("bad_arguments", f"{head}The parameter `{key}` type is expected as `{want}` but "
                            f"provided as `{_json_type(value)}`")


def cat_n(lines: list[str], first: int = 1) -> str:
    """Lines numbered as Claude Code's Read shows them (``{n:>6}→text``, long lines cut)."""
    return "\n".join(f"{n:>6}→{line[:_LINE_CHARS]}" for n, line in enumerate(lines, first))


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, keeping its head and its tail around a marker."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n... [{len(text) - 2 * half} characters truncated] ...\n{text[-half:]}"


@dataclass(kw_only=True)
class ToolConfig:
    """Limits and environment of every tool call of an episode."""

    timeout_s: float = 30.0
    """Wall-clock limit of one Bash or Grep call (a Bash ``timeout`` input may only lower it)."""
    memory_mb: int = 1024
    """Address-space limit of a command's processes (``RLIMIT_AS``)."""
    max_file_mb: int = 16
    """Largest file a command or a Write/Edit may write (``RLIMIT_FSIZE``)."""
    disk_mb: int = 64
    """Size of a command's private ``/tmp``, and of the workspace's files (checked after each command)."""
    max_output_chars: int = 30_000
    """Every tool result is cut to this many characters (head and tail kept)."""
    os_sandbox: str = "require"
    """``"require"`` (bubblewrap or an error), ``"auto"`` (without it where it cannot run) or ``"off"``
    (commands run on the host under the limits only: for machines without namespaces, never for training)."""
    env: dict[str, str] = field(default_factory=lambda: dict(_ENV))
    """Environment variables of every command. By default pytest loads no plugin of the training
    environment by itself (name one with ``-p NAME``; 2x faster runs) and Python writes no bytecode."""


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A path glob as a regex on ``/``-separated relative paths: ``**/`` any folders (or none), ``**`` anything,
    ``*`` and ``?`` within one name, ``{a,b}`` alternatives."""
    parts = re.split(r"(\*\*/|\*\*|\*|\?|\{[^{}]*\})", pattern)
    special = {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}
    return re.compile("".join(special.get(t) or ("(?:" + "|".join(map(re.escape, t[1:-1].split(","))) + ")"
                                               if t.startswith("{") else re.escape(t)) for t in parts) + r"\Z")


class Workspace:
    """A host folder seen by the agent as ``cwd``; :meth:`call` runs one validated tool call.

    Args:
        root: the host folder (created by the caller, holding the task's files).
        cwd: its absolute path inside the sandbox, and the paths the agent uses.
        limits: the per-call :class:`ToolConfig`.
    """

    def __init__(self, root: Path, cwd: str, limits: ToolConfig) -> None:
        self.root, self.real = Path(root), Path(os.path.realpath(root))
        self.limits = limits
        self.sandboxed = limits.os_sandbox == "require" or (limits.os_sandbox == "auto" and os_sandbox_status()[0])
        self.cwd = cwd if self.sandboxed else str(self.real)  # without the OS sandbox, commands see the host
        self.read_files: set[Path] = set()
        self.budget_s = math.inf  # sandbox seconds the episode has left (the caller lowers it)

    # ------------------------------------------------------------------ paths
    def resolve(self, file_path: str) -> Path:
        """The host path of ``file_path``; :class:`ToolError` when it leaves the workspace."""
        p = posixpath.normpath(file_path) if file_path else "."
        if p.startswith("/"):
            if p != self.cwd and not p.startswith(self.cwd.rstrip("/") + "/"):
                raise ToolError("path_outside", f"Path {file_path} is outside the workspace {self.cwd}; use a "
                                "relative path or one under it")
            p = posixpath.relpath(p, self.cwd)
        real = Path(os.path.realpath(self.real / p))
        if real != self.real and self.real not in real.parents:
            raise ToolError("path_outside", f"Path {file_path} resolves outside the workspace {self.cwd}")
        return real

    def shown(self, host: Path) -> str:
        """The agent's (absolute) path of a host path inside the workspace."""
        rel = host.relative_to(self.real).as_posix()
        return self.cwd if rel == "." else posixpath.join(self.cwd, rel)

    def _file(self, file_path: str, *, must_exist: bool = True) -> Path:
        path = self.resolve(file_path)
        if not path.exists():
            if must_exist:
                raise ToolError("file_not_found", f"File does not exist. Current working directory: {self.cwd}")
            return path
        mode = path.stat().st_mode
        if stat.S_ISDIR(mode):
            raise ToolError("is_directory", "EISDIR: illegal operation on a directory, read")
        if not stat.S_ISREG(mode):
            raise ToolError("not_regular_file", f"{file_path} is not a regular file")
        return path

    # ------------------------------------------------------------------ dispatch
    def call(self, name: str, args: Any) -> str:
        """Run one call; returns its result text or raises :class:`ToolError`."""
        validate_input(name, args)
        try:
            out = getattr(self, f"_{name.lower()}")(**{k.lstrip("-"): v for k, v in args.items()})
        except (OSError, ValueError) as e:  # e.g. a path with a NUL byte, a parent that is a file
            raise ToolError("os_error", f"{type(e).__name__}: {e}") from None
        return clip(out, self.limits.max_output_chars)

    def _read(self, file_path: str, offset: int = 1, limit: int = _READ_LINES) -> str:
        path = self._file(file_path)
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            raise ToolError("binary_file", "This tool cannot read binary files.")
        self.read_files.add(path)
        lines = data.decode("utf-8", errors="replace").splitlines()
        if not lines:
            return "<system-reminder>Warning: the file exists but the contents are empty.</system-reminder>"
        start = max(offset, 1)
        if start > len(lines):
            return (f"<system-reminder>Warning: the file exists but is shorter than the provided offset "
                    f"({offset}). The file has {len(lines)} lines.</system-reminder>")
        return cat_n(lines[start - 1 : start - 1 + max(limit, 1)], start)

    def _write(self, file_path: str, content: str) -> str:
        path = self._file(file_path, must_exist=False)
        existed = path.exists()
        if existed and path not in self.read_files:
            raise ToolError("not_read", "File has not been read yet. Read it first before writing to it.")
        self.put(path, content)
        return (f"The file {self.shown(path)} has been updated." if existed
                else f"File created successfully at: {self.shown(path)}")

    def put(self, path: Path, content: str) -> None:
        """Write ``content`` at the host path ``path`` (inside the workspace), creating its folders."""
        data = content.encode("utf-8", "replace")  # a lone surrogate from JSON becomes "?"
        if len(data) > self.limits.max_file_mb << 20:
            raise ToolError("file_too_large", f"The content is {len(data)} bytes; files are limited to "
                            f"{self.limits.max_file_mb} MiB")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        self.read_files.add(path)

    def _edit(self, file_path: str, old_string: str, new_string: str, replace_all: bool = False) -> str:
        path = self._file(file_path)
        if path not in self.read_files:
            raise ToolError("not_read", "File has not been read yet. Read it first before writing to it.")
        if old_string == new_string:
            raise ToolError("no_change", "No changes to make: old_string and new_string are exactly the same.")
        text = path.read_text(encoding="utf-8", errors="replace")
        count = text.count(old_string) if old_string else 0
        if count == 0:
            raise ToolError("old_string_not_found", f"String to replace not found in file.\nString: {old_string}")
        if count > 1 and not replace_all:
            raise ToolError("old_string_not_unique", f"Found {count} matches of the string to replace, but "
                            "replace_all is false. To replace all occurrences, set replace_all to true. To replace "
                            f"only one occurrence, please provide more context to uniquely identify the instance.\n"
                            f"String: {old_string}")
        at = text.index(old_string)
        new = text.replace(old_string, new_string) if replace_all else text.replace(old_string, new_string, 1)
        self.put(path, new)
        first = text[:at].count("\n") + 1
        lines = new.splitlines()[max(0, first - 2) : first + new_string.count("\n") + 1]
        return (f"The file {self.shown(path)} has been updated. Here's the result of running `cat -n` on a "
                f"snippet of the edited file:\n{cat_n(lines, max(1, first - 1))}")

    def _files(self, base: Path) -> list[Path]:
        """Regular files under ``base`` (no symlinks, no hidden folders, no ``__pycache__``), sorted."""
        if base.is_file():
            return [base]
        out = []
        for folder, dirs, names in os.walk(base):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
            out += [Path(folder, n) for n in sorted(names) if not os.path.islink(os.path.join(folder, n))]
        return [p for p in out if p.is_file()]

    def _grep(self, pattern: str, path: str = "", glob: str = "", output_mode: str = "files_with_matches",
              i: bool = False, n: bool = False, head_limit: int = _GREP_MAX) -> str:
        """Files are listed here; the regex runs in the sandbox, where a pattern that backtracks forever
        is killed at the call's time limit (Python's ``re`` cannot be interrupted in-process)."""
        if output_mode not in ("files_with_matches", "content", "count"):
            raise ToolError("bad_arguments", f"output_mode must be files_with_matches, content or count, got "
                            f"{output_mode!r}")
        try:
            re.compile(pattern)
        except re.error as e:
            raise ToolError("bad_pattern", f"Invalid regular expression {pattern!r}: {e}") from None
        base = self.resolve(path).relative_to(self.real).as_posix()
        limit = min(self.limits.timeout_s, self.budget_s)
        args = [pattern, re.IGNORECASE if i else 0, base, glob_regex(glob).pattern if glob else "", max(1, head_limit)]
        res = self.run([os.path.realpath(sys.executable), "-I", "-S", "-c", _GREP_CHILD, json.dumps(args)], limit)
        if res.timed_out or res.returncode != 0:
            raise ToolError("timeout" if res.timed_out else "grep_failed",
                            f"Grep timed out after {limit:g}s; simplify the pattern" if res.timed_out else res.output)
        hits: list[str] = []
        for rel, found in json.loads(res.output):
            if output_mode == "files_with_matches":
                hits.append(posixpath.join(self.cwd, rel))
            elif output_mode == "count":
                hits.append(f"{rel}:{len(found)}")
            else:
                hits += [f"{rel}:{k}:{line}" if n else f"{rel}:{line}" for k, line in found]
        hits = hits[: max(1, head_limit)]
        if output_mode == "files_with_matches":
            return f"Found {len(hits)} file{'s' * (len(hits) != 1)}\n" + "\n".join(hits) if hits else "No files found"
        return "\n".join(hits) if hits else "No matches found"

    def _glob(self, pattern: str, path: str = "") -> str:
        base = self.resolve(path)
        if pattern.startswith("/"):
            pattern = posixpath.relpath(posixpath.normpath(pattern), self.shown(base))
        rx = glob_regex(pattern)
        found = [self.shown(f) for f in self._files(base) if rx.match(f.relative_to(base).as_posix())]
        if not found:
            return "No files found"
        more = "\n(Results are truncated. Consider using a more specific path or pattern.)"
        return "\n".join(found[:_GLOB_MAX]) + (more if len(found) > _GLOB_MAX else "")

    def _bash(self, command: str, timeout: float | None = None, description: str = "") -> str:
        if self.budget_s <= 0:
            raise ToolError("episode_timeout", "Error: the episode has used its time for commands")
        limit = self.limits.timeout_s if timeout is None else min(max(timeout / 1000, 0.1), self.limits.timeout_s)
        limit = min(limit, self.budget_s)
        res = self.run(["/bin/bash", "-c", command], limit)
        out = res.output.rstrip("\n")
        if res.timed_out:
            raise ToolError("timeout", f"Command timed out after {limit:g}s\n{out}".rstrip())
        if res.returncode != 0:
            raise ToolError("command_failed", f"Exit code {res.returncode}\n{out}".rstrip())
        return out or "(no output)"

    def run(self, argv: list[str], timeout_s: float) -> CommandResult:
        """Run ``argv`` in the workspace under the OS sandbox (the venv is readable and first on PATH)."""
        lim = self.limits
        return run_command_sandboxed(
            argv, workdir=self.real, mount=self.cwd, timeout_s=timeout_s, memory_mb=lim.memory_mb,
            max_file_bytes=lim.max_file_mb << 20, disk_mb=lim.disk_mb,
            readable_paths=[sys.prefix], path=f"{sys.prefix}/bin:/usr/bin:/bin", os_sandbox=lim.os_sandbox,
            env=lim.env,
        )

    def size_bytes(self) -> int:
        """Bytes of the workspace's files (checked against ``disk_mb`` after each command)."""
        return sum(os.lstat(os.path.join(d, n)).st_size for d, _, names in os.walk(self.real) for n in names)
