"""Unit tests: keys (lookup, redaction), budget (reserve/settle), ledger (resume, torn line), prompting."""

from __future__ import annotations

import asyncio
import json
import pickle

import pytest
from replay_helpers import SECRET

from composer_replication.teacher_replay import Budget, Ledger
from composer_replication.teacher_replay.budget import (
    BadUsageError,
    CostModel,
    Usage,
    estimate_prompt_tokens,
    parse_usage,
    worst_case_cost,
)
from composer_replication.teacher_replay.keys import (
    InvalidAPIKeyError,
    MissingAPIKeyError,
    SecretKey,
    parse_dotenv,
    resolve_api_key,
    scrub,
    scrub_clip,
)
from composer_replication.teacher_replay.ledger import ledger_spend, request_sha256
from composer_replication.teacher_replay.teachers import build_teacher_messages, reply_to_action

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


def test_scrub_removes_every_run_of_8_key_characters_and_runs_before_cutting():
    key = SecretKey(SECRET)
    cut = "x" * 10 + SECRET[:-1]  # a key cut at the end of an error body
    assert scrub(cut, key) == "x" * 10 + "[REDACTED]"
    middle = f"a{SECRET[5:13]}b{SECRET[20:27]}c"  # 8 characters go; 7 stay
    assert scrub(middle, key) == f"a[REDACTED]b{SECRET[20:27]}c"
    assert scrub(SECRET + SECRET, key) == "[REDACTED]"
    clipped = scrub_clip("y" * 30 + SECRET, key, 40)  # scrubbed first, then cut
    assert clipped == "y" * 30 + "[REDACTED]" and SECRET[:8] not in clipped


@pytest.mark.parametrize(
    ("value", "what"), [("ab\r\ncd-0123", "line break"), ("abcé0123", "non-ASCII"), ("ab\x00cd", "control")]
)
def test_secret_key_refuses_characters_a_header_cannot_hold(value, what):
    with pytest.raises(InvalidAPIKeyError, match=what) as info:
        SecretKey(value, source="the environment variable X")
    assert "API key from the environment variable X" in str(info.value) and value not in str(info.value)


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


def test_parse_usage_refuses_values_that_would_corrupt_the_sums():
    assert parse_usage({"prompt_tokens": 3, "completion_tokens": 4, "cost": 0.5}) == Usage(3, 4, 0.5)
    assert parse_usage({}) == Usage(0, 0, None)
    for bad in (
        {"prompt_tokens": -1},
        {"completion_tokens": "7"},
        {"cost": float("inf")},
        {"cost": True},
        [1],
    ):
        with pytest.raises(BadUsageError):
            parse_usage(bad)


def test_cost_model_calibrates_one_call_at_a_time_and_learns_from_bills():
    async def go():
        spec = {"slug": "x/free", "input_per_mtok": 0.0, "output_per_mtok": 0.0}
        model, msgs = CostModel(spec), [{"role": "user", "content": "x" * 30}]
        assert model.reservation(msgs, 100) == 0.0 and await model.admit() is True
        second = asyncio.create_task(model.admit())  # waits: the first call is calibrating
        await asyncio.sleep(0.01)
        assert not second.done()
        assert model.bill(Usage(100, 10, 0.3), 0.0) == 0.3  # billed above its prices (0)
        await model.release(True)
        assert await asyncio.wait_for(second, 1) is False and model.calibrated and not model.trusted
        # bounds: input <= 0.3/100, output <= 0.3/10 per token
        expected = estimate_prompt_tokens(msgs) * 0.003 + 100 * 0.03
        assert model.reservation(msgs, 100) == pytest.approx(expected)
        assert model.bill(Usage(5, 5, None), 1.25) == 1.25  # no usage.cost on a teacher priced too low

        vllm = CostModel(spec)  # a free server: bills nothing, reports no cost
        await vllm.admit()
        assert vllm.bill(Usage(100, 10, None), 0.0) == 0.0 and vllm.trusted and vllm.calibrated
        assert vllm.reservation(msgs, 100) == 0.0

    asyncio.run(go())


def test_retry_policy_is_the_one_place_that_decides():
    from composer_replication.teacher_replay.client import AttemptOutcome, RetryPolicy

    policy = RetryPolicy(max_retries=2, backoff_base_s=0.0, max_retry_after_s=10)
    transient = AttemptOutcome(error="HTTP 503 (no provider available): x", retryable=True)
    assert policy.next_delay(0, transient) == (0.0, None)
    assert policy.next_delay(2, transient)[1].endswith("gave up after 3 attempts")
    assert policy.next_delay(0, AttemptOutcome(error="bad", retryable=False)) == (None, "bad")
    late = AttemptOutcome(error="HTTP 429 (rate limited): x", retryable=True, retry_after=60)
    assert "exceeds 10s" in policy.next_delay(0, late)[1]
    assert policy.next_delay(0, AttemptOutcome(text="ok")) == (None, None)


@pytest.mark.parametrize("bad", [-1, "5", True, float("nan"), float("inf")])
def test_budget_rejects_bad_caps(bad):
    with pytest.raises(ValueError, match="max_total_usd must be a finite number >= 0"):
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


def _paid(led: Ledger, attempt: str, sid: str, reserved: float, cost: float | None, error=None) -> None:
    """Record one attempt (reserve, then settle unless ``cost`` is None: killed in flight)."""
    led.write_records([Ledger.reserve_record(attempt, sid, "a/b", "h-" + sid, reserved)])
    if cost is not None:
        result = _result(sid, cost, error)
        led.write_records([Ledger.settle_record(attempt, cost, error=error, result=result)])


def test_ledger_resume_and_torn_last_line(tmp_path):
    path = tmp_path / "sub" / "ledger.jsonl"
    with Ledger(path) as led:
        _paid(led, "a1", "s1", 0.5, 0.25)
        _paid(led, "a2", "s2", 0.5, 0.0, error="HTTP 500 (server error): x")
    with open(path, "a") as fh:
        fh.write('{"v": 2, "kind": "reserve", "attempt": "a3", "tea')  # the process died mid-write
    led = Ledger(path)
    assert led.lookup("s1", "a/b", "h-s1")["response_text"] == "ok"
    assert led.lookup("s1", "a/b", "other-hash") is None
    assert led.lookup("s2", "a/b", "h-s2") is None  # errors are not reused: they are retried
    assert led.spent_usd == pytest.approx(0.25) and len(led) == 4
    _paid(led, "a3", "s3", 0.5, 0.5)  # appended after the truncated torn line
    led.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 6 and all(json.loads(line) for line in lines)
    assert Ledger(path).spent_usd == pytest.approx(0.75)


def test_ledger_reads_version_1_lines(tmp_path):
    path = tmp_path / "v1.jsonl"
    rec = {"v": 1, "state_id": "s1", "teacher_slug": "a/b", "request_sha256": "h", "ok": True}
    path.write_text(json.dumps({**rec, "result": _result("s1", 0.25)}) + "\n")
    assert ledger_spend(path) == pytest.approx(0.25)
    with Ledger(path) as led:
        assert led.lookup("s1", "a/b", "h")["cost_usd"] == 0.25 and led.spent_usd == pytest.approx(0.25)


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
