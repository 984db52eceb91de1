"""Faults: what networks, servers and crashes do to the money of a replay (issue 9, section 1).

Each test reproduces one fault; the budget must count what the provider may bill, and the replay
must neither hang, nor blow up its memory, nor crash on one bad reply.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc

import httpx
import pytest
from raw_server import RawServer, http_response, ok_response
from replay_helpers import REPO, SECRET, make_states, teacher

from benchmarks.fake_openai_server import FakeOpenAIServer
from composer_replication.teacher_replay import Ledger, replay_trace
from composer_replication.teacher_replay.budget import worst_case_cost
from composer_replication.teacher_replay.ledger import ledger_spend
from composer_replication.teacher_replay.teachers import BUDGET_SKIP, build_teacher_messages

FAST = {"backoff_base_s": 0.005, "max_backoff_s": 0.02}


def _reservation(state: dict, spec: dict, max_tokens: int = 1024) -> float:
    return worst_case_cost(spec, build_teacher_messages(state), max_tokens)


def _billed_attempts(path) -> list[float]:
    """USD of every attempt the ledger records as settled (or, for old ledgers, every call)."""
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "reserve":
            continue
        cost = rec["cost_usd"] if "cost_usd" in rec else rec["result"]["cost_usd"]
        if cost > 0:
            out.append(cost)
    return out


# ---------------------------------------------------------------------------- no resend, every attempt paid


def test_a_reused_connection_closed_after_the_post_is_never_resent_unpaid(tmp_path):
    """The server reads the POST on a reused connection, works 0.5 s and closes: that attempt may
    have been billed, so each POST the server saw is one attempt paid in the ledger."""

    def handler(conn, n, body):
        if n == 0:
            conn.sendall(ok_response())
            return True  # keep-alive: the next call reuses this connection
        time.sleep(0.5)
        return False  # read, worked, closed without a byte of response

    ledger = tmp_path / "ledger.jsonl"
    states, spec = make_states(2), teacher("a/one", "")
    with RawServer(handler) as srv:
        spec["base_url"] = srv.base_url
        res = asyncio.run(
            replay_trace(states, [spec], 1.0, SECRET, ledger_path=ledger, per_teacher_concurrency=1, **FAST)
        )
        posts = srv.posts
    billed = _billed_attempts(ledger)
    assert posts == len(billed) == 3  # call 1; call 2 closed (paid); call 2 retried (paid)
    assert all(r["error"] is None for r in res)
    success = (10 * 1.0 + 2 * 2.0) / 1e6
    assert res[1]["cost_usd"] == pytest.approx(_reservation(states[1], spec) + success)
    assert ledger_spend(ledger) == pytest.approx(sum(r["cost_usd"] for r in res))


@pytest.mark.parametrize(
    ("failure", "paid"),
    [
        (lambda req: (_ for _ in ()).throw(httpx.ConnectError("refused", request=req)), False),
        (lambda req: (_ for _ in ()).throw(httpx.ConnectTimeout("slow connect", request=req)), False),
        (lambda req: httpx.Response(429, json={"error": {"code": 429, "message": "slow down"}}), False),
        (lambda req: (_ for _ in ()).throw(httpx.ReadError("reset", request=req)), True),
        (lambda req: (_ for _ in ()).throw(httpx.RemoteProtocolError("closed", request=req)), True),
        (lambda req: httpx.Response(502, json={"error": {"code": 502, "message": "upstream died"}}), False),
        (lambda req: httpx.Response(200, json={"choices": [{"error": {"code": 503}}]}), False),
        (lambda req: httpx.Response(502, text="<html>bad gateway</html>"), False),
    ],
    ids=["connect-error", "connect-timeout", "429", "read-error", "closed", "502", "error-in-200", "502-html"],
)
def test_only_attempts_whose_outcome_is_unknown_are_paid_at_their_reservation(failure, paid):
    """Never sent: free. Answered by the provider (an error status or an error body, no usage): its bill, 0.
    Sent, then the connection dropped: the bill is unknown, so the reservation."""
    script = [failure, failure]

    def handler(request: httpx.Request) -> httpx.Response:
        if script:
            return script.pop(0)(request)
        return httpx.Response(
            200,
            json={
                "choices": [{"message": {"role": "assistant", "content": "ok"}}],
                "usage": {"prompt_tokens": 100, "completion_tokens": 10},
            },
        )

    states, spec = make_states(1), teacher("a/one", "https://api.example.test/v1")
    res = asyncio.run(
        replay_trace(states, [spec], 1.0, SECRET, http_client=httpx.MockTransport(handler), **FAST)
    )
    assert res[0]["error"] is None and script == []
    success = (100 * 1.0 + 10 * 2.0) / 1e6
    expected = success + (2 * _reservation(states[0], spec) if paid else 0.0)
    assert res[0]["cost_usd"] == pytest.approx(expected)


def test_answered_errors_settle_at_the_bill_not_the_reservation(tmp_path):
    """The server answers 429 and 502 (a body, no usage, nothing billed), then succeeds: the reported spend is
    the server's bill (the answered errors once counted at their reservations: a third of the budget early)."""
    ledger = tmp_path / "ledger.jsonl"
    with FakeOpenAIServer(api_key=SECRET, prices={"a/one": (1000.0, 1000.0)}) as srv:
        srv.add_fault("status", status=429, times=1, message="slow down")
        srv.add_fault("status", status=502, times=1, message="upstream died")
        spec = teacher("a/one", srv.base_url, p_in=1000.0, p_out=1000.0)
        res = asyncio.run(replay_trace(make_states(2), [spec], 10.0, SECRET, ledger_path=ledger,
                                       per_teacher_concurrency=1, **FAST))
        statuses, bill = [r.status for r in srv.requests], srv.billed_usd
    assert statuses == [429, 502, 200, 200] and all(r["error"] is None for r in res)
    assert bill > 0 and sum(r["cost_usd"] for r in res) == pytest.approx(bill, rel=1e-9)
    assert ledger_spend(ledger) == pytest.approx(bill, rel=1e-9)
    assert res[0]["cost_usd"] < _reservation(make_states(1)[0], spec)  # far below one reservation


_KILLED_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    sys.path.insert(0, {repo!r}); sys.path.insert(0, {here!r})
    from composer_replication.teacher_replay import replay_trace
    from replay_helpers import make_states, teacher
    asyncio.run(replay_trace(make_states(3), [teacher("a/one", {url!r})], 1.0, ledger_path={ledger!r},
                             timeout_s=60, per_teacher_concurrency=3))
    print("FINISHED")
    """
)


@pytest.mark.slow
def test_kill_9_mid_call_then_resume_counts_the_attempt_at_its_reservation(tmp_path):
    ledger = tmp_path / "ledger.jsonl"
    with FakeOpenAIServer(api_key=SECRET) as srv:
        srv.add_fault("hang", latency_s=60, times=-1)  # the request arrives; no reply comes
        code = _KILLED_CHILD.format(
            repo=str(REPO), here=os.path.dirname(__file__), url=srv.base_url, ledger=str(ledger)
        )
        env = {**os.environ, "OPENROUTER_API_KEY": SECRET, "OMP_NUM_THREADS": "1"}
        child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and srv.count() == 0:
            time.sleep(0.02)
        assert srv.count() >= 1, "the child never sent a request"
        os.kill(child.pid, signal.SIGKILL)
        child.communicate(timeout=30)
        state, spec = make_states(1)[0], teacher("a/one", srv.base_url)
    spent = ledger_spend(ledger)
    assert spent == pytest.approx(_reservation(state, spec) * srv.count())  # in flight: paid at reservation
    with FakeOpenAIServer(api_key=SECRET) as again:
        spec = teacher("a/one", again.base_url)
        res = asyncio.run(replay_trace(make_states(3), [spec], spent * 1.5, SECRET, ledger_path=ledger))
        assert again.count() == 0  # what is left of the cap (half a reservation) pays for nothing
    assert [r["error"] for r in res] == [BUDGET_SKIP] * 3


# ---------------------------------------------------------------------------- deadlines and sizes


def test_a_server_sending_one_byte_at_a_time_hits_the_total_deadline():
    def handler(conn, n, body):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
        for _ in range(600):  # a byte every 0.05 s: every read succeeds well inside any read timeout
            time.sleep(0.05)
            conn.sendall(b" ")
        return False

    with RawServer(handler) as srv:
        t0 = time.monotonic()
        run = replay_trace(
            make_states(1), [teacher("a/one", srv.base_url)], 1.0, SECRET, timeout_s=1.0, max_retries=0
        )
        res = asyncio.run(asyncio.wait_for(run, 20))
        elapsed = time.monotonic() - t0
    assert res[0]["error"].startswith("timeout: no complete reply within 1s") and elapsed < 6


def test_a_gzip_bomb_is_refused_without_inflating_it():
    bomb = gzip.compress(b"\0" * (256 << 20), compresslevel=9)  # ~256 KB that inflate to 256 MiB

    def handler(conn, n, body):
        conn.sendall(http_response(200, bomb, headers={"Content-Encoding": "gzip"}))
        return False

    with RawServer(handler) as srv:
        tracemalloc.start()
        try:
            res = asyncio.run(
                replay_trace(make_states(1), [teacher("a/one", srv.base_url)], 1.0, SECRET, max_retries=0)
            )
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    # identity was asked for: a compressed body is refused unread, never inflated
    assert res[0]["error"].startswith("malformed response: Content-Encoding 'gzip' where identity was asked for")
    assert peak < 64 << 20, f"peak {peak / 2**20:.0f} MiB"


def test_a_body_over_the_limit_is_refused_while_it_streams():
    def handler(conn, n, body):
        conn.sendall(http_response(200, b" " * (9 << 20)))
        return False

    with RawServer(handler) as srv:
        res = asyncio.run(replay_trace(make_states(1), [teacher("a/one", srv.base_url)], 1.0, SECRET, max_retries=0))
    assert res[0]["error"].startswith("response too large: over 8388608 bytes")


# ---------------------------------------------------------------------------- bad usage values


@pytest.mark.parametrize(
    "usage",
    [
        '{"prompt_tokens": -1e12, "completion_tokens": 5}',
        '{"prompt_tokens": "abc", "completion_tokens": 5}',
        '{"prompt_tokens": 1e999, "completion_tokens": 5}',
        '{"prompt_tokens": 10, "completion_tokens": NaN}',
        '{"prompt_tokens": 10, "completion_tokens": 5, "cost": -3.0}',
        '{"prompt_tokens": 10, "completion_tokens": 5, "cost": "free"}',
        '{"prompt_tokens": 10, "completion_tokens": 5, "cost": Infinity}',
        "[1, 2]",
    ],
)
def test_bad_usage_is_a_per_call_error_paid_at_its_reservation(tmp_path, usage):
    def handler(request: httpx.Request) -> httpx.Response:
        text = usage if b"number 0 " in request.content else '{"prompt_tokens": 10, "completion_tokens": 5}'
        body = '{"choices": [{"message": {"role": "assistant", "content": "ok"}}], "usage": ' + text + "}"
        return httpx.Response(200, text=body)

    states, spec, ledger = (
        make_states(3),
        teacher("a/one", "https://api.example.test/v1"),
        tmp_path / "l.jsonl",
    )
    res = asyncio.run(
        replay_trace(
            states, [spec], 1.0, SECRET, ledger_path=ledger, http_client=httpx.MockTransport(handler), **FAST
        )
    )
    assert res[0]["error"].startswith("bad usage: usage") and res[0]["response_text"] is None
    assert res[0]["cost_usd"] == pytest.approx(_reservation(states[0], spec))
    assert all(r["error"] is None and r["cost_usd"] == pytest.approx(20e-6) for r in res[1:])
    assert ledger_spend(ledger) == pytest.approx(sum(r["cost_usd"] for r in res))


def test_bad_amounts_in_a_ledger_never_reduce_its_spend(tmp_path):
    path = tmp_path / "ledger.jsonl"
    good = {"v": 1, "state_id": "s", "teacher_slug": "a", "request_sha256": "h", "ok": True}
    path.write_text(
        json.dumps({**good, "result": {"cost_usd": -135.0, "error": None}})
        + "\n"
        + json.dumps({**good, "state_id": "s2", "result": {"cost_usd": 0.25, "error": None}})
        + "\n"
    )
    assert ledger_spend(path) == pytest.approx(0.25)
    with Ledger(path) as led:
        assert led.spent_usd == pytest.approx(0.25)


@pytest.mark.parametrize(
    "body",
    ["[" * 200_000, '{"error": ' + "[" * 200_000, '{"choices": [{"message": {"content": ' + "[" * 200_000],
    ids=["nested-200", "nested-error", "nested-message"],
)
def test_a_reply_nested_past_the_recursion_limit_fails_one_call_not_the_replay(body):
    def handler(request: httpx.Request) -> httpx.Response:
        if b"number 0 " in request.content:
            return httpx.Response(200, text=body)
        return httpx.Response(200, json={"choices": [{"message": {"content": "ok"}}], "usage": {}})

    states, spec = make_states(2), teacher("a/one", "https://api.example.test/v1")
    res = asyncio.run(replay_trace(states, [spec], 1.0, SECRET, http_client=httpx.MockTransport(handler)))
    assert res[0]["error"].startswith("malformed response") and res[1]["error"] is None


def test_lone_surrogates_in_a_reply_never_stop_the_ledger(tmp_path):
    """``\\ud800`` is a legal JSON escape but not encodable as UTF-8: it once failed the ledger write."""

    def handler(request: httpx.Request) -> httpx.Response:
        if b"number 0 " in request.content:
            body = '{"choices": [{"message": {"content": "a\\ud800b"}}], "usage": {}}'
        else:
            body = '{"error": {"code": 400, "message": "bad \\udfff input"}}'
        return httpx.Response(200, text=body)

    ledger = tmp_path / "ledger.jsonl"
    spec = teacher("a/one", "https://api.example.test/v1")
    res = asyncio.run(
        replay_trace(
            make_states(2), [spec], 1.0, SECRET, ledger_path=ledger, http_client=httpx.MockTransport(handler)
        )
    )
    assert res[0]["response_text"] == "a?b" and "bad ? input" in res[1]["error"]
    assert len(ledger.read_text(encoding="utf-8").splitlines()) == 4
