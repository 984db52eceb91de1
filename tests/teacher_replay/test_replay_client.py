"""The replay client against httpx.MockTransport and the fake server: replies, retries, stops, faults."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from replay_helpers import SECRET, make_states, teacher

from composer_replication.teacher_replay import replay_trace
from composer_replication.teacher_replay.budget import worst_case_cost
from composer_replication.teacher_replay.keys import MissingAPIKeyError
from composer_replication.teacher_replay.teachers import build_teacher_messages

URL = "https://api.example.test/v1"


def _ok(content="Run the tests.", usage=None, tool_calls=None) -> dict:
    msg = {"role": "assistant", "content": content}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    body = {"id": "gen-1", "choices": [{"index": 0, "finish_reason": "stop", "message": msg}]}
    if usage is not False:
        body["usage"] = usage or {"prompt_tokens": 100, "completion_tokens": 10}
    return body


def _run(states, teachers, handler, **kw):
    kw.setdefault("api_key", SECRET)
    return asyncio.run(replay_trace(states, teachers, http_client=httpx.MockTransport(handler), **kw))


def _t(slug="a/one", **extra):
    return teacher(slug, URL, **extra)


def test_success_usage_cost_and_tool_calls():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        calls.append((request.url.path, request.headers["Authorization"], body))
        if body["model"] == "a/one":
            return httpx.Response(
                200, json=_ok(usage={"prompt_tokens": 100, "completion_tokens": 10, "cost": 0.5})
            )
        tc = [{"id": "c", "type": "function", "function": {"name": "Bash", "arguments": '{"command":"ls"}'}}]
        return httpx.Response(200, json=_ok(content="", tool_calls=tc))

    res = _run(make_states(1), [_t("a/one"), _t("b/two", p_in=1.0, p_out=2.0)], handler, max_total_usd=10.0)
    assert calls[0][0] == "/v1/chat/completions" and calls[0][1] == f"Bearer {SECRET}"
    assert calls[0][2]["max_tokens"] == 1024 and "temperature" not in calls[0][2]
    assert res[0]["response_text"] == "Run the tests." and res[0]["cost_usd"] == 0.5  # usage.cost wins
    assert res[1]["response_text"] == '[TOOL_USE] name=Bash input={"command":"ls"}'
    assert res[1]["cost_usd"] == pytest.approx((100 * 1.0 + 10 * 2.0) / 1e6)  # tokens x prices
    assert res[1]["prompt_tokens"] == 100 and res[1]["completion_tokens"] == 10 and res[1]["error"] is None


def test_results_keep_state_teacher_order_and_concurrency_limits():
    in_flight = {"all": 0, "a/one": 0, "b/two": 0}
    peak = {"all": 0, "a/one": 0, "b/two": 0}
    rng = random.Random(0)

    async def handler(request: httpx.Request) -> httpx.Response:
        model = json.loads(request.content)["model"]
        for k in ("all", model):
            in_flight[k] += 1
            peak[k] = max(peak[k], in_flight[k])
        await asyncio.sleep(rng.uniform(0.0, 0.01))
        for k in ("all", model):
            in_flight[k] -= 1
        return httpx.Response(200, json=_ok(content=model))

    states = make_states(30)
    teachers = [_t("a/one"), _t("b/two", max_concurrency=2)]
    res = _run(states, teachers, handler, max_concurrency=5, per_teacher_concurrency=4)
    assert [(r["state_id"], r["teacher_slug"]) for r in res] == [
        (s["state_id"], t["slug"]) for s in states for t in teachers
    ]
    assert all(r["response_text"] == r["teacher_slug"] for r in res)
    assert peak["all"] <= 5 and peak["a/one"] <= 4 and peak["b/two"] <= 2
    assert peak["all"] >= 3  # it really ran concurrently


@pytest.mark.parametrize(
    ("status", "meaning"),
    [
        (400, "bad request"),
        (401, "bad or missing API key"),
        (402, "insufficient credits"),
        (403, "moderation"),
    ],
)
def test_fatal_statuses_stop_the_teacher(status, meaning):
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        model = json.loads(request.content)["model"]
        seen.append(model)
        if model == "bad/one":
            return httpx.Response(status, json={"error": {"code": status, "message": "nope"}})
        return httpx.Response(200, json=_ok())

    res = _run(make_states(4), [_t("bad/one"), _t("b/two")], handler, per_teacher_concurrency=1)
    bad = [r for r in res if r["teacher_slug"] == "bad/one"]
    assert bad[0]["error"].startswith(f"HTTP {status} ({meaning}") and "nope" in bad[0]["error"]
    for r in bad[1:]:
        assert r["error"].startswith(f"skipped: teacher stopped after HTTP {status} ({meaning}")
    assert seen.count("bad/one") == 1  # never retried, never called again
    assert all(r["error"] is None for r in res if r["teacher_slug"] == "b/two")


def test_transient_statuses_and_body_errors_are_retried(fast_retry):
    script = [
        httpx.Response(502, json={"error": {"code": 502, "message": "down"}}),
        httpx.Response(503, text="no provider"),
        httpx.Response(408, json={"error": {"code": 408, "message": "slow"}}),
        httpx.Response(200, json={"error": {"code": 502, "message": "upstream died"}}),
        httpx.Response(
            200, json={"choices": [{"finish_reason": "error", "error": {"code": 503, "message": "x"}}]}
        ),
        httpx.Response(402, headers={"Retry-After": "0"}, json={"error": {"code": 402, "message": "top up"}}),
        httpx.Response(200, json=_ok()),
    ]

    def handler(request: httpx.Request) -> httpx.Response:
        return script.pop(0)

    res = _run(make_states(1), [_t()], handler, max_retries=6, **fast_retry)
    assert res[0]["error"] is None and res[0]["response_text"] == "Run the tests." and script == []


def test_connection_errors_are_retried_then_give_up(fast_retry):
    n = {"calls": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        n["calls"] += 1
        raise httpx.ConnectError("connection refused", request=request)

    res = _run(make_states(1), [_t()], handler, max_retries=2, **fast_retry)
    assert n["calls"] == 3
    assert (
        res[0]["error"].startswith("connection error: ConnectError")
        and "gave up after 3 attempts" in res[0]["error"]
    )


@pytest.mark.parametrize(
    ("body", "expected", "answered"),
    [
        ("<html>oops</html>", "malformed response: HTTP 200 body is not JSON", False),
        (json.dumps({"choices": []}), "malformed response: no choices[0]", False),
        (json.dumps({"choices": [{"finish_reason": "stop"}]}), "malformed response: choices[0].message", False),
        (json.dumps([1, 2]), "malformed response: expected a JSON object", False),
        (json.dumps({"choices": [{"finish_reason": "error", "message": {}}]}), "provider error (finish_reason", True),
        (json.dumps({"error": {"code": "weird", "message": "bad"}}), "provider error in a 200 reply", True),
    ],
)
def test_bad_200_bodies_are_errors_not_retried(body, expected, answered):
    n = {"calls": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        n["calls"] += 1
        return httpx.Response(200, text=body)

    states, t = make_states(1), _t()
    res = _run(states, [t], handler)
    assert res[0]["error"].startswith(expected) and res[0]["response_text"] is None and n["calls"] == 1
    # a broken reply: the server may have worked (and billed), so the reservation; an error the provider
    # reported without usage: nothing billed
    reservation = worst_case_cost(t, build_teacher_messages(states[0]), 1024)
    assert res[0]["cost_usd"] == (0.0 if answered else pytest.approx(reservation))


@pytest.mark.parametrize(
    ("headers", "body"),
    [({"Content-Type": "text/event-stream"}, 'data: {"choices": []}\n\ndata: [DONE]\n\n'),
     ({"Content-Type": "application/json"}, 'data: {"choices": [{"delta": {"content": "ok"}}]}\n\n')],
    ids=["event-stream", "data-lines"],
)
def test_a_streamed_reply_is_refused_and_stops_the_teacher(headers, body):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers=headers, text=body)

    res = _run(make_states(2), [_t()], handler, per_teacher_concurrency=1)
    assert res[0]["error"] == "streaming replies are not supported; use a non-streaming endpoint"
    assert res[1]["error"] == "skipped: teacher stopped after streaming replies are not supported; use a non-streaming endpoint"


def test_error_code_402_inside_200_stops_the_teacher():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"error": {"code": 402, "message": "Insufficient credits"}})

    res = _run(make_states(3), [_t()], handler, per_teacher_concurrency=1)
    assert res[0]["error"].startswith("provider error 402 (insufficient credits)")
    assert res[2]["error"] == "skipped: teacher stopped after HTTP 402 (insufficient credits)"


def test_missing_usage_is_charged_the_worst_case():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=_ok(usage=False))

    states, t = make_states(1), _t(max_tokens=50)
    res = _run(states, [t], handler)
    assert res[0]["cost_usd"] == pytest.approx(worst_case_cost(t, build_teacher_messages(states[0]), 50))


def test_retry_after_is_honoured_with_the_fake_server(fake_server, fast_retry):
    fake_server.add_fault("status", status=429, retry_after=0.6, times=1, message="slow down")
    t0 = time.monotonic()
    res = asyncio.run(
        replay_trace(make_states(1), [teacher("a/one", fake_server.base_url)], api_key=SECRET, **fast_retry)
    )
    reqs = fake_server.requests
    assert res[0]["error"] is None and [r.status for r in reqs] == [429, 200]
    gap = reqs[1].time - reqs[0].time
    assert 0.6 <= gap < 5.0, gap  # waited Retry-After (not the 5 ms backoff); generous bound for loaded CI
    assert time.monotonic() - t0 >= 0.6


def test_long_retry_after_fails_instead_of_waiting(fake_server, fast_retry):
    fake_server.add_fault("status", status=429, retry_after=3600, times=1)
    res = asyncio.run(
        replay_trace(
            make_states(1),
            [teacher("a/one", fake_server.base_url)],
            api_key=SECRET,
            max_retry_after_s=10,
            **fast_retry,
        )
    )
    assert res[0]["error"].startswith("HTTP 429 (rate limited)") and "exceeds" in res[0]["error"]


def test_timeouts_and_dropped_connections_with_the_fake_server(fake_server, fast_retry):
    fake_server.add_fault("hang", latency_s=1.0, times=2)
    fake_server.add_fault("drop", times=1)
    states = make_states(2)
    t = teacher("a/one", fake_server.base_url)
    res = asyncio.run(
        replay_trace(
            states, [t], api_key=SECRET, timeout_s=0.2, max_retries=1, per_teacher_concurrency=1, **fast_retry
        )
    )
    assert (
        res[0]["error"].startswith("timeout: no complete reply within 0.2s")
        and "gave up after 2 attempts" in res[0]["error"]
    )
    assert res[1]["error"] is None  # dropped once, then answered


def test_wrong_key_gets_401_with_its_meaning(fake_server):
    res = asyncio.run(
        replay_trace(
            make_states(2),
            [teacher("a/one", fake_server.base_url)],
            api_key="sk-wrong",
            per_teacher_concurrency=1,
        )
    )
    assert res[0]["error"].startswith("HTTP 401 (bad or missing API key)")
    assert res[1]["error"].startswith("skipped: teacher stopped after HTTP 401")
    assert fake_server.count() == 1


def test_key_required_only_for_remote_teachers(monkeypatch):
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    with pytest.raises(MissingAPIKeyError, match="OPENROUTER_API_KEY"):
        asyncio.run(replay_trace(make_states(1), [_t()], api_key=None))

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("Authorization"))
        return httpx.Response(200, json=_ok())

    loopback = teacher("a/one", "http://127.0.0.1:9/v1")
    res = asyncio.run(replay_trace(make_states(1), [loopback], http_client=httpx.MockTransport(handler)))
    assert res[0]["error"] is None and seen == [None]  # no key needed, none sent


@pytest.mark.parametrize(
    ("teachers", "kw", "match"),
    [
        ([], {}, "non-empty list"),
        ([_t(), _t()], {}, "listed twice"),
        ([_t(p_in=-1)], {}, "input_per_mtok must be a finite number >= 0"),
        ([{"slug": "x/y", "input_per_mtok": 1, "output_per_mtok": 1, "base_url": "ftp://x"}], {}, "base_url"),
        ([_t(max_tokens=0)], {}, "max_tokens must be an integer >= 1"),
        ([_t()], {"max_concurrency": 0}, "max_concurrency must be an integer >= 1"),
        ([_t()], {"http_client": object()}, "http_client must be"),
        ([_t()], {"max_total_usd": -1.0}, "max_total_usd must be a finite number >= 0"),
    ],
)
def test_bad_arguments_raise(teachers, kw, match):
    with pytest.raises(ValueError, match=match):
        asyncio.run(replay_trace(make_states(1), teachers, api_key=SECRET, **kw))


def test_duplicate_state_ids_raise():
    with pytest.raises(ValueError, match="appears twice"):
        asyncio.run(replay_trace(make_states(1) * 2, [_t()], api_key=SECRET))


def test_bad_state_messages_raise_before_any_call():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(200, json=_ok())

    states = make_states(3)
    states[2]["messages"] = "not a list"
    with pytest.raises(ValueError, match="'messages' must be a list"):
        _run(states, [_t()], handler)
    assert calls == []


def test_empty_states_make_no_calls():
    def handler(request: httpx.Request) -> httpx.Response:
        raise AssertionError("no call expected")

    assert _run([], [_t()], handler) == []
