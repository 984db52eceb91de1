"""The ``recorded`` teacher: chosen = the session's recorded action, rejected = the student's own sample."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from replay_helpers import make_states

from composer_replication.actions import canonical_action
from composer_replication.teacher_replay import (
    LocalTeacher,
    PairCollector,
    TeacherReplayer,
    extract_dpo_pairs,
    teacher_needs_key,
)
from composer_replication.teacher_replay.recorded import (
    RECORDED_TEACHER,
    StudentSampling,
    recorded_result,
    sample_student_actions,
)

READ = '[TOOL_USE] name=Read input={"file_path": "/app/config.py"}'
GREP = '[TOOL_USE] name=Grep input={"pattern": "retries"}'
SAMPLING = StudentSampling(max_new_tokens=6, temperature=1.0, seed=3)


def _states(n: int = 3) -> list[dict]:
    states = make_states(n)
    for i, s in enumerate(states):
        s["student_action"] = READ if i % 2 == 0 else GREP
    return states


def _no_network(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"unexpected HTTP call to {request.url}")


@pytest.fixture
def student(tiny_model_and_tokenizer) -> LocalTeacher:
    """The tiny student (seed 0) through the local backend, not reloaded."""
    return LocalTeacher("tiny", preloaded=tiny_model_and_tokenizer)


def test_recorded_teacher_alone_threshold_1(monkeypatch, student):
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)  # free and in-process: no key needed
    assert not teacher_needs_key(RECORDED_TEACHER)
    states = _states(3)
    rp = TeacherReplayer(
        [RECORDED_TEACHER],
        student=student,
        student_sampling=SAMPLING,
        http_client=httpx.MockTransport(_no_network),
    )
    results = asyncio.run(rp.replay(states, max_total_usd=0.0))
    assert [(r["teacher_slug"], r["response_text"], r["cost_usd"], r["error"]) for r in results] == [
        ("recorded", s["student_action"], 0.0, None) for s in states
    ]
    samples = asyncio.run(rp.sample_student(states))
    assert set(samples) == {s["state_id"] for s in states} and all(
        isinstance(t, str) for t in samples.values()
    )
    assert samples == asyncio.run(rp.sample_student(states))  # deterministic from the seed
    pairs = extract_dpo_pairs(
        states, results, agreement_threshold=1, student_actions=samples, student_meta=SAMPLING.metadata(0)
    )
    disagree = [
        s for s in states if canonical_action(samples[s["state_id"]]) != canonical_action(s["student_action"])
    ]
    assert [p.state_id for p in pairs] == [s["state_id"] for s in disagree] and pairs
    for pair, state in zip(pairs, disagree):
        assert pair.chosen == state["student_action"] and pair.rejected == samples[state["state_id"]]
        assert pair.n_teachers_agreeing == 1 and pair.state_messages == state["messages"]
        assert (
            pair.metadata["teachers"] == ["recorded"] and pair.metadata["rejected_source"] == "student_sample"
        )
        assert pair.metadata["student_sample"] == {
            "step": 0,
            "max_new_tokens": 6,
            "temperature": 1.0,
            "top_p": 1.0,
            "seed": 3,
        }
        assert pair.metadata["recorded_action"] == state["student_action"]


def test_student_samples_follow_the_seed(student):
    states = _states(4)
    a = sample_student_actions(student, states, SAMPLING)
    b = sample_student_actions(student, states, StudentSampling(max_new_tokens=6, temperature=1.0, seed=4))
    assert a != b  # a random tiny model at temperature 1: another seed gives other samples
    greedy = StudentSampling(max_new_tokens=6, temperature=0.0, seed=0)
    assert sample_student_actions(student, states, greedy) == sample_student_actions(
        student, states, StudentSampling(max_new_tokens=6, temperature=0.0, seed=9)
    )


def test_recorded_with_a_frontier_teacher_threshold_2(student):
    """[recorded, a/frontier] with threshold 2: a pair only where the frontier teacher confirms the recorded action."""
    states = _states(2)

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        confirm = "bug number 0" in body["messages"][-1]["content"]  # state 0: agrees; state 1: answers text
        action = '[TOOL_USE] name=Read input={"file_path":  "/app/config.py"}' if confirm else "I am done."
        return httpx.Response(
            200,
            json={
                "choices": [{"message": {"role": "assistant", "content": action}}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5},
            },
        )

    frontier = {"slug": "a/frontier", "input_per_mtok": 1.0, "output_per_mtok": 1.0}
    rp = TeacherReplayer(
        [RECORDED_TEACHER, frontier],
        api_key="sk-test",
        student=student,
        student_sampling=SAMPLING,
        http_client=httpx.MockTransport(handler),
    )
    results = asyncio.run(rp.replay(states, max_total_usd=1.0))
    assert [r["teacher_slug"] for r in results] == ["recorded", "a/frontier"] * 2
    samples = {s["state_id"]: "I will do nothing." for s in states}
    pairs = extract_dpo_pairs(states, results, agreement_threshold=2, student_actions=samples)
    assert [p.state_id for p in pairs] == ["t::0000"]
    assert pairs[0].n_teachers_agreeing == 2 and pairs[0].metadata["teachers"] == ["recorded", "a/frontier"]
    assert pairs[0].chosen == READ and pairs[0].rejected == "I will do nothing."
    # threshold 1: state 1 ties 1-1 between the recorded action and the frontier's text; the recorded
    # teacher is listed first, so it wins
    loose = extract_dpo_pairs(states, results, agreement_threshold=1, student_actions=samples)
    assert [(p.state_id, p.chosen) for p in loose] == [("t::0000", READ), ("t::0001", GREP)]


def test_student_agreeing_with_the_recorded_action_makes_no_pair():
    states = _states(2)
    results = [recorded_result(s) for s in states]
    same = {
        "t::0000": '[TOOL_USE] name=Read input={"file_path":"/app/config.py"}',  # same call, other spacing
        "t::0001": "Let me grep.",
    }
    pairs = extract_dpo_pairs(states, results, agreement_threshold=1, student_actions=same)
    assert [p.state_id for p in pairs] == ["t::0001"] and pairs[0].rejected == "Let me grep."
    # without student samples the student's side is the recorded action: it always agrees, no pairs
    assert extract_dpo_pairs(states, results, agreement_threshold=1) == []


def test_recorded_result_and_collector():
    states = _states(2)
    states[1]["student_action"] = "   "
    assert recorded_result(states[1])["error"] == "no recorded action"  # takes no part in the vote
    collector = PairCollector(
        states,
        num_teachers=1,
        agreement_threshold=1,
        student_actions={"t::0000": "hm", "t::0001": "hm"},
        student_meta={"step": 0},
    )
    first = collector.add(recorded_result(states[0]))
    assert [(p.chosen, p.rejected, p.metadata["student_sample"]) for p in first] == [
        (READ, "hm", {"step": 0})
    ]
    assert collector.add(recorded_result(states[1])) == []


def test_recorded_teacher_abstains_where_the_recorded_call_failed():
    """A call to a tool that does not exist (the agent's mistake, corrected next turn) is no action to teach."""
    states = _states(3)
    states[0]["student_action"] = '[TOOL_USE] name=Search input={"query": "def f"}'
    states[0]["error_kind"] = "tool_not_found"
    states[1]["error_kind"] = "runtime_error"  # e.g. a failing test run: a sound action, kept
    results = [recorded_result(s) for s in states]
    assert (
        results[0]["error"] == "recorded action failed: tool_not_found"
        and results[0]["response_text"] is None
    )
    assert results[1]["error"] is None
    pairs = extract_dpo_pairs(
        states,
        results,
        agreement_threshold=1,
        student_actions=dict.fromkeys((s["state_id"] for s in states), "I will do nothing."),
    )
    assert [p.state_id for p in pairs] == ["t::0001", "t::0002"]


def test_recorded_needs_a_student():
    with pytest.raises(ValueError, match="pass student='local:<student model>'"):
        TeacherReplayer([RECORDED_TEACHER])
    rp = TeacherReplayer([{"slug": "local:tiny", "input_per_mtok": 0.0, "output_per_mtok": 0.0}])
    with pytest.raises(ValueError, match="sample_student needs"):
        asyncio.run(rp.sample_student(_states(1)))
    with pytest.raises(ValueError, match="need max_new_tokens >= 1 and batch_size >= 1"):
        StudentSampling(max_new_tokens=0)


def test_replay_and_normalize_with_the_recorded_teacher(student):
    """replaysim's one-call pipeline: recorded teacher, the student's samples, the default normalizer."""
    from composer_replication.replaysim import replay_and_normalize_trace

    states = _states(3)
    raw, pairs = asyncio.run(
        replay_and_normalize_trace(
            states=states,
            teachers=[RECORDED_TEACHER],
            agreement_threshold=1,
            max_total_usd=0.0,
            student=student,
            student_sampling=SAMPLING,
        )
    )
    samples = sample_student_actions(student, states, SAMPLING)
    assert [r["teacher_slug"] for r in raw] == ["recorded"] * 3
    assert pairs and all(p.chosen == p.metadata["recorded_action"] for p in pairs)
    assert [p.rejected for p in pairs] == [samples[p.state_id] for p in pairs]
    assert all(
        p.metadata["rejected_source"] == "student_sample" and p.metadata["backend"] == "native" for p in pairs
    )
