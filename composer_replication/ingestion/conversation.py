"""One normalized conversation -> TraceStates, streamed (shared by the OpenAI and SWE-agent ingesters).

Messages are consumed one at a time and each state is yielded as soon as its tool results are known
(at the next user or assistant message), so a conversation of any length is never held whole. With
``max_history_tokens`` the history itself is a sliding window: messages that fall out of it are
dropped for good (the window only moves forward), so memory is bounded by the history budget, not
by the conversation. Without a budget the history is the whole conversation so far.

The session's tool names must be known before the first state (every state carries them): they
come from a first pass, :class:`ToolTracker`, over the same messages.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain
from typing import Any

from composer_replication.actions import ActionBlock, render_action, tool_calls_to_action
from composer_replication.ingestion.errors import (
    RepeatTracker,
    classify_tool_error,
    looks_like_error,
    make_error_site,
)
from composer_replication.ingestion.history import NO_RESULT, IngestionStats, tool_message, trim_history
from composer_replication.types import TraceState

__all__ = ["ConversationBuilder", "ToolTracker"]


def _match(m: dict, pending: dict[str, str]) -> str | None:
    """The call id a tool message answers: its own ``tool_call_id``, else the first pending call."""
    return m.get("tool_call_id") or next(iter(pending), None)


class ToolTracker:
    """The tools a conversation offered, from one pass over its normalized messages.

    A tool counts when declared (``tools`` schemas) or called at least once without being answered by
    a ``tool_not_found`` error; names the agent invented (only ever refused) are left out. Memory is
    the distinct tool names plus one message's pending calls.
    """

    def __init__(self) -> None:
        self.pending: dict[str, str] = {}
        self.good: set[str] = set()
        self.bad: set[str] = set()

    def feed(self, m: dict) -> None:
        """Account for one normalized message (in conversation order)."""
        if m["role"] == "tool":
            cid = _match(m, self.pending)
            if cid in self.pending:
                name, text = self.pending.pop(cid), m["content"]
                failed = looks_like_error(text) and classify_tool_error(text) == "tool_not_found"
                (self.bad if failed else self.good).add(name)
            return
        self.good.update(self.pending.values())  # unanswered calls count as offered
        self.pending = {}
        for c in m.get("tool_calls") or () if m["role"] == "assistant" else ():
            self.pending[c["id"]] = c["function"]["name"]

    def tools(self, declared: Iterable[str] = ()) -> list[str]:
        """The sorted tool names: declared ones, plus called ones that were not only refused."""
        declared = set(declared)
        return sorted(declared | self.good | set(self.pending.values()) | (self.bad & declared))


class ConversationBuilder:
    """Turns one normalized conversation into states, streamed.

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
        messages: Iterable[dict],
        *,
        tools: list[str] | None = None,
        tool_schemas: dict[str, dict] | None = None,
        extra_actions: Iterable[tuple[str, str]] | None = None,
    ) -> Iterator[TraceState]:
        """Yield the states of ``messages`` (normalized), one per assistant message.

        ``tools`` is the conversation's tool list (from :class:`ToolTracker`); when None it is computed
        here, which needs ``messages`` to be a list. ``extra_actions`` are ``(action_text,
        observation)`` turns that continue after the last message (SWE-agent steps missing from
        ``history``).
        """
        schemas = tool_schemas or {}
        if tools is None:
            if not isinstance(messages, list):
                raise TypeError("build(messages, tools=None) needs a list of messages to find the tools")
            tracker = ToolTracker()
            for m in messages:
                tracker.feed(m)
            tools = tracker.tools(schemas)
        self.cache = {}
        it = iter(messages)
        first = next(it, None)
        run = _Run(self, tools, schemas)
        if first is None or first["role"] != "system":
            run.hist.append({"role": "system", "content": self.system_prompt})
        for m in chain(() if first is None else (first,), it):
            yield from run.feed(m)
        yield from run.flush()
        for action, observation in extra_actions or ():
            run.close_calls()
            state = run.state(action, action)
            run.hist.append({"role": "assistant", "content": action})
            run.hist.append({"role": "user", "content": observation})
            yield from run.emit(state, [("_obs", "")], {"_obs": observation})


class _Run:
    """The mutable state of one :meth:`ConversationBuilder.build`: history, open turn, pending calls."""

    def __init__(self, cfg: ConversationBuilder, tools: list[str], schemas: dict[str, dict]) -> None:
        self.cfg, self.stats, self.tools, self.schemas = cfg, cfg.stats, tools, schemas
        self.hist: list[dict] = []
        self.pending: dict[str, str] = {}  # call id -> tool name, calls of the open turn
        self.unanswered: set[str] = set()  # ids closed with NO_RESULT (a later result is "late")
        self.turn: tuple[TraceState, str] | None = None
        self.calls: list[tuple[str, str]] = []  # (call id, tool name) of the open turn, in call order
        self.results: dict[str, str] = {}  # call id -> result text, for the open turn
        self.repeats = RepeatTracker()

    def feed(self, m: dict) -> Iterator[TraceState]:
        role, st = m["role"], self.stats
        if role == "tool":
            cid = _match(m, self.pending)
            if cid in self.pending:
                del self.pending[cid]
                self.hist.append(tool_message(cid, m["content"]))
                self.results[cid] = m["content"]
            else:
                st.n_orphan_results += 1
                if cid in self.unanswered:
                    st.n_late_results += 1
                self.hist.append({"role": "user", "content": m["content"]})
            return
        self.close_calls()
        yield from self.flush()
        if role != "assistant":
            self.hist.append({"role": role, "content": m["content"]})
            return
        calls = m.get("tool_calls") or []
        blocks = [ActionBlock("thinking", m["_thinking"])] if m.get("_thinking") else []
        action = render_action(blocks + [ActionBlock("text", tool_calls_to_action(m["content"], calls))])
        self.turn = self.state(action, m["content"])
        content = (
            m["content"]
            if self.cfg.strip_thinking or not m.get("_thinking")
            else (render_action(blocks) + ("\n" + m["content"] if m["content"] else ""))
        )
        self.hist.append(
            {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        )
        self.calls = [(c["id"], c["function"]["name"]) for c in calls]
        self.pending = dict(self.calls)

    def close_calls(self) -> None:
        """Answer every pending call with the :data:`NO_RESULT` placeholder."""
        for cid in self.pending:
            self.hist.append(tool_message(cid, NO_RESULT))
            self.unanswered.add(cid)
        self.stats.n_missing_results += len(self.pending)
        self.pending = {}

    def flush(self) -> Iterator[TraceState]:
        """Emit the open turn (its results are final)."""
        if self.turn is not None:
            turn, calls, results = self.turn, self.calls, self.results
            self.turn, self.calls, self.results = None, [], {}
            yield from self.emit(turn, calls, results)

    def state(self, action: str, text: str) -> tuple[TraceState, str]:
        """A new state whose history is the (trimmed) history so far; drops what left the window."""
        cfg, hist = self.cfg, self.hist
        self.stats.n_assistant_turns += 1
        messages = list(hist)
        if cfg.max_history_tokens is not None:
            messages = trim_history(messages, cfg.max_history_tokens, cfg.count, cfg.cache)
            dropped = len(hist) - len(messages)
            if dropped:  # the window only moves forward: these never return
                head = 0
                while head < len(hist) and hist[head].get("role") == "system":
                    head += 1
                for gone in hist[head : head + dropped]:
                    cfg.cache.pop(id(gone), None)
                del hist[head : head + dropped]
        return {"state_id": "", "messages": messages, "student_action": action, "source": cfg.source}, text

    def emit(
        self, turn: tuple[TraceState, str], calls: list[tuple[str, str]], results: dict[str, str]
    ) -> Iterator[TraceState]:
        """Mark the error site of ``turn`` (its first call, in call order, whose result looks like an
        error) and yield it; ``calls`` are ``(id, tool name)``, ``results`` id -> text."""
        state, text = turn
        if not state["student_action"]:
            return
        state["tools"] = self.tools
        failure = next(
            (
                (name, results[cid], classify_tool_error(results[cid]))
                for cid, name in calls
                if cid in results and looks_like_error(results[cid])
            ),
            None,
        )
        kind = self.repeats.observe(failure)
        if kind is not None and failure is not None:
            state["error_kind"] = kind
            state["error_meta"] = make_error_site(
                kind=kind,
                message=failure[1],
                tool_name=failure[0],
                available_tools=self.tools,
                tool_schema=self.schemas.get(failure[0]),
                intent=text,
            )
            self.stats.n_errors += 1
        self.stats.n_tool_use_blocks += state["student_action"].count("[TOOL_USE] name=")
        yield state
