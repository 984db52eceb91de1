"""Budget under concurrency, ledger resume (incl. after SIGKILL), and the key never leaking."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
from replay_helpers import REPO, SECRET, make_states, teacher

from benchmarks.fake_openai_server import FakeOpenAIServer
from composer_replication.teacher_replay import TeacherReplayer, replay_trace
from composer_replication.teacher_replay.budget import worst_case_cost
from composer_replication.teacher_replay.ledger import request_sha256
from composer_replication.teacher_replay.teachers import BUDGET_SKIP, build_teacher_messages


def test_spend_never_exceeds_the_cap_with_many_calls_in_flight():
    events = []
    with FakeOpenAIServer(latency_s=0.02, api_key=SECRET) as srv:
        teachers = [
            teacher("a/one", srv.base_url, max_tokens=64),
            teacher("b/two", srv.base_url, max_tokens=64),
        ]
        states = make_states(60)
        one_call = worst_case_cost(teachers[0], build_teacher_messages(states[0]), 64)
        cap = 30 * one_call  # room for ~half of the 120 calls (actual costs are below the worst case)
        res = asyncio.run(
            replay_trace(
                states,
                teachers,
                cap,
                SECRET,
                max_concurrency=32,
                per_teacher_concurrency=16,
                progress=events.append,
            )
        )
        n_requests = srv.count()
    assert len(res) == 120 and len(events) == 120
    assert max(e.spent_usd + e.reserved_usd for e in events) <= cap + 1e-12
    assert sum(r["cost_usd"] for r in res) <= cap
    skipped = [r for r in res if r["error"] == BUDGET_SKIP]
    made = [r for r in res if r["error"] is None]
    assert skipped and len(made) >= 30 and len(made) + len(skipped) == 120
    assert n_requests == len(made)  # skipped calls were never sent
    assert all(r["cost_usd"] == 0 and r["response_text"] is None for r in skipped)


def test_zero_budget_skips_everything_without_requests(fake_server):
    res = asyncio.run(replay_trace(make_states(3), [teacher("a/one", fake_server.base_url)], 0.0, SECRET))
    assert [r["error"] for r in res] == [BUDGET_SKIP] * 3 and fake_server.count() == 0


def test_ledger_resume_returns_paid_calls_and_counts_their_spend(tmp_path, fake_server):
    ledger = tmp_path / "ledger.jsonl"
    teachers = [teacher("a/one", fake_server.base_url), teacher("b/two", fake_server.base_url)]
    first = asyncio.run(replay_trace(make_states(4), teachers, 1.0, SECRET, ledger_path=ledger))
    kinds = [json.loads(line)["kind"] for line in ledger.read_text().splitlines()]
    assert fake_server.count() == 8 and kinds.count("reserve") == kinds.count("settle") == 8
    spent = sum(r["cost_usd"] for r in first)
    again = asyncio.run(replay_trace(make_states(4), teachers, 1.0, SECRET, ledger_path=ledger))
    assert again == first and fake_server.count() == 8  # nothing paid twice
    # the ledger's spend counts against the cap: with cap == spend, new states are all skipped
    more = asyncio.run(replay_trace(make_states(6), teachers, spent, SECRET, ledger_path=ledger))
    assert more[:8] == first and [r["error"] for r in more[8:]] == [BUDGET_SKIP] * 4
    assert fake_server.count() == 8
    # a changed request (max_tokens) is a different call
    asyncio.run(replay_trace(make_states(1), teachers[:1], 1.0, SECRET, ledger_path=ledger, max_tokens=7))
    assert fake_server.count() == 9


_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    sys.path.insert(0, {repo!r})
    from composer_replication.teacher_replay import replay_trace
    sys.path.insert(0, {here!r})
    from replay_helpers import make_states, teacher
    teachers = [teacher("a/one", {url!r}), teacher("b/two", {url!r})]
    asyncio.run(replay_trace(make_states(20), teachers, 1.0, ledger_path={ledger!r},
                             max_concurrency=2, per_teacher_concurrency=1))
    print("FINISHED")
    """
)


@pytest.mark.slow
def test_resume_after_sigkill_pays_no_call_twice(tmp_path):
    ledger = tmp_path / "ledger.jsonl"
    with FakeOpenAIServer(latency_s=0.1, api_key=SECRET) as srv:
        code = _CHILD.format(
            repo=str(REPO), here=os.path.dirname(__file__), url=srv.base_url, ledger=str(ledger)
        )
        env = {**os.environ, "OPENROUTER_API_KEY": SECRET, "OMP_NUM_THREADS": "1"}
        child = subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if ledger.exists() and len(ledger.read_text().splitlines()) >= 8:
                break
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
        out, err = child.communicate(timeout=30)
        assert b"FINISHED" not in out, "the child finished before it was killed; make it slower"
        paid = _succeeded_hashes(ledger)
        assert len(paid) >= 2
        before = len(srv.requests)
        res = asyncio.run(
            replay_trace(
                make_states(20),
                [teacher("a/one", srv.base_url), teacher("b/two", srv.base_url)],
                1.0,
                SECRET,
                ledger_path=ledger,
            )
        )
        resumed = srv.requests[before:]
    assert all(r["error"] is None for r in res) and len(res) == 40
    resumed_hashes = [request_sha256(r.body) for r in resumed]
    assert not paid & set(resumed_hashes)  # zero duplicate paid calls
    assert len(resumed_hashes) == len(set(resumed_hashes)) == 40 - len(paid)
    assert _succeeded_hashes(ledger) >= set(resumed_hashes)


def _succeeded_hashes(ledger) -> set[str]:
    """request_sha256 of the calls the ledger records as answered successfully."""
    recs = [json.loads(line) for line in ledger.read_text().splitlines() if line.endswith("}")]
    hashes = {r["attempt"]: r["request_sha256"] for r in recs if r["kind"] == "reserve"}
    return {
        hashes[r["attempt"]]
        for r in recs
        if r["kind"] == "settle" and r.get("result") and r["result"]["error"] is None
    }


def test_the_key_never_leaks(tmp_path, caplog, capfd, fast_retry):
    caplog.set_level(logging.DEBUG)
    ledger = tmp_path / "ledger.jsonl"
    with FakeOpenAIServer(api_key=SECRET) as srv:
        srv.add_fault("status", status=500, times=2, message="upstream saw {auth}")
        srv.add_fault("status", status=400, model="b/two", times=-1, message="bad request from {auth}")
        teachers = [teacher("a/one", srv.base_url), teacher("b/two", srv.base_url)]
        replayer = TeacherReplayer(teachers, api_key=SECRET, max_retries=1, **fast_retry)
        res = asyncio.run(replayer.replay(make_states(3), ledger_path=ledger))
    assert any("[REDACTED]" in (r["error"] or "") for r in res)  # the echoed key was scrubbed

    def transport_error(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"proxy refused {request.headers['Authorization']}", request=request)

    res2 = asyncio.run(
        replay_trace(
            make_states(1),
            [teacher("c/three", "https://x.test/v1")],
            api_key=SECRET,
            http_client=httpx.MockTransport(transport_error),
            max_retries=0,
        )
    )
    texts = [
        json.dumps(res),
        json.dumps(res2),
        ledger.read_text(),
        repr(replayer),
        str(replayer.__dict__),
        caplog.text,
        "".join(capfd.readouterr()),
    ]
    with pytest.raises(ValueError) as info:  # validation errors never carry the key either
        TeacherReplayer(teachers, api_key=SECRET, max_concurrency=0)
    texts.append(str(info.value))
    for text in texts:
        assert SECRET not in text
    assert "[REDACTED]" in res2[0]["error"]


def test_a_failing_ledger_write_fails_the_replay(tmp_path, fake_server, monkeypatch):
    from composer_replication.teacher_replay import Ledger

    def disk_full(self, items):
        raise OSError("No space left on device")

    monkeypatch.setattr(Ledger, "write_records", disk_full)
    with pytest.raises(OSError, match="No space left"):
        asyncio.run(
            replay_trace(
                make_states(3),
                [teacher("a/one", fake_server.base_url)],
                1.0,
                SECRET,
                ledger_path=tmp_path / "l",
            )
        )
