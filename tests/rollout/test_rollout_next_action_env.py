"""Next-action rewards: each component, each error kind, consensus preferred over the recorded action."""

from __future__ import annotations

import pytest

from composer_replication.actions import ActionBlock
from composer_replication.hint_generator import dispatch
from composer_replication.rollout.environment import Environment, Prompt, Score, score_texts
from composer_replication.rollout.next_action import (
    NextActionEnvironment,
    RewardWeights,
    text_f1,
    tool_call_agreement,
)

TOOLS = ["Read", "Bash", "Edit"]
READ = '[TOOL_USE] name=Read input={"file_path": "/repo/a.py", "limit": 50}'


def state(state_id="s::0000", action=READ, tools=TOOLS, **extra):
    s = {
        "state_id": state_id,
        "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "Open a.py and fix the bug"}],
        "student_action": action,
    }
    if tools is not None:
        s["tools"] = tools
    s.update(extra)
    return s


def score(action, st=None, pairs=None, **kw):
    env = NextActionEnvironment([st or state()], pairs, **kw)
    return env.score(env.prompts()[0], action)


def test_protocol_and_prompt():
    env = NextActionEnvironment([state()])
    assert isinstance(env, Environment) and env.name == "next_action"
    (p,) = env.prompts()
    assert p.prompt_id == "s::0000" and p.tools == TOOLS and p.reference == READ
    assert p.messages[-1]["content"] == "Open a.py and fix the bug"
    assert p.metadata["reference_source"] == "recorded"


def test_exact_match_scores_one_even_with_reordered_keys_and_thinking():
    s = score('[THINKING] look first\n[TOOL_USE] name=Read input={"limit": 50, "file_path": "/repo/a.py"}')
    assert s.reward == pytest.approx(1.0)
    assert s.error_kind is None and s.error_meta is None
    assert s.details == {"format": 1.0, "json": 1.0, "agreement": 1.0, "reference_source": "recorded"}


def test_partial_agreement_same_tool_some_arguments():
    s = score('[TOOL_USE] name=Read input={"file_path": "/repo/a.py", "limit": 10}')
    # same name (0.5) + 1 of 2 keys equal (0.5 * 0.5) = 0.75 agreement
    assert s.details["agreement"] == pytest.approx(0.75)
    assert s.reward == pytest.approx(0.2 + 0.2 + 0.6 * 0.75)
    assert s.error_kind is None


def test_other_offered_tool_gets_format_and_json_only():
    s = score('[TOOL_USE] name=Bash input={"command": "ls"}')
    assert s.details["agreement"] == 0.0 and s.reward == pytest.approx(0.4) and s.error_kind is None


def test_unknown_tool_is_tool_not_found():
    s = score('[TOOL_USE] name=Reed input={"file_path": "/repo/a.py"}')
    assert s.error_kind == "tool_not_found"
    assert s.details["format"] == 0.0 and s.details["json"] == 1.0
    meta = s.error_meta
    assert meta["tool_name"] == "Reed" and meta["available_tools"] == TOOLS
    assert "Reed" in meta["error_message"] and "Read" in meta["error_message"]
    assert meta["intent"] == "Open a.py and fix the bug" and meta["error_kind"] == "tool_not_found"


def test_invalid_json_is_json_decode():
    s = score('[TOOL_USE] name=Read input={"file_path": "/repo/a.py",}')
    assert s.error_kind == "json_decode" and s.details["json"] == 0.0 and s.details["format"] == 1.0
    assert "invalid JSON" in s.error_meta["error_message"]
    assert s.details["agreement"] == pytest.approx(0.5)  # right tool, no usable arguments


def test_non_object_json_is_json_decode():
    s = score('[TOOL_USE] name=Read input=["/repo/a.py"]')
    assert s.error_kind == "json_decode" and "JSON object" in s.error_meta["error_message"]


def test_wrong_argument_type_vs_reference_is_type_error():
    s = score('[TOOL_USE] name=Read input={"file_path": "/repo/a.py", "limit": "50"}')
    assert s.error_kind == "type_error"
    assert "'limit'" in s.error_meta["error_message"] and "number" in s.error_meta["error_message"]


def test_schema_types_and_required_arguments():
    schema = {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
              "required": ["command"]}
    st = state(action='[TOOL_USE] name=Bash input={"command": "ls"}')
    s = score('[TOOL_USE] name=Bash input={"command": "ls", "timeout": "5"}', st, tool_schemas={"Bash": schema})
    assert s.error_kind == "type_error" and s.error_meta["tool_schema"] == schema
    s = score('[TOOL_USE] name=Bash input={"timeout": 5}', st, tool_schemas={"Bash": schema})
    assert s.error_kind == "type_error" and "missing required argument 'command'" in s.error_meta["error_message"]
    s = score('[TOOL_USE] name=Bash input={"command": "ls", "timeout": 5}', st, tool_schemas={"Bash": schema})
    assert s.error_kind is None


def test_error_order_first_failing_call():
    s = score('[TOOL_USE] name=Read input={bad\n[TOOL_USE] name=Nope input={}')
    assert s.error_kind == "json_decode"


def test_text_answer_to_a_tool_reference_gets_nothing_and_is_an_error_site():
    s = score("I will read the file now.")
    assert s.reward == 0.0 and s.error_kind == "other"
    meta = s.error_meta
    assert meta["available_tools"] == TOOLS and "tool_name" not in meta
    assert "needs a tool call" in meta["error_message"] and "[TOOL_USE] name=<tool>" in meta["error_message"]
    hint = dispatch("other", meta)
    assert hint.startswith("Reminder: this step needs a tool call") and "`Read`" in hint
    assert "Your goal: Open a.py and fix the bug." in hint


def test_text_answer_to_a_text_reference_is_not_an_error_site():
    assert score("Done, the tests pass.", state(action="The tests pass now.")).error_kind is None


def test_plain_text_reference_scored_by_token_f1():
    st = state(action="The bug is in line 3 of a.py")
    s = score("the bug is in line 3", st)
    assert s.details["format"] == 1.0 and s.details["json"] == 1.0
    assert s.details["agreement"] == pytest.approx(text_f1("the bug is in line 3", "The bug is in line 3 of a.py"))
    assert score("The  bug is in line 3 of a.py", st).reward == pytest.approx(1.0)
    assert score("", st).reward == pytest.approx(0.2)  # empty: only the (vacuous) json credit


def test_consensus_reference_preferred_over_recorded():
    chosen = '[TOOL_USE] name=Bash input={"command": "pytest -x"}'
    weak = '[TOOL_USE] name=Edit input={"path": "a.py"}'
    pairs = [
        {"state_id": "s::0000", "state_messages": [], "chosen": weak, "rejected": READ, "n_teachers_agreeing": 2},
        {"state_id": "s::0000", "state_messages": [], "chosen": chosen, "rejected": READ, "n_teachers_agreeing": 3},
        {"state_id": "other", "state_messages": [], "chosen": weak, "rejected": READ, "n_teachers_agreeing": 5},
    ]
    env = NextActionEnvironment([state()], pairs)
    (p,) = env.prompts()
    assert p.reference == chosen and p.metadata["reference_source"] == "consensus"
    assert p.metadata["n_teachers_agreeing"] == 3
    assert env.score(p, chosen).reward == pytest.approx(1.0)
    assert env.score(p, READ).reward == pytest.approx(0.4)  # the recorded action is no longer the target


def test_offered_tools_fall_back_to_history_and_reference():
    msgs = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "Grep", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "1", "content": "ok"}]
    st = {"state_id": "x", "messages": msgs, "student_action": READ}
    env = NextActionEnvironment([st])
    assert env.prompts()[0].tools == ["Grep", "Read"]
    assert env.score(env.prompts()[0], '[TOOL_USE] name=Write input={}').error_kind == "tool_not_found"


def test_unknown_tool_set_accepts_any_valid_name():
    st = {"state_id": "x", "messages": [{"role": "user", "content": "hi"}], "student_action": "hello"}
    env = NextActionEnvironment([st])
    p = env.prompts()[0]
    assert p.tools == []
    assert env.score(p, '[TOOL_USE] name=Anything input={}').error_kind is None
    assert env.score(p, '[TOOL_USE] name=bad name! input={}').error_kind == "tool_not_found"


def test_custom_weights():
    s = score('[TOOL_USE] name=Bash input={"command": "ls"}', weights=RewardWeights(format=1.0, json=0.0, agreement=0.0))
    assert s.reward == pytest.approx(1.0)
    with pytest.raises(ValueError, match="RewardWeights.json"):
        RewardWeights(json=-0.1)
    with pytest.raises(ValueError, match="at least one weight"):
        RewardWeights(format=0, json=0, agreement=0)


def test_helpers():
    a = ActionBlock("tool_use", name="Read", arguments={"p": 1, "q": 2})
    b = ActionBlock("tool_use", name="Read", arguments={"p": 1, "q": 3})
    c = ActionBlock("tool_use", name="Bash", arguments={})
    assert tool_call_agreement([a], [a]) == 1.0
    assert tool_call_agreement([a], [b]) == pytest.approx(0.75)
    assert tool_call_agreement([a, c], [b]) == pytest.approx(0.375)  # an extra call halves the credit
    assert tool_call_agreement([], []) == 1.0
    assert text_f1("", "") == 1.0 and text_f1("a b", "c d") == 0.0 and text_f1("a b", "a b") == 1.0


def test_bad_states():
    with pytest.raises(ValueError, match=r"lacks \['student_action'\]"):
        NextActionEnvironment([{"state_id": "x", "messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ValueError, match="repeats"):
        NextActionEnvironment([state(), state()])


def test_score_and_prompt_validation():
    with pytest.raises(ValueError, match="finite"):
        Score(float("nan"))
    with pytest.raises(ValueError, match="error_kind must be one of"):
        Score(0.0, error_kind="oops")
    with pytest.raises(ValueError, match="non-empty list"):
        Prompt(prompt_id="p", messages=[])
    env = NextActionEnvironment([state()])
    scores = score_texts(env, env.prompts(), [0, 0], [READ, "nothing"])
    assert [round(s.reward, 3) for s in scores] == [1.0, 0.0]
    with pytest.raises(ValueError, match="one index per text"):
        score_texts(env, env.prompts(), [0], [READ, READ])
    with pytest.raises(ValueError, match="out of range"):
        score_texts(env, env.prompts(), [3], [READ])
