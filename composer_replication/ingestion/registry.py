"""One entry point for every trace format: :func:`ingest_any`, :func:`detect_format`, :data:`INGESTERS`.

The format is read from the file's content (its first records), not from its name:

- ``claude_code``: JSONL records with ``type`` user/assistant/summary/system/... and a ``uuid``,
  ``sessionId`` or ``leafUuid``;
- ``codex``: JSONL ``{timestamp, type, payload}`` rollout lines, or the legacy layout (a first
  ``{id, timestamp, instructions}`` line, bare response items with ``input_text``/``output_text``
  parts, ``{"record_type": "state"}``);
- ``swe_agent``: a JSON object with ``history`` or ``trajectory`` steps (``action``/``observation``);
- ``openai``: a JSON object with ``messages`` (or ``trajectory``/``conversations`` of role/text
  messages), a bare list of messages, or JSONL of messages or conversations.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from composer_replication.ingestion.claude_code import ClaudeCodeIngester
from composer_replication.ingestion.codex import CodexIngester
from composer_replication.ingestion.openai_messages import OpenAIMessagesIngester
from composer_replication.ingestion.streaming import (
    MalformedJSON,
    has_content,
    iter_events,
    open_utf8,
    skip_value,
)
from composer_replication.ingestion.swe_agent import SWEAgentIngester
from composer_replication.types import TraceState

__all__ = ["INGESTERS", "FORMATS", "detect_format", "make_ingester", "ingest_any"]

INGESTERS: dict[str, type] = {
    "claude_code": ClaudeCodeIngester,
    "codex": CodexIngester,
    "openai": OpenAIMessagesIngester,
    "swe_agent": SWEAgentIngester,
}
"""Format name -> ingester class (each has ``ingest(path) -> Iterator[TraceState]`` and ``last_stats``)."""

FORMATS: tuple[str, ...] = tuple(INGESTERS)

_CLAUDE_TYPES = frozenset(
    {
        "user",
        "assistant",
        "summary",
        "system",
        "file-history-snapshot",
        "queue-operation",
        "progress",
        "attachment",
        "pr-link",
        "custom-title",
        "last-prompt",
        "agent-name",
    }
)
_CODEX_TYPES = frozenset({"session_meta", "response_item", "event_msg", "turn_context", "compacted"})
_CODEX_ITEMS = frozenset(
    {
        "message",
        "function_call",
        "function_call_output",
        "reasoning",
        "local_shell_call",
        "custom_tool_call",
        "custom_tool_call_output",
        "web_search_call",
    }
)
_MAX_LINES = 20


def _classify_record(rec: Any) -> str | None:
    if not isinstance(rec, dict):
        return None
    rtype = rec.get("type")
    if rtype in _CODEX_TYPES and "payload" in rec:
        return "codex"
    if rec.get("record_type") == "state" or ("instructions" in rec and "id" in rec and "type" not in rec):
        return "codex"
    if rtype in _CLAUDE_TYPES and (
        "uuid" in rec or "sessionId" in rec or "leafUuid" in rec or "parentUuid" in rec
    ):
        return "claude_code"
    if (
        rtype in _CODEX_ITEMS
        and "role" not in rec
        or (
            rtype == "message"
            and isinstance(rec.get("content"), list)
            and any(
                isinstance(p, dict) and p.get("type") in ("input_text", "output_text") for p in rec["content"]
            )
        )
    ):
        return "codex"
    return _classify_doc(rec)


def _classify_doc(doc: Any) -> str | None:
    if isinstance(doc, list):
        if doc and all(isinstance(m, dict) for m in doc[:20]):
            if any("role" in m or "from" in m for m in doc[:20]):
                return "openai"
            if any(_classify_doc(m) == "openai" for m in doc[:5]):
                return "openai"
        return None
    if not isinstance(doc, dict):
        return None
    if isinstance(doc.get("history"), list) or (
        isinstance(doc.get("trajectory"), list)
        and any(isinstance(s, dict) and ("action" in s or "observation" in s) for s in doc["trajectory"][:5])
    ):
        return "swe_agent"
    for key in ("messages", "trajectory", "conversations", "conversation"):
        if isinstance(doc.get(key), list):
            return "openai"
    if "role" in doc and ("content" in doc or "text" in doc or "tool_calls" in doc):
        return "openai"
    return None


def _prune(event: str, value: Any, events: Iterator[tuple[str, Any]], depth: int = 0) -> Any:
    """The JSON value starting with ``(event, value)``, pruned to what the classifiers read:
    containers to depth 3, the first 20 items of each list, strings up to 200 characters (longer
    ones, such as a pasted image, become ""). Built from streamed events, so a record of any size
    costs no more than its pruned form."""
    if event not in ("start_map", "start_array"):
        return "" if isinstance(value, str) and len(value) > 200 else value
    if depth >= 3:
        skip_value(event, events)
        return {} if event == "start_map" else []
    out: Any = {} if event == "start_map" else []
    key = None
    for event, value in events:
        if event in ("end_map", "end_array"):
            return out
        if event == "map_key":
            key = value
            continue
        item = _prune(event, value, events, depth + 1)
        if isinstance(out, dict):
            out[key] = item
        elif len(out) < _MAX_LINES:
            out.append(item)
    return out


def detect_format(path: str | Path) -> str:
    """Name the trace format of ``path`` from its content (one of :data:`FORMATS`).

    The first 20 JSON values (the lines of a JSONL file, or the one document of a JSON file) vote;
    they are streamed and pruned, so a first record of many megabytes (a pasted image) or a large
    document costs little memory. UTF-8 (with or without a BOM) and UTF-16 are read.

    Raises:
        ValueError: the file is empty, or its content matches no known format (the message lists
            the formats and how to force one).
        NestingTooDeep: the JSON nests deeper than Python's recursion limit.
    """
    path = Path(path)
    votes: list[str] = []
    with open_utf8(path, clean=True) as f:
        events = iter_events(f, path)
        try:
            for event, value in events:
                rec = _prune(event, value, events)
                kind = _classify_record(rec) if isinstance(rec, dict) else _classify_doc(rec)
                if kind is not None:
                    votes.append(kind)
                if len(votes) >= _MAX_LINES:
                    break
        except MalformedJSON:
            pass  # a damaged line: the records before it vote
    if votes:
        return max(set(votes), key=votes.count)
    if not has_content(path):
        raise ValueError(f"{path} is empty (no records): nothing to ingest")
    raise ValueError(
        f"could not tell the trace format of {path} from its content; known formats: {', '.join(FORMATS)}. "
        "Force one with ingest_any(path, format='claude_code') or the CLI's --format claude_code."
    )


def make_ingester(format: str, **kwargs: Any) -> Any:
    """An ingester for ``format`` (a key of :data:`INGESTERS`), built with ``kwargs``.

    Keyword arguments an ingester does not take (``skip_sidechain`` for non-Claude formats) are dropped.
    """
    if format not in INGESTERS:
        raise ValueError(
            f"format={format!r} is not a known trace format; use 'auto' or one of {', '.join(FORMATS)}"
        )
    cls = INGESTERS[format]
    import inspect

    accepted = set(inspect.signature(cls.__init__).parameters)
    return cls(**{k: v for k, v in kwargs.items() if k in accepted})


def ingest_any(path: str | Path, *, format: str = "auto", **kwargs: Any) -> Iterator[TraceState]:
    """Ingest ``path`` in any known format (detected from content when ``format="auto"``).

    ``kwargs`` go to the ingester (``system_prompt``, ``max_history_tokens``, ``tokenizer``,
    ``strip_thinking``, ``skip_sidechain``). Detection and argument errors raise here, before the
    first state.

    Raises:
        ValueError: unknown ``format``, or a file whose format cannot be detected.
    """
    if format != "auto" and format not in INGESTERS:
        raise ValueError(
            f"format={format!r} is not a known trace format; use 'auto' or one of {', '.join(FORMATS)}"
        )
    fmt = detect_format(path) if format == "auto" else format
    return make_ingester(fmt, **kwargs).ingest(Path(path))
