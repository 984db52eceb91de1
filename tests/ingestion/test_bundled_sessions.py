"""The five hand-written sessions in composer_replication/data/sessions/train (fix-*.jsonl; the generated
syn-*.jsonl sessions are checked by tests/core/test_bundled_data.py)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from composer_replication.actions import parse_action
from composer_replication.ingestion import ClaudeCodeIngester
from composer_replication.ingestion.registry import detect_format

SESSIONS = Path(__file__).resolve().parents[2] / "composer_replication" / "data" / "sessions" / "train"
FILES = sorted(SESSIONS.glob("fix-*.jsonl"))
EXPECTED_KINDS = {
    "fix-config-defaults": [None, "type_error", None, "type_error", "runtime_error", None, None, None],
    "fix-iso-date-parsing": ["tool_not_found", None, None, None, None, None, None, None],
    "fix-memoize-kwargs": [None, None, "runtime_error", None, None, None, None, None],
    "fix-pagination-off-by-one": [None, None, None, "runtime_error", None, None, None],
    "fix-slugify-punctuation": [
        None,
        None,
        None,
        "runtime_error",
        "repeated_failure",
        None,
        None,
        None,
        None,
    ],
}


def test_the_bundle() -> None:
    assert [f.stem for f in FILES] == sorted(EXPECTED_KINDS)
    assert all(f.stat().st_size < 40_000 for f in FILES)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_session_ingests_with_its_error_sites(path: Path) -> None:
    assert detect_format(path) == "claude_code"
    ing = ClaudeCodeIngester()
    states = list(ing.ingest(path))
    assert 5 <= len(states) <= 15
    assert [s.get("error_kind") for s in states] == EXPECTED_KINDS[path.stem]
    st = ing.last_stats
    assert st.skipped_truncated_lines == 0 and st.skipped_unknown == 0 and not st.version_warnings
    assert st.n_missing_results == 0 and st.n_orphan_results == 0
    for s in states:
        assert set(s["tools"]) <= {"Read", "Edit", "Bash", "Grep", "Write"}
        blocks = parse_action(s["student_action"])
        assert blocks and all(b.arguments_valid for b in blocks if b.kind == "tool_use")
        calls = {c["id"] for m in s["messages"] for c in m.get("tool_calls", [])}
        assert all(m["tool_call_id"] in calls for m in s["messages"] if m["role"] == "tool")
        if "error_meta" in s:
            assert s["error_meta"]["tool_name"] in ("Search", "Edit", "Bash")
    assert (
        states[-1]["student_action"] and "[TOOL_USE]" not in states[-1]["student_action"]
    )  # ends by reporting


def test_actions_are_varied() -> None:
    states = [s for f in FILES for s in ClaudeCodeIngester().ingest(f)]
    assert len(states) == 40
    tools = Counter(b.name for s in states for b in parse_action(s["student_action"]) if b.kind == "tool_use")
    assert set(tools) == {"Read", "Edit", "Bash", "Grep", "Write", "Search"} and max(tools.values()) < 20
    assert len({s["student_action"] for s in states}) >= 35  # only re-runs of the same test command repeat


def test_memoize_session_interleaves_one_turn_with_its_results() -> None:
    path = SESSIONS / "fix-memoize-kwargs.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    first_id = next(r["message"]["id"] for r in records if r["type"] == "assistant")
    kinds = [r["type"] for r in records if r["type"] in ("user", "assistant")][:7]
    assert kinds == ["user", "assistant", "assistant", "user", "assistant", "user", "assistant"]
    assert sum(r["type"] == "assistant" and r["message"]["id"] == first_id for r in records) == 3
    states = list(ClaudeCodeIngester().ingest(path))
    assert states[0]["student_action"].count("[TOOL_USE] name=Read") == 2
    assert [m["role"] for m in states[1]["messages"]] == ["system", "user", "assistant", "tool", "tool"]
