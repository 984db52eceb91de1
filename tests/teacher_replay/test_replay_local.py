"""The local teacher backend (``local:tiny``): offline actions, reproducible, cost 0, no key."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from replay_helpers import make_states

from composer_replication.teacher_replay import TeacherReplayer
from composer_replication.teacher_replay.teachers import LocalTeacher, local_model_name, teacher_needs_key


def test_local_slugs():
    assert local_model_name("local:tiny") == "tiny"
    assert local_model_name("local:") == "smollm2-135m"
    assert not teacher_needs_key({"slug": "local:tiny", "input_per_mtok": 0, "output_per_mtok": 0})
    with pytest.raises(ValueError, match="not a local teacher slug"):
        local_model_name("openai/gpt-5")


@pytest.mark.slow
def test_local_tiny_teacher_offline_reproducible(monkeypatch, tiny_model_and_tokenizer):
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)

    def no_network(request: httpx.Request) -> httpx.Response:  # any HTTP call would fail the test
        raise AssertionError(f"unexpected HTTP call to {request.url}")

    tiny = {"slug": "local:tiny", "input_per_mtok": 0.0, "output_per_mtok": 0.0, "max_tokens": 6}
    states = make_states(3)
    rp = TeacherReplayer([tiny], http_client=httpx.MockTransport(no_network))
    lt = rp.local_teachers["local:tiny"]
    lt._model, lt._tokenizer = tiny_model_and_tokenizer  # the session's tiny model (seed 0), not reloaded
    first = asyncio.run(rp.replay(states, max_total_usd=0.0))
    again = asyncio.run(rp.replay(list(reversed(states)), max_total_usd=0.0))
    assert rp.local_teachers["local:tiny"] is lt and lt._model is tiny_model_and_tokenizer[0]
    assert all(r["error"] is None and isinstance(r["response_text"], str) for r in first)
    assert all(
        r["cost_usd"] == 0.0 and 0 < r["completion_tokens"] <= 6 and r["prompt_tokens"] > 0 for r in first
    )
    by_id = {r["state_id"]: r["response_text"] for r in again}
    assert [by_id[r["state_id"]] for r in first] == [r["response_text"] for r in first]  # order-independent
    rp2 = TeacherReplayer([{**tiny, "seed": 123}], local_teachers={"local:tiny": lt})
    other_seed = asyncio.run(rp2.replay(states, max_total_usd=0.0))
    assert [r["response_text"] for r in other_seed] != [r["response_text"] for r in first]


@pytest.mark.slow
def test_local_teacher_generate_and_bad_model(tiny_model_and_tokenizer):
    assert "not loaded" in repr(LocalTeacher("tiny"))
    lt = LocalTeacher("tiny", preloaded=tiny_model_and_tokenizer)
    msgs = [{"role": "user", "content": "hello"}]
    a = lt.generate(msgs, state_id="s", max_new_tokens=5, temperature=0.0)
    b = lt.generate(msgs, state_id="other", max_new_tokens=5, temperature=0.0)
    assert a.text == b.text and a.completion_tokens <= 5  # greedy ignores the seed
    with pytest.raises(ValueError, match="does not fit the local model's context"):
        lt.generate(msgs, state_id="s", max_new_tokens=10**6)
    broken = {"slug": "local:/no/such/folder", "input_per_mtok": 0.0, "output_per_mtok": 0.0}
    res = asyncio.run(
        TeacherReplayer([broken], per_teacher_concurrency=1).replay(make_states(2), max_total_usd=0.0)
    )
    assert res[0]["error"].startswith("local teacher error: ValueError")
    assert res[1]["error"].startswith("skipped: teacher stopped after local teacher error")
