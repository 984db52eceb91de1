"""Codex, OpenAI-messages and SWE-agent ingesters on our fixtures and on the real samples in ../shared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from composer_replication.actions import format_thinking
from composer_replication.ingestion import SYSTEM_PROMPT
from composer_replication.ingestion.codex import CodexIngester
from composer_replication.ingestion.history import NO_RESULT
from composer_replication.ingestion.openai_messages import OpenAIMessagesIngester, SWEAgentIngester

FIX = Path(__file__).parent / "fixtures"
SYS = {"role": "system", "content": SYSTEM_PROMPT}


def _resolves(messages: list[dict]) -> bool:
    calls = {c["id"] for m in messages for c in m.get("tool_calls", [])}
    return all(m["tool_call_id"] in calls for m in messages if m["role"] == "tool")


def test_codex_current_layout() -> None:
    ing = CodexIngester()
    states = list(ing.ingest(FIX / "codex_current.jsonl"))
    dev = {"role": "system", "content": "Sandbox: workspace-write."}
    user = {"role": "user", "content": "Fix the failing test in calc.py"}
    shell = {
        "id": "c1",
        "type": "function",
        "function": {"name": "shell", "arguments": '{"command": ["pytest", "-q"]}'},
    }
    out1 = {
        "role": "tool",
        "tool_call_id": "c1",
        "content": "Exit code: 1\nTraceback (most recent call last):\nAssertionError: assert -1 == 3",
    }
    assert states[0]["messages"] == [SYS, dev, user]
    assert states[0]["student_action"] == format_thinking("Run the tests first.") + "\n" + (
        '[TOOL_USE] name=shell input={"command": ["pytest", "-q"]}'
    )
    assert states[1]["messages"] == [
        SYS,
        dev,
        user,
        {"role": "assistant", "content": "", "tool_calls": [shell]},
        out1,
    ]
    patch = "*** Begin Patch\n*** Update File: calc.py\n-    return a - b\n+    return a + b\n*** End Patch"
    assert (
        states[1]["student_action"]
        == "add() subtracts; patching it.\n[TOOL_USE] name=apply_patch input=" + patch
    )
    assert states[2]["student_action"] == "[TOOL_USE] name=shell input={not json"  # invalid JSON kept as text
    assert states[3]["messages"] == [
        SYS,
        {"role": "user", "content": "Summary: add() was fixed in calc.py."},
        {"role": "user", "content": "Thanks. Anything else?"},
    ]
    assert [s.get("error_kind") for s in states] == ["runtime_error", None, "json_decode", None]
    assert all(s["tools"] == ["apply_patch", "shell"] and s["source"] == "codex" for s in states)
    assert ing.last_stats.n_compactions == 1 and ing.last_stats.skipped_noise == 4


def test_codex_legacy_layout() -> None:
    states = list(CodexIngester().ingest(FIX / "codex_legacy.jsonl"))
    assert [s["student_action"] for s in states] == [
        '[TOOL_USE] name=local_shell input={"type": "exec", "command": ["ls"]}',
        "One file: calc.py",
    ]
    assert states[1]["messages"][-1]["role"] == "tool" and _resolves(states[1]["messages"])
    assert "error_kind" not in states[1]  # exit_code 0


def test_openai_object_with_tools_and_unknown_tool_error() -> None:
    states = list(OpenAIMessagesIngester().ingest(FIX / "openai_object.json"))
    assert [s["state_id"] for s in states] == [
        "openai_object::0000",
        "openai_object::0001",
        "openai_object::0002",
    ]
    assert states[0]["messages"] == [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Open main.py"},
    ]
    assert (
        states[1]["student_action"] == 'Using read_file.\n[TOOL_USE] name=read_file input={"path": "main.py"}'
    )
    site = states[0]["error_meta"]
    assert states[0]["error_kind"] == "tool_not_found" and site["available_tools"] == ["read_file"]
    assert "tool_schema" not in site  # open_file has no schema
    assert states[2]["messages"][4]["tool_calls"][0]["function"]["arguments"] == '{"path": "main.py"}'


def test_openai_nebius_trajectory_text_and_ai_role() -> None:
    states = list(OpenAIMessagesIngester().ingest(FIX / "openai_nebius.json"))
    assert [s["student_action"] for s in states] == [
        "DISCUSSION\nLet me look.\n```\nls\n```",
        "```\nsubmit\n```",
    ]
    assert states[1]["messages"][2] == {
        "role": "assistant",
        "content": "DISCUSSION\nLet me look.\n```\nls\n```",
    }


def test_openai_jsonl_conversations_and_messages() -> None:
    ing = OpenAIMessagesIngester()
    states = list(ing.ingest(FIX / "openai_conversations.jsonl"))
    assert [s["student_action"] for s in states] == ["a0", "a1", "a2"]
    assert [s["state_id"] for s in states] == [f"openai_conversations::{i:04d}" for i in range(3)]
    assert states[2]["messages"] == [SYS, {"role": "user", "content": "q2"}]
    states = list(ing.ingest(FIX / "openai_messages.jsonl"))
    assert states[1]["messages"][3:] == [
        {"role": "tool", "tool_call_id": "k1", "content": NO_RESULT},
        {"role": "user", "content": "never mind"},
    ]
    assert ing.last_stats.n_missing_results == 1


def test_openai_bare_list_orphan_tool_and_legacy_function(tmp_path: Path) -> None:
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "hi"},
                {"type": "image_url", "image_url": {"url": "http://x"}},
            ],
        },
        {"role": "tool", "tool_call_id": "nope", "content": "stray"},
        {"role": "assistant", "content": None, "function_call": {"name": "ls", "arguments": "{}"}},
        {"role": "function", "name": "ls", "content": "a.py"},
        {"role": "assistant", "content": "done", "reasoning_content": "easy"},
        {"role": "narrator", "content": "ignored"},
    ]
    p = tmp_path / "list.json"
    p.write_text(json.dumps(msgs))
    ing = OpenAIMessagesIngester()
    states = list(ing.ingest(p))
    assert states[0]["messages"] == [
        SYS,
        {"role": "user", "content": "hi\n[image: url]"},
        {"role": "user", "content": "stray"},
    ]
    assert states[1]["messages"][-1] == {"role": "tool", "tool_call_id": "call_0", "content": "a.py"}
    assert states[1]["student_action"] == format_thinking("easy") + "\ndone"
    assert ing.last_stats.n_orphan_results == 1 and ing.last_stats.skipped_unknown == 1


def test_swe_agent_history_skips_demos_and_adds_missing_steps() -> None:
    ing = SWEAgentIngester()
    states = list(ing.ingest(FIX / "swe_history.traj"))
    assert [s["student_action"] for s in states] == [
        'Open the file.\n[TOOL_USE] name=open input={"path": "greet.py"}',
        "Fixed the typo; submitting.\n\n```\nsubmit\n```",
    ]
    assert states[0]["messages"] == [
        {"role": "system", "content": "SETTING: autonomous programmer"},
        {"role": "user", "content": "Issue: typo in greet()\nPlease fix."},
    ]
    assert "DEMO" not in json.dumps(states) and "\r" not in json.dumps(states)
    assert states[1]["messages"][-1] == {
        "role": "tool",
        "tool_call_id": "c1",
        "content": "1: print('helo')\n",
    }
    assert all(s["source"] == "swe_agent" for s in states) and ing.last_stats.skipped_meta == 1


def test_swe_agent_trajectory_only() -> None:
    states = list(SWEAgentIngester().ingest(FIX / "swe_trajectory_only.traj"))
    assert states[0]["messages"] == [SYS]
    assert (
        states[0]["student_action"] == "DISCUSSION\nList files.\n\n```\nls\n```"
    )  # the command is already there
    assert states[1]["student_action"] == "Read it.\n\n```\ncat a.py\n```"
    assert states[1]["messages"][1:] == [
        {"role": "assistant", "content": "DISCUSSION\nList files.\n\n```\nls\n```"},
        {"role": "user", "content": "a.py"},
    ]
    assert states[1].get("error_kind") == "runtime_error"


def test_swe_agent_rejects_non_object(tmp_path: Path) -> None:
    p = tmp_path / "x.traj"
    p.write_text("[]")
    with pytest.raises(ValueError, match="not a SWE-agent .traj"):
        list(SWEAgentIngester().ingest(p))


# ---------------------------------------------------------------------------- real samples (../shared)
def test_real_codex_rollout(shared_traces: Path) -> None:
    (path,) = (shared_traces / "codex").glob("*.jsonl")
    states = list(CodexIngester().ingest(path))
    assert len(states) == 6  # five reasoning+message+call turns and the final answer
    assert all(_resolves(s["messages"]) for s in states)
    assert all("[REDACTED_ARGUMENTS" in s["student_action"] for s in states[:5])
    assert [m["role"] for m in states[5]["messages"]].count("tool") == 5


def test_real_openai_and_swe_samples(shared_traces: Path) -> None:
    (oai,) = (shared_traces / "openai_messages").glob("*.json")
    (traj,) = (shared_traces / "swe_agent").glob("*.traj")
    o = list(OpenAIMessagesIngester().ingest(oai))
    s = list(SWEAgentIngester().ingest(traj))
    assert len(o) == 4 and len(s) == 5  # history has 4 actions; the trajectory's final submit is the 5th
    assert [x["student_action"] for x in s[:4]] == [x["student_action"] for x in o]
    assert s[0]["student_action"].endswith('[TOOL_USE] name=find_file input={"file_name":"missing_colon.py"}')
    assert s[4]["student_action"].endswith("```\nsubmit\n```")
    assert all(_resolves(x["messages"]) for x in o + s)
