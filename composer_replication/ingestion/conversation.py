"""One linear conversation -> turns, streamed: the builder behind the Codex, OpenAI and SWE-agent ingesters.

Messages are normalized chat messages plus private keys: ``_thinking`` (in the action, out of the history),
``_action`` / ``_intent`` (a format that renders its own action), ``_observation`` on a user message (the open
turn's result, for its error site), ``{"role": "_reset", "messages": [...]}`` (a compaction). A turn is yielded
once its results are known; what leaves the ``max_history_tokens`` window is dropped for good (memory bounded by
the budget); every call is answered before the next user or assistant message (:data:`NO_RESULT` if unrecorded).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from composer_replication.actions import ActionBlock, render_action, tool_calls_to_action
from composer_replication.ingestion import errors
from composer_replication.ingestion.history import NO_RESULT, BaseIngester, IngestionStats, Turn, tool_message


def offered(messages: Iterable[dict], declared: Iterable[str] = ()) -> list[str]:
    """The tools a conversation (normalized messages, one pass) offered, sorted: ``declared`` ones, plus those
    called at least once without being answered by a ``tool_not_found`` error."""
    pending: dict[str, str] = {}
    good, bad, declared = set(), set(), set(declared)
    for m in messages:
        if m["role"] == "tool":
            cid = m.get("tool_call_id") or next(iter(pending), None)
            if cid in pending:
                text = m["content"]
                refused = errors.looks_like_error(text) and errors.classify_tool_error(text) == "tool_not_found"
                (bad if refused else good).add(pending.pop(cid))
            continue
        good.update(pending.values())  # unanswered calls count as offered
        pending = {c["id"]: c["function"]["name"] for c in m.get("tool_calls") or ()} if m["role"] == "assistant" else {}
    return sorted(declared | good | set(pending.values()) | (bad & declared))


class Conversation:
    """The history, open turn and pending calls of one conversation (``tools``: :func:`offered`); :meth:`build`
    yields its turns. A tool message whose call is unknown or closed becomes a user message with
    ``orphans_as_user`` (OpenAI), else it is dropped (Codex); ``redact`` applies once to every text fed."""

    def __init__(self, cfg: BaseIngester, stats: IngestionStats, tools: list[str], redact: Callable[[str], str], *,
                 schemas: dict[str, dict] | None = None, orphans_as_user: bool = True) -> None:  # fmt: skip
        self.cfg, self.stats, self.tools, self.schemas, self.redact = cfg, stats, tools, schemas or {}, redact
        self.orphans_as_user = orphans_as_user
        self.hist: list[dict] = []
        self.cache: dict = {}
        self.pending: dict[str, str] = {}  # call id -> tool name, calls of the open turn
        self.unanswered: set[str] = set()  # ids closed with NO_RESULT (a later result is "late")
        self.turn: tuple[list[dict], str, str] | None = None  # (history, action, intent) of the open turn
        self.calls: list[tuple[str, str]] = []  # (call id, tool name) of the open turn, in call order
        self.results: dict[str, str] = {}  # call id -> result text, for the open turn
        self.repeats = errors.RepeatTracker()

    def build(self, messages: Iterable[dict]) -> Iterator[Turn]:
        """The turns of ``messages`` (normalized), one per assistant message with a non-empty action; the
        conversation's own leading system message is kept, ``system_prompt`` added only without one."""
        for i, m in enumerate(messages):
            if i == 0 and m["role"] != "system":
                self.hist.append({"role": "system", "content": self.cfg.system_prompt})
            yield from self.feed(m)
        self.hist = self.hist or [{"role": "system", "content": self.cfg.system_prompt}]
        yield from self.flush()

    def feed(self, m: dict) -> Iterator[Turn]:
        m, st = _redacted(m, self.redact), self.stats
        if m["role"] == "tool":
            cid = m.get("tool_call_id") or next(iter(self.pending), None)
            if cid in self.pending:
                del self.pending[cid]
                self.hist.append(tool_message(cid, m["content"]))
                self.results[cid] = m["content"]
            else:
                st.n_late_results += cid in self.unanswered
                st.n_orphan_results += self.orphans_as_user or cid not in self.unanswered
                if self.orphans_as_user:
                    self.hist.append({"role": "user", "content": m["content"]})
            return
        if m.get("_observation") and self.turn is not None:
            self.calls.append(("_obs", ""))
            self.results["_obs"] = m["content"]
        self.close_calls()
        yield from self.flush()
        if m["role"] == "_reset":
            st.n_compactions += 1
            self.hist = self.hist[:1] + list(m["messages"])
        elif m["role"] != "assistant":
            self.hist.append({"role": m["role"], "content": m["content"]})
        else:
            self._assistant(m)

    def _assistant(self, m: dict) -> None:
        calls, thinking, content = m.get("tool_calls") or [], m.get("_thinking"), m["content"]
        blocks = [ActionBlock("thinking", thinking)] if thinking else []
        action = m["_action"] if "_action" in m else render_action(
            [*blocks, ActionBlock("text", tool_calls_to_action(content, calls))])  # fmt: skip
        self.stats.n_assistant_turns += 1
        self.turn = (self._snapshot(), action, m.get("_intent", content))
        if thinking and not self.cfg.strip_thinking:
            content = render_action(blocks) + ("\n" + content if content else "")
        if content or calls:
            self.hist.append({"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})})
        self.calls = [(c["id"], c["function"]["name"]) for c in calls]
        self.pending = dict(self.calls)

    def close_calls(self) -> None:
        """Answer every pending call with the :data:`NO_RESULT` placeholder."""
        self.hist.extend(tool_message(cid, NO_RESULT) for cid in self.pending)
        self.unanswered.update(self.pending)
        self.stats.n_missing_results += len(self.pending)
        self.pending = {}

    def _snapshot(self) -> list[dict]:
        """The (trimmed) history so far; what left the window is dropped from the history for good."""
        hist = self.hist
        messages = self.cfg.trim(hist, self.cache)
        if dropped := len(hist) - len(messages):
            head = next((i for i, m in enumerate(hist) if m.get("role") != "system"), len(hist))
            if head + dropped >= len(hist) or hist[head + dropped].get("role") != "system":
                for gone in hist[head : head + dropped]:
                    self.cache.pop(id(gone), None)
                del hist[head : head + dropped]
        return messages

    def flush(self) -> Iterator[Turn]:
        """Yield the open turn (its results are final) with its error site: its first call, in call order,
        whose result looks like an error."""
        if self.turn is None:
            return
        (messages, action, intent), calls, results = self.turn, self.calls, self.results
        self.turn, self.calls, self.results = None, [], {}
        if not action:
            return
        failure = next(((name, results[c], errors.classify_tool_error(results[c])) for c, name in calls
                        if c in results and errors.looks_like_error(results[c])), None)  # fmt: skip
        kind, site = self.repeats.observe(failure), None
        if kind is not None and failure is not None:
            site = errors.error_site(kind=kind, message=failure[1], tool_name=failure[0], available_tools=self.tools,
                              tool_schema=self.schemas.get(failure[0]), intent=intent)  # fmt: skip
            self.stats.n_errors += 1
        self.stats.n_tool_use_blocks += action.count("[TOOL_USE] name=")
        self.stats.n_text_blocks += bool(intent.strip())
        yield messages, action, self.tools, site


def _redacted(m: dict, redact: Callable[[str], str]) -> dict:
    out = {k: redact(v) if k in ("content", "_thinking", "_action", "_intent") and isinstance(v, str) else v
           for k, v in m.items()}  # fmt: skip
    if m.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": redact(c["function"]["arguments"])}}
                             for c in m["tool_calls"]]  # fmt: skip
    if m["role"] == "_reset":
        out["messages"] = [_redacted(x, redact) for x in m["messages"]]
    return out


def normalized(stats: IngestionStats, raw: Iterable[Any], normalize: Callable[[Any], dict | None]) -> Iterator[dict]:
    """``normalize(m)`` of each raw message, counted in ``n_records_total`` (refused ones in ``skipped_unknown``)."""
    for m in raw:
        stats.n_records_total += 1
        if (nm := normalize(m)) is None:
            stats.skipped_unknown += 1
        else:
            yield nm
