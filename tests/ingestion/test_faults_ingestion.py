"""Ingestion under faults: huge conversations, huge first records, other encodings, an output that
cannot be written, folders that cannot be listed, a file that fails half-way (issue #9, section 3)."""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from composer_replication.ingestion import __main__ as cli
from composer_replication.ingestion import ingest_any
from composer_replication.ingestion.openai_messages import OpenAIMessagesIngester
from composer_replication.ingestion.registry import detect_format

FIX = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parents[2]
SESSION = FIX / "errors.jsonl"  # a Claude Code session: 8 states


# ---------------------------------------------------------------------------- a huge conversation streams
def _write_conversation(path: Path, n_turns: int, *, jsonl: bool) -> None:
    """One conversation of ``3 * n_turns + 1`` messages (user, assistant tool call, tool result)."""
    msgs = [{"role": "system", "content": "sys"}]
    with open(path, "w") as f:
        f.write(
            "" if jsonl else '{"tools": [{"type": "function", "function": {"name": "read"}}], "messages": ['
        )
        for i in range(n_turns):
            call = {"id": f"c{i}", "type": "function",
                    "function": {"name": "read", "arguments": json.dumps({"path": f"f{i}.py"})}}  # fmt: skip
            msgs += [
                {"role": "user", "content": f"step {i}: " + "look at the file " * 6},
                {"role": "assistant", "content": "reading", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"c{i}", "content": "x = 1\n" * 40},
            ]
            sep = "\n" if jsonl else ", "
            f.write(sep.join(json.dumps(m) for m in msgs) + sep)
            msgs = []
        f.write("" if jsonl else '{"role": "user", "content": "done"}]}')


def _peak(path: Path, budget: int | None) -> tuple[int, int]:
    """(states, peak traced bytes) of ingesting ``path``; each state is dropped once counted."""
    tracemalloc.start()
    try:
        n = sum(1 for _ in OpenAIMessagesIngester(max_history_tokens=budget).ingest(path))
        return n, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.slow
@pytest.mark.parametrize("jsonl", [False, True], ids=["json-object", "jsonl"])
def test_openai_memory_is_bounded_by_the_history_budget(tmp_path: Path, jsonl: bool) -> None:
    path = tmp_path / "long.json"
    _write_conversation(path, 4000, jsonl=jsonl)  # 12k messages, ~2.6 MB on disk, ~15 MB as objects
    n, peak = _peak(path, budget=1000)  # a 1000-token history is ~4 kB of text
    assert n == 4000
    # today the whole conversation and every state are held: tens of MB; bounded: well under 1 MB
    assert peak < 1000 * 4000, f"peak {peak / 1e6:.1f} MB for a 4 kB history budget"
    *_, last = OpenAIMessagesIngester(max_history_tokens=1000).ingest(path)  # right, not only cheap
    assert last["state_id"] == "long::3999" and last["tools"] == ["read"]
    assert last["messages"][0]["content"] == "sys" and last["messages"][-1]["content"].startswith("step 3999")
    assert 2 < len(last["messages"]) < 40


@pytest.mark.slow
def test_openai_without_a_budget_streams_states_instead_of_holding_them(tmp_path: Path) -> None:
    path = tmp_path / "long.json"
    _write_conversation(path, 1500, jsonl=False)
    n, peak = _peak(path, budget=None)
    # every state's history is the whole conversation so far: held together they are ~70 MB
    assert n == 1500 and peak < 12 * path.stat().st_size


# ---------------------------------------------------------------------------- detection
def _image_record(n_bytes: int) -> dict:
    data = "A" * n_bytes
    return {"type": "user", "uuid": "u0", "parentUuid": None, "sessionId": "s", "version": "2.1.42",
            "message": {"role": "user", "content": [
                {"type": "text", "text": "what is in this screenshot?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}]}}  # fmt: skip


def test_detection_reads_a_first_record_over_1_mb(tmp_path: Path) -> None:
    f = tmp_path / "pasted.jsonl"
    f.write_text(json.dumps(_image_record(3_000_000)) + "\n" + SESSION.read_text())
    assert detect_format(f) == "claude_code"  # today: "could not tell the trace format"
    states = list(ingest_any(f))
    assert len(states) == 8
    assert cli.main([str(f), "--out", str(tmp_path.parent / f"{tmp_path.name}.jsonl")]) == 0


def test_detection_streams_a_large_document(tmp_path: Path) -> None:
    f = tmp_path / "big.json"
    _write_conversation(f, 3000, jsonl=False)
    tracemalloc.start()
    try:
        assert detect_format(f) == "openai"
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < f.stat().st_size  # the document is never held whole


_SAMPLES = ["errors.jsonl", "codex_current.jsonl", "codex_legacy.jsonl", "openai_object.json",
            "openai_messages.jsonl", "openai_conversations.jsonl", "swe_history.traj"]  # fmt: skip
_ENCODINGS = {
    "utf-8-bom": lambda t: codecs.BOM_UTF8 + t.encode("utf-8"),
    "utf-16": lambda t: t.encode("utf-16"),
    "utf-16-le-no-bom": lambda t: t.encode("utf-16-le"),
    "utf-16-be-no-bom": lambda t: t.encode("utf-16-be"),
}


@pytest.mark.parametrize("encoding", list(_ENCODINGS))
@pytest.mark.parametrize("name", _SAMPLES)
def test_bom_and_utf16_files_detect_and_ingest_like_utf8(tmp_path: Path, name: str, encoding: str) -> None:
    src = FIX / name
    f = tmp_path / name
    f.write_bytes(_ENCODINGS[encoding](src.read_text(encoding="utf-8")))
    assert detect_format(f) == detect_format(src)
    got, want = list(ingest_any(f)), list(ingest_any(src))
    assert got == want and len(got) > 0


# ---------------------------------------------------------------------------- an output that cannot be used
def _one_line_error(capsys, rc: int) -> str:
    assert rc == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in captured.out + err
    return err


def test_out_that_is_a_folder_is_one_line(tmp_path: Path, capsys) -> None:
    err = _one_line_error(capsys, cli.main([str(SESSION), "--out", str(tmp_path)]))
    assert "is a folder" in err and "states.jsonl" in err


def test_out_under_a_file_is_one_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "notes.txt").write_text("keep")
    err = _one_line_error(capsys, cli.main([str(SESSION), "--out", str(tmp_path / "notes.txt" / "s.jsonl")]))
    assert "notes.txt is a file, not a folder" in err
    assert (tmp_path / "notes.txt").read_text() == "keep"


@pytest.mark.skipif(not os.path.isdir("/sys"), reason="needs /sys (unwritable even for root)")
def test_unwritable_out_is_one_line_in_a_subprocess() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "composer_replication.ingestion", str(SESSION), "--out", "/sys/states.jsonl"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == "error: cannot write --out /sys/states.jsonl: Permission denied"


def test_a_write_failure_midway_is_one_line_and_leaves_the_old_output(tmp_path: Path, capsys, monkeypatch):
    out = tmp_path / "states.jsonl"
    out.write_text("previous\n")

    def disk_full(sink, state):
        raise cli._OutputError("[Errno 28] No space left on device")

    monkeypatch.setattr(cli, "_write", disk_full)
    err = _one_line_error(capsys, cli.main([str(SESSION), "--out", str(out)]))
    assert "No space left on device" in err and out.read_text() == "previous\n"
    assert [p.name for p in tmp_path.iterdir()] == ["states.jsonl"]


# ---------------------------------------------------------------------------- inputs that fail
def test_an_unlistable_folder_is_reported(tmp_path: Path, capsys, monkeypatch) -> None:
    traces = tmp_path / "traces"
    (traces / "locked").mkdir(parents=True)
    (traces / "s.jsonl").write_text(SESSION.read_text())
    (traces / "locked" / "hidden.jsonl").write_text(SESSION.read_text())
    real_scandir = os.scandir

    def scandir(path="."):  # what os.walk meets in a folder without read permission
        if Path(path) == traces / "locked":
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    out = tmp_path / "states.jsonl"
    assert cli.main([str(traces), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.replace("\n", "")
    assert f"{traces / 'locked'}: cannot list this folder (Permission denied)" in printed  # today: silent
    assert len(out.read_text().splitlines()) == 8


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads folders whatever their mode")
def test_an_unreadable_folder_is_reported_for_real(tmp_path: Path, capsys) -> None:
    locked = tmp_path / "traces" / "locked"
    locked.mkdir(parents=True)
    (locked / "s.jsonl").write_text(SESSION.read_text())
    os.chmod(locked, 0)
    try:
        assert cli.main([str(tmp_path / "traces"), "--out", str(tmp_path / "s.jsonl")]) == 1
    finally:
        os.chmod(locked, 0o755)
    assert "cannot list this folder" in capsys.readouterr().out.replace("\n", "")


def test_a_file_that_fails_halfway_contributes_nothing(tmp_path: Path, capsys, monkeypatch) -> None:
    real = cli.make_ingester

    class HalfWay:
        last_stats = None

        def ingest(self, path):
            yield {"state_id": "half::0000", "messages": [], "student_action": "x", "source": "openai"}
            raise ValueError(f"{path}: broken after one state")

    def make(fmt, **kw):
        return HalfWay() if fmt == "openai" else real(fmt, **kw)

    monkeypatch.setattr(cli, "make_ingester", make)
    out = tmp_path / "states.jsonl"
    assert cli.main([str(FIX / "openai_object.json"), str(SESSION), "--out", str(out), "--allow-empty"]) == 0
    ids = [json.loads(x)["state_id"] for x in out.read_text().splitlines()]
    assert len(ids) == 8 and not any(i.startswith("half") for i in ids)
    assert "broken after one state" in capsys.readouterr().out


# ---------------------------------------------------------------------------- the real traces
def test_real_traces_still_ingest_as_before(shared_traces: Path, tmp_path: Path, capsys) -> None:
    def digest() -> dict[str, str]:
        return {
            str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in shared_traces.rglob("*")
            if p.is_file()
        }

    before = digest()
    out = tmp_path / "states.jsonl"
    assert cli.main([str(shared_traces), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "skipped /" not in printed and "cannot read" not in printed
    counts: dict[str, int] = {}
    for line in out.read_text().splitlines():
        stem = json.loads(line)["state_id"].split("::")[0]
        counts[stem[:8]] = counts.get(stem[:8], 0) + 1
    assert counts == {"03eb5929": 9, "326189cf": 15, "rollout-": 6, "swe_agen": 4, "6e44b9__": 5}
    assert digest() == before  # read-only: nothing beside the traces was written or changed
    # and writing into them is refused before anything is read
    assert cli.main([str(shared_traces), "--out", str(shared_traces / "states.jsonl")]) == 2
    assert digest() == before
