"""The command line, end to end against the fake server."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from replay_helpers import REPO, SECRET, make_states

from composer_replication.teacher_replay import load_pairs
from composer_replication.teacher_replay.__main__ import main


def _write_states(path, n=5):
    path.write_text("".join(json.dumps(s) + "\n" for s in make_states(n)))
    return path


def _args(tmp_path, base_url, *extra):
    return [
        str(_write_states(tmp_path / "states.jsonl")),
        "--teachers", "a/one,b/two",
        "--budget", "1.0",
        "--ledger", str(tmp_path / "ledger.jsonl"),
        "--out", str(tmp_path / "out" / "pairs.jsonl"),
        "--base-url", base_url,
        "--price-in", "1", "--price-out", "2",
        "--max-tokens", "64",
        *extra,
    ]  # fmt: skip


@pytest.mark.slow
def test_cli_end_to_end_and_resume(tmp_path, fake_server):
    env = {**os.environ, "OPENROUTER_API_KEY": SECRET, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "composer_replication.teacher_replay",
        *_args(tmp_path, fake_server.base_url),
    ]
    cmd += ["--results", str(tmp_path / "results.jsonl")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "teacher replay" in proc.stdout and "a/one" in proc.stdout and "5 pair(s) written" in proc.stdout
    assert SECRET not in proc.stdout + proc.stderr
    pairs = load_pairs(tmp_path / "out" / "pairs.jsonl")
    assert len(pairs) == 5 and all(
        p["n_teachers_agreeing"] == 2 and p["chosen"].startswith("[TOOL_USE]") for p in pairs
    )
    assert all(b.body["max_tokens"] == 64 for b in fake_server.requests) and fake_server.count() == 10
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 10
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert again.returncode == 0 and fake_server.count() == 10  # resumed from the ledger
    assert load_pairs(tmp_path / "out" / "pairs.jsonl") == pairs


def test_cli_in_process_with_progress_and_all_failing(tmp_path, fake_server, monkeypatch, capsys):
    monkeypatch.setenv("OPENROUTER_API_KEY", SECRET)
    fake_server.add_fault("status", status=402, times=-1, message="Insufficient credits")
    rc = main(_args(tmp_path, fake_server.base_url, "--per-teacher-concurrency", "1"))
    out = capsys.readouterr()
    assert rc == 1  # every call failed
    assert "http 402" in out.out and "teacher stopped" in out.out and "0 pair(s)" in out.out
    assert load_pairs(tmp_path / "out" / "pairs.jsonl") == []


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--teachers", "x/unknown", "--price-in", "1"], "has no known prices"),  # --price-out missing
        (["--agreement", "0"], "--agreement must be >= 1"),
        (["--budget", "-1"], "max_total_usd must be a finite number >= 0"),
    ],
)
def test_cli_bad_arguments_exit_2(tmp_path, extra, match, capsys, monkeypatch):
    monkeypatch.setenv("OPENROUTER_API_KEY", SECRET)
    args = [
        str(_write_states(tmp_path / "s.jsonl")),
        "--budget", "1", "--ledger", str(tmp_path / "l.jsonl"), "--out", str(tmp_path / "p.jsonl"),
    ]  # fmt: skip
    if "--price-in" in extra:
        args += ["--base-url", "http://127.0.0.1:9/v1"]
    assert main(args + extra) == 2
    assert match in capsys.readouterr().err


def test_cli_missing_key_and_bad_states(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    base = ["--budget", "1", "--ledger", str(tmp_path / "l.jsonl"), "--out", str(tmp_path / "p.jsonl")]
    assert main([str(_write_states(tmp_path / "s.jsonl")), *base]) == 2  # default teachers are remote
    assert "No API key found" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"state_id": "x"}) + "\n")
    assert main([str(bad), "--teachers", "local:tiny", *base]) == 2
    assert "bad.jsonl:1: a TraceState needs" in capsys.readouterr().err
    assert not (tmp_path / "p.jsonl").exists()


def test_cli_normalize_through_replaysim(tmp_path, fake_server, monkeypatch, capsys):
    try:
        from composer_replication.replaysim import DJNormalizer

        DJNormalizer()
    except Exception as exc:  # the replaysim layer is optional and owned elsewhere
        pytest.skip(f"replaysim default normalizer unavailable: {exc}")
    monkeypatch.setenv("OPENROUTER_API_KEY", SECRET)
    assert main(_args(tmp_path, fake_server.base_url, "--normalize", "--no-progress")) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "pairs.jsonl").read_text().splitlines()]
    assert rows and all("chosen_messages" in r and "rejected_messages" in r for r in rows)
