"""Hint templates: they use their context, degrade without it, and the registry validates."""

from __future__ import annotations

import pytest

import composer_replication.hint_generator as hg
from composer_replication.hint_generator import (
    ERROR_KINDS,
    HINT_TEMPLATES,
    dispatch,
    hint_json_decode,
    hint_repeated_failure,
    hint_runtime_error,
    hint_tool_not_found,
    hint_type_error,
    make_hint_generator,
    register,
)

SCHEMA = {
    "name": "Edit",
    "parameters": {
        "type": "object",
        "properties": {
            "file_path": {"type": "string"},
            "count": {"type": "integer"},
            "dry": {"type": "boolean"},
        },
        "required": ["file_path", "count"],
    },
}


@pytest.fixture()
def isolated_registry(monkeypatch):
    """Give the module a private copy of the registry so register() cannot leak into other tests."""
    monkeypatch.setattr(hg, "HINT_TEMPLATES", dict(hg.HINT_TEMPLATES))
    return hg.HINT_TEMPLATES


def test_default_registry_covers_every_ingester_kind():
    from composer_replication.types import ERROR_KINDS as INGESTER_KINDS

    assert set(INGESTER_KINDS) <= set(ERROR_KINDS) == set(HINT_TEMPLATES)
    for kind in ERROR_KINDS:
        text = dispatch(kind)
        assert isinstance(text, str) and text.startswith("Reminder:"), kind


def test_tool_not_found_lists_tools_and_suggests_closest():
    text = hint_tool_not_found({"tool_name": "Reed", "available_tools": ["Read", "Write", "Bash"]})
    assert "`Reed`" in text
    assert "Did you mean `Read`?" in text
    for tool in ("Read", "Write", "Bash"):
        assert f"`{tool}`" in text
    far = hint_tool_not_found({"tool_name": "Zzzzzz", "available_tools": ["Read"]})
    assert "Did you mean" not in far and "`Read`" in far


def test_tool_not_found_degrades_without_context():
    text = hint_tool_not_found({})
    assert text == "Reminder: call only tools that exist. Use exactly one of the tool names you were given."


def test_json_decode_uses_schema_message_and_intent():
    text = hint_json_decode(
        {
            "tool_schema": SCHEMA,
            "error_message": "Expecting ',' delimiter: line 1 column 9",
            "intent": "fix the bug",
        }
    )
    assert text.startswith("Reminder: tool arguments must be valid JSON")
    assert "`Edit`" in text  # tool name taken from the schema
    assert "file_path (string)" in text and "count (integer)" in text
    assert "Optional: dry (boolean)" in text
    assert "Expecting ',' delimiter" in text
    assert text.endswith(" Your goal: fix the bug.")


@pytest.mark.parametrize(
    "schema",
    [
        SCHEMA["parameters"],
        {"type": "function", "function": SCHEMA},
        {"name": "Edit", "input_schema": SCHEMA["parameters"]},
    ],
)
def test_type_error_reads_every_schema_wrapper(schema):
    text = hint_type_error(
        {"tool_name": "Edit", "tool_schema": schema, "error_message": "count: expected int"}
    )
    assert "`Edit`" in text
    assert "file_path (string), count (integer)" in text
    assert "count: expected int" in text


def test_type_error_without_schema_is_generic():
    text = hint_type_error({"tool_name": "Edit"})
    assert "`Edit`" in text and "Check each argument's name and type" in text


def test_runtime_error_quotes_message_and_shortens_it():
    long = "Traceback (most recent call last):\n" + "  frame\n" * 300 + "AssertionError: expected 3, got 2"
    text = hint_runtime_error({"tool_name": "Bash", "error_message": long})
    assert "`Bash`" in text and "Traceback" in text
    assert "AssertionError: expected 3, got 2" in text  # the tail survives the shortening
    assert "\n" not in text and len(text) < 600


def test_repeated_failure_offers_other_tools():
    text = hint_repeated_failure(
        {"tool_name": "Bash", "available_tools": ["Bash", "Read"], "error_message": "exit 1"}
    )
    assert "`Bash`" in text and "exit 1" in text
    assert "Other tools you can use: `Read`." in text


def test_dispatch_unknown_kind_is_none_and_ctx_is_not_mutated():
    assert dispatch("no_such_kind", {"tool_name": "X"}) is None
    ctx = {"tool_name": "Reed"}
    dispatch("tool_not_found", ctx)
    assert ctx == {"tool_name": "Reed"}


def test_other_kind_quotes_message():
    assert "disk full" in dispatch("other", {"error_message": "disk full"})


def test_register_overrides_and_adds(isolated_registry):
    register("json_decode", lambda ctx: f"custom {ctx['error_kind']} {ctx.get('tool_name', '')}")
    assert dispatch("json_decode", {"tool_name": "Edit"}) == "custom json_decode Edit"
    register("my_error", lambda ctx: "Reminder: try X.")
    assert dispatch("my_error") == "Reminder: try X."
    register("empty", lambda ctx: "   ")
    assert dispatch("empty") is None


def test_register_leaves_real_registry_alone_under_fixture(isolated_registry):
    register("only_here", lambda ctx: "x")
    assert "only_here" in hg.HINT_TEMPLATES


@pytest.mark.parametrize("kind", ["", "   ", None, 3])
def test_register_rejects_bad_kind(isolated_registry, kind):
    with pytest.raises(ValueError, match="error_kind must be a non-empty string"):
        register(kind, lambda ctx: "x")


def test_register_rejects_non_callable(isolated_registry):
    with pytest.raises(ValueError, match="must be callable"):
        register("x", "not a function")


def test_template_returning_non_string_is_an_error(isolated_registry):
    register("bad", lambda ctx: 42)
    with pytest.raises(ValueError, match="returned int, expected str"):
        dispatch("bad")


def test_make_hint_generator_default_follows_registry(isolated_registry):
    gen = make_hint_generator()
    assert "`Read`" in gen("tool_not_found", {"available_tools": ["Read"]})
    register("late", lambda ctx: "late hint")
    assert gen("late", {}) == "late hint"


def test_make_hint_generator_with_own_templates_is_isolated():
    gen = make_hint_generator({"json_decode": lambda ctx: "only mine"})
    assert gen("json_decode", {}) == "only mine"
    assert gen("tool_not_found", {}) is None
    with pytest.raises(ValueError, match="must be callable"):
        make_hint_generator({"x": None})
