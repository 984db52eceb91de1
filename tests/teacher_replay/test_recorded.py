"""The ``recorded`` teacher: chosen = the session's recorded action; the rejected side is left to the rollouts."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from replay_helpers import make_states

from composer_replication.teacher_replay import (
    RECORDED_TEACHER,
    PairCollector,
    TeacherReplayer,
    extract_dpo_pairs,
)
from composer_replication.teacher_replay.teachers import recorded_result, teacher_needs_key
from composer_replication.types import ROLLOUT_REJECTED

READ = '[TOOL_USE] name=Read input={"file_path": "/app/config.py"}'
GREP = '[TOOL_USE] name=Grep input={"pattern": "retries"}'


def _states(n: int = 3) -> list[dict]:
    states = make_states(n)
    for i, s in enumerate(states):
        s["student_action"] = READ if i % 2 == 0 else GREP
    return states


def _no_network(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"unexpected HTTP call to {request.url}")


def _assert_rollout_pair(pair, state, teachers=("recorded",)) -> None:
    assert pair.chosen == state["student_action"] and pair.chosen_messages == [
        {"role": "assistant", "content": state["student_action"]}]
    assert pair.rejected_messages == [] and pair.rejected_from_rollout
    assert pair.metadata["rejected_source"] == ROLLOUT_REJECTED and pair.metadata["teachers"] == list(teachers)
    assert pair.metadata["recorded_action"] == state["student_action"] and pair.state_messages == state["messages"]


def test_recorded_teacher_alone_threshold_1_makes_a_rollout_pair_at_every_state(monkeypatch):
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)  # free and in-process: no key, no student model
    assert not teacher_needs_key(RECORDED_TEACHER)
    states = _states(3)
    rp = TeacherReplayer([RECORDED_TEACHER], http_client=httpx.MockTransport(_no_network))
    results = asyncio.run(rp.replay(states, max_total_usd=0.0))
    assert [(r["teacher_slug"], r["response_text"], r["cost_usd"], r["error"]) for r in results] == [
        ("recorded", s["student_action"], 0.0, None) for s in states
    ]
    pairs = extract_dpo_pairs(states, results, agreement_threshold=1, rejected_from_rollout=True)
    assert len(pairs) == len(states)  # no student side to agree with here: every answered state counts
    for pair, state in zip(pairs, states):
        _assert_rollout_pair(pair, state)
        assert pair.n_teachers_agreeing == 1
    # without the flag the rejected side is the recorded action itself: it always agrees, no pairs
    assert extract_dpo_pairs(states, results, agreement_threshold=1) == []


def test_recorded_with_a_frontier_teacher_threshold_2():
    """[recorded, a/frontier] with threshold 2: a pair only where the frontier teacher confirms the recorded action."""
    states = _states(2)

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        confirm = "bug number 0" in body["messages"][-1]["content"]  # state 0: agrees; state 1: answers text
        action = '[TOOL_USE] name=Read input={"file_path":  "/app/config.py"}' if confirm else "I am done."
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": action}}],
                                         "usage": {"prompt_tokens": 10, "completion_tokens": 5}})

    frontier = {"slug": "a/frontier", "input_per_mtok": 1.0, "output_per_mtok": 1.0}
    rp = TeacherReplayer([RECORDED_TEACHER, frontier], api_key="sk-test", http_client=httpx.MockTransport(handler))
    results = asyncio.run(rp.replay(states, max_total_usd=1.0))
    assert [r["teacher_slug"] for r in results] == ["recorded", "a/frontier"] * 2
    pairs = extract_dpo_pairs(states, results, agreement_threshold=2, rejected_from_rollout=True)
    assert [p.state_id for p in pairs] == ["t::0000"] and pairs[0].n_teachers_agreeing == 2
    _assert_rollout_pair(pairs[0], states[0], teachers=("recorded", "a/frontier"))
    # threshold 1: state 1 ties 1-1 between the recorded action and the frontier's text; recorded is listed first
    loose = extract_dpo_pairs(states, results, agreement_threshold=1, rejected_from_rollout=True)
    assert [(p.state_id, p.chosen) for p in loose] == [("t::0000", READ), ("t::0001", GREP)]


def test_recorded_result_and_collector():
    states = _states(2)
    states[1]["student_action"] = "   "
    assert recorded_result(states[1])["error"] == "no recorded action"  # takes no part in the vote
    collector = PairCollector(states, num_teachers=1, agreement_threshold=1, rejected_from_rollout=True)
    (first,) = collector.add(recorded_result(states[0]))
    _assert_rollout_pair(first, states[0])
    assert collector.add(recorded_result(states[1])) == []


def test_recorded_teacher_abstains_where_the_recorded_call_failed():
    """A call to a tool that does not exist (the agent's mistake, corrected next turn) is no action to teach."""
    states = _states(3)
    states[0]["student_action"] = '[TOOL_USE] name=Search input={"query": "def f"}'
    states[0]["error_kind"] = "tool_not_found"
    states[1]["error_kind"] = "runtime_error"  # e.g. a failing test run: a sound action, kept
    results = [recorded_result(s) for s in states]
    assert results[0]["error"] == "recorded action failed: tool_not_found" and results[0]["response_text"] is None
    assert results[1]["error"] is None
    pairs = extract_dpo_pairs(states, results, agreement_threshold=1, rejected_from_rollout=True)
    assert [p.state_id for p in pairs] == ["t::0001", "t::0002"]


def test_pairs_with_a_rollout_rejected_side_round_trip(tmp_path):
    from composer_replication.teacher_replay import load_pairs, save_pairs

    states = _states(2)
    pairs = extract_dpo_pairs(states, [recorded_result(s) for s in states], 1, rejected_from_rollout=True)
    save_pairs(pairs, tmp_path / "pairs.jsonl")
    row = json.loads((tmp_path / "pairs.jsonl").read_text().splitlines()[0])
    assert row["rejected_messages"] == [] and row["rejected"] == ""
    assert load_pairs(tmp_path / "pairs.jsonl") == pairs


def test_replay_and_normalize_with_the_recorded_teacher():
    """replaysim's one-call pipeline: the recorded teacher implies rollout-rejected pairs; the normalizer keeps
    them (their empty rejected side is not a reason to drop) and filters their chosen side."""
    from composer_replication.replaysim import replay_and_normalize_trace

    states = _states(3)
    states[2]["student_action"] = "The tests pass. The tests pass."  # degenerate: dropped, counted
    raw, pairs = asyncio.run(replay_and_normalize_trace(states=states, teachers=[RECORDED_TEACHER],
                                                        agreement_threshold=1, max_total_usd=0.0))
    assert [r["teacher_slug"] for r in raw] == ["recorded"] * 3
    assert [p.state_id for p in pairs] == ["t::0000", "t::0001"]
    for pair, state in zip(pairs, states):
        _assert_rollout_pair(pair, state)
        assert pair.metadata["backend"] == "native"


def test_recorded_needs_no_student_and_local_teachers_keep_generating():
    rp = TeacherReplayer([RECORDED_TEACHER, {"slug": "local:tiny", "input_per_mtok": 0.0, "output_per_mtok": 0.0}])
    assert set(rp.local_teachers) == {"local:tiny"}
    with pytest.raises(TypeError):
        TeacherReplayer([RECORDED_TEACHER], student="local:tiny")  # the student is not sampled here any more
