"""Shared pieces of every ingester: the default system prompt, stats, message builders, media
placeholders and token-budget trimming of histories.

Histories are OpenAI-style chat messages (``system`` first; ``assistant`` messages carry
``tool_calls``; tool results are ``{"role": "tool", "tool_call_id", "content"}``). Within one
ingested file, message dicts are *shared* between the histories of successive states (each state
has its own list): copy a message before mutating it.
"""

from __future__ import annotations

import gc
import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

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


def estimate_tokens(text: str) -> int:
    """Rough token count when no tokenizer is given: ``ceil(len(text) / 4)``."""
    return math.ceil(len(text) / 4)


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


_MESSAGE_OVERHEAD = 4  # role markers of a chat template, roughly


def _message_tokens(msg: dict, count: Callable[[str], int]) -> int:
    text = msg.get("content") or ""
    if not isinstance(text, str):
        text = json.dumps(text, ensure_ascii=False)
    n = count(text) + _MESSAGE_OVERHEAD if text else _MESSAGE_OVERHEAD
    for call in msg.get("tool_calls") or ():
        fn = call.get("function", {})
        n += count(f"{fn.get('name', '')} {fn.get('arguments', '')}")
    return n


def trim_history(
    messages: list[dict],
    max_tokens: int,
    count: Callable[[str], int] = estimate_tokens,
    cache: dict[int, tuple[dict, int]] | None = None,
) -> list[dict]:
    """Drop the oldest non-system messages until ``messages`` fits in ``max_tokens``.

    Leading system messages are always kept. An assistant message with ``tool_calls`` and the tool
    messages answering it are dropped together, so no tool message outlives its call. ``cache``
    (keyed by ``id(message)``) saves recounting messages shared between histories. Returns a new list
    (the input when it already fits); it may hold only the system messages when even the newest
    message alone does not fit.
    """
    return trim_window(messages, len(messages), max_tokens, count, cache)


def trim_window(
    messages: list[dict],
    end: int,
    max_tokens: int,
    count: Callable[[str], int] = estimate_tokens,
    cache: dict[int, tuple[dict, int]] | None = None,
) -> list[dict]:
    """:func:`trim_history` of ``messages[:end]``, reading only the messages it keeps (newest first),
    so a bounded history costs O(kept), not O(end), however long the session."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens={max_tokens} must be a positive token budget (or None to keep all)")

    def size(m: dict) -> int:
        hit = cache.get(id(m)) if cache is not None else None
        if hit is not None and hit[0] is m:
            return hit[1]
        n = _message_tokens(m, count)
        if cache is not None:
            cache[id(m)] = (m, n)  # keeps m alive, so its id is not reused
        return n

    head = 0
    while head < end and messages[head].get("role") == "system":
        head += 1
    budget = max_tokens - sum(size(m) for m in messages[:head])
    total, start = 0, end
    get = cache.get if cache is not None else {}.get
    while start > head:
        m = messages[start - 1]
        hit = get(id(m))
        n = hit[1] if hit is not None and hit[0] is m else size(m)  # inlined cache hit: the hot loop
        if total + n > budget:
            break
        total += n
        start -= 1
    if start == head:
        return messages if end == len(messages) else messages[:end]
    while start < end and messages[start].get("role") == "tool":  # its assistant call was dropped
        start += 1
    return messages[:head] + messages[start:end]


class HistoryWindow:
    """:func:`trim_window` made incremental for histories that grow in place (Claude Code ingestion).

    Consecutive calls on the same list with a growing ``end`` only count the new messages and slide
    the start forward, so a session costs O(messages) token counts in all, not O(messages) per state.
    Call :meth:`replaced` when an element below a previous ``end`` is replaced in place; the next call
    on that list is then computed from scratch. Results equal :func:`trim_window`'s.
    """

    def __init__(self, max_tokens: int, count: Callable[[str], int] = estimate_tokens) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens={max_tokens} must be a positive token budget (or None to keep all)")
        self.max_tokens, self.count = max_tokens, count
        self.cache: dict[int, tuple[dict, int]] = {}
        self._last: dict[int, tuple[list, int, int, int, int]] = {}  # id -> (list, end, head, start, total)
        self._dirty: dict[int, int] = {}

    def replaced(self, lst: list, index: int) -> None:
        """Note that ``lst[index]`` was replaced in place."""
        key = id(lst)
        self._dirty[key] = min(index, self._dirty.get(key, index))

    def _size(self, m: dict) -> int:
        hit = self.cache.get(id(m))
        if hit is not None and hit[0] is m:
            return hit[1]
        n = _message_tokens(m, self.count)
        self.cache[id(m)] = (m, n)
        return n

    def __call__(self, lst: list[dict], end: int) -> list[dict]:
        """The trimmed ``lst[:end]`` (a new list)."""
        key = id(lst)
        last = self._last.get(key)
        dirty = self._dirty.pop(key, None)
        if last is None or last[0] is not lst or end < last[1] or (dirty is not None and dirty < last[1]):
            head = 0
            while head < end and lst[head].get("role") == "system":
                head += 1
            budget = self.max_tokens - sum(self._size(m) for m in lst[:head])
            start, total, prev_end = head, 0, head
        else:
            _, prev_end, head, start, total = last
            budget = self.max_tokens - sum(self._size(m) for m in lst[:head])
        size = self._size
        for i in range(prev_end, end):
            total += size(lst[i])
        while total > budget and start < end:
            total -= size(lst[start])
            start += 1
        while start < end and lst[start].get("role") == "tool":  # its assistant call was dropped
            total -= size(lst[start])
            start += 1
        self._last[key] = (lst, end, head, start, total)
        return lst[:end] if start == head else lst[:head] + lst[start:end]


# ---------------------------------------------------------------------------- reading JSONL
_DECODER = json.JSONDecoder()


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


def iter_jsonl(path: Path, stats: IngestionStats) -> Iterator[Any]:
    """Decode a JSONL file line by line, never raising on bad content.

    Invalid UTF-8 bytes are replaced (U+FFFD). Blank lines are ignored; lines that do not decode
    (truncated, NUL garbage) are counted in ``stats.skipped_truncated_lines`` (and in
    ``n_records_total``); a 0-byte file counts as one truncated line. Yields the decoded values (any
    JSON type) in file order.
    """
    data = path.read_bytes()
    if not data:
        stats.skipped_truncated_lines += 1
        return
    # fast path: strict UTF-8 decode + the decoder's raw_decode (json.loads on bytes re-detects the
    # encoding and runs two whitespace regexes per line); anything unusual takes the slow path
    raw_decode, find = _DECODER.raw_decode, data.find
    start, size = 0, len(data)
    while start < size:  # bytes lines, one at a time (a split list would hold a second copy of the file)
        end = find(b"\n", start)
        if end < 0:
            end = size
        raw = data[start:end]
        start = end + 1
        if not raw:
            continue
        try:
            text = raw.decode()
            value, stop = raw_decode(text)
            if stop == len(text) or not text[stop:].strip():
                yield value
                continue
        except ValueError:  # includes UnicodeDecodeError
            pass
        value = _slow_line(raw, stats)
        if value is not _BAD:
            yield value


_BAD = object()


def _slow_line(raw: bytes, stats: IngestionStats) -> Any:
    """Decode one unusual line (bad bytes, NUL padding, leading blanks) or count it as truncated."""
    line = raw.decode("utf-8", errors="replace")
    stripped = line.strip(" \t\r\n\x00")
    if not stripped:
        if "\x00" in line:
            stats.n_records_total += 1
            stats.skipped_truncated_lines += 1
        return _BAD
    try:
        return json.loads(stripped)
    except ValueError:
        stats.n_records_total += 1
        stats.skipped_truncated_lines += 1
        return _BAD


def read_jsonl(path: Path, stats: IngestionStats) -> list[Any]:
    """:func:`iter_jsonl` as a list."""
    return list(iter_jsonl(path, stats))


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

