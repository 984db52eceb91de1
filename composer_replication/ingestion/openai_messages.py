"""OpenAI-style chat messages with ``tool_calls`` -> one :class:`TraceState` per assistant message.

Accepted files: a JSON object with ``messages`` (or ``trajectory`` / ``conversations``), a bare JSON
list of messages or of such objects, or JSONL with one conversation per line or one message per line.
Messages may use ``text`` instead of ``content`` and the role ``ai`` (or ``gpt``) for ``assistant``
(``human`` for ``user``); legacy ``function_call`` / ``function`` messages become tool calls / tool
messages. The conversation's own system message is kept; one is added only when it has none. A
``tools`` list (OpenAI schemas) gives the available tool names and their schemas for error sites.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from composer_replication.actions import ActionBlock, render_action, tool_calls_to_action
from composer_replication.ingestion.errors import (
    RepeatTracker,
    classify_tool_error,
    looks_like_error,
    make_error_site,
    offered_tools,
)
from composer_replication.ingestion.history import (
    NO_RESULT,
    BaseIngester,
    IngestionStats,
    parts_to_text,
    read_jsonl,
    tool_call,
    tool_message,
    trim_history,
)
from composer_replication.types import TraceState

__all__ = ["OpenAIMessagesIngester", "ConversationBuilder", "load_conversations", "normalize_message"]

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


class ConversationBuilder:
    """Turns one normalized conversation into states (shared by the OpenAI and SWE-agent ingesters).

    Histories always end with every tool call answered: unanswered calls get a :data:`NO_RESULT`
    tool message before the next user/assistant message; a tool message whose call is unknown
    becomes a user message (its text is kept, counted in ``n_orphan_results``).
    """

    def __init__(
        self,
        *,
        system_prompt: str,
        strip_thinking: bool,
        max_history_tokens: int | None,
        count: Any,
        stats: IngestionStats,
        source: str,
    ) -> None:
        self.system_prompt, self.strip_thinking = system_prompt, strip_thinking
        self.max_history_tokens, self.count, self.stats, self.source = (
            max_history_tokens,
            count,
            stats,
            source,
        )
        self.cache: dict = {}

    def build(
        self,
        messages: list[dict],
        *,
        tool_schemas: dict[str, dict] | None = None,
        extra_actions: list[tuple[str, str]] | None = None,
    ) -> list[TraceState]:
        """States for ``messages`` (normalized); ``extra_actions`` are ``(action_text, observation)``
        turns that continue after the last message (SWE-agent steps missing from ``history``)."""
        st = self.stats
        hist: list[dict] = []
        if not messages or messages[0]["role"] != "system":
            hist.append({"role": "system", "content": self.system_prompt})
        pending: list[str] = []
        known: set[str] = set()
        outputs: dict[str, str] = {}
        names: dict[str, str] = {}
        turns: list[tuple[TraceState, list[str], str]] = []
        for m in messages:
            role = m["role"]
            if role == "tool":
                cid = m.get("tool_call_id") or (pending[0] if pending else None)
                if cid is None and m.get("_name"):
                    cid = next((p for p in pending if names.get(p) == m["_name"]), None)
                if cid in pending:
                    pending.remove(cid)
                    hist.append(tool_message(cid, m["content"]))
                    outputs[cid] = m["content"]
                else:
                    st.n_orphan_results += 1
                    if cid in known:
                        st.n_late_results += 1
                    hist.append({"role": "user", "content": m["content"]})
                continue
            self._close(hist, pending)
            if role != "assistant":
                hist.append({"role": role, "content": m["content"]})
                continue
            calls = m.get("tool_calls") or []
            blocks = [ActionBlock("thinking", m["_thinking"])] if m.get("_thinking") else []
            action = render_action(blocks + [ActionBlock("text", tool_calls_to_action(m["content"], calls))])
            ids = [c["id"] for c in calls]
            for c in calls:
                names[c["id"]] = c["function"]["name"]
            turns.append(self._state(hist, action, ids, m["content"]))
            content = (
                m["content"]
                if self.strip_thinking or not m.get("_thinking")
                else (render_action(blocks) + ("\n" + m["content"] if m["content"] else ""))
            )
            hist.append({"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})})
            pending = list(ids)
            known.update(ids)
        for action, observation in extra_actions or []:
            self._close(hist, pending)
            pending = []
            turns.append(self._state(hist, action, [], action))
            hist.append({"role": "assistant", "content": action})
            hist.append({"role": "user", "content": observation})
            outputs[f"_obs{len(turns)}"] = observation
            turns[-1][1].append(f"_obs{len(turns)}")
            names[f"_obs{len(turns)}"] = ""
        return self._finish(turns, outputs, names, tool_schemas or {})

    def _close(self, hist: list[dict], pending: list[str]) -> None:
        for cid in pending:
            hist.append(tool_message(cid, NO_RESULT))
        self.stats.n_missing_results += len(pending)
        pending.clear()

    def _state(
        self, hist: list[dict], action: str, ids: list[str], text: str
    ) -> tuple[TraceState, list[str], str]:
        self.stats.n_assistant_turns += 1
        messages = list(hist)
        if self.max_history_tokens is not None:
            messages = trim_history(messages, self.max_history_tokens, self.count, self.cache)
        return (
            {"state_id": "", "messages": messages, "student_action": action, "source": self.source},
            ids,
            text,
        )

    def _finish(
        self, turns: list, outputs: dict[str, str], names: dict[str, str], schemas: dict[str, dict]
    ) -> list[TraceState]:
        calls = {c: n for c, n in names.items() if not c.startswith("_obs")}
        tools = offered_tools(calls, {c: (t, looks_like_error(t)) for c, t in outputs.items()}, schemas)
        repeats = RepeatTracker()
        out: list[TraceState] = []
        for state, ids, text in turns:
            if not state["student_action"]:
                continue
            state["tools"] = tools
            failure = next(
                (
                    (names.get(c, ""), outputs[c], classify_tool_error(outputs[c]))
                    for c in ids
                    if c in outputs and looks_like_error(outputs[c])
                ),
                None,
            )
            kind = repeats.observe(failure)
            if kind is not None and failure is not None:
                state["error_kind"] = kind
                state["error_meta"] = make_error_site(
                    kind=kind,
                    message=failure[1],
                    tool_name=failure[0],
                    available_tools=tools,
                    tool_schema=schemas.get(failure[0]),
                    intent=text,
                )
                self.stats.n_errors += 1
            blocks = state["student_action"].count("[TOOL_USE] name=")
            self.stats.n_tool_use_blocks += blocks
            out.append(state)
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


def load_conversations(path: Path, stats: IngestionStats) -> list[tuple[list, dict]]:
    """Read every conversation of a JSON / JSONL file (see the module docstring for the shapes)."""
    text = path.read_bytes().decode("utf-8", errors="replace")
    if not text.strip():
        stats.skipped_truncated_lines += 1
        return []
    try:
        return _from_doc(json.loads(text))
    except ValueError:
        pass
    records = read_jsonl(path, stats)
    if records and all(isinstance(r, dict) and ("role" in r or "from" in r) for r in records):
        return [(records, {})]
    return [c for r in records for c in _from_doc(r)]


class OpenAIMessagesIngester(BaseIngester):
    """Convert OpenAI chat-messages files (see module docstring) into TraceStates.

    Args: ``system_prompt`` (used only when a conversation has no system message),
    ``strip_thinking``, ``max_history_tokens``, ``tokenizer``, as for ``ClaudeCodeIngester``.
    ``state_id = f"{path.stem}::{idx:04d}"`` with ``idx`` counting states across the file's conversations.
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
        """Yield one TraceState per assistant message of every conversation in ``path``."""
        path = Path(path)
        stats = self.last_stats = IngestionStats()
        builder = self.builder(stats)
        idx = 0
        for raw, schemas in load_conversations(path, stats):
            messages = []
            for m in raw:
                stats.n_records_total += 1
                nm = normalize_message(m)
                if nm is None:
                    stats.skipped_unknown += 1
                    stats.n_records_skipped += 1
                else:
                    messages.append(nm)
            for state in builder.build(messages, tool_schemas=schemas):
                state["state_id"] = f"{path.stem}::{idx:04d}"
                idx += 1
                stats.n_states_emitted += 1
                yield state
