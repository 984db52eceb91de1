"""Unit tests: keys (lookup, redaction), budget (reserve/settle), ledger (resume, torn line), prompting."""

from __future__ import annotations

import asyncio
import json
import pickle

import pytest
from replay_helpers import SECRET

from composer_replication.teacher_replay import (
    Budget,
    Ledger,
    MissingAPIKeyError,
    SecretKey,
    build_teacher_messages,
    estimate_prompt_tokens,
    reply_to_action,
    request_sha256,
    resolve_api_key,
    worst_case_cost,
)
from composer_replication.teacher_replay.keys import parse_dotenv, scrub

# ---------------------------------------------------------------------------- keys


def test_secret_key_never_shows_its_value():
    k = SecretKey(SECRET)
    for text in (repr(k), str(k), f"{k}", f"{k!r}", repr([k]), repr({"key": k})):
        assert SECRET not in text and "redacted" in text
    assert k.reveal() == SECRET
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(k)
    with pytest.raises(ValueError, match="non-empty string"):
        SecretKey("  ")


def test_scrub_removes_the_key():
    assert scrub(f"bad key {SECRET} here", SecretKey(SECRET)) == "bad key [REDACTED] here"
    assert scrub("nothing", None) == "nothing"


def test_key_lookup_order(monkeypatch, tmp_path):
    env = tmp_path / ".env"
    env.write_text('# comment\nexport OPENROUTER_API_KEY="from-dotenv"\nOTHER=1\n')
    monkeypatch.setenv("OPENROUTER_API_KEY", "from-env")
    assert resolve_api_key("from-arg", dotenv_path=env).reveal() == "from-arg"
    assert resolve_api_key(None, dotenv_path=env).reveal() == "from-env"
    monkeypatch.delenv("OPENROUTER_API_KEY")
    assert resolve_api_key(None, dotenv_path=env).reveal() == "from-dotenv"
    assert parse_dotenv(env) == {"OPENROUTER_API_KEY": "from-dotenv", "OTHER": "1"}


def test_missing_key_says_where_it_looked(monkeypatch, tmp_path):
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    with pytest.raises(MissingAPIKeyError, match="OPENROUTER_API_KEY") as info:
        resolve_api_key(None, dotenv_path=tmp_path / "missing.env")
    assert "api_key argument" in str(info.value) and "missing.env (does not exist)" in str(info.value)
    assert resolve_api_key(None, required=False) is None


# ---------------------------------------------------------------------------- budget


def test_estimates_are_conservative_and_priced():
    msgs = [{"role": "user", "content": "x" * 300}]
    assert estimate_prompt_tokens(msgs) >= 100  # 300 chars / 3
    assert estimate_prompt_tokens([{"role": "user", "content": "字" * 30}]) >= 30  # bytes, not chars
    spec = {"slug": "a/b", "input_per_mtok": 2.0, "output_per_mtok": 4.0}
    expected = estimate_prompt_tokens(msgs) * 2e-6 + 100 * 4e-6
    assert worst_case_cost(spec, msgs, 100) == pytest.approx(expected)


def test_budget_reserve_settle_and_refusal():
    async def go():
        b = Budget(1.0)
        r1 = await b.reserve(0.6)
        assert b.reserved_usd == pytest.approx(0.6)
        waiter = asyncio.create_task(b.reserve(0.6))  # does not fit while r1 is in flight: waits
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await b.settle(r1, 0.1)  # frees room: the waiter gets its reservation
        r2 = await asyncio.wait_for(waiter, 1)
        assert r2 is not None and b.spent_usd == pytest.approx(0.1)
        await b.settle(r2, 0.2)
        assert await b.reserve(0.71) is None  # nothing in flight and it cannot fit: refused
        assert b.spent_usd == pytest.approx(0.3) and b.peak_committed_usd <= 1.0
        with pytest.raises(RuntimeError, match="already settled"):
            await b.settle(r2, 0.0)

    asyncio.run(go())


@pytest.mark.parametrize("bad", [-1, "5", True])
def test_budget_rejects_bad_caps(bad):
    with pytest.raises(ValueError, match="max_total_usd must be a number >= 0"):
        Budget(bad)


# ---------------------------------------------------------------------------- ledger


def _result(sid: str, cost: float, error: str | None = None) -> dict:
    return {
        "state_id": sid,
        "teacher_slug": "a/b",
        "response_text": None if error else "ok",
        "latency_s": 0.1,
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "cost_usd": cost,
        "error": error,
    }


def test_request_hash_covers_the_canonical_fields():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5}
    h = request_sha256(body)
    assert h == request_sha256({**body, "stream": False})  # other fields do not matter
    assert h == request_sha256(dict(reversed(list(body.items()))))  # key order does not matter
    assert h != request_sha256({**body, "max_tokens": 6})
    assert h != request_sha256({**body, "temperature": 0.5})
    assert h != request_sha256({**body, "seed": 1})


def test_ledger_resume_and_torn_last_line(tmp_path):
    path = tmp_path / "sub" / "ledger.jsonl"
    with Ledger(path) as led:
        led.append("h1", _result("s1", 0.25))
        led.append("h2", _result("s2", 0.0, error="HTTP 500 (server error): x"))
    with open(path, "a") as fh:
        fh.write('{"v": 1, "state_id": "s3", "tea')  # the process died mid-write
    led = Ledger(path)
    assert led.lookup("s1", "a/b", "h1")["response_text"] == "ok"
    assert led.lookup("s1", "a/b", "other-hash") is None
    assert led.lookup("s2", "a/b", "h2") is None  # errors are not reused: they are retried
    assert led.spent_usd == pytest.approx(0.25) and len(led) == 2
    led.append("h3", _result("s3", 0.5))  # appended after the truncated torn line
    led.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(line) for line in lines)
    assert Ledger(path).spent_usd == pytest.approx(0.75)


# ---------------------------------------------------------------------------- prompting


def test_history_is_rendered_as_plain_alternating_text():
    state = {
        "state_id": "s",
        "tools": ["Read", "Bash"],
        "student_action": "x",
        "messages": [
            {"role": "system", "content": "Agent rules."},
            {"role": "user", "content": [{"type": "text", "text": "Fix it."}]},
            {
                "role": "assistant",
                "content": "Looking.",
                "tool_calls": [
                    {"id": "c1", "function": {"name": "Read", "arguments": '{"file_path": "/a"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "file body"},
            {"role": "user", "content": "and hurry"},
        ],
    }
    msgs = build_teacher_messages(state)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert all(set(m) == {"role", "content"} for m in msgs)  # no tool_calls / tool roles sent
    assert "[TOOL_USE] name=" in msgs[0]["content"] and "Agent rules." in msgs[0]["content"]
    assert "Read, Bash" in msgs[0]["content"]
    assert msgs[2]["content"] == 'Looking.\n[TOOL_USE] name=Read input={"file_path": "/a"}'
    assert msgs[3]["content"] == "[TOOL_RESULT] id=c1\nfile body\n\nand hurry"


def test_history_ending_with_assistant_gets_a_user_turn():
    state = {"state_id": "s", "student_action": "x", "messages": [{"role": "assistant", "content": "hi"}]}
    assert build_teacher_messages(state)[-1]["role"] == "user"
    with pytest.raises(ValueError, match="'messages' must be a list"):
        build_teacher_messages({"state_id": "s", "messages": "oops", "student_action": ""})


def test_reply_to_action():
    assert reply_to_action({"content": "  plain  "}) == "plain"
    call = {"type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}
    assert (
        reply_to_action({"content": None, "tool_calls": [call]})
        == '[TOOL_USE] name=Bash input={"command": "ls"}'
    )
    assert (
        reply_to_action({"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}) == "a\nb"
    )
