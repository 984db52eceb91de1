"""OpenAI Codex CLI rollouts (``~/.codex/sessions/YYYY/MM/DD/rollout-*.jsonl``, current and legacy layouts) -> one
TraceState per turn: a run of assistant-side response items between two inputs. Rules: docs/ingestion.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from composer_replication.actions import ActionBlock, render_action
from composer_replication.ingestion.conversation import Conversation, offered
from composer_replication.ingestion.history import (
    BaseIngester,
    IngestionStats,
    Turn,
    parts_to_text,
    tool_call,
)
from composer_replication.ingestion.reading import iter_jsonl

_CALLS = ("function_call", "custom_tool_call", "local_shell_call", "web_search_call")
_OUTPUTS = ("function_call_output", "custom_tool_call_output", "local_shell_call_output")
_ROLLOUT = ("session_meta", "turn_context", "response_item", "event_msg", "compacted")


class CodexIngester(BaseIngester):
    """A Codex CLI rollout -> TraceStates (``source="codex"``), options as ``BaseIngester``."""

    source = "codex"

    def _turns(self, path: Path, stats: IngestionStats, redact: Callable[[str], str]) -> Iterator[Turn]:
        declared: set[str] = set()
        messages = [{"role": "system", "content": self.system_prompt}]
        turn: list[tuple[ActionBlock, dict | None]] | None = None  # the open turn's blocks (and calls)

        for kind, item in self._items(path, stats):
            t, role = item.get("type"), item.get("role")
            if kind == "item" and ((t == "message" and role == "assistant") or t == "reasoning" or t in _CALLS):
                turn = [] if turn is None else turn
                turn.extend(self._blocks(item, declared))
                continue
            if kind != "compacted" and t != "message" and t not in _OUTPUTS:
                stats.skipped_unknown += 1
                continue
            if turn is not None:
                messages.append(self._assistant(turn))
                turn = None
            if kind == "compacted":
                messages.append({"role": "_reset", "messages": _replacement(item)})
            elif t == "message":
                if (text := parts_to_text(item.get("content"), stats)).strip():
                    messages.append({"role": "system" if role == "developer" else "user", "content": text})
            else:
                out = item.get("output")
                text = (parts_to_text(out.get("content")) or json.dumps(out, ensure_ascii=False)
                        if isinstance(out, dict) else parts_to_text(out, stats))  # fmt: skip
                messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": text})
        if turn is not None:
            messages.append(self._assistant(turn))
        conv = Conversation(self, stats, offered(messages, declared), redact, orphans_as_user=False)
        yield from conv.build(messages)

    @staticmethod
    def _items(path: Path, stats: IngestionStats) -> Iterator[tuple[str, dict]]:
        """Both layouts as ``("item" | "compacted", payload)``."""
        for rec in iter_jsonl(path, stats):
            stats.n_records_total += 1
            rtype = rec.get("type") if isinstance(rec, dict) else None
            if not isinstance(rec, dict):
                stats.skipped_unknown += 1
            elif "payload" in rec and rtype in _ROLLOUT:
                if rtype in ("response_item", "compacted") and isinstance(rec["payload"], dict):
                    yield ("item" if rtype == "response_item" else "compacted"), rec["payload"]
                else:
                    stats.skipped_noise += 1
            elif rec.get("record_type") == "state" or ("instructions" in rec and "type" not in rec):
                stats.skipped_noise += 1
            elif isinstance(rtype, str):
                yield ("compacted" if rtype == "compacted" else "item"), rec
            else:
                stats.skipped_unknown += 1

    def _blocks(self, item: dict, declared: set[str]) -> Iterator[tuple[ActionBlock, dict | None]]:
        """One assistant-side item as action blocks, each with its history tool call (or None)."""
        t = item.get("type")
        if t == "reasoning":
            if text := (parts_to_text(item.get("summary")) or parts_to_text(item.get("content"))).strip():
                yield ActionBlock("thinking", text), None
        elif t == "message":
            if text := parts_to_text(item.get("content")).strip():
                yield ActionBlock("text", text), None
        else:
            name, args, cid = _call_parts(item)
            block = ActionBlock("tool_use", text=args if isinstance(args, str) else "", name=name,
                                arguments=None if isinstance(args, str) else args)  # fmt: skip
            if t == "web_search_call":  # no output item: in the action only
                declared.add(name)
                yield block, None
            else:
                yield block, tool_call(cid, name, args)

    def _assistant(self, turn: list[tuple[ActionBlock, dict | None]]) -> dict[str, Any]:
        texts = [render_action([b]) if b.kind == "thinking" else b.text for b, _ in turn
                 if b.kind == "text" or (b.kind == "thinking" and not self.strip_thinking)]  # fmt: skip
        calls = [c for _, c in turn if c is not None]
        return {"role": "assistant", "content": "\n".join(texts), **({"tool_calls": calls} if calls else {}),
                "_action": render_action([b for b, _ in turn]),
                "_intent": "\n".join(b.text for b, _ in turn if b.kind == "text")}  # fmt: skip


def _replacement(item: dict) -> list[dict]:
    """The history a ``compacted`` item leaves: its ``replacement_history`` messages, else its ``message``."""
    history = item.get("replacement_history")
    if not (isinstance(history, list) and history):
        return [{"role": "user", "content": str(item["message"])}] if item.get("message") else []
    subs = [s for s in history if isinstance(s, dict) and s.get("type", "message") == "message"]
    msgs = [("system" if (r := s.get("role") or "user") == "developer" else r, parts_to_text(s.get("content"))) for s in subs]
    return [{"role": r, "content": t} for r, t in msgs if t.strip() and r in ("system", "user", "assistant")]


def _call_parts(item: dict) -> tuple[str, Any, str]:
    """(name, arguments, call_id) of a call item; arguments are a dict when they parse, else text."""
    t, cid = item.get("type"), str(item.get("call_id") or item.get("id") or "")
    if t in ("local_shell_call", "web_search_call"):
        return t.removesuffix("_call"), item.get("action") or {}, cid
    name, raw = str(item.get("name", "")), item.get("arguments") if t == "function_call" else item.get("input")
    if not isinstance(raw, dict):
        raw = "" if raw is None else str(raw)
        try:
            raw = parsed if isinstance(parsed := json.loads(raw), dict) else raw
        except (ValueError, RecursionError):  # not JSON, or nested past the recursion limit: kept as text
            pass
    return name, raw, cid
