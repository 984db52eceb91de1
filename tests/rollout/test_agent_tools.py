"""The agent's tools on a workspace: each tool's results and errors as Claude Code words them, and path escapes.

Read, Write, Edit and Glob run in-process and need no OS sandbox; Bash and Grep (whose regex runs in
the sandbox) skip where bubblewrap cannot run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from composer_replication.rollout.agent.tools import (
    TOOL_SCHEMAS,
    ToolConfig,
    ToolError,
    Workspace,
    glob_regex,
)
from composer_replication.rollout.sandbox import os_sandbox_status

CWD = "/workspace"
needs_bwrap = pytest.mark.skipif(not os_sandbox_status()[0], reason=f"no OS sandbox here: {os_sandbox_status()[1]}")


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    root = tmp_path / "ws"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "calc.py").write_text("def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n")
    (root / "README.md").write_text("calc\n")
    (tmp_path / "secret.txt").write_text("outside")
    return Workspace(root, CWD, ToolConfig())


def fails(ws: Workspace, name: str, args: object, failure: str) -> str:
    with pytest.raises(ToolError) as e:
        ws.call(name, args)
    assert e.value.failure == failure, str(e.value)
    return str(e.value)


# ---------------------------------------------------------------------------- arguments


def test_schemas_are_claude_codes_and_validation_words_errors_like_it(ws):
    assert sorted(TOOL_SCHEMAS) == ["Bash", "Edit", "Glob", "Grep", "Read", "Write"]
    assert TOOL_SCHEMAS["Edit"]["input_schema"]["required"] == ["file_path", "old_string", "new_string"]
    assert "No such tool available: Reed" in fails(ws, "Reed", {}, "unknown_tool")
    assert "The required parameter `new_string` is missing" in fails(
        ws, "Edit", {"file_path": "a", "old_string": "x"}, "bad_arguments")
    msg = fails(ws, "Edit", {"file_path": "a", "old_string": "x", "new_string": "y", "replace_all": "false"},
                "bad_arguments")
    assert "`replace_all` type is expected as `boolean` but provided as `string`" in msg
    assert "`offset` type is expected as `integer`" in fails(ws, "Read", {"file_path": "a", "offset": True},
                                                             "bad_arguments")
    assert "unexpected parameter `path`" in fails(ws, "Read", {"file_path": "a", "path": "b"}, "bad_arguments")
    assert "JSON object" in fails(ws, "Read", ["a"], "bad_json")
    fails(ws, "Bash", {"command": "true", "timeout": float("nan")}, "bad_arguments")


def test_odd_inputs_are_tool_errors_never_crashes(ws):
    assert "null byte" in fails(ws, "Read", {"file_path": "a\0b"}, "os_error")
    fails(ws, "Write", {"file_path": "README.md/x.py", "content": "x"}, "os_error")  # a parent that is a file
    assert ws.call("Write", {"file_path": "s.py", "content": "x = '\ud800'\n"}).startswith("File created")


# ---------------------------------------------------------------------------- Read / Write / Edit


def test_read_numbers_lines_and_honours_offset_and_limit(ws):
    out = ws.call("Read", {"file_path": "pkg/calc.py"})
    assert out.splitlines()[:2] == ["     1→def add(a, b):", "     2→    return a - b"]
    assert ws.call("Read", {"file_path": f"{CWD}/pkg/calc.py", "offset": 5, "limit": 1}) == "     5→def sub(a, b):"
    assert "shorter than the provided offset (99)" in ws.call("Read", {"file_path": "README.md", "offset": 99})
    (ws.root / "empty.py").write_text("")
    assert "contents are empty" in ws.call("Read", {"file_path": "empty.py"})


def test_read_errors(ws):
    assert "File does not exist. Current working directory: /workspace" in fails(
        ws, "Read", {"file_path": "nope.py"}, "file_not_found")
    assert "EISDIR" in fails(ws, "Read", {"file_path": "pkg"}, "is_directory")
    (ws.root / "blob.bin").write_bytes(b"\0\1\2")
    fails(ws, "Read", {"file_path": "blob.bin"}, "binary_file")
    os.mkfifo(ws.root / "fifo")  # would block a naive open forever
    fails(ws, "Read", {"file_path": "fifo"}, "not_regular_file")


def test_write_creates_files_and_needs_a_read_before_overwriting(ws):
    assert ws.call("Write", {"file_path": "new/mod.py", "content": "X = 1\n"}) == (
        "File created successfully at: /workspace/new/mod.py")
    assert (ws.root / "new" / "mod.py").read_text() == "X = 1\n"
    assert "has not been read yet" in fails(ws, "Write", {"file_path": "README.md", "content": "x"}, "not_read")
    ws.call("Read", {"file_path": "README.md"})
    assert ws.call("Write", {"file_path": "README.md", "content": "y"}) == "The file /workspace/README.md has been updated."
    small = Workspace(ws.root, CWD, ToolConfig(max_file_mb=1))
    fails(small, "Write", {"file_path": "big.txt", "content": "x" * (2 << 20)}, "file_too_large")


def test_edit_replaces_once_and_shows_a_snippet(ws):
    assert "has not been read yet" in fails(
        ws, "Edit", {"file_path": "pkg/calc.py", "old_string": "a", "new_string": "b"}, "not_read")
    ws.call("Read", {"file_path": "pkg/calc.py"})
    out = ws.call("Edit", {"file_path": "pkg/calc.py", "old_string": "def add(a, b):\n    return a - b",
                           "new_string": "def add(a, b):\n    return a + b"})
    assert out.startswith("The file /workspace/pkg/calc.py has been updated. Here's the result of running `cat -n`")
    assert "     2→    return a + b" in out
    assert (ws.root / "pkg" / "calc.py").read_text().count("a + b") == 1


def test_edit_errors_name_why(ws):
    ws.call("Read", {"file_path": "pkg/calc.py"})
    edit = {"file_path": "pkg/calc.py", "new_string": "return a * b"}
    assert "String to replace not found in file.\nString: return a -  b" in fails(
        ws, "Edit", {**edit, "old_string": "return a -  b"}, "old_string_not_found")
    assert "Found 2 matches of the string to replace, but replace_all is false" in fails(
        ws, "Edit", {**edit, "old_string": "return a - b"}, "old_string_not_unique")
    fails(ws, "Edit", {**edit, "old_string": "return a * b"}, "no_change")
    fails(ws, "Edit", {**edit, "old_string": ""}, "old_string_not_found")
    fails(ws, "Edit", {**edit, "file_path": "gone.py", "old_string": "x"}, "file_not_found")
    ws.call("Edit", {**edit, "old_string": "return a - b", "replace_all": True})
    assert (ws.root / "pkg" / "calc.py").read_text().count("return a * b") == 2


# ---------------------------------------------------------------------------- Grep / Glob


@needs_bwrap
def test_grep_modes(ws):
    assert ws.call("Grep", {"pattern": r"def \w+"}) == "Found 1 file\n/workspace/pkg/calc.py"
    assert ws.call("Grep", {"pattern": "def sub", "output_mode": "content", "-n": True}) == "pkg/calc.py:5:def sub(a, b):"
    assert ws.call("Grep", {"pattern": "return", "output_mode": "count"}) == "pkg/calc.py:2"
    assert ws.call("Grep", {"pattern": "CALC", "-i": True, "glob": "*.md"}) == "Found 1 file\n/workspace/README.md"
    assert ws.call("Grep", {"pattern": "zzz"}) == "No files found"
    assert ws.call("Grep", {"pattern": "zzz", "output_mode": "content"}) == "No matches found"
    fails(ws, "Grep", {"pattern": "("}, "bad_pattern")
    fails(ws, "Grep", {"pattern": "x", "output_mode": "lines"}, "bad_arguments")
    assert ws.call("Grep", {"pattern": "return", "path": "pkg/calc.py", "output_mode": "count"}) == "pkg/calc.py:2"


@needs_bwrap
def test_a_grep_pattern_that_backtracks_forever_is_killed_at_the_limit(ws):
    (ws.root / "xs.txt").write_text("x" * 40 + "\n")
    slow = Workspace(ws.root, CWD, ToolConfig(timeout_s=1.0))
    start = time.monotonic()
    assert "Grep timed out after 1s" in fails(slow, "Grep", {"pattern": "(x+x+)+y"}, "timeout")
    assert time.monotonic() - start < 5


def test_glob_patterns(ws):
    assert ws.call("Glob", {"pattern": "**/*.py"}) == "/workspace/pkg/calc.py"
    assert ws.call("Glob", {"pattern": "*.md"}) == "/workspace/README.md"
    assert ws.call("Glob", {"pattern": "*.py"}) == "No files found"  # one level only
    assert ws.call("Glob", {"pattern": "*.py", "path": "pkg"}) == "/workspace/pkg/calc.py"
    assert ws.call("Glob", {"pattern": "/workspace/**/*.{py,md}"}).splitlines() == [
        "/workspace/README.md", "/workspace/pkg/calc.py"]
    assert glob_regex("a/**/b?.py").match("a/x/y/b1.py") and not glob_regex("*.py").match("a/b.py")


# ---------------------------------------------------------------------------- path escapes


@pytest.mark.parametrize("path", ["../secret.txt", "pkg/../../secret.txt", "/etc/passwd", "/workspace/../etc/passwd",
                                  "/workspacex/a.py"])
def test_paths_outside_the_workspace_are_refused(ws, path):
    fails(ws, "Read", {"file_path": path}, "path_outside")
    fails(ws, "Write", {"file_path": path, "content": "pwned"}, "path_outside")
    fails(ws, "Grep", {"pattern": "x", "path": path}, "path_outside")
    assert (ws.root.parent / "secret.txt").read_text() == "outside"


def test_symlinks_leading_out_are_refused(ws):
    outside = ws.root.parent / "secret.txt"
    (ws.root / "link.txt").symlink_to(outside)
    (ws.root / "out").symlink_to(ws.root.parent)
    fails(ws, "Read", {"file_path": "link.txt"}, "path_outside")
    fails(ws, "Write", {"file_path": "out/secret.txt", "content": "pwned"}, "path_outside")
    fails(ws, "Write", {"file_path": "out/new/file.txt", "content": "pwned"}, "path_outside")
    assert "secret" not in ws.call("Glob", {"pattern": "**/*"})  # symlinked folders are not walked
    if os_sandbox_status()[0]:
        assert ws.call("Grep", {"pattern": "outside"}) == "No files found"
    assert outside.read_text() == "outside" and not (ws.root.parent / "new").exists()
    (ws.root / "inner.py").symlink_to(ws.root / "pkg" / "calc.py")  # a link inside is fine
    assert "def add" in ws.call("Read", {"file_path": "inner.py"})


def test_long_results_are_cut_keeping_head_and_tail(ws):
    (ws.root / "long.txt").write_text("".join(f"line {i}\n" for i in range(5000)))
    small = Workspace(ws.root, CWD, ToolConfig(max_output_chars=1000))
    out = small.call("Read", {"file_path": "long.txt"})
    assert len(out) < 1100 and "characters truncated" in out
    assert out.startswith("     1→line 0") and out.endswith("  2000→line 1999")  # Read shows 2000 lines


# ---------------------------------------------------------------------------- Bash


@needs_bwrap
def test_bash_results_exit_codes_and_timeouts(ws):
    assert ws.call("Bash", {"command": "pwd; ls"}) == "/workspace\nREADME.md\npkg"
    assert ws.call("Bash", {"command": "true"}) == "(no output)"
    msg = fails(ws, "Bash", {"command": "echo oops >&2; exit 3"}, "command_failed")
    assert msg == "Exit code 3\noops"
    assert fails(ws, "Bash", {"command": "sleep 30", "timeout": 500}, "timeout").startswith("Command timed out after 0.5s")
    ws.call("Bash", {"command": "echo 'X = 2' > made.py"})
    assert ws.call("Read", {"file_path": "made.py"}) == "     1→X = 2"


@needs_bwrap
def test_bash_cannot_write_outside_the_workspace_nor_reach_the_network(ws, tmp_path):
    host_file = tmp_path / "secret.txt"
    out = ws.call("Bash", {"command": f"echo pwned > {host_file}; echo pwned > /etc/cr-test; cat {host_file}; "
                                      f"echo pwned > {os.path.realpath(ws.root)}/x; ls {tmp_path} 2>&1; true"})
    assert host_file.read_text() == "outside" and not Path("/etc/cr-test").exists()
    assert "No such file or directory" in out and not (ws.root / "x").exists()  # the host path is not there
    net = ws.call("Bash", {"command": "python -c \"import socket; socket.create_connection(('1.1.1.1', 80), 2)\" "
                                      "2>&1 | tail -1; true"})
    assert "unreachable" in net.lower() or "error" in net.lower()
    assert "Exit code" in fails(ws, "Bash", {"command": "python -c 'x = bytearray(4 << 30)'"}, "command_failed")
