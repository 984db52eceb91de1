"""errors.py (classification, repeats, error sites) and history.py (placeholders, trimming, stats)."""

from __future__ import annotations

import pytest

from composer_replication.ingestion.errors import (
    RepeatTracker,
    classify_tool_error,
    error_site,
    looks_like_error,
    offered_tools,
)
from composer_replication.ingestion.history import (
    IngestionStats,
    estimate_tokens,
    make_token_counter,
    media_placeholder,
    parts_to_text,
    trim_history,
)
from composer_replication.types import ERROR_KINDS


@pytest.mark.parametrize(
    "text,kind",
    [
        ("<tool_use_error>Error: No such tool available: Serch</tool_use_error>", "tool_not_found"),
        ("Unknown tool 'open_file'", "tool_not_found"),
        ("unsupported call: shell2", "tool_not_found"),
        ("Error parsing tool input: Expecting ',' delimiter: line 1 column 19 (char 18)", "json_decode"),
        ("failed to parse function arguments: EOF while parsing", "json_decode"),
        ("Unexpected token } in JSON at position 12", "json_decode"),
        ("InputValidationError: Edit failed: The required parameter `old_string` is missing", "type_error"),
        ("Invalid type for parameter limit: expected number, received string", "type_error"),
        (
            'Traceback (most recent call last):\n  File "x.py"\njson.decoder.JSONDecodeError: Expecting value',
            "runtime_error",
        ),
        ("Exit code 2\nusage: pytest", "runtime_error"),
        ("FAILED tests/test_a.py::test_x - AssertionError", "runtime_error"),
        ("bash: foo: command not found", "runtime_error"),
        ("The user doesn't want to proceed with this tool use.", "other"),
        ("", "other"),
    ],
)
def test_classify_tool_error(text: str, kind: str) -> None:
    assert classify_tool_error(text) == kind
    assert kind in ERROR_KINDS


def test_looks_like_error_is_conservative() -> None:
    assert looks_like_error("Error: file not found")
    assert looks_like_error("Exit code: 1\nboom")
    assert looks_like_error('{"output": "x", "metadata": {"exit_code": 2}}')
    assert not looks_like_error('{"output": "x", "metadata": {"exit_code": 0}}')
    assert not looks_like_error("def handle_error(e):\n    return None")
    assert not looks_like_error("All 3 tests passed")


def test_repeat_tracker_needs_consecutive_identical_failures() -> None:
    r = RepeatTracker()
    tb = "Exit code 1\nAssertionError at line 12"
    assert r.observe(("Bash", tb, "runtime_error")) == "runtime_error"
    assert (
        r.observe(("Bash", tb.replace("12", "13"), "runtime_error")) == "repeated_failure"
    )  # digits normalized
    assert r.observe(("Edit", tb, "runtime_error")) == "runtime_error"  # another tool
    assert r.observe(None) is None
    assert r.observe(("Edit", tb, "runtime_error")) == "runtime_error"  # the run was broken


def test_error_site_and_bad_kind() -> None:
    site = error_site(
        kind="type_error",
        message="x" * 5000,
        tool_name="Edit",
        available_tools=["Edit"],
        tool_schema={"name": "Edit"},
        intent="fix",
    )
    assert len(site["error_message"]) == 2000 and site["tool_schema"] == {"name": "Edit"}
    assert "tool_schema" not in error_site(kind="other", message="", tool_name="", available_tools=[])
    with pytest.raises(ValueError, match="kind='oops'"):
        error_site(kind="oops", message="", tool_name="", available_tools=[])


def test_offered_tools_drops_invented_names_only() -> None:
    calls = {"1": "Serch", "2": "Grep", "3": "Bash"}
    failed = {"1": "No such tool available: Serch", "3": "Exit code 1"}  # call 2 succeeded
    assert offered_tools(calls, failed) == ["Bash", "Grep"]
    assert offered_tools(calls, failed, declared=["Serch", "Read"]) == ["Bash", "Grep", "Read", "Serch"]


def test_media_placeholders() -> None:
    data = "A" * 197988
    assert media_placeholder(
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    ) == ("[image: image/png, 148 KB]")
    assert (
        media_placeholder({"type": "document", "source": {"type": "url", "url": "http://x"}})
        == "[document: url]"
    )
    assert media_placeholder({"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,QUJD"}}) == (
        "[image: image/jpeg, 1 KB]"
    )
    stats = IngestionStats()
    text = parts_to_text([{"type": "text", "text": "a"}, {"type": "image", "source": {}}, "b"], stats)
    assert text == "a\n[image: unknown]\nb" and stats.n_media == 1


def _msgs() -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "Read", "arguments": "{}"}}
    return [
        {"role": "system", "content": "s" * 40},
        {"role": "user", "content": "u" * 400},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "t" * 400},
        {"role": "user", "content": "v" * 40},
    ]


def test_trim_history_keeps_system_and_drops_calls_with_results() -> None:
    msgs = _msgs()
    assert trim_history(msgs, 10_000) is msgs
    out = trim_history(msgs, 120)
    assert out == [msgs[0], msgs[4]]  # the assistant call went with its tool result
    assert trim_history(msgs, 5) == [msgs[0]]
    seen: list[str] = []

    def count(text: str) -> int:
        seen.append(text)
        return estimate_tokens(text)

    cache: dict = {}
    assert trim_history(msgs, 120, count, cache) == out
    n_counted = len(seen)
    assert trim_history(msgs, 120, count, cache) == out and len(seen) == n_counted  # all from the cache
    long = [msgs[0]] + [{"role": "user", "content": f"m{i}"} for i in range(10_000)]
    seen.clear()
    kept = trim_history(long, 60, count)
    assert (
        kept[0] is msgs[0] and kept[-1]["content"] == "m9999" and len(seen) < 20
    )  # reads only what it keeps
    with pytest.raises(ValueError, match="max_tokens=0"):
        trim_history(msgs, 0)


def test_token_counters() -> None:
    assert estimate_tokens("abcde") == 2
    assert make_token_counter(lambda t: [1, 2, 3])("x") == 3

    class Tok:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [0] * (len(text.split()) + (1 if add_special_tokens else 0))

    assert make_token_counter(Tok())("a b c") == 3


@pytest.mark.slow
def test_real_tokenizer_counts(tokenizer) -> None:
    count = make_token_counter(tokenizer)
    assert 0 < count("def add(a, b): return a + b") < 20


def test_stats_add_and_warn() -> None:
    a, b = IngestionStats(n_states_emitted=2), IngestionStats(n_states_emitted=3, version_warnings=["w"])
    a.warn("w")
    a.add(b)
    assert a.n_states_emitted == 5 and a.version_warnings == ["w"]
    assert IngestionStats().version_warnings == []
