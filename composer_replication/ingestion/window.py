"""Token budgets of histories: drop the oldest messages until a history fits.

A budget never splits a tool call from its results (an assistant message with ``tool_calls`` and the
tool messages answering it are dropped together) and always keeps the leading system messages.
:func:`trim_history` trims one list; :class:`HistoryWindow` does it incrementally for histories that
grow in place, so a long session costs O(messages) token counts in all.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

__all__ = ["estimate_tokens", "trim_history", "trim_window", "HistoryWindow"]


def estimate_tokens(text: str) -> int:
    """Rough token count when no tokenizer is given: ``ceil(len(text) / 4)``."""
    return math.ceil(len(text) / 4)


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
