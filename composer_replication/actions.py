"""Agent actions as text: one rendering shared by ingestion, teacher replay and rollouts.

An *action* is what an agent emits in one assistant turn: text, thinking and tool calls, in order.
Every part of the project speaks about actions in one textual form so that a student's recorded
action, a teacher's replayed action and a freshly sampled rollout can be compared:

    [THINKING] I should look at the file first. [/THINKING]
    Let me read it.
    [TOOL_USE] name=Read input={"file_path": "/repo/a.py"}

- ``[THINKING] ... [/THINKING]`` blocks carry reasoning (kept in the recorded action, stripped from
  histories); the closing marker lets text that follows a thinking block be told apart from it.
- ``[TOOL_USE] name=NAME input=JSON`` carries one tool call; ``JSON`` is the arguments object as
  written by :func:`format_tool_use` (or the raw argument text when it was not valid JSON).
- Everything else is plain text.

:func:`parse_action` reads the form back; :func:`canonical_action` gives the form used to judge
agreement (whitespace-normalized text, tool calls by name and canonical JSON arguments).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["ActionBlock", "format_tool_use", "render_action", "parse_action", "canonical_action",
           "tool_calls_to_action"]

TOOL_USE_PREFIX = "[TOOL_USE] name="
THINKING_PREFIX = "[THINKING]"
THINKING_SUFFIX = "[/THINKING]"
_BLOCK_START = re.compile(r"^(\[TOOL_USE\] name=|\[THINKING\])", re.MULTILINE)
_WS = re.compile(r"\s+")


@dataclass
class ActionBlock:
    """One block of an action: ``kind`` ``"text"`` / ``"thinking"`` / ``"tool_use"``; ``text`` (for a tool call,
    the raw argument text); ``name`` and ``arguments`` (parsed; ``None`` when not valid JSON) for a tool call."""

    kind: Literal["text", "thinking", "tool_use"]
    text: str = ""
    name: str = ""
    arguments: Any = None

    @property
    def arguments_valid(self) -> bool:
        """True when a tool call's arguments parsed as a JSON object."""
        return self.kind == "tool_use" and isinstance(self.arguments, dict)


def format_tool_use(name: str, arguments: Any) -> str:
    """One tool call as ``[TOOL_USE] name=NAME input=JSON``: a dict is dumped (keys in their order); a string
    (an OpenAI-style JSON string) is kept verbatim, so invalid JSON survives as written."""
    if isinstance(arguments, str):
        payload = arguments.strip() or "{}"
    else:
        payload = json.dumps({} if arguments is None else arguments, ensure_ascii=False)
    return f"{TOOL_USE_PREFIX}{name} input={payload}"


def format_thinking(text: str) -> str:
    """One thinking block as ``[THINKING] text [/THINKING]``."""
    return f"{THINKING_PREFIX} {text.strip() + ' ' if text.strip() else ''}{THINKING_SUFFIX}"


def render_action(blocks: list[ActionBlock]) -> str:
    """Join blocks into the action text, one block per paragraph, in order."""
    return "\n".join(
        format_tool_use(b.name, b.arguments if b.arguments is not None else b.text) if b.kind == "tool_use"
        else format_thinking(b.text) if b.kind == "thinking" else b.text.strip()
        for b in blocks if b.kind != "text" or b.text.strip()
    )  # fmt: skip


def tool_calls_to_action(content: str | None, tool_calls: list[dict] | None) -> str:
    """Render an OpenAI-style assistant message (``content`` + ``tool_calls``) as action text."""
    calls = [c.get("function", c) for c in tool_calls or []]
    return render_action([ActionBlock("text", content or ""), *(
        ActionBlock("tool_use", text=str(fn.get("arguments", "")), name=str(fn.get("name", ""))) for fn in calls)])


def _split_tool_payload(rest: str) -> tuple[str, str, str]:
    """Split ``NAME input=PAYLOAD...`` into (name, payload, trailing text after the JSON value)."""
    name, sep, after = rest.partition(" input=")
    if not sep:
        return rest.strip(), "", ""
    after = after.lstrip()
    try:
        _, end = json.JSONDecoder().raw_decode(after)
        return name.strip(), after[:end], after[end:]
    except json.JSONDecodeError:
        return name.strip(), after.rstrip(), ""


def parse_action(text: str) -> list[ActionBlock]:
    """Parse action text (:func:`render_action`'s form) back into blocks, tolerantly: text before the first
    marker, or after a tool call's JSON value, is a text block; a ``[TOOL_USE]`` whose payload is not valid
    JSON keeps it raw in ``text`` with ``arguments=None``."""
    blocks: list[ActionBlock] = []
    starts = [m.start() for m in _BLOCK_START.finditer(text)]
    if not starts or starts[0] > 0:
        head = text[: starts[0]] if starts else text
        if head.strip():
            blocks.append(ActionBlock("text", head.strip()))
    for i, s in enumerate(starts):
        chunk = text[s : starts[i + 1] if i + 1 < len(starts) else len(text)]
        if chunk.startswith(THINKING_PREFIX):
            body, closed, rest = chunk[len(THINKING_PREFIX) :].partition(THINKING_SUFFIX)
            blocks.append(ActionBlock("thinking", body.strip()))
            if closed and rest.strip():
                blocks.append(ActionBlock("text", rest.strip()))
            continue
        name, payload, trailing = _split_tool_payload(chunk[len(TOOL_USE_PREFIX) :])
        try:
            args = json.loads(payload) if payload else None
        except json.JSONDecodeError:
            args = None
        blocks.append(ActionBlock("tool_use", text=payload, name=name, arguments=args))
        if trailing.strip():
            blocks.append(ActionBlock("text", trailing.strip()))
    return blocks


def canonical_action(text: str, *, include_thinking: bool = False) -> str:
    """The form used to judge whether two actions agree: text whitespace-normalized, tool calls by name and
    canonical JSON arguments (sorted keys, compact), so key order and spacing do not matter; thinking ignored
    unless ``include_thinking``."""
    out: list[str] = []
    for b in parse_action(text):
        if b.kind == "thinking":
            if include_thinking:
                out.append("[THINKING] " + _WS.sub(" ", b.text).strip())
        elif b.kind == "tool_use":
            if b.arguments is not None:
                args = json.dumps(b.arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            else:
                args = _WS.sub(" ", b.text).strip()
            out.append(f"[TOOL_USE] {b.name} {args}")
        else:
            norm = _WS.sub(" ", b.text).strip()
            if norm:
                out.append(norm)
    return "\n".join(out)
