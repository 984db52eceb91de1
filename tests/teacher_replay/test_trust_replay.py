"""Issue 24's teacher-replay findings: damaged ledgers, a ledger path that is a folder, piped summaries.

(The bill of answered errors is in ``test_faults_replay.py``, the streamed reply in ``test_replay_client.py``.)
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from replay_helpers import SECRET, make_states, teacher

from benchmarks.fake_openai_server import FakeOpenAIServer
from composer_replication.teacher_replay import Ledger, replay_trace
from composer_replication.teacher_replay.__main__ import main
from composer_replication.teacher_replay.ledger import ledger_spend, request_sha256
from composer_replication.teacher_replay.replay import TeacherReplayer
from composer_replication.teacher_replay.teachers import build_teacher_messages


def _good(sid: str, slug: str = "a/one") -> dict:
    return {"state_id": sid, "teacher_slug": slug, "response_text": "[TOOL_USE] name=Read input={}", "latency_s": 0.1,
            "prompt_tokens": 3, "completion_tokens": 4, "cost_usd": 0.001, "error": None}


DAMAGED = {
    "no text": {"response_text": None},
    "text of the wrong type": {"response_text": ["not", "text"]},
    "tokens of the wrong type": {"prompt_tokens": "7"},
    "a negative cost": {"cost_usd": -1.0},
    "a missing field": {"latency_s": None},
    "another call's ids": {"state_id": "someone-else"},
}


def test_damaged_cached_results_are_sent_again_not_trusted(tmp_path, caplog):
    states, ledger = make_states(len(DAMAGED) + 1), tmp_path / "ledger.jsonl"
    with FakeOpenAIServer(api_key=SECRET) as srv:
        spec = teacher("a/one", srv.base_url)
        rp = TeacherReplayer([spec], api_key=SECRET)
        lines = []
        for i, (state, damage) in enumerate(zip(states, [{}, *DAMAGED.values()])):
            h = request_sha256(rp._body(spec, build_teacher_messages(state)))
            lines.append(Ledger.reserve_record(f"a{i}", state["state_id"], "a/one", h, 0.01))
            result = {k: v for k, v in {**_good(state["state_id"]), **damage}.items() if v is not None or k != "latency_s"}
            lines.append(Ledger.settle_record(f"a{i}", 0.001, error=None, result=result))
        ledger.write_text("".join(json.dumps(rec) + "\n" for rec in lines))
        caplog.set_level(logging.WARNING)
        res = asyncio.run(rp.replay(states, max_total_usd=1.0, ledger_path=ledger))
        assert srv.count() == len(DAMAGED)  # only the sound cached result was reused
    assert res[0] == _good(states[0]["state_id"])
    assert all(r["error"] is None and isinstance(r["response_text"], str) for r in res)
    assert f"{len(DAMAGED)} cached result(s) are damaged" in caplog.text
    assert ledger_spend(ledger) == pytest.approx(sum(r["cost_usd"] for r in res[1:]) + 0.001 * len(states))


def test_a_deeply_nested_ledger_line_is_skipped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "ledger.jsonl"
    good = Ledger.settle_record("a1", 0.25, error=None)
    path.write_text("[" * 200_000 + "\n" + '{"kind": "settle", "attempt": "x", "cost_usd": ' + "[" * 200_000 + "\n"
                    + json.dumps(good) + "\n")
    caplog.set_level(logging.WARNING)
    assert ledger_spend(path) == pytest.approx(0.25)
    with Ledger(path) as led:
        assert led.spent_usd == pytest.approx(0.25)
    assert "skipped 2 unreadable line(s)" in caplog.text


def test_a_ledger_path_that_is_a_folder_or_unusable_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OPENROUTER_API_KEY", SECRET)
    states = tmp_path / "states.jsonl"
    states.write_text("".join(json.dumps(s) + "\n" for s in make_states(2)))
    (tmp_path / "dir").mkdir()
    (tmp_path / "a-file").write_text("")
    with FakeOpenAIServer(api_key=SECRET) as srv:
        for ledger, what in ((tmp_path / "dir", "is a folder"), (tmp_path / "a-file" / "ledger.jsonl", "cannot be opened")):
            rc = main([str(states), "--teachers", "a/one", "--base-url", srv.base_url, "--price-in", "1", "--price-out",
                       "1", "--budget", "1", "--ledger", str(ledger), "--out", str(tmp_path / "pairs.jsonl"),
                       "--no-progress"])
            err = capsys.readouterr().err.strip()
            assert rc == 2 and err.startswith("error: ") and what in err and "\n" not in err and "Traceback" not in err
            with pytest.raises(ValueError, match=what):
                asyncio.run(replay_trace(make_states(1), [teacher("a/one", srv.base_url)], 1.0, SECRET, ledger_path=ledger))
        assert srv.count() == 0
    assert not (tmp_path / "pairs.jsonl").exists()


def test_the_summary_stays_readable_when_piped(tmp_path, monkeypatch, capsys):
    """Piped output once cut the table to 80 columns, so the cost columns read ``0.0…``."""
    monkeypatch.setenv("OPENROUTER_API_KEY", SECRET)
    slug = "a-provider-with-a-long-name/a-model-with-an-even-longer-name-v2"
    states = tmp_path / "states.jsonl"
    states.write_text("".join(json.dumps(s) + "\n" for s in make_states(3)))
    with FakeOpenAIServer(api_key=SECRET, prices={slug: (1000.0, 3000.0)}) as srv:
        rc = main([str(states), "--teachers", slug, "--base-url", srv.base_url, "--price-in", "1000", "--price-out",
                   "3000", "--budget", "5", "--ledger", str(tmp_path / "l.jsonl"), "--out", str(tmp_path / "p.jsonl"),
                   "--agreement", "1", "--max-tokens", "64", "--no-progress"])
        bill = srv.billed_usd
    out = capsys.readouterr().out
    assert rc == 0 and "…" not in out
    row = next(line for line in out.splitlines() if line.startswith(slug))
    assert row.split()[1:3] == ["3", "0"] and f"{bill:.6f}" in row.split()
