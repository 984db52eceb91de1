"""One entry point for every trace format: :func:`ingest_any`, :func:`detect_format`, :data:`INGESTERS`.

The format is read from the content (its first records), not from the name; formats we recognise but do not read
(Gemini CLI, OpenHands, aider) are refused as such, never taken for another. Rules: docs/ingestion.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from composer_replication.ingestion.claude_code import ClaudeCodeIngester
from composer_replication.ingestion.codex import CodexIngester
from composer_replication.ingestion.openai_messages import OpenAIMessagesIngester, SWEAgentIngester
from composer_replication.ingestion.reading import MalformedJSON, has_content, iter_events, open_utf8, prune
from composer_replication.types import TraceState

INGESTERS: dict[str, type] = {"claude_code": ClaudeCodeIngester, "codex": CodexIngester,
                               "openai": OpenAIMessagesIngester, "swe_agent": SWEAgentIngester}  # fmt: skip
"""Format name -> ingester class (each has ``ingest(path) -> Iterator[TraceState]`` and ``last_stats``)."""
FORMATS: tuple[str, ...] = tuple(INGESTERS)
UNSUPPORTED = {"gemini_cli": "Gemini CLI", "openhands": "OpenHands", "aider": "aider chat history"}  # named, not read

_CLAUDE_TYPES = frozenset({"user", "assistant", "summary", "system", "file-history-snapshot", "queue-operation",
                           "progress", "attachment", "pr-link", "custom-title", "last-prompt", "agent-name"})  # fmt: skip
_CODEX_TYPES = frozenset({"session_meta", "response_item", "event_msg", "turn_context", "compacted"})
_CODEX_ITEMS = frozenset({"message", "function_call", "function_call_output", "reasoning", "local_shell_call",
                          "custom_tool_call", "custom_tool_call_output", "web_search_call"})  # fmt: skip
_N = 20  # records that vote; items kept per pruned list


def _openhands(items: Any) -> bool:
    return isinstance(items, list) and any(
        isinstance(e, dict) and "source" in e and ("action" in e or "observation" in e) for e in items[:_N])


def _classify(rec: Any) -> str | None:
    """The format one pruned record (or document) belongs to, or None."""
    if isinstance(rec, list):
        if _openhands(rec):
            return "openhands"
        if rec and all(isinstance(m, dict) for m in rec) and any("role" in m or "from" in m for m in rec):
            return "openai"
        return "openai" if any(_classify(m) == "openai" for m in rec[:5]) else None
    if not isinstance(rec, dict):
        return None
    rtype = rec.get("type")
    if (rtype in _CODEX_TYPES and "payload" in rec) or rec.get("record_type") == "state" \
            or ("instructions" in rec and "id" in rec and "type" not in rec):  # fmt: skip
        return "codex"
    if "projectHash" in rec or rtype == "gemini" or "$rewindTo" in rec or "$set" in rec:
        return "gemini_cli"
    if isinstance(rec.get("messages"), list) and any(
            isinstance(m, dict) and m.get("type") == "gemini" for m in rec["messages"]):  # fmt: skip
        return "gemini_cli"
    if rtype in _CLAUDE_TYPES and ("uuid" in rec or "sessionId" in rec or "leafUuid" in rec or "parentUuid" in rec):
        return "claude_code"
    if (rtype in _CODEX_ITEMS and "role" not in rec) or (rtype == "message" and isinstance(rec.get("content"), list)
            and any(isinstance(p, dict) and p.get("type") in ("input_text", "output_text") for p in rec["content"])):
        return "codex"
    if _openhands([rec]) or _openhands(rec.get("history")):
        return "openhands"
    trajectory = rec.get("trajectory")
    if isinstance(rec.get("history"), list) or (isinstance(trajectory, list) and any(
            isinstance(s, dict) and ("action" in s or "observation" in s) for s in trajectory[:5])):  # fmt: skip
        return "swe_agent"
    if any(isinstance(rec.get(k), list) for k in ("messages", "trajectory", "conversations", "conversation")):
        return "openai"
    return "openai" if "role" in rec and ("content" in rec or "text" in rec or "tool_calls" in rec) else None


def detect_format(path: str | Path) -> str:
    """The trace format of ``path`` (one of :data:`FORMATS`): its first 20 JSON values vote (the lines of a
    JSONL file, or the document of a JSON file), streamed and pruned, so a first record of many MB costs little
    memory; a damaged line ends the vote.

    Raises:
        ValueError: an empty file, or an unsupported format (Gemini CLI, OpenHands, aider, or none we know):
            the message lists the supported ones.
        NestingTooDeep: the JSON nests deeper than Python's recursion limit.
    """
    path = Path(path)
    votes: list[str] = []
    with open_utf8(path, clean=True) as f:
        events = iter_events(f, path)
        try:
            for event, value in events:
                if (kind := _classify(prune(event, value, events))) is not None:
                    votes.append(kind)
                if len(votes) >= _N:
                    break
        except MalformedJSON:
            pass  # the records before the damage vote
    if not votes:
        if not has_content(path):
            raise ValueError(f"{path} is empty (no records): nothing to ingest")
        with open_utf8(path, clean=True) as f:
            votes = ["aider"] if f.read(64).lstrip().startswith(b"# aider chat started at") else []
    kind = max(set(votes), key=votes.count) if votes else None
    if kind in FORMATS:
        return kind  # type: ignore[return-value]
    what = f"{UNSUPPORTED[kind]}, which we do not read" if kind else "its content matches none we read"
    raise ValueError(f"{path}: unsupported format ({what}); supported formats: {', '.join(FORMATS)}")


def make_ingester(format: str, **kwargs: Any) -> Any:
    """An ingester for ``format`` (a key of :data:`INGESTERS`) with ``kwargs`` (``skip_sidechain`` dropped but
    for Claude Code); ``ValueError`` for an unknown ``format``."""
    if format not in INGESTERS:
        raise ValueError(f"format={format!r} is not a known trace format; use 'auto' or one of {', '.join(FORMATS)}")
    if format != "claude_code":
        kwargs.pop("skip_sidechain", None)
    return INGESTERS[format](**kwargs)


def ingest_any(path: str | Path, *, format: str = "auto", **kwargs: Any) -> Iterator[TraceState]:
    """Ingest ``path`` in any supported format (detected from its content when ``format="auto"``); ``kwargs``
    go to the ingester (``system_prompt``, ``max_history_tokens``, ``tokenizer``, ``strip_thinking``,
    ``skip_sidechain``, ``redact``: on by default). Detection and argument errors raise here, before the first
    state (``ValueError``: an unknown ``format``, or an unsupported one, :func:`detect_format`); a file that
    yields no state logs a warning."""
    return make_ingester(detect_format(path) if format == "auto" else format, **kwargs).ingest(Path(path))
