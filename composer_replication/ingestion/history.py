"""Shared pieces of every ingester: the default system prompt, stats, message builders, media
placeholders and the options base class. Token-budget trimming lives in ``window.py`` and JSONL
reading in ``streaming.py``; both are re-exported here.

Histories are OpenAI-style chat messages (``system`` first; ``assistant`` messages carry
``tool_calls``; tool results are ``{"role": "tool", "tool_call_id", "content"}``). Within one
ingested file, message dicts are *shared* between the histories of successive states (each state
has its own list): copy a message before mutating it.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from typing import Any

from composer_replication.ingestion.streaming import iter_jsonl, read_jsonl
from composer_replication.ingestion.window import (
    HistoryWindow,
    estimate_tokens,
    trim_history,
    trim_window,
)

__all__ = [
    "SYSTEM_PROMPT",
    "NO_RESULT",
    "ERROR_PREFIX",
    "IngestionStats",
    "BaseIngester",
    "media_placeholder",
    "parts_to_text",
    "tool_call",
    "assistant_message",
    "tool_message",
    "estimate_tokens",
    "make_token_counter",
    "trim_history",
    "trim_window",
    "HistoryWindow",
    "gc_paused",
    "iter_jsonl",
    "read_jsonl",
]

SYSTEM_PROMPT = (
    "You are a senior software engineer working as a coding agent in a terminal environment. "
    "You solve the user's task by calling tools: read files before changing them, make small and "
    "correct edits, run the tests or the program to check your work, and read every tool result "
    "carefully. When a tool call fails, fix the call instead of repeating it. Answer concisely."
)
"""Synthetic system message put at ``messages[0]`` when a trace does not record its own."""

NO_RESULT = "[no result recorded]"
"""Content of the tool message standing in for a tool call whose result the trace never recorded."""

ERROR_PREFIX = "[ERROR] "
"""Prefix of a tool message whose result was flagged as an error (``is_error``)."""


@dataclass
class IngestionStats:
    """Counters of one ``ingest(path)`` call (``ingester.last_stats``).

    The first ten fields are the spec's; the rest break ``n_records_skipped`` down by reason and
    count the repairs the ingester made.
    """

    n_records_total: int = 0
    """Non-blank lines (or messages/steps for JSON formats) read."""
    n_records_skipped: int = 0
    """Records that contributed nothing (the sum of the ``skipped_*`` counters)."""
    n_states_emitted: int = 0
    """TraceStates yielded."""
    n_assistant_turns: int = 0
    """Assistant turns found (a turn with an empty action yields no state)."""
    n_tool_use_blocks: int = 0
    """Tool calls in the emitted actions."""
    n_text_blocks: int = 0
    """Non-empty text blocks in the emitted actions."""
    skipped_subagent: int = 0
    """Subagent files (``agent-*.jsonl``, ``subagents/``) skipped whole."""
    skipped_summary: int = 0
    """``summary`` (title) records."""
    skipped_truncated_lines: int = 0
    """Lines that did not decode as JSON (truncated, NUL-padded) and 0-byte files."""
    version_warnings: list[str] | None = None
    """One line per unknown record type or untested version (with the version seen)."""
    skipped_sidechain: int = 0
    """Records with ``isSidechain: true``."""
    skipped_meta: int = 0
    """``isMeta`` records and local-command user records (``<command-name>``, caveats...)."""
    skipped_noise: int = 0
    """system / progress / attachment / file-history-snapshot / queue-operation / title records."""
    skipped_unknown: int = 0
    """Records of unknown type and lines that are not JSON objects."""
    skipped_synthetic: int = 0
    """Assistant records written by the client, not the model (``model: "<synthetic>"``, API errors)."""
    skipped_duplicate: int = 0
    """Records whose uuid was already seen (resumed copies)."""
    n_errors: int = 0
    """States marked with an ``error_kind``."""
    n_missing_results: int = 0
    """Tool calls closed with the :data:`NO_RESULT` placeholder."""
    n_late_results: int = 0
    """Tool results dropped because their call was already closed by a placeholder."""
    n_orphan_results: int = 0
    """Tool results whose call is not in the history (dropped)."""
    n_compactions: int = 0
    """Compaction boundaries that reset the history."""
    n_media: int = 0
    """Images and documents replaced by a placeholder."""

    def __post_init__(self) -> None:
        if self.version_warnings is None:
            self.version_warnings = []

    def warn(self, message: str) -> None:
        """Add ``message`` to ``version_warnings`` unless it is already there."""
        assert self.version_warnings is not None
        if message not in self.version_warnings:
            self.version_warnings.append(message)

    def add(self, other: IngestionStats) -> None:
        """Add ``other``'s counters into this one (warnings merged without duplicates)."""
        for f in fields(self):
            if f.name == "version_warnings":
                for w in other.version_warnings or []:
                    self.warn(w)
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, Any]:
        """The counters as a plain dict."""
        return asdict(self)


def media_placeholder(block: dict) -> str:
    """A short stand-in for an image or document block: ``"[image: image/png, 148 KB]"``.

    The size is the decoded size of base64 data in kB (1000 bytes), at least 1.
    """
    kind = str(block.get("type") or "media")
    if kind == "image_url":
        url = block.get("image_url")
        url = url.get("url", "") if isinstance(url, dict) else str(url or "")
        media = url[5 : url.index(";")] if url.startswith("data:") and ";" in url else "url"
        data = url.partition(",")[2] if url.startswith("data:") else ""
        kind = "image"
    else:
        source = block.get("source") if isinstance(block.get("source"), dict) else {}
        media = str(source.get("media_type") or source.get("type") or "unknown")
        data = source.get("data") if isinstance(source.get("data"), str) else ""
    if not data:
        return f"[{kind}: {media}]"
    n_bytes = len(data) * 3 // 4 - data[-2:].count("=")
    return f"[{kind}: {media}, {max(1, round(n_bytes / 1000))} KB]"


def parts_to_text(content: Any, *, on_media: Callable[[], None] | None = None) -> str:
    """Flatten message content (a string, or a list of text / image / document parts) to text.

    Text parts (``text``, ``input_text``, ``output_text``) are joined with newlines; media parts
    become :func:`media_placeholder` strings (``on_media`` is called for each).
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        content = [content]
    if not isinstance(content, list):
        return str(content)
    out: list[str] = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
            continue
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind in ("image", "document", "image_url", "input_image", "input_file"):
            if on_media is not None:
                on_media()
            if kind == "input_image":
                part = {"type": "image_url", "image_url": part.get("image_url", "")}
            out.append(media_placeholder(part))
        elif isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind == "tool_reference":
            out.append(f"[tool reference: {part.get('tool_name', '')}]")
    return "\n".join(out)


def tool_call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    """An OpenAI tool call; ``arguments`` is kept verbatim when a string, JSON-dumped otherwise."""
    if not isinstance(arguments, str):
        arguments = json.dumps({} if arguments is None else arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def assistant_message(text: str, tool_calls: list[dict] | None = None) -> dict[str, Any]:
    """An assistant message; ``tool_calls`` is present only when non-empty."""
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def tool_message(call_id: str, content: str) -> dict[str, Any]:
    """A tool-result message answering ``call_id``."""
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def make_token_counter(tokenizer: Any = None) -> Callable[[str], int]:
    """Return ``count(text) -> int``.

    ``tokenizer`` may be ``None`` (:func:`estimate_tokens`), an object with ``encode`` (a Hugging
    Face tokenizer: special tokens are not added), or a callable returning an int or a token list.
    """
    if tokenizer is None:
        return estimate_tokens
    if hasattr(tokenizer, "encode"):

        def count(text: str) -> int:
            try:
                return len(tokenizer.encode(text, add_special_tokens=False))
            except TypeError:
                return len(tokenizer.encode(text))

        return count
    if callable(tokenizer):

        def count_callable(text: str) -> int:
            out = tokenizer(text)
            return out if isinstance(out, int) else len(out)

        return count_callable
    raise ValueError(
        f"tokenizer={type(tokenizer).__name__} is neither None, an object with .encode(text) nor a "
        "callable text -> int | list; pass a Hugging Face tokenizer or a counting function"
    )


# ---------------------------------------------------------------------------- reading files
@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while one file is indexed (restored on exit; no yield to the
    caller happens inside). Indexing creates many long-lived containers that every collection would
    rescan for nothing; this alone is ~15% of the ingestion time of a large session."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class BaseIngester:
    """The options every ingester shares, validated once.

    Args:
        system_prompt: the system message of each state's history (formats that record their own
            system prompt keep it; see each ingester).
        strip_thinking: drop thinking blocks from the history (``student_action`` keeps them).
        max_history_tokens: drop the oldest non-system messages until the history fits (``None``:
            keep whole histories). Counted with ``tokenizer`` when given, else estimated.
        tokenizer: anything with ``encode(str) -> list[int]`` (a Hugging Face tokenizer).

    Raises:
        ValueError: ``max_history_tokens`` is not a positive number (or ``None``).
    """

    source = ""

    def __init__(
        self,
        *,
        system_prompt: str = SYSTEM_PROMPT,
        strip_thinking: bool = True,
        max_history_tokens: int | None = None,
        tokenizer: Any = None,
    ) -> None:
        if max_history_tokens is not None and max_history_tokens <= 0:
            raise ValueError(
                f"max_history_tokens={max_history_tokens} must be a positive number of tokens, "
                "or None to keep whole histories"
            )
        self.system_prompt = system_prompt
        self.strip_thinking = strip_thinking
        self.max_history_tokens = max_history_tokens
        self._count = make_token_counter(tokenizer)
        self.last_stats = IngestionStats()
