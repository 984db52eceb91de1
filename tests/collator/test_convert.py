"""TraceState -> TraceExample, and the example through the collator."""

from __future__ import annotations

import pytest

from composer_replication.chat_format import build_response_ids
from composer_replication.hint_generator import make_hint_generator
from composer_replication.trainer import (
    CollatorConfig,
    ComposerDataCollator,
    trace_states_to_examples,
)
from composer_replication.trainer.convert import trace_state_to_example

ACTION = 'I will edit it.\n[TOOL_USE] name=Edit input={"file_path": "a.py", "count": "2"}'


def state(**extra) -> dict:
    return {
        "state_id": "sess::0003",
        "messages": [
            {"role": "system", "content": "You are an agent."},
            {"role": "user", "content": "Fix a.py"},
            {
                "role": "assistant",
                "content": "Reading.",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "Read", "arguments": '{"file_path": "a.py"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "x = 1"},
        ],
        "student_action": ACTION,
        "tools": ["Read", "Edit"],
        "source": "openai",
        **extra,
    }


def pair(sid: str, chosen: str = "good") -> dict:
    return {
        "state_id": sid,
        "state_messages": state()["messages"],
        "chosen": chosen,
        "rejected": ACTION,
        "n_teachers_agreeing": 2,
    }


def test_messages_become_turns_and_action_is_final_turn():
    ex = trace_state_to_example(state(), reward=0.25)
    assert ex["trace_id"] == "sess::0003" and ex["final_reward"] == 0.25
    assert [t["role"] for t in ex["turns"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert ex["turns"][2]["content"] == 'Reading.\n[TOOL_USE] name=Read input={"file_path": "a.py"}'
    assert ex["turns"][3] == {"role": "tool", "content": "x = 1"}
    assert ex["turns"][-1] == {"role": "assistant", "content": ACTION}
    assert "dpo_pairs" not in ex and "final_reward" not in trace_state_to_example(state())


def test_error_state_marks_final_turn_and_fills_tools():
    ex = trace_state_to_example(
        state(error_kind="type_error", error_meta={"error_message": "count must be int"})
    )
    final = ex["turns"][-1]
    assert final["tool_error"] == "type_error"
    assert final["error_meta"] == {
        "error_message": "count must be int",
        "error_kind": "type_error",
        "available_tools": ["Read", "Edit"],
    }
    only_meta = trace_state_to_example(state(error_meta={"error_kind": "json_decode"}))["turns"][-1]
    assert only_meta["tool_error"] == "json_decode"
    assert all("tool_error" not in t for t in ex["turns"][:-1])


def test_matching_pairs_attach():
    pairs = [pair("sess::0003"), pair("other::0001"), pair("sess::0003", "better")]
    ex = trace_state_to_example(state(), pairs=pairs)
    assert [p["chosen"] for p in ex["dpo_pairs"]] == ["good", "better"]
    with pytest.raises(ValueError, match=r"pairs\[0\] must be a DPOPair dict with a string 'state_id'"):
        trace_state_to_example(state(), pairs=[{"chosen": "x"}])


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"student_action": None}, "'student_action' must be a str"),
        ({"messages": []}, "has no messages"),
        ({"messages": [{"role": "developer", "content": "x"}]}, "role 'developer'"),
    ],
)
def test_bad_states(bad, match):
    with pytest.raises(ValueError, match=match):
        trace_state_to_example(state(**bad))
    with pytest.raises(ValueError, match="reward must be a finite number"):
        trace_state_to_example(state(), reward=float("inf"))


def test_batch_conversion_matches_pairs_and_rewards():
    s2 = state(state_id="sess::0004")
    exs = trace_states_to_examples([state(), s2], pairs=[pair("sess::0004")], rewards={"sess::0003": 1.0})
    assert exs[0]["final_reward"] == 1.0 and "final_reward" not in exs[1]
    assert "dpo_pairs" not in exs[0] and len(exs[1]["dpo_pairs"]) == 1


def test_converted_error_state_fires_all_channels(tokenizer):
    ex = trace_state_to_example(
        state(error_kind="type_error", error_meta={"error_message": "count must be int"}),
        pairs=[pair("sess::0003")],
        reward=0.0,
    )
    coll = ComposerDataCollator(
        tokenizer, CollatorConfig(hint_generator=make_hint_generator(), response_turns="last")
    )
    out = coll([ex])
    resp = build_response_ids(tokenizer, ACTION)
    si, ti = out["sdpo_student_index"], out["sdpo_teacher_index"]
    assert out["input_ids"][si[:, 0], si[:, 1]].tolist() == resp
    assert out["ctx_teacher_input_ids"][ti[:, 0], ti[:, 1]].tolist() == resp
    assert out["input_ids"][0][out["response_mask"][0].bool()].tolist() == resp
    teacher_text = tokenizer.decode(out["ctx_teacher_input_ids"][0])
    assert "`Edit`" in teacher_text and "count must be int" in teacher_text  # the hint used the context
    assert out["dpo_chosen_input_ids"].shape[0] == 1
