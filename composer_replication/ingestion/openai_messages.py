"""OpenAI-style chat messages and SWE-agent ``.traj`` files -> one TraceState per assistant message.

OpenAI files (many layouts; ``text`` for ``content``, roles ``ai`` / ``gpt`` / ``human``) are streamed with
``ijson``: memory is bounded by one history. A ``.traj`` gives its ``history`` (demonstrations skipped) then the
``trajectory`` steps it does not reach. Rules: docs/ingestion.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ijson

from composer_replication.ingestion import reading
from composer_replication.ingestion.conversation import Conversation, normalized, offered
from composer_replication.ingestion.history import (
    BaseIngester,
    IngestionStats,
    Turn,
    parts_to_text,
    tool_call,
)

_ROLES = {
    "ai": "assistant", "gpt": "assistant", "bot": "assistant", "model": "assistant", "assistant": "assistant",
    "human": "user", "user": "user", "system": "system", "developer": "system",
    "tool": "tool", "function": "tool", "ipython": "tool",
}  # fmt: skip
_CONV_KEYS = ("messages", "trajectory", "conversations", "conversation")


def normalize_message(m: Any) -> dict[str, Any] | None:
    """One message in the builder's form (``conversation``), or None when it is not a chat message."""
    if not isinstance(m, dict) or (role := _ROLES.get(str(m.get("role") or m.get("from") or "").lower())) is None:
        return None
    out: dict[str, Any] = {"role": role, "content": parts_to_text(m["content"] if "content" in m else m.get("text", m.get("value")))}
    if role == "assistant":
        calls = []
        for j, c in enumerate(m.get("tool_calls") or []):
            if isinstance(c, dict):
                fn = c.get("function") if isinstance(c.get("function"), dict) else c
                calls.append(tool_call(str(c.get("id") or f"call_{j}"), str(fn.get("name", "")),
                                       fn.get("arguments", fn.get("input", ""))))  # fmt: skip
        if isinstance(fc := m.get("function_call"), dict):
            calls.append(tool_call(f"call_{len(calls)}", str(fc.get("name", "")), fc.get("arguments", "")))
        if calls:
            out["tool_calls"] = calls
        if isinstance(thinking := m.get("reasoning_content") or m.get("reasoning"), str) and thinking.strip():
            out["_thinking"] = thinking.strip()
    elif role == "tool":
        ids = m.get("tool_call_ids")
        cid = m.get("tool_call_id") or (ids[0] if isinstance(ids, list) and ids else None)
        out["tool_call_id"] = str(cid) if cid else None
    return out


def _schemas(tools: Any) -> dict[str, dict]:
    fns = [t.get("function") if isinstance(t.get("function"), dict) else t for t in tools if isinstance(t, dict)] \
        if isinstance(tools, list) else []  # fmt: skip
    return {str(fn["name"]): fn for fn in fns if fn.get("name")}


def _is_message(r: Any) -> bool:
    return isinstance(r, dict) and ("role" in r or "from" in r)


def _from_doc(doc: Any) -> list[tuple[list, dict]]:
    """The conversations of one decoded JSON value: ``[(raw messages, tool schemas), ...]``."""
    if isinstance(doc, dict):
        key = next((k for k in _CONV_KEYS if isinstance(doc.get(k), list)), None)
        return [(doc[key], _schemas(doc.get("tools")))] if key else []
    if isinstance(doc, list):
        return [(doc, {})] if any(map(_is_message, doc)) else [c for d in doc for c in _from_doc(d)]
    return []


def probe_layout(path: Path) -> tuple[str, Any]:
    """How to stream ``path``, from its first JSON value, pruned as it streams: ``("object", key)`` (one object
    whose ``key`` list holds the messages), ``("messages" | "documents", None)`` (one list of messages / of
    conversations), ``("lines", all_messages)`` (JSONL, or not one JSON value), ``("none" | "empty", None)``;
    ``reading.NestingTooDeep`` when the JSON nests deeper than Python's recursion limit."""
    if not reading.has_content(path):
        return "empty", None
    with reading.open_utf8(path, clean=True) as f:
        events = reading.iter_events(f, path)
        try:
            doc = reading.prune(*first, events) if (first := next(events, None)) else None
            single = first is not None and next(events, None) is None
        except reading.MalformedJSON:
            single = False
    if single and isinstance(doc, dict):
        key = next((k for k in _CONV_KEYS if isinstance(doc.get(k), list)), None)
        return ("object", key) if key else ("none", None)
    if single:
        return ("messages" if any(map(_is_message, doc)) else "documents", None) if isinstance(doc, list) else ("none", None)
    flags = (_is_message(r) for r in reading.iter_jsonl(path, IngestionStats()))
    return "lines", next(flags, False) and all(flags)


def iter_conversations(path: Path, stats: IngestionStats, layout: tuple[str, Any]) -> Iterator[tuple[Iterator, dict]]:
    """Stream the conversations of a file as ``(raw messages, tool schemas)``: a message list one message
    at a time, a list of conversations (or JSONL of them) one conversation at a time."""
    kind, detail = layout
    if kind == "object":
        yield _items(path, f"{detail}.item"), _schemas(next(_items(path, "tools"), None))
    elif kind == "messages":
        yield _items(path, "item"), {}
    elif kind == "empty":
        stats.skipped_truncated_lines += 1
    elif kind == "lines" and detail:
        yield reading.iter_jsonl(path, stats), {}
    elif kind in ("documents", "lines"):
        for doc in _items(path, "item") if kind == "documents" else reading.iter_jsonl(path, stats):
            yield from ((iter(raw), schemas) for raw, schemas in _from_doc(doc))


def _items(path: Path, prefix: str) -> Iterator[Any]:
    with reading.open_utf8(path, clean=True) as f:  # the depth was checked by probe_layout
        yield from ijson.items(f, prefix, use_float=True)


class OpenAIMessagesIngester(BaseIngester):
    """OpenAI chat-message files -> TraceStates (``source="openai"``), options as ``BaseIngester``
    (``system_prompt`` only for a conversation without one); ids count across the file's conversations. The
    file is read three times, streamed: its layout, each conversation's tools, the states."""

    source = "openai"

    def _turns(self, path: Path, stats: IngestionStats, redact: Callable[[str], str]) -> Iterator[Turn]:
        layout = probe_layout(path)
        tools = [offered(normalized(IngestionStats(), raw, normalize_message), schemas)
                 for raw, schemas in iter_conversations(path, IngestionStats(), layout)]  # fmt: skip
        for n, (raw, schemas) in enumerate(iter_conversations(path, stats, layout)):
            conv = Conversation(self, stats, tools[n], redact, schemas=schemas)
            yield from conv.build(normalized(stats, raw, normalize_message))


def step_action(step: dict) -> str:
    """The action text of one ``trajectory`` step (raw response, plus the command when not in it)."""
    response = str(step.get("response") or step.get("thought") or "").replace("\r\n", "\n").strip()
    action = str(step.get("action") or "").replace("\r\n", "\n").strip()
    present = action in response if "\n" in action else any(ln.strip() == action for ln in response.splitlines())
    return f"{response}\n\n```\n{action}\n```".strip() if action and not present else response


class SWEAgentIngester(BaseIngester):
    """A SWE-agent ``.traj`` -> TraceStates (``source="swe_agent"``), options as ``BaseIngester``;
    ``ValueError`` when the file is JSON but not an object."""

    source = "swe_agent"

    def _turns(self, path: Path, stats: IngestionStats, redact: Callable[[str], str]) -> Iterator[Turn]:
        try:
            with reading.open_utf8(path, clean=True) as f:
                doc = reading.loads(f.read(), path)
        except reading.NestingTooDeep:
            raise
        except ValueError:  # not JSON
            stats.n_records_total += 1
            stats.skipped_truncated_lines += 1
            return
        if not isinstance(doc, dict):
            raise ValueError(f"{path} is not a SWE-agent .traj (a JSON object with 'trajectory'/'history'); "
                             f"got a JSON {type(doc).__name__}. Use format='openai' for message lists.")  # fmt: skip
        steps = [s for s in doc.get("trajectory") or [] if isinstance(s, dict)]
        messages: list[dict] = []
        for m in (m for m in doc.get("history") or [] if isinstance(m, dict)):
            stats.n_records_total += 1
            demo = m.get("is_demo") or m.get("message_type") == "demonstration" or m.get("agent") not in (None, "main", "primary")
            if (nm := None if demo else normalize_message(m)) is None:
                stats.skipped_meta += 1
            else:
                messages.append({**nm, "content": nm["content"].replace("\r\n", "\n")})
        extra = steps[sum(m["role"] == "assistant" for m in messages):] if messages else steps
        stats.n_records_total += len(extra)
        for s in extra:
            messages.append({"role": "assistant", "content": step_action(s)})
            messages.append({"role": "user", "content": str(s.get("observation") or "").replace("\r\n", "\n"),
                             "_observation": True})  # fmt: skip
        yield from Conversation(self, stats, offered(messages), redact).build(messages)
