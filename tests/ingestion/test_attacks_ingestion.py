"""Ingestion never destroys its input, whatever a careless or hostile command line or file does.

Each test is one reproduced misuse (issue #9, section 3): the output aimed at an input, a symlinked
output, and files nested deeper than Python can decode.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from composer_replication.ingestion import ingest_any
from composer_replication.ingestion.__main__ import main
from composer_replication.ingestion.reading import NestingTooDeep
from composer_replication.ingestion.registry import detect_format, make_ingester

FIX = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parents[2]
SESSION = FIX / "errors.jsonl"  # a Claude Code session: 8 states


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# ---------------------------------------------------------------------------- --out aimed at the input
def test_out_equal_to_the_input_file_is_refused_and_the_session_kept(tmp_path: Path, capsys) -> None:
    session = tmp_path / "session.jsonl"
    shutil.copy(SESSION, session)
    before = session.read_bytes()
    assert main([str(session), "--out", str(session)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --out") and "is the input" in err and "\n" not in err
    assert session.read_bytes() == before  # today: replaced by states


def test_out_through_a_symlink_or_dotted_path_to_the_input_is_refused(tmp_path: Path, capsys) -> None:
    session = tmp_path / "session.jsonl"
    shutil.copy(SESSION, session)
    before = session.read_bytes()
    alias = tmp_path / "alias.jsonl"
    alias.symlink_to(session)
    assert main([str(session), "--out", str(alias)]) == 2
    assert main([str(session), "--out", str(tmp_path / "sub" / ".." / "session.jsonl")]) == 2
    assert "is the input" in capsys.readouterr().err
    assert session.read_bytes() == before and alias.is_symlink()


@pytest.mark.parametrize("where", ["states.jsonl", "deeper/states.jsonl"])
def test_out_inside_an_input_folder_is_refused(tmp_path: Path, capsys, where: str) -> None:
    traces = tmp_path / "traces"
    shutil.copytree(FIX, traces)
    before = _digest(traces)
    out = traces / where
    assert main([str(traces), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "inside the input folder" in err and "re-run would read it back" in err
    assert not out.exists() and _digest(traces) == before


def test_a_rerun_never_reads_its_own_output_back(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    traces.mkdir()
    shutil.copy(SESSION, traces / "s.jsonl")
    out = tmp_path / "states.jsonl"
    for _ in range(2):
        assert main([str(traces), "--out", str(out)]) == 0
        assert len(out.read_text().splitlines()) == 8  # the same 8 states, not 8 + states read back
    assert _digest(traces) == {"s.jsonl": hashlib.sha256(SESSION.read_bytes()).hexdigest()}


# ---------------------------------------------------------------------------- symlinked output, file mode
def test_out_symlink_is_written_through_with_the_usual_mode(tmp_path: Path) -> None:
    real = tmp_path / "data" / "states.jsonl"
    real.parent.mkdir()
    real.write_text("old\n")
    os.chmod(real, 0o640)
    link = tmp_path / "states.jsonl"
    link.symlink_to(real)
    assert main([str(SESSION), "--out", str(link)]) == 0
    assert link.is_symlink() and os.readlink(link) == str(real)  # today: the link is replaced
    assert len(real.read_text().splitlines()) == 8
    assert os.stat(real).st_mode & 0o777 == 0o640  # an existing file keeps its mode


def test_a_new_output_gets_the_umask_mode_not_0600(tmp_path: Path) -> None:
    out = tmp_path / "states.jsonl"
    old = os.umask(0o022)
    try:
        assert main([str(SESSION), "--out", str(out)]) == 0
    finally:
        os.umask(old)
    assert os.stat(out).st_mode & 0o777 == 0o644  # today: 0600, unreadable to the group


# ---------------------------------------------------------------------------- nesting past the recursion limit
_DEPTH = sys.getrecursionlimit() * 20


def _deep(n: int = _DEPTH) -> str:
    return "[" * n + "]" * n


def _nested_files(folder: Path) -> list[Path]:
    """One hostile file per reading path: JSON document, JSONL line, Claude record, SWE-agent .traj."""
    files = {
        "doc.json": '{"messages": [{"role": "user", "content": "hi"}, ' + _deep() + "]}",
        "lines.jsonl": '{"role": "user", "content": "hi"}\n' + _deep() + "\n",
        "claude.jsonl": SESSION.read_text()
        + '{"type": "user", "uuid": "zz", "sessionId": "s", "message": {"role": "user", "content": '
        + _deep()
        + "}}\n",
        "run.traj": '{"trajectory": [{"action": "ls", "observation": ' + _deep() + "}]}",
    }
    for name, text in files.items():
        (folder / name).write_text(text)
    return [folder / n for n in files]


def test_nesting_deeper_than_the_recursion_limit_skips_only_that_file(tmp_path: Path, capsys) -> None:
    bad = _nested_files(tmp_path)
    out = tmp_path.parent / f"{tmp_path.name}-states.jsonl"
    rc = main([*map(str, bad), str(SESSION), "--out", str(out), "--allow-empty"])
    assert rc == 0  # today: RecursionError traceback, nothing written
    captured = capsys.readouterr()
    assert len(out.read_text().splitlines()) == 8  # the good session is all there
    for f in bad:
        assert f"skipped {f}: JSON nested deeper than Python's recursion limit" in captured.out.replace(
            "\n", ""
        ), f
    assert "Traceback" not in captured.out + captured.err


@pytest.mark.parametrize("name,fmt", [("doc.json", "openai"), ("lines.jsonl", "openai"),
                                      ("claude.jsonl", "claude_code"), ("run.traj", "swe_agent")])  # fmt: skip
def test_every_ingester_raises_a_named_error_on_deep_nesting(tmp_path: Path, name: str, fmt: str) -> None:
    f = dict((p.name, p) for p in _nested_files(tmp_path))[name]
    with pytest.raises(NestingTooDeep, match=r"recursion limit .* skipped"):
        detect_format(f)
    with pytest.raises(ValueError, match=r"nested deeper than Python's recursion limit"):
        list(make_ingester(fmt).ingest(f))


def test_nesting_just_inside_the_limit_never_aborts_the_batch(tmp_path: Path, capsys) -> None:
    # decodes, but re-encoding the arguments (json.dumps) under pytest's deep stack may recurse past
    # the limit: the file then contributes nothing and says why; it never aborts the batch
    depth = sys.getrecursionlimit() - 20
    call = '{"id": "c1", "function": {"name": "f", "arguments": ' + _deep(depth) + "}}"
    f = tmp_path / "near.json"
    f.write_text(
        '{"messages": [{"role": "user", "content": "go"}, '
        '{"role": "assistant", "content": "x", "tool_calls": [' + call + "]}]}"
    )
    out = tmp_path.parent / f"{tmp_path.name}-near.jsonl"
    assert main([str(f), str(SESSION), "--out", str(out), "--allow-empty"]) == 0
    lines = out.read_text().splitlines()
    printed = capsys.readouterr().out.replace("\n", "")
    assert len(lines) == 9 or (
        len(lines) == 8 and f"skipped {f}: " in printed and "recursion limit" in printed
    )
    assert list(ingest_any(SESSION))  # the process is still healthy


def test_deep_nesting_in_a_subprocess_prints_one_reason_and_no_traceback(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    _nested_files(tmp_path / "in")
    r = subprocess.run(
        [sys.executable, "-m", "composer_replication.ingestion", str(tmp_path / "in"), "--out",
         str(tmp_path / "out.jsonl")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 1  # nothing readable: exit 1 with a reason, not a crash
    assert "Traceback" not in r.stderr and "no file could be read" in r.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_deeply_nested_tool_arguments_inside_a_string_are_kept_as_text(tmp_path: Path) -> None:
    # the file itself is shallow; only the arguments string decodes deeper than the limit
    deep_args = _deep()
    item = {"type": "function_call", "name": "shell", "arguments": deep_args, "call_id": "c9"}
    line = {"timestamp": "2026-03-01T10:09:00.000Z", "type": "response_item", "payload": item}
    f = tmp_path / "codex.jsonl"
    f.write_text((FIX / "codex_current.jsonl").read_text() + json.dumps(line) + "\n")
    states = list(ingest_any(f))  # today: RecursionError
    assert len(states) == len(list(ingest_any(FIX / "codex_current.jsonl")))  # joins the last turn
    assert (
        "[TOOL_USE] name=shell" in states[-1]["student_action"] and deep_args in states[-1]["student_action"]
    )
