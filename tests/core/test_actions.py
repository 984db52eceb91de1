"""The shared action text form: render, parse back, canonical agreement form."""

from __future__ import annotations

from composer_replication.actions import (
    ActionBlock,
    canonical_action,
    format_tool_use,
    parse_action,
    render_action,
    tool_calls_to_action,
)


def test_render_then_parse_round_trips_every_block_kind():
    blocks = [
        ActionBlock("thinking", "look at the file first"),
        ActionBlock("text", "Let me read it."),
        ActionBlock("tool_use", name="Read", arguments={"file_path": "/repo/a.py", "limit": 10}),
    ]
    text = render_action(blocks)
    assert text == (
        "[THINKING] look at the file first [/THINKING]\nLet me read it.\n"
        '[TOOL_USE] name=Read input={"file_path": "/repo/a.py", "limit": 10}'
    )
    back = parse_action(text)
    assert [b.kind for b in back] == ["thinking", "text", "tool_use"]
    assert back[2].name == "Read" and back[2].arguments == {"file_path": "/repo/a.py", "limit": 10}
    assert back[2].arguments_valid


def test_invalid_json_arguments_survive_as_text():
    text = format_tool_use("Bash", '{"command": "ls"')  # truncated JSON string from an OpenAI message
    (block,) = parse_action(text)
    assert block.kind == "tool_use" and block.name == "Bash"
    assert block.arguments is None and not block.arguments_valid
    assert block.text == '{"command": "ls"'


def test_text_after_tool_json_is_its_own_block():
    blocks = parse_action('[TOOL_USE] name=Grep input={"pattern": "x"} and then some words')
    assert [b.kind for b in blocks] == ["tool_use", "text"]
    assert blocks[1].text == "and then some words"


def test_canonical_ignores_whitespace_key_order_and_thinking():
    a = '[THINKING] hmm [/THINKING]\nFix  the\tbug.\n[TOOL_USE] name=Edit input={"b": 1, "a": [1, 2]}'
    b = 'Fix the bug.\n[TOOL_USE] name=Edit input={"a":[1,2],"b":1}'
    assert canonical_action(a) == canonical_action(b)
    assert canonical_action(a, include_thinking=True) != canonical_action(b, include_thinking=True)


def test_canonical_distinguishes_tool_name_and_argument_values():
    base = '[TOOL_USE] name=Read input={"file_path": "a.py"}'
    assert canonical_action(base) != canonical_action('[TOOL_USE] name=Write input={"file_path": "a.py"}')
    assert canonical_action(base) != canonical_action('[TOOL_USE] name=Read input={"file_path": "b.py"}')


def test_openai_tool_calls_render_in_the_same_form():
    text = tool_calls_to_action(
        "I'll list files.",
        [{"id": "c1", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}],
    )
    assert text == "I'll list files.\n[TOOL_USE] name=Bash input={\"command\": \"ls\"}"
    assert canonical_action(text) == canonical_action(
        "I'll list files.\n" + format_tool_use("Bash", {"command": "ls"})
    )


def test_unclosed_thinking_runs_to_the_next_marker():
    blocks = parse_action('[THINKING] plan\nmore plan\n[TOOL_USE] name=Read input={}')
    assert [(b.kind, b.text) for b in blocks] == [("thinking", "plan\nmore plan"), ("tool_use", "{}")]


def test_empty_action_parses_to_nothing():
    assert parse_action("") == []
    assert canonical_action("   \n ") == ""
