"""extract_dpo_pairs / save_pairs / load_pairs on hand-built cases."""

from __future__ import annotations

import json

import pytest

from composer_replication.teacher_replay import PairCollector, extract_dpo_pairs, load_pairs, save_pairs

READ_A = '[TOOL_USE] name=Read input={"file_path": "/a.py", "limit": 10}'
READ_A_REORDERED = '[TOOL_USE] name=Read input={"limit":10,   "file_path":"/a.py"}  '
READ_B = '[TOOL_USE] name=Read input={"file_path": "/b.py"}'


def _state(sid: str = "s1", student: str = "ls") -> dict:
    return {"state_id": sid, "messages": [{"role": "user", "content": "go"}], "student_action": student}


def _res(sid: str, slug: str, text: str | None, error: str | None = None) -> dict:
    return {
        "state_id": sid,
        "teacher_slug": slug,
        "response_text": text,
        "latency_s": 0.1,
        "prompt_tokens": 1,
        "completion_tokens": 1,
        "cost_usd": 0.0,
        "error": error,
    }


def test_two_agreeing_teachers_make_a_pair_keeping_original_text():
    results = [_res("s1", "t1", READ_A_REORDERED), _res("s1", "t2", READ_A), _res("s1", "t3", READ_B)]
    pairs = extract_dpo_pairs([_state()], results, agreement_threshold=2)
    assert len(pairs) == 1
    p = pairs[0]
    assert p["chosen"] == READ_A_REORDERED  # the earliest agreeing teacher's ORIGINAL text
    assert p["rejected"] == "ls" and p["n_teachers_agreeing"] == 2
    assert p["state_messages"] == [{"role": "user", "content": "go"}]


def test_threshold_edges():
    results = [_res("s1", "t1", READ_A), _res("s1", "t2", READ_A), _res("s1", "t3", READ_B)]
    assert len(extract_dpo_pairs([_state()], results, agreement_threshold=2)) == 1
    assert extract_dpo_pairs([_state()], results, agreement_threshold=3) == []
    single = extract_dpo_pairs([_state()], [_res("s1", "t1", READ_B)], agreement_threshold=1)
    assert single[0]["chosen"] == READ_B and single[0]["n_teachers_agreeing"] == 1


def test_whitespace_only_differences_agree():
    results = [_res("s1", "t1", "Run   the\ntests now. "), _res("s1", "t2", "Run the tests now.")]
    pairs = extract_dpo_pairs([_state()], results)
    assert pairs[0]["chosen"] == "Run   the\ntests now. " and pairs[0]["n_teachers_agreeing"] == 2


def test_agreement_with_the_student_makes_no_pair():
    student = '[TOOL_USE] name=Read input={"limit": 10, "file_path": "/a.py"}'
    results = [_res("s1", "t1", READ_A), _res("s1", "t2", READ_A_REORDERED)]
    assert extract_dpo_pairs([_state(student=student)], results) == []


def test_tie_between_student_group_and_other_group_makes_no_pair():
    results = [
        _res("s1", "t1", READ_A),
        _res("s1", "t2", READ_A),
        _res("s1", "t3", READ_B),
        _res("s1", "t4", READ_B),
    ]
    assert extract_dpo_pairs([_state(student=READ_B)], results) == []
    # a larger non-student group beats the student's group
    results.append(_res("s1", "t5", READ_A))
    pairs = extract_dpo_pairs([_state(student=READ_B)], results)
    assert pairs[0]["chosen"] == READ_A and pairs[0]["n_teachers_agreeing"] == 3


def test_tie_between_two_non_student_groups_goes_to_the_earliest_reply():
    results = [
        _res("s1", "t1", READ_B),
        _res("s1", "t2", READ_A),
        _res("s1", "t3", READ_A),
        _res("s1", "t4", READ_B),
    ]
    pairs = extract_dpo_pairs([_state()], results)
    assert pairs[0]["chosen"] == READ_B  # t1 (first in results order) is in the B group
    flipped = [results[1], results[0], results[2], results[3]]
    assert extract_dpo_pairs([_state()], flipped)[0]["chosen"] == READ_A


def test_errors_empty_replies_duplicates_and_unknown_states_are_ignored():
    results = [
        _res("s1", "t1", READ_A),
        _res("s1", "t1", READ_A),  # the same teacher twice counts once
        _res("s1", "t2", None, error="HTTP 402 (insufficient credits): no"),
        _res("s1", "t3", "   "),
        _res("other", "t4", READ_A),
    ]
    assert extract_dpo_pairs([_state()], results) == []
    assert len(extract_dpo_pairs([_state()], results, agreement_threshold=1)) == 1


def test_pairs_follow_state_order_one_per_state():
    states = [_state("s2"), _state("s1")]
    results = [_res(s, t, READ_A) for s in ("s1", "s2") for t in ("t1", "t2")]
    assert [p["state_id"] for p in extract_dpo_pairs(states, results)] == ["s2", "s1"]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_threshold_raises(bad):
    with pytest.raises(ValueError, match="agreement_threshold must be an integer >= 1"):
        extract_dpo_pairs([_state()], [], agreement_threshold=bad)


def test_duplicate_states_raise():
    with pytest.raises(ValueError, match="appears twice"):
        extract_dpo_pairs([_state(), _state()], [])


def test_save_and_load_round_trip_atomic(tmp_path):
    results = [_res("s1", "t1", READ_A), _res("s1", "t2", READ_A)]
    pairs = extract_dpo_pairs([_state()], results)
    out = tmp_path / "deep" / "dir" / "pairs.jsonl"
    save_pairs(pairs, out)
    assert load_pairs(out) == pairs
    save_pairs([], out)  # overwrite atomically; no temp files left behind
    assert load_pairs(out) == []
    assert sorted(p.name for p in out.parent.iterdir()) == ["pairs.jsonl"]


def test_load_pairs_errors_name_the_line(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"state_id": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"p.jsonl:1: 'chosen' must be the action text"):
        load_pairs(p)
    p.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"p.jsonl:1: not a JSON line"):
        load_pairs(p)


def test_pair_collector_emits_when_every_teacher_answered():
    state = {"state_id": "s", "messages": [{"role": "user", "content": "ls"}],
             "student_action": '[TOOL_USE] name=Bash input={"command": "ls"}'}
    coll = PairCollector([state], num_teachers=2, agreement_threshold=2)
    r = {"state_id": "s", "response_text": '[TOOL_USE] name=Read input={"file_path": "a"}', "error": None,
         "latency_s": 0.1, "prompt_tokens": 1, "completion_tokens": 1, "cost_usd": 0.0}
    assert coll.add({**r, "teacher_slug": "a"}) == []
    pairs = coll.add({**r, "teacher_slug": "b"})
    assert len(pairs) == 1 and pairs[0]["n_teachers_agreeing"] == 2 and "Read" in pairs[0]["chosen"]
