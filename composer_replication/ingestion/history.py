"""What every ingester shares: the system prompt, the stats, message builders, history budgets, and the base
class that builds each state (its id, redaction, the spec's keys). Histories are OpenAI-style messages
(``system`` first; ``assistant`` ones carry ``tool_calls``; results are ``{"role": "tool", "tool_call_id",
"content"}``); message dicts are *shared* between the histories of one file: copy one before mutating it.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from composer_replication.ingestion.redact import Redactor
from composer_replication.types import HintContext, TraceState, trace_state

logger = logging.getLogger("composer_replication.ingestion")

SYSTEM_PROMPT = (
    "You are a senior software engineer working as a coding agent in a terminal environment. "
    "You solve the user's task by calling tools: read files before changing them, make small and "
    "correct edits, run the tests or the program to check your work, and read every tool result "
    "carefully. When a tool call fails, fix the call instead of repeating it. Answer concisely."
)
"""The spec's synthetic system message, put at ``messages[0]`` when a trace does not record its own."""

NO_RESULT = "[no result recorded]"  # the tool message answering a call whose result the trace never recorded
ERROR_PREFIX = "[ERROR] "  # opens a tool message whose result was flagged as an error (is_error)
Turn = tuple[list[dict[str, Any]], str, list[str], "HintContext | None"]  # history, recorded action, tools, site


@dataclass
class IngestionStats:
    """Counters of one ``ingest(path)`` call (``ingester.last_stats``); the first ten fields are the spec's."""

    n_records_total: int = 0  # non-blank lines (messages or steps for JSON formats) read
    n_records_skipped: int = 0  # records that contributed nothing: the skipped_* counters but subagent files
    n_states_emitted: int = 0
    n_assistant_turns: int = 0  # a turn with an empty action yields no state
    n_tool_use_blocks: int = 0  # tool calls in the emitted actions
    n_text_blocks: int = 0  # non-empty text blocks in the emitted actions (linear formats: turns with text)
    skipped_subagent: int = 0  # subagent files (agent-*.jsonl, subagents/) skipped whole
    skipped_summary: int = 0  # summary (title) records
    skipped_truncated_lines: int = 0  # lines that do not decode (truncated, NUL-padded) and 0-byte files
    version_warnings: list[str] | None = None  # unknown record types and untested versions, each once
    skipped_sidechain: int = 0  # isSidechain records
    skipped_meta: int = 0  # isMeta and local-command records, demonstrations, other agents' messages
    skipped_noise: int = 0  # system / progress / attachment / snapshot / title / UI-event records
    skipped_unknown: int = 0  # unknown record types and lines that are not JSON objects
    skipped_synthetic: int = 0  # assistant records written by the client (model "<synthetic>", API errors)
    skipped_duplicate: int = 0  # records whose uuid was already seen (resumed copies)
    n_errors: int = 0  # states marked with an error_kind
    n_missing_results: int = 0  # tool calls answered with the NO_RESULT placeholder
    n_late_results: int = 0  # results dropped because their call was already closed by a placeholder
    n_orphan_results: int = 0  # results whose call is not in the history
    n_compactions: int = 0  # compaction boundaries that reset the history
    n_media: int = 0  # images and documents replaced by a placeholder
    redactions: dict[str, int] = field(default_factory=dict)  # distinct secrets replaced, per kind

    def __post_init__(self) -> None:
        self.version_warnings = [] if self.version_warnings is None else self.version_warnings

    def warn(self, message: str) -> None:
        """Add ``message`` to ``version_warnings`` unless it is already there."""
        if message not in self.version_warnings:  # type: ignore[operator]
            self.version_warnings.append(message)  # type: ignore[union-attr]

    def add(self, other: IngestionStats) -> None:
        """Add ``other``'s counters into this one (warnings merged without duplicates)."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, list):
                mine.extend(w for w in theirs or [] if w not in mine)
            elif isinstance(mine, dict):
                mine.update({k: mine.get(k, 0) + v for k, v in theirs.items()})
            else:
                setattr(self, f.name, mine + theirs)


def media_placeholder(block: dict) -> str:
    """A stand-in for an image or document block: ``"[image: image/png, 148 KB]"`` (decoded base64 size)."""
    kind = str(block.get("type") or "media")
    if kind == "image_url":
        url = block.get("image_url")
        url = url.get("url", "") if isinstance(url, dict) else str(url or "")
        media = url[5 : url.index(";")] if url.startswith("data:") and ";" in url else "url"
        data, kind = (url.partition(",")[2] if url.startswith("data:") else ""), "image"
    else:
        source = block.get("source") if isinstance(block.get("source"), dict) else {}
        media = str(source.get("media_type") or source.get("type") or "unknown")
        data = source.get("data") if isinstance(source.get("data"), str) else ""
    if not data:
        return f"[{kind}: {media}]"
    n_bytes = len(data) * 3 // 4 - data[-2:].count("=")
    return f"[{kind}: {media}, {max(1, round(n_bytes / 1000))} KB]"


def parts_to_text(content: Any, stats: IngestionStats | None = None) -> str:
    """Message content (a string or parts) as text: parts joined by newlines, media as placeholders (``n_media``)."""
    if not isinstance(content, (list, dict)):
        return "" if content is None else str(content)
    out: list[str] = []
    for part in [content] if isinstance(content, dict) else content:
        if isinstance(part, str):
            out.append(part)
        elif not isinstance(part, dict):
            continue
        elif part.get("type") in ("image", "document", "image_url", "input_image", "input_file"):
            if stats is not None:
                stats.n_media += 1
            if part["type"] == "input_image":
                part = {"type": "image_url", "image_url": part.get("image_url", "")}
            out.append(media_placeholder(part))
        elif isinstance(part.get("text"), str):
            out.append(part["text"])
        elif part.get("type") == "tool_reference":
            out.append(f"[tool reference: {part.get('tool_name', '')}]")
    return "\n".join(out)


def tool_call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    """An OpenAI tool call; ``arguments`` is kept verbatim when a string, JSON-dumped otherwise."""
    if not isinstance(arguments, str):
        arguments = json.dumps({} if arguments is None else arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_message(call_id: str, content: str) -> dict[str, Any]:
    """A tool-result message answering ``call_id``."""
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def estimate_tokens(text: str) -> int:
    """Rough token count when no tokenizer is given: ``ceil(len(text) / 4)``."""
    return math.ceil(len(text) / 4)


def make_token_counter(tokenizer: Any = None) -> Callable[[str], int]:
    """``count(text) -> int``: :func:`estimate_tokens` for None, ``len(tokenizer.encode(text))`` (no special
    tokens) for a Hugging Face tokenizer, or a callable returning an int or a token list."""
    if tokenizer is None:
        return estimate_tokens
    if hasattr(tokenizer, "encode"):
        try:
            tokenizer.encode("x", add_special_tokens=False)
            return lambda text: len(tokenizer.encode(text, add_special_tokens=False))
        except TypeError:  # an encode without add_special_tokens
            return lambda text: len(tokenizer.encode(text))
    if callable(tokenizer):
        return lambda text: out if isinstance(out := tokenizer(text), int) else len(out)
    raise ValueError(f"tokenizer={type(tokenizer).__name__} is neither None, an object with .encode(text) nor a "
                     "callable text -> int | list; pass a Hugging Face tokenizer or a counting function")  # fmt: skip


def _message_tokens(msg: dict, count: Callable[[str], int]) -> int:
    text = msg.get("content") or ""
    text = text if isinstance(text, str) else json.dumps(text, ensure_ascii=False)
    calls = [c.get("function", {}) for c in msg.get("tool_calls") or ()]
    return (count(text) if text else 0) + 4 + sum(count(f"{fn.get('name', '')} {fn.get('arguments', '')}") for fn in calls)


def trim_history(messages: list[dict], max_tokens: int, count: Callable[[str], int] = estimate_tokens,
                 cache: dict[int, tuple[dict, int]] | None = None, *, end: int | None = None) -> list[dict]:  # fmt: skip
    """Drop the oldest non-system messages of ``messages[:end]`` until it fits in ``max_tokens`` (leading system
    messages kept; a call and its results go together). Only the kept messages are read, newest first: O(kept)
    however long the session; ``cache`` (``id(m) -> (m, tokens)``) shares counts between histories. Returns
    ``messages`` itself when it fits whole.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens={max_tokens} must be a positive token budget (or None to keep all)")
    end = len(messages) if end is None else end
    cache = {} if cache is None else cache

    def size(m: dict) -> int:
        hit = cache.get(id(m))
        if hit is None or hit[0] is not m:
            hit = cache[id(m)] = (m, _message_tokens(m, count))  # keeps m alive: its id is not reused
        return hit[1]

    head = 0
    while head < end and messages[head].get("role") == "system":
        head += 1
    budget, total, start, get = max_tokens - sum(size(m) for m in messages[:head]), 0, end, cache.get
    while start > head:  # the hot loop: the cache hit inlined
        hit = get(id(m := messages[start - 1]))
        if (total := total + (hit[1] if hit is not None and hit[0] is m else size(m))) > budget:
            break
        start -= 1
    if start == head:
        return messages if end == len(messages) else messages[:end]
    while start < end and messages[start].get("role") == "tool":  # its assistant call was dropped
        start += 1
    return messages[:head] + messages[start:end]


class BaseIngester:
    """The options every ingester shares, validated once, and the one place a state is built.

    Args:
        system_prompt: the system message of each history (formats that record their own keep it).
        strip_thinking: keep thinking out of histories (the action keeps it); False: ``[THINKING] ...`` text.
        max_history_tokens: drop the oldest messages until a history fits (:func:`trim_history`); None: all.
        tokenizer: counts those tokens (a Hugging Face tokenizer or ``text -> int | list``); None: len / 4.
        redact: replace secrets in every message, tool call, result, action and error site (``ingestion.redact``).

    ``ValueError`` when ``max_history_tokens`` is not a positive number (or ``None``), or for a bad ``tokenizer``.
    """

    source = ""

    def __init__(self, *, system_prompt: str = SYSTEM_PROMPT, strip_thinking: bool = True,
                 max_history_tokens: int | None = None, tokenizer: Any = None, redact: bool = True) -> None:  # fmt: skip
        if max_history_tokens is not None and max_history_tokens <= 0:
            raise ValueError(f"max_history_tokens={max_history_tokens} must be a positive number of tokens, "
                             "or None to keep whole histories")  # fmt: skip
        self.system_prompt, self.strip_thinking, self.redact = system_prompt, strip_thinking, redact
        self.max_history_tokens = max_history_tokens
        self._count = make_token_counter(tokenizer)
        self.last_stats = IngestionStats()

    def trim(self, messages: list[dict], cache: dict, end: int | None = None) -> list[dict]:
        """``messages[:end]`` within ``max_history_tokens`` (a new list)."""
        budget = self.max_history_tokens
        out = messages if budget is None else trim_history(messages, budget, self._count, cache, end=end)
        return messages[:end] if out is messages else out

    def ingest(self, path: str | Path) -> Iterator[TraceState]:
        """Yield one TraceState per assistant turn of ``path``, ``state_id = f"{path.stem}::{idx:04d}"``; fresh
        ``self.last_stats`` filled as the file streams. A file that yields no state logs a warning;
        ``NestingTooDeep`` when the file nests deeper than Python's recursion limit."""
        path = Path(path)
        stats = self.last_stats = IngestionStats()
        redact = Redactor(stats.redactions).text if self.redact else str
        for messages, action, tools, site in self._turns(path, stats, redact):
            state_id = f"{path.stem}::{stats.n_states_emitted:04d}"
            stats.n_states_emitted += 1
            yield trace_state(state_id, messages, action, tools=tools, source=self.source,
                              error_kind=site["error_kind"] if site else None, error_meta=site)  # fmt: skip
        stats.n_records_skipped = sum(getattr(stats, f.name) for f in fields(stats)
                                      if f.name.startswith("skipped_") and f.name != "skipped_subagent")  # fmt: skip
        if not stats.n_states_emitted and not stats.skipped_subagent:
            logger.warning("%s: no states (%d records read, %d skipped)", path, stats.n_records_total,
                           stats.n_records_skipped)  # fmt: skip

    def _turns(self, path: Path, stats: IngestionStats, redact: Callable[[str], str]) -> Iterator[Turn]:
        """The file's turns; every text read from it goes through ``redact`` once, as it is read."""
        raise NotImplementedError
