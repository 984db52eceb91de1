"""OpenAI Codex CLI rollouts -> one :class:`TraceState` per assistant turn.

Codex writes ``~/.codex/sessions/YYYY/MM/DD/rollout-<ts>-<uuid>.jsonl``. Two layouts:

- current: every line is ``{timestamp, type, payload}`` with ``type`` in ``session_meta``,
  ``turn_context``, ``response_item``, ``event_msg`` (UI duplicates: ignored) and ``compacted``
  (the history is replaced from there);
- legacy (up to ~0.3x): a first ``{id, timestamp, instructions}`` line, then bare response items and
  ``{"record_type": "state"}`` lines.

History is built from response items only: ``message`` (``developer`` becomes ``system``),
``reasoning`` (thinking: in the action, out of the history), ``function_call`` /
``custom_tool_call`` / ``local_shell_call`` (tool calls; arguments that are not JSON stay text) and
their ``*_output`` items (tool messages). A turn is a run of consecutive assistant-side items between
two inputs (a user/developer message or a tool output).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from composer_replication.actions import ActionBlock, render_action
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

__all__ = ["CodexIngester"]

_CALL_TYPES = ("function_call", "custom_tool_call", "local_shell_call", "web_search_call")
_OUTPUT_TYPES = ("function_call_output", "custom_tool_call_output", "local_shell_call_output")
_ROLLOUT_TYPES = ("session_meta", "turn_context", "response_item", "event_msg", "compacted")


class CodexIngester(BaseIngester):
    """Convert a Codex CLI rollout JSONL (current or legacy layout) into TraceStates.

    Args: as :class:`~composer_replication.ingestion.claude_code.ClaudeCodeIngester`
    (``system_prompt``, ``strip_thinking``, ``max_history_tokens``, ``tokenizer``).
    """

    source = "codex"

    def ingest(self, path: str | Path) -> Iterator[TraceState]:
        """Yield one TraceState per assistant turn; ``state_id = f"{path.stem}::{idx:04d}"``."""
        path = Path(path)
        stats = self.last_stats = IngestionStats()
        items = list(self._items(read_jsonl(path, stats), stats))
        yield from _TurnBuilder(self, stats, path.stem).run(items)

    @staticmethod
    def _items(records: list[Any], stats: IngestionStats) -> Iterator[tuple[str, dict]]:
        """Normalize both layouts to ``("item" | "compacted", payload)`` pairs."""
        for rec in records:
            stats.n_records_total += 1
            if not isinstance(rec, dict):
                stats.skipped_unknown += 1
                continue
            rtype = rec.get("type")
            if "payload" in rec and rtype in _ROLLOUT_TYPES:
                payload = rec.get("payload")
                if rtype == "response_item" and isinstance(payload, dict):
                    yield "item", payload
                elif rtype == "compacted" and isinstance(payload, dict):
                    yield "compacted", payload
                else:
                    stats.skipped_noise += 1
            elif rec.get("record_type") == "state" or ("instructions" in rec and "type" not in rec):
                stats.skipped_noise += 1
            elif rtype == "compacted":
                yield "compacted", rec
            elif isinstance(rtype, str):
                yield "item", rec
            else:
                stats.skipped_unknown += 1
        stats.n_records_skipped = stats.skipped_noise + stats.skipped_unknown + stats.skipped_truncated_lines


class _TurnBuilder:
    """Walks normalized items, keeps one linear history and emits a state at each turn's end."""

    def __init__(self, cfg: CodexIngester, stats: IngestionStats, stem: str) -> None:
        self.cfg, self.stats, self.stem = cfg, stats, stem
        self.hist: list[dict] = [{"role": "system", "content": cfg.system_prompt}]
        self.turn: list[ActionBlock] | None = None
        self.turn_hist: list[dict] = []
        self.turn_msg: dict | None = None
        self.pending: list[str] = []
        self.names: dict[str, str] = {}
        self.states: list[TraceState] = []
        self.turn_calls: list[list[str]] = []
        self.outputs: dict[str, str] = {}
        self.declared: set[str] = set()
        self.cache: dict = {}

    def run(self, items: list[tuple[str, dict]]) -> Iterator[TraceState]:
        """Consume ``items`` and yield the finished states."""
        for kind, item in items:
            if kind == "compacted":
                self._end_turn()
                self._compact(item)
                continue
            t = item.get("type")
            role = item.get("role")
            if (t == "message" and role == "assistant") or t == "reasoning" or t in _CALL_TYPES:
                self._assistant_item(item)
            elif t == "message":
                self._end_turn()
                self._close_pending()
                text = parts_to_text(item.get("content"), on_media=self._media)
                if text.strip():
                    self.hist.append({"role": "system" if role == "developer" else "user", "content": text})
            elif t in _OUTPUT_TYPES:
                self._end_turn()
                self._output(item)
            else:
                self.stats.skipped_unknown += 1
                self.stats.n_records_skipped += 1
        self._end_turn()
        yield from self._finish()

    def _media(self) -> None:
        self.stats.n_media += 1

    def _assistant_item(self, item: dict) -> None:
        if self.turn is None:
            self._close_pending()
            self.turn, self.turn_hist, self.turn_msg = [], list(self.hist), None
            self.turn_calls.append([])
        t = item.get("type")
        if t == "reasoning":
            text = parts_to_text(item.get("summary")) or parts_to_text(item.get("content"))
            if text.strip():
                self.turn.append(ActionBlock("thinking", text.strip()))
                if not self.cfg.strip_thinking:
                    self._history_text(render_action([ActionBlock("thinking", text.strip())]))
            return
        if t == "message":
            text = parts_to_text(item.get("content")).strip()
            if text:
                self.turn.append(ActionBlock("text", text))
                self._history_text(text)
            return
        name, args, cid = _call_parts(item)
        if t == "web_search_call":
            self.declared.add(name)
        self.turn.append(
            ActionBlock(
                "tool_use",
                text=args if isinstance(args, str) else "",
                name=name,
                arguments=None if isinstance(args, str) else args,
            )
        )
        if t == "web_search_call":  # no result item: action only
            return
        self.names[cid] = name
        self.turn_calls[-1].append(cid)
        self._assistant_msg().setdefault("tool_calls", []).append(tool_call(cid, name, args))
        self.pending.append(cid)

    def _assistant_msg(self) -> dict:
        if self.turn_msg is None:
            self.turn_msg = {"role": "assistant", "content": ""}
            self.hist.append(self.turn_msg)
        return self.turn_msg

    def _history_text(self, text: str) -> None:
        msg = self._assistant_msg()
        msg["content"] = f"{msg['content']}\n{text}" if msg["content"] else text

    def _output(self, item: dict) -> None:
        cid = str(item.get("call_id", ""))
        out = item.get("output")
        if isinstance(out, dict):
            text = parts_to_text(out.get("content")) or json.dumps(out, ensure_ascii=False)
        else:
            text = parts_to_text(out, on_media=self._media)
        if cid in self.pending:
            self.pending.remove(cid)
            self.hist.append(tool_message(cid, text))
            self.outputs[cid] = text
        elif cid in self.names:
            self.stats.n_late_results += 1
        else:
            self.stats.n_orphan_results += 1

    def _close_pending(self) -> None:
        for cid in self.pending:
            self.hist.append(tool_message(cid, NO_RESULT))
        self.stats.n_missing_results += len(self.pending)
        self.pending = []

    def _end_turn(self) -> None:
        if self.turn is None:
            return
        self.stats.n_assistant_turns += 1
        action = render_action(self.turn)
        if action:
            messages = self.turn_hist
            if self.cfg.max_history_tokens is not None:
                messages = trim_history(messages, self.cfg.max_history_tokens, self.cfg._count, self.cache)
            state: TraceState = {
                "state_id": "",
                "messages": messages,
                "student_action": action,
                "source": "codex",
            }
            state["_calls"] = self.turn_calls[-1]  # type: ignore[typeddict-unknown-key]
            state["_text"] = "\n".join(b.text for b in self.turn if b.kind == "text")  # type: ignore[typeddict-unknown-key]
            self.states.append(state)
            self.stats.n_tool_use_blocks += sum(b.kind == "tool_use" for b in self.turn)
            self.stats.n_text_blocks += sum(b.kind == "text" for b in self.turn)
        self.turn = None

    def _compact(self, item: dict) -> None:
        self._close_pending()
        self.stats.n_compactions += 1
        self.hist = [self.hist[0]]
        replacement = item.get("replacement_history")
        if isinstance(replacement, list) and replacement:
            for sub in replacement:
                if isinstance(sub, dict) and sub.get("type", "message") == "message":
                    text = parts_to_text(sub.get("content"))
                    role = {"developer": "system"}.get(sub.get("role"), sub.get("role") or "user")
                    if text.strip() and role in ("system", "user", "assistant"):
                        self.hist.append({"role": role, "content": text})
        elif item.get("message"):
            self.hist.append({"role": "user", "content": str(item["message"])})

    def _finish(self) -> Iterator[TraceState]:
        results = {c: (t, looks_like_error(t)) for c, t in self.outputs.items()}
        tools = offered_tools(self.names, results, self.declared)
        repeats = RepeatTracker()
        for idx, state in enumerate(self.states):
            calls = state.pop("_calls")  # type: ignore[typeddict-item]
            text = state.pop("_text")  # type: ignore[typeddict-item]
            state["state_id"] = f"{self.stem}::{idx:04d}"
            state["tools"] = tools
            failure = next(
                (
                    (self.names[c], self.outputs[c], classify_tool_error(self.outputs[c]))
                    for c in calls
                    if c in self.outputs and looks_like_error(self.outputs[c])
                ),
                None,
            )
            kind = repeats.observe(failure)
            if kind is not None and failure is not None:
                state["error_kind"] = kind
                state["error_meta"] = make_error_site(
                    kind=kind, message=failure[1], tool_name=failure[0], available_tools=tools, intent=text
                )
                self.stats.n_errors += 1
            self.stats.n_states_emitted += 1
            yield state


def _call_parts(item: dict) -> tuple[str, Any, str]:
    """(name, arguments, call_id) of a call item; arguments are a dict when they parse, else text."""
    t = item.get("type")
    cid = str(item.get("call_id") or item.get("id") or "")
    if t == "local_shell_call":
        return "local_shell", item.get("action") or {}, cid
    if t == "web_search_call":
        return "web_search", item.get("action") or {}, cid
    name = str(item.get("name", ""))
    raw = item.get("arguments") if t == "function_call" else item.get("input")
    if isinstance(raw, dict):
        return name, raw, cid
    raw = "" if raw is None else str(raw)
    try:
        parsed = json.loads(raw)
        return name, parsed if isinstance(parsed, dict) else raw, cid
    except (ValueError, RecursionError):  # not JSON, or nested past the recursion limit: kept as text
        return name, raw, cid
