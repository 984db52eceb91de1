"""How a trace state becomes a teacher request, and how the teacher's reply becomes action text.

Request: the state's history is rendered into plain ``system`` / ``user`` / ``assistant`` text
messages. Assistant turns become their action text (``[TOOL_USE] name=... input={json}`` lines via
:func:`composer_replication.actions.tool_calls_to_action`); tool results become user messages that
start with ``[TOOL_RESULT]``. No ``tool_calls`` or ``tool`` roles are sent, because several endpoints
reject them without matching ``tools`` definitions. Consecutive messages of the same role are merged
(blank line between) so that roles alternate, which strict chat templates require. A system message
that explains the action format and asks for the next action only is put first (merged with the
trace's own system prompt, which follows it).

Reply: ``message.tool_calls`` (if any) become ``[TOOL_USE]`` lines after the text content; otherwise
the text content (stripped) is the action. Content given as a list of parts keeps its text parts.
"""

from __future__ import annotations

from typing import Any

from composer_replication.actions import tool_calls_to_action
from composer_replication.chat_format import content_text
from composer_replication.types import TraceState

__all__ = ["REPLAY_INSTRUCTION", "content_text", "build_teacher_messages", "reply_to_action"]

REPLAY_INSTRUCTION = (
    "You are replaying a recorded coding-agent session. The conversation below is the agent's history: "
    "its earlier actions are written as action text, tool results appear as user messages starting "
    "with [TOOL_RESULT]. Reply with the agent's NEXT action only, nothing else. To call a tool, write "
    "one line per call exactly as\n"
    '[TOOL_USE] name=TOOL_NAME input={"argument": "value"}\n'
    "with the arguments as one JSON object on that line. Otherwise reply with plain text."
)


def _render(message: dict[str, Any]) -> tuple[str, str]:
    role = message.get("role", "user")
    if role == "assistant":
        return "assistant", tool_calls_to_action(
            content_text(message.get("content")), message.get("tool_calls")
        )
    if role == "tool":
        call_id = message.get("tool_call_id") or message.get("name") or ""
        head = f"[TOOL_RESULT] id={call_id}" if call_id else "[TOOL_RESULT]"
        return "user", f"{head}\n{content_text(message.get('content'))}".rstrip()
    if role in ("system", "developer"):
        return "system", content_text(message.get("content"))
    return "user", content_text(message.get("content"))


def build_teacher_messages(
    state: TraceState, *, instruction: str = REPLAY_INSTRUCTION
) -> list[dict[str, str]]:
    """The plain-text chat messages sent to a teacher for ``state`` (see the module docstring).

    Args:
        state: the trace state; ``state["tools"]`` (optional) is listed in the instruction.
        instruction: the system instruction put first.

    Raises:
        ValueError: ``state["messages"]`` is not a list of dicts.
    """
    messages = state.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError(
            f"state {state.get('state_id')!r}: 'messages' must be a list of chat-message dicts; "
            f"got {type(messages).__name__}."
        )
    system = instruction
    tools = state.get("tools")
    if tools:
        system += "\nTools available in this session: " + ", ".join(map(str, tools)) + "."
    out: list[dict[str, str]] = [{"role": "system", "content": system}]
    for message in messages:
        role, text = _render(message)
        if not text.strip():
            continue
        if role == "system" and len(out) > 1:
            role = "user"  # a late system message (rare) is kept as context, not as a second system turn
        if out[-1]["role"] == role:
            out[-1]["content"] = out[-1]["content"] + "\n\n" + text
        else:
            out.append({"role": role, "content": text})
    if out[-1]["role"] != "user":
        out.append({"role": "user", "content": "What is your next action?"})
    return out


def reply_to_action(message: dict[str, Any]) -> str:
    """Action text of a chat-completions ``message`` (``content`` plus ``tool_calls``)."""
    text = content_text(message.get("content")).strip()
    tool_calls = message.get("tool_calls")
    if tool_calls:
        return tool_calls_to_action(text, tool_calls)
    return text
