"""OpenAI-style chat messages with ``tool_calls`` -> one :class:`TraceState` per assistant message.

Accepted files: a JSON object with ``messages`` (or ``trajectory`` / ``conversations``), a bare JSON
list of messages or of such objects, or JSONL with one conversation per line or one message per line.
Messages may use ``text`` instead of ``content`` and the role ``ai`` (or ``gpt``) for ``assistant``
(``human`` for ``user``); legacy ``function_call`` / ``function`` messages become tool calls / tool
messages. The conversation's own system message is kept; one is added only when it has none. A
``tools`` list (OpenAI schemas) gives the available tool names and their schemas for error sites.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import ijson

from composer_replication.ingestion.conversation import ConversationBuilder, ToolTracker
from composer_replication.ingestion.history import (
    BaseIngester,
    IngestionStats,
    iter_jsonl,
    parts_to_text,
    tool_call,
)
from composer_replication.ingestion.streaming import (
    MalformedJSON,
    build_value,
    has_content,
    iter_events,
    open_utf8,
    skip_value,
)
from composer_replication.types import TraceState

__all__ = [
    "OpenAIMessagesIngester",
    "ConversationBuilder",
    "iter_conversations",
    "load_conversations",
    "normalize_message",
]

_ROLES = {
    "ai": "assistant", "gpt": "assistant", "bot": "assistant", "model": "assistant", "assistant": "assistant",
    "human": "user", "user": "user", "system": "system", "developer": "system",
    "tool": "tool", "function": "tool", "ipython": "tool",
}  # fmt: skip
_CONV_KEYS = ("messages", "trajectory", "conversations", "conversation")


def normalize_message(m: Any) -> dict[str, Any] | None:
    """One message in canonical form (``role``, ``content`` str, ``tool_calls``, ``tool_call_id``), or None."""
    if not isinstance(m, dict):
        return None
    role = _ROLES.get(str(m.get("role") or m.get("from") or "").lower())
    if role is None:
        return None
    raw = m["content"] if "content" in m else m.get("text", m.get("value"))
    out: dict[str, Any] = {"role": role, "content": parts_to_text(raw)}
    if role == "assistant":
        calls = []
        for j, c in enumerate(m.get("tool_calls") or []):
            if not isinstance(c, dict):
                continue
            fn = c.get("function") if isinstance(c.get("function"), dict) else c
            cid = str(c.get("id") or f"call_{j}")
            calls.append(tool_call(cid, str(fn.get("name", "")), fn.get("arguments", fn.get("input", ""))))
        if isinstance(m.get("function_call"), dict):
            fc = m["function_call"]
            calls.append(tool_call(f"call_{len(calls)}", str(fc.get("name", "")), fc.get("arguments", "")))
        if calls:
            out["tool_calls"] = calls
        thinking = m.get("reasoning_content") or m.get("reasoning")
        if isinstance(thinking, str) and thinking.strip():
            out["_thinking"] = thinking.strip()
    elif role == "tool":
        ids = m.get("tool_call_ids")
        cid = m.get("tool_call_id") or (ids[0] if isinstance(ids, list) and ids else None)
        out["tool_call_id"] = str(cid) if cid else None
        if m.get("role") == "function" and m.get("name"):
            out["_name"] = str(m["name"])
    return out


def _tool_schemas(tools: Any) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for t in tools if isinstance(tools, list) else ():
        if isinstance(t, dict):
            fn = t.get("function") if isinstance(t.get("function"), dict) else t
            if fn.get("name"):
                out[str(fn["name"])] = fn
    return out


def _from_doc(doc: Any) -> list[tuple[list, dict]]:
    """Conversations in one decoded JSON value: ``[(raw_messages, tool_schemas), ...]``."""
    if isinstance(doc, dict):
        for key in _CONV_KEYS:
            if isinstance(doc.get(key), list):
                return [(doc[key], _tool_schemas(doc.get("tools")))]
        return []
    if isinstance(doc, list):
        if any(isinstance(m, dict) and ("role" in m or "from" in m) for m in doc):
            return [(doc, {})]
        return [c for d in doc for c in _from_doc(d)]
    return []


# ---------------------------------------------------------------------------- streaming the file
Conversation = tuple[Iterator[Any], dict[str, dict]]
"""A conversation being read: ``(raw messages, tool schemas)``."""


def probe_layout(path: Path) -> tuple[str, Any]:
    """How to stream ``path``, from one pass over its JSON events (nothing large is built):

    - ``("object", (key, tools))``: one JSON object whose ``key`` list holds the messages;
    - ``("messages", None)``: one JSON list of messages; ``("documents", None)``: a list of objects;
    - ``("lines", all_messages)``: JSONL (several values) or text that is not one JSON value;
      ``all_messages``: every record is a message (one conversation), else each is a document;
    - ``("none", None)``: one value holding no conversation; ``("empty", None)``: only blanks.

    Raises:
        NestingTooDeep: the JSON nests deeper than Python's recursion limit.
    """
    if not has_content(path):
        return "empty", None
    with open_utf8(path, clean=True) as f:
        events = iter_events(f, path)
        try:
            first = next(events, None)
            if first is None:
                return "lines", False
            if first[0] == "start_map":
                lists, tools = set(), None
                for event, value in events:
                    if event == "end_map":
                        break
                    nxt = next(events)
                    if value == "tools":
                        tools = build_value(*nxt, events)
                        continue
                    if nxt[0] == "start_array":
                        lists.add(value)
                    skip_value(nxt[0], events)
                key = next((k for k in _CONV_KEYS if k in lists), None)
                layout: tuple[str, Any] = ("object", (key, tools)) if key else ("none", None)
            elif first[0] == "start_array":
                layout = ("documents", None)
                for event, _ in events:
                    if event == "end_array":
                        break
                    if event == "start_map" and _has_role_key(events):
                        layout = ("messages", None)
                    elif event != "start_map":
                        skip_value(event, events)
            else:
                layout = ("none", None)
            if next(events, None) is None:
                return layout
        except MalformedJSON:
            pass
    return "lines", _all_messages(path)


def _all_messages(path: Path) -> bool:
    """Whether a JSONL file has records and every one is a message (read until one is not)."""
    found = False
    for r in iter_jsonl(path, IngestionStats()):
        if not _is_message(r):
            return False
        found = True
    return found


def _has_role_key(events: Iterator[tuple[str, Any]]) -> bool:
    """Consume one object (after its ``start_map``); whether it has a ``role`` or ``from`` key."""
    found = False
    for event, value in events:
        if event == "end_map":
            return found
        found = found or value in ("role", "from")
        skip_value(next(events)[0], events)
    return found


def _is_message(r: Any) -> bool:
    return isinstance(r, dict) and ("role" in r or "from" in r)


def iter_conversations(
    path: Path, stats: IngestionStats, layout: tuple[str, Any] | None = None
) -> Iterator[Conversation]:
    """Stream the conversations of a JSON / JSONL file (see the module docstring for the shapes).

    A JSON object's message list, a JSON list of messages and JSONL of messages are streamed one
    message at a time; a list of conversation objects, or JSONL of conversations, one conversation
    at a time. Bad JSONL lines are counted in ``stats`` (as :func:`iter_jsonl` does). ``layout`` is
    :func:`probe_layout`'s answer when the caller already has it (the file is read once less).
    """
    kind, detail = layout or probe_layout(path)
    if kind == "object":
        key, tools = detail
        yield _items(path, f"{key}.item"), _tool_schemas(tools)
    elif kind == "messages":
        yield _items(path, "item"), {}
    elif kind == "documents":
        for doc in _items(path, "item"):
            yield from ((iter(raw), schemas) for raw, schemas in _from_doc(doc))
    elif kind == "empty":
        stats.skipped_truncated_lines += 1
    elif kind == "lines":
        if detail:  # every record is a message: one conversation
            yield iter_jsonl(path, stats), {}
        else:
            for r in iter_jsonl(path, stats):
                yield from ((iter(raw), schemas) for raw, schemas in _from_doc(r))


def _items(path: Path, prefix: str) -> Iterator[Any]:
    """The values at ``prefix`` (an ``ijson`` path), streamed; the depth was checked by
    :func:`probe_layout`."""
    with open_utf8(path, clean=True) as f:
        yield from ijson.items(f, prefix, use_float=True)


def load_conversations(path: Path, stats: IngestionStats) -> list[tuple[list, dict]]:
    """Every conversation of a JSON / JSONL file as lists (holds the file: prefer
    :func:`iter_conversations`)."""
    return [(list(raw), schemas) for raw, schemas in iter_conversations(path, stats)]


class OpenAIMessagesIngester(BaseIngester):
    """Convert OpenAI chat-messages files (see module docstring) into TraceStates.

    Args: ``system_prompt`` (used only when a conversation has no system message),
    ``strip_thinking``, ``max_history_tokens``, ``tokenizer``, as for ``ClaudeCodeIngester``.
    ``state_id = f"{path.stem}::{idx:04d}"`` with ``idx`` counting states across the file's conversations.

    The file is read twice, streamed: once for each conversation's tool names (every state carries
    them), once for the states. Memory is bounded by one history (by ``max_history_tokens`` when set),
    not by the conversation.
    """

    source = "openai"

    def builder(self, stats: IngestionStats) -> ConversationBuilder:
        """A :class:`ConversationBuilder` with this ingester's settings."""
        return ConversationBuilder(
            system_prompt=self.system_prompt,
            strip_thinking=self.strip_thinking,
            max_history_tokens=self.max_history_tokens,
            count=self._count,
            stats=stats,
            source=self.source,
        )

    def ingest(self, path: str | Path) -> Iterator[TraceState]:
        """Yield one TraceState per assistant message of every conversation in ``path``.

        Raises:
            NestingTooDeep: the file nests deeper than Python's recursion limit (nothing is yielded).
        """
        path = Path(path)
        stats = self.last_stats = IngestionStats()
        layout = probe_layout(path)
        tools = []
        for raw, schemas in iter_conversations(path, IngestionStats(), layout):
            tracker = ToolTracker()
            for m in raw:
                nm = normalize_message(m)
                if nm is not None:
                    tracker.feed(nm)
            tools.append(tracker.tools(schemas))
        builder = self.builder(stats)
        idx = 0
        for n, (raw, schemas) in enumerate(iter_conversations(path, stats, layout)):
            for state in builder.build(self._normalized(raw, stats), tools=tools[n], tool_schemas=schemas):
                state["state_id"] = f"{path.stem}::{idx:04d}"
                idx += 1
                stats.n_states_emitted += 1
                yield state

    @staticmethod
    def _normalized(raw: Iterable[Any], stats: IngestionStats) -> Iterator[dict]:
        for m in raw:
            stats.n_records_total += 1
            nm = normalize_message(m)
            if nm is None:
                stats.skipped_unknown += 1
                stats.n_records_skipped += 1
            else:
                yield nm
