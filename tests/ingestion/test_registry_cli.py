"""ingest_any / detect_format (content-based) and the CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from composer_replication.ingestion import ingest_any
from composer_replication.ingestion.__main__ import main
from composer_replication.ingestion.registry import INGESTERS, detect_format, make_ingester

FIX = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "name,fmt",
    [
        ("rewind_interleaved.jsonl", "claude_code"),
        ("sidechain_compaction.jsonl", "claude_code"),
        ("damaged.jsonl", "claude_code"),
        ("codex_current.jsonl", "codex"),
        ("codex_legacy.jsonl", "codex"),
        ("openai_object.json", "openai"),
        ("openai_nebius.json", "openai"),
        ("openai_conversations.jsonl", "openai"),
        ("openai_messages.jsonl", "openai"),
        ("swe_history.traj", "swe_agent"),
        ("swe_trajectory_only.traj", "swe_agent"),
    ],
)
def test_detect_format_from_content_not_name(tmp_path: Path, name: str, fmt: str) -> None:
    assert detect_format(FIX / name) == fmt
    renamed = tmp_path / "trace.data"  # the name says nothing
    shutil.copy(FIX / name, renamed)
    assert detect_format(renamed) == fmt
    assert len(list(ingest_any(renamed))) > 0


def test_detect_format_failure_names_formats(tmp_path: Path) -> None:
    p = tmp_path / "x.jsonl"
    p.write_text('{"hello": 1}\n')
    with pytest.raises(ValueError, match=r"unsupported format.*supported formats: claude_code, codex, openai, swe_agent"):
        detect_format(p)
    with pytest.raises(ValueError, match="unsupported format") as err:
        ingest_any(p)  # raises before the first state
    assert "--format" not in str(err.value) and "format=" not in str(err.value)  # never a guess that yields nothing
    assert len(list(ingest_any(FIX / "codex_current.jsonl", format="codex"))) == 4
    with pytest.raises(ValueError, match="is empty"):
        detect_format(FIX / "empty.jsonl")


def test_bad_format_and_kwargs_routing() -> None:
    with pytest.raises(ValueError, match="format='gemini'"):
        ingest_any(FIX / "errors.jsonl", format="gemini")
    with pytest.raises(ValueError, match="format='nope'"):
        make_ingester("nope")
    ing = make_ingester("codex", skip_sidechain=True, max_history_tokens=50)  # skip_sidechain dropped
    assert ing.max_history_tokens == 50
    assert set(INGESTERS) == {"claude_code", "codex", "openai", "swe_agent"}
    states = list(ingest_any(FIX / "errors.jsonl", max_history_tokens=40))
    assert all(len(s["messages"]) <= 3 for s in states)


def test_real_samples_detected(shared_traces: Path) -> None:
    want = {
        "claude_code": "claude_code",
        "codex": "codex",
        "openai_messages": "openai",
        "swe_agent": "swe_agent",
    }
    for folder, fmt in want.items():
        for f in (shared_traces / folder).iterdir():
            assert detect_format(f) == fmt, f


def test_cli_walks_folders_skips_subagents_and_writes_atomically(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out" / "states.jsonl"
    rc = main([str(FIX), "--out", str(out)])
    assert rc == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    printed = capsys.readouterr().out
    assert "2 subagent files skipped" in printed and "TOTAL" in printed
    by_file = {}
    for s in lines:
        by_file.setdefault(s["state_id"].split("::")[0], []).append(s)
    assert len(by_file["rewind_interleaved"]) == 5 and len(by_file["codex_current"]) == 4
    assert "agent-a1b2c3d4" not in by_file
    assert not list(out.parent.glob(".*.tmp"))
    assert "make_fixtures" not in printed  # only .jsonl/.json/.traj are walked


def test_cli_max_history_tokens_and_format(tmp_path: Path) -> None:
    out = tmp_path / "s.jsonl"
    assert (
        main(
            [
                str(FIX / "errors.jsonl"),
                "--out",
                str(out),
                "--format",
                "claude_code",
                "--max-history-tokens",
                "40",
            ]
        )
        == 0
    )
    assert all(len(json.loads(x)["messages"]) <= 3 for x in out.read_text().splitlines())


def test_cli_fails_only_when_nothing_read(tmp_path: Path, capsys) -> None:
    out = tmp_path / "s.jsonl"
    out.write_text("previous\n")
    assert main([str(tmp_path / "missing"), "--out", str(out)]) == 1
    assert "no file could be read" in capsys.readouterr().err
    assert out.read_text() == "previous\n"  # untouched
    assert main([str(FIX / "agent-a1b2c3d4.jsonl"), "--out", str(out)]) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hello": 1}\n')
    # one unreadable file does not stop the others; it is named, and the run fails unless --allow-empty
    assert main([str(bad), str(FIX / "errors.jsonl"), "--out", str(out)]) == 1
    assert len(out.read_text().splitlines()) == 8 and f"no states from {bad}" in capsys.readouterr().err
    out.unlink()
    assert main([str(bad), str(FIX / "errors.jsonl"), "--out", str(out), "--allow-empty"]) == 0
    assert len(out.read_text().splitlines()) == 8


def test_cli_subprocess_help_and_run(tmp_path: Path) -> None:
    out = tmp_path / "s.jsonl"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "composer_replication.ingestion",
            str(FIX / "damaged.jsonl"),
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert len(out.read_text().splitlines()) == 3
