"""ClaudeCodeIngester on our synthetic fixtures (exact states) and on the real sessions in ../shared."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from composer_replication.actions import format_thinking, parse_action
from composer_replication.ingestion import SYSTEM_PROMPT, ClaudeCodeIngester, IngestionStats
from composer_replication.ingestion.history import NO_RESULT, trim_history

FIX = Path(__file__).parent / "fixtures"
SYS = {"role": "system", "content": SYSTEM_PROMPT}


def call(cid: str, name: str, args: dict) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def tool(cid: str, content: str) -> dict:
    return {"role": "tool", "tool_call_id": cid, "content": content}


def check_tool_ids(messages: list[dict]) -> None:
    """Every tool message answers a call of an earlier assistant message, once, before any other message."""
    open_calls: set[str] = set()
    answered: set[str] = set()
    for m in messages:
        if m["role"] == "tool":
            assert m["tool_call_id"] in open_calls, m
            assert m["tool_call_id"] not in answered, m
            answered.add(m["tool_call_id"])
        else:
            assert open_calls <= answered, f"unanswered calls before {m}"
            open_calls = {c["id"] for c in m.get("tool_calls", [])}
            answered = set()


def ingest(name: str, **kw) -> tuple[list[dict], IngestionStats]:
    ing = ClaudeCodeIngester(**kw)
    states = list(ing.ingest(FIX / name))
    return states, ing.last_stats


U1 = {"role": "user", "content": "The test test_add fails. Fix calc.py."}
A_MSG = {
    "role": "assistant",
    "content": "I'll look at the code first.",
    "tool_calls": [
        call("t1", "Read", {"file_path": "/repo/calc.py"}),
        call("t2", "Grep", {"pattern": "add\\(", "path": "/repo/tests"}),
    ],
}
R1 = tool("t1", "     1\tdef add(a, b):\n     2\t    return a - b")
R2 = tool("t2", "tests/test_calc.py:4: assert add(2, 2) == 4")
B_MSG = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        call("t3", "Edit", {"file_path": "/repo/calc.py", "old_string": "a - b", "new_string": "a + b"})
    ],
}
R3 = tool("t3", "The file /repo/calc.py has been updated.")
D_ARGS = {
    "file_path": "/repo/calc.py",
    "old_string": "def add(a, b):",
    "new_string": 'def add(a, b):\n    """Return a + b."""',
}


def test_rewind_and_interleaved_exact_states() -> None:
    states, stats = ingest("rewind_interleaved.jsonl")
    assert [s["state_id"] for s in states] == [f"rewind_interleaved::{i:04d}" for i in range(5)]
    head = [SYS, U1, A_MSG, R1, R2, B_MSG, R3]
    assert [s["messages"] for s in states] == [
        [SYS, U1],
        [SYS, U1, A_MSG, R1, R2],
        head + [{"role": "user", "content": "Now run the tests."}],
        head + [{"role": "user", "content": "Actually, add a docstring to add() instead."}],
        head
        + [
            {"role": "user", "content": "Actually, add a docstring to add() instead."},
            {
                "role": "assistant",
                "content": "Adding a docstring.",
                "tool_calls": [call("t5", "Edit", D_ARGS)],
            },
            tool("t5", "The file /repo/calc.py has been updated."),
        ],
    ]
    assert [s["student_action"] for s in states] == [
        "I'll look at the code first.\n"
        '[TOOL_USE] name=Read input={"file_path": "/repo/calc.py"}\n'
        '[TOOL_USE] name=Grep input={"pattern": "add\\\\(", "path": "/repo/tests"}',
        format_thinking("add subtracts instead of adding.") + "\n"
        '[TOOL_USE] name=Edit input={"file_path": "/repo/calc.py", "old_string": "a - b", "new_string": "a + b"}',
        'Running the tests.\n[TOOL_USE] name=Bash input={"command": "pytest -q"}',
        "Adding a docstring.\n[TOOL_USE] name=Edit input=" + json.dumps(D_ARGS),
        "Done: add() now has a docstring.",
    ]
    assert all(
        s["tools"] == ["Bash", "Edit", "Grep", "Read"] and s["source"] == "claude_code" for s in states
    )
    assert not any("error_kind" in s for s in states)
    # the rewound branch (u2 "Now run the tests", its Bash call) never reaches the other branch
    assert "Now run the tests" not in json.dumps(states[4]["messages"])
    assert stats.n_states_emitted == 5 and stats.n_assistant_turns == 5
    assert stats.n_tool_use_blocks == 5 and stats.skipped_noise == 3 and stats.n_records_total == 19


def test_thinking_kept_in_history_when_not_stripped() -> None:
    states, _ = ingest("rewind_interleaved.jsonl", strip_thinking=False)
    b_msg = states[2]["messages"][5]
    assert b_msg["content"] == format_thinking("add subtracts instead of adding.")
    assert b_msg["tool_calls"] == B_MSG["tool_calls"]


def test_sidechain_compaction_noise_and_duplicates() -> None:
    states, stats = ingest("sidechain_compaction.jsonl")
    assert len(states) == 4
    dump = json.dumps(states)
    assert "SIDECHAIN-SECRET" not in dump and "msg_SIDE" not in dump and "Grep" not in dump
    assert "API Error" not in dump and "/clear" not in dump and "Caveat" not in dump
    summary = {
        "role": "user",
        "content": "This session is being continued from a previous conversation. Summary: "
        "the user asked where parse_date is defined (utils/dates.py:12).",
    }
    u2 = {"role": "user", "content": "Add a test for parse_date."}
    assert states[0]["messages"] == [SYS, {"role": "user", "content": "Where is parse_date defined?"}]
    assert states[1]["messages"][-1] == tool("t1", "parse_date is defined in utils/dates.py:12")
    assert states[2]["messages"] == [SYS, summary, u2]  # history reset at the compaction
    assert states[3]["messages"] == [
        SYS,
        summary,
        u2,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call("t2", "Write", {"file_path": "/repo/tests/test_dates.py"})],
        },
        tool(
            "t2",
            "[ERROR] <tool_use_error>InputValidationError: Write failed due to the following issue:\n"
            "The required parameter `content` is missing</tool_use_error>",
        ),
    ]
    assert states[2]["error_kind"] == "type_error"
    assert states[2]["error_meta"]["tool_name"] == "Write"
    assert states[2]["tools"] == ["Task", "Write"]
    assert stats.skipped_sidechain == 4 and stats.skipped_summary == 1 and stats.skipped_meta == 3
    assert stats.skipped_synthetic == 1 and stats.skipped_duplicate == 1 and stats.skipped_unknown == 1
    assert stats.n_compactions == 1
    assert any("'future-thing'" in w and "2.3.0" in w for w in stats.version_warnings)
    assert len([w for w in stats.version_warnings if "future-thing" in w]) == 1


def test_inline_sidechain_kept_when_asked() -> None:
    states, stats = ingest("sidechain_compaction.jsonl", skip_sidechain=False)
    assert len(states) == 6 and stats.skipped_sidechain == 0
    side = [s for s in states if "SIDECHAIN-SECRET" in s["student_action"]]
    assert len(side) == 1 and side[0]["messages"][1] == {"role": "user", "content": "Search for parse_date"}


def test_damaged_file_bad_bytes_image_nul_truncated_missing_and_late() -> None:
    states, stats = ingest("damaged.jsonl")
    u1 = {"role": "user", "content": "Why is this plot wrong? caf\ufffd\n[image: image/png, 3 KB]"}
    a_msg = {
        "role": "assistant",
        "content": "Let me read the plotting code.",
        "tool_calls": [call("t1", "Read", {"file_path": "/repo/plot.py"})],
    }
    b_msg = {
        "role": "assistant",
        "content": "The axes are swapped; I'll check the caller.",
        "tool_calls": [call("t2", "Bash", {"command": "grep -rn 'plot(' /repo"})],
    }
    r1 = tool("t1", "plot(y, x)\n[image: image/jpeg, 2 KB]")
    assert [s["messages"] for s in states] == [
        [SYS, u1],
        [SYS, u1, a_msg, r1],
        [
            SYS,
            u1,
            a_msg,
            r1,
            b_msg,
            tool("t2", NO_RESULT),
            {"role": "user", "content": "[Request interrupted by user for tool use]"},
        ],
    ]
    assert states[2]["student_action"] == "Understood, stopping here."
    assert stats.skipped_truncated_lines == 2  # the NUL line and the cut last line
    assert stats.n_missing_results == 1 and stats.n_late_results == 1 and stats.n_media == 2
    assert "late output" not in json.dumps(states)


def test_error_kinds_each_and_repeated_failure() -> None:
    states, stats = ingest("errors.jsonl")
    assert [s.get("error_kind") for s in states] == [
        "tool_not_found",
        None,
        "type_error",
        "runtime_error",
        "repeated_failure",
        "json_decode",
        "other",
        None,
    ]
    assert stats.n_errors == 6
    site = states[0]["error_meta"]
    assert site["error_kind"] == "tool_not_found" and site["tool_name"] == "Serch"
    assert "No such tool available" in site["error_message"]
    assert site["available_tools"] == [
        "Bash",
        "Edit",
        "Grep",
        "Write",
        "mcp__lint__run",
    ]  # the invented one is not offered
    assert (
        site["intent"] == "The CLI crashes on empty input; please fix cli.py."
    )  # no text in the turn: the request
    assert states[4]["error_meta"]["intent"] == "Let me run it once more."
    # empty thinking (signature only) and redacted thinking are hidden: only the tool call remains
    assert states[1]["student_action"] == '[TOOL_USE] name=Grep input={"pattern": "def main"}'
    assert all(parse_action(s["student_action"]) for s in states)


@pytest.mark.parametrize(
    "rel", ["agent-a1b2c3d4.jsonl", "subagents_session/subagents/agent-a0123456789abcdef.jsonl"]
)
def test_subagent_files_yield_nothing(rel: str) -> None:
    ing = ClaudeCodeIngester()
    assert list(ing.ingest(FIX / rel)) == []
    assert ing.last_stats.skipped_subagent == 1 and ing.last_stats.n_records_total == 0


def test_empty_and_nul_only_files(tmp_path: Path) -> None:
    ing = ClaudeCodeIngester()
    assert list(ing.ingest(FIX / "empty.jsonl")) == [] and ing.last_stats.skipped_truncated_lines == 1
    nul = tmp_path / "nul.jsonl"
    nul.write_bytes(b"\x00" * 64)
    assert list(ing.ingest(nul)) == [] and ing.last_stats.skipped_truncated_lines == 1


def test_non_object_lines_and_garbage_do_not_crash(tmp_path: Path) -> None:
    p = tmp_path / "junk.jsonl"
    p.write_bytes(
        b'[1, 2]\n"text"\n{"type": "assistant", "message": "not a dict", "uuid": "z"}\n\xff\xfe{{{\n'
    )
    ing = ClaudeCodeIngester()
    assert list(ing.ingest(p)) == []
    assert ing.last_stats.skipped_unknown == 3 and ing.last_stats.skipped_truncated_lines == 1


def test_missing_parent_and_cycle_start_history_there(tmp_path: Path) -> None:
    lines = [
        {"type": "user", "uuid": "u1", "parentUuid": "gone", "message": {"role": "user", "content": "hi"}},
        {
            "type": "assistant",
            "uuid": "a1",
            "parentUuid": "u1",
            "message": {"id": "m1", "content": [{"type": "text", "text": "hello"}]},
        },
        {"type": "user", "uuid": "c1", "parentUuid": "c2", "message": {"role": "user", "content": "loop"}},
        {"type": "user", "uuid": "c2", "parentUuid": "c1", "message": {"role": "user", "content": "loop2"}},
        {
            "type": "assistant",
            "uuid": "a2",
            "parentUuid": "c2",
            "message": {"id": "m2", "content": "plain string"},
        },
    ]
    p = tmp_path / "s.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines))
    states = list(ClaudeCodeIngester().ingest(p))
    assert states[0]["messages"] == [SYS, {"role": "user", "content": "hi"}]
    assert states[1]["student_action"] == "plain string"
    assert states[1]["messages"][0] == SYS and len(states[1]["messages"]) <= 3


def test_max_history_tokens_drops_oldest_with_their_tool_results() -> None:
    full, _ = ingest("rewind_interleaved.jsonl")
    states, _ = ingest("rewind_interleaved.jsonl", max_history_tokens=120)
    for s, f in zip(states, full):
        msgs = s["messages"]
        assert msgs[0] == SYS and msgs == [SYS] + f["messages"][len(f["messages"]) - len(msgs) + 1 :]
        assert len(msgs) == 1 or msgs[1]["role"] != "tool"
        check_tool_ids(msgs)
    assert len(states[4]["messages"]) < len(full[4]["messages"])
    # a tokenizer callable counts instead of chars/4: one token per message fits everything
    states, _ = ingest("rewind_interleaved.jsonl", max_history_tokens=10_000, tokenizer=lambda t: 1)
    assert [s["messages"] for s in states] == [f["messages"] for f in full]


@pytest.mark.parametrize("budget", [25, 60, 120, 200, 400, 100_000])
def test_incremental_trimming_equals_trim_history(budget: int) -> None:
    """The ingester's sliding window gives exactly trim_history of the whole history, on every fixture."""
    sessions = Path(__file__).resolve().parents[2] / "composer_replication" / "data" / "sessions"
    paths = [*FIX.glob("*.jsonl"), *sessions.glob("train/fix-*.jsonl")]
    assert len(paths) >= 10
    for path in paths:
        full = list(ClaudeCodeIngester(skip_sidechain=False).ingest(path))
        cut = list(ClaudeCodeIngester(skip_sidechain=False, max_history_tokens=budget).ingest(path))
        assert len(cut) == len(full)
        for f, c in zip(full, cut):
            assert c["messages"] == trim_history(f["messages"], budget), (path.name, c["state_id"])
            check_tool_ids(c["messages"])


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="max_history_tokens=0"):
        ClaudeCodeIngester(max_history_tokens=0)
    with pytest.raises(ValueError, match="tokenizer="):
        ClaudeCodeIngester(tokenizer=3)


def test_resumed_copy_in_other_file_is_deduped(tmp_path: Path) -> None:
    src = (FIX / "rewind_interleaved.jsonl").read_text()
    p = tmp_path / "resumed.jsonl"
    p.write_text(src + src)  # the same records copied again (same uuids, same message ids)
    ing = ClaudeCodeIngester()
    states = list(ing.ingest(p))
    assert len(states) == 5 and ing.last_stats.skipped_duplicate == 18


# ---------------------------------------------------------------------------- real sessions (../shared)
REAL = {"03eb5929-52b3-4b13-ada3-b93ae35806b8.jsonl": 9, "326189cf-5676-4237-8cde-1ce80aae4a9f.jsonl": 15}


@pytest.mark.parametrize("name,n_turns", sorted(REAL.items()))
def test_real_sessions_one_state_per_main_chain_message_id(
    shared_traces: Path, name: str, n_turns: int
) -> None:
    path = shared_traces / "claude_code" / name
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    ids = {r["message"]["id"] for r in records if r.get("type") == "assistant" and not r.get("isSidechain")}
    assert len(ids) == n_turns
    ing = ClaudeCodeIngester()
    states = list(ing.ingest(path))
    assert len(states) == n_turns and ing.last_stats.n_states_emitted == n_turns
    assert len({s["state_id"] for s in states}) == n_turns
    for s in states:
        assert s["messages"][0] == SYS and s["student_action"].strip()
        check_tool_ids(s["messages"])
        assert not any(
            m.get("content", "").startswith(("<command-name>", "<local-command")) for m in s["messages"]
        )


def test_real_rewind_never_leaks_across_branches(shared_traces: Path) -> None:
    states = list(
        ClaudeCodeIngester().ingest(
            shared_traces / "claude_code" / "03eb5929-52b3-4b13-ada3-b93ae35806b8.jsonl"
        )
    )
    liked = "I very much like this idea"
    disliked = "I actually don't like much this idea"
    for s in states:
        text = json.dumps(s["messages"])
        assert not (liked in text and disliked in text)
    branch_b = [s for s in states if disliked in json.dumps(s["messages"])]
    assert len(branch_b) == 3
    for s in branch_b:  # nothing said on the first branch appears in the second
        assert "Boundary is often blurry" not in json.dumps(s["messages"])
        assert "Clear separation of concerns" not in json.dumps(s["messages"])


def test_real_image_record_and_subagent_copy(shared_traces: Path, tmp_path: Path) -> None:
    img = shared_traces / "claude_code" / "image_user_record.jsonl"
    lines = [json.loads(img.read_text())]
    lines[0]["parentUuid"] = None
    lines.append(
        {
            "type": "assistant",
            "uuid": "a",
            "parentUuid": lines[0]["uuid"],
            "message": {"id": "m", "content": [{"type": "text", "text": "ok"}]},
        }
    )
    p = tmp_path / "img.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines))
    (state,) = ClaudeCodeIngester().ingest(p)
    user = state["messages"][1]["content"]
    assert user.startswith("[image: image/png, 148 KB]\nDo you think we could set up rewrites")
    assert len(json.dumps(state)) < 2000
    agent = tmp_path / "agent-1234abcd.jsonl"
    shutil.copy(shared_traces / "claude_code" / "03eb5929-52b3-4b13-ada3-b93ae35806b8.jsonl", agent)
    assert list(ClaudeCodeIngester().ingest(agent)) == []
